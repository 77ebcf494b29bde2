"""Every check of a job that can fail on the user's input, on the driver, before the job's MLflow run
exists: the config's values and ``_target_`` imports, the data's files and columns, the storage, then
(with Ray started or joined) whether the job fits a local runtime and whether every node of a cluster
reaches the storage and data.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import ray

from pipeline import build, cluster, source, tracking
from pipeline.config import PipelineError, check_targets
from pipeline.filesystems import is_s3, locate, s3_error


def checked(cfg: dict) -> dict[str, source.Split]:
    """Config, data and storage checks, then Ray started or joined and the checks that need it: the
    job fits a local runtime; every node of a cluster reaches the storage and data. The checked
    splits, or a PipelineError before anything is recorded.

    Ray's start mostly waits on the processes it launches, so a helper thread meanwhile imports and
    checks the ``_target_`` callables and opens the MLflow store (a new SQLite store creates its
    tables), work that would otherwise come one after the other."""
    splits = build.sources(cfg)
    storage = cfg["storage"]["path"]
    if storage is not None:
        check_storage(storage, cfg["storage"]["s3"])
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="preflight") as helper:
        targets = helper.submit(check_targets_then_open_store, cfg)
        cluster.connect(cfg["ray"], cfg["scaling"])
        targets.result()
    if cfg["ray"]["address"] is None:  # a cluster may autoscale; a local runtime never grows
        check_resources(ray.cluster_resources(), cfg["scaling"], build.transform_cpus(splits))
    shared = {f"source.{name}": split.files[0] for name, split in splits.items() if split.local}
    cluster.check_shared(cfg["ray"]["address"], {**shared, "storage.path": storage})
    return splits


def check_targets_then_open_store(cfg: dict) -> None:
    """The ``_target_`` checks, then, if they pass, the MLflow store opened: later clients of the same
    store reuse it (MLflow caches a store per URI). It holds no run until one is started."""
    check_targets(cfg)
    tracking.connect(cfg["tracking"]["uri"], cfg["paths"]["outputs"])


def check_storage(uri: str, s3: dict) -> None:
    """Create the storage directory now, so a missing bucket or a read-only store fails before training."""
    fs, path = locate(uri, s3, "storage.path")
    try:
        fs.create_dir(path, recursive=True)
    except OSError as err:
        if is_s3(uri):
            raise s3_error("storage.path", uri, err) from err
        raise PipelineError(f"storage.path: cannot create {uri} ({err}).") from err


def check_resources(available: dict[str, float], scaling: dict, transform_cpus: float) -> None:
    """Fail fast where Ray would wait forever: training workers that do not fit the runtime, or
    workers that take every CPU so preprocessing never gets one (Ray Data then stalls silently)."""
    per_worker = scaling["resources_per_worker"]
    for resource, amount in per_worker.items():
        needed, have = amount * scaling["num_workers"], available.get(resource, 0.0)
        if needed > have:
            hint = " Use scaling=cpu on a machine without GPUs." if resource == "GPU" else ""
            raise PipelineError(
                f"scaling asks for {needed:g} {resource} ({scaling['num_workers']} workers x {amount:g}, "
                f"scaling.resources_per_worker.{resource}) but the Ray runtime has {have:g}.{hint}"
            )
    cpus = available.get("CPU", 0.0)
    spare = cpus - per_worker.get("CPU", 0.0) * scaling["num_workers"]
    if spare < transform_cpus:
        raise PipelineError(
            f"training workers take {cpus - spare:g} of {cpus:g} CPUs, leaving {spare:g} for preprocessing, "
            f"which needs {transform_cpus:g} (transforms.*.num_cpus): lower scaling.resources_per_worker.CPU "
            "or scaling.num_workers, or raise ray.num_cpus."
        )
