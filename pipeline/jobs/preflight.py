"""Every check of a job that can fail on the user's input, on the driver, before the job's MLflow run
exists: the config's values and ``_target_`` imports, the data's files and columns, the storage, then
(with Ray started or joined) whether the job fits a local runtime and whether every node of a cluster
reaches the storage and data.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import ray

from pipeline.common.errors import PipelineError
from pipeline.config import PipelineConfig, check_targets
from pipeline.data import source
from pipeline.jobs import build, predict
from pipeline.runtime import cluster
from pipeline.runtime.filesystems import make_dir
from pipeline.tracking import mlflow_store
from pipeline.training import parallel
from pipeline.training.finetune import Initial


def checked(cfg: PipelineConfig) -> tuple[dict[str, source.Split], Initial | None]:
    """Config, data and storage checks, then Ray started or joined and the checks that need it: the
    job fits a local runtime; every node of a cluster reaches the storage and data. The checked
    splits and the weights training starts from (``finetune.weights``, read before Ray starts), or a
    PipelineError before anything is recorded.

    A helper thread imports and checks the ``_target_`` callables while the data's files are read, and
    opens the MLflow store (a new SQLite store creates its tables) while Ray starts, which mostly waits on
    the processes it launches: work that would otherwise come one after the other."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="preflight") as helper:
        # the _target_ imports (the model's: torchvision, seconds) while the data's footers are read
        targets = helper.submit(check_targets, cfg)
        splits = build.sources(cfg)
        if cfg.train.evaluate:  # the rows evaluation scores after training
            predict.prediction_split(cfg, evaluating=True)
        initial = build.start_weights(cfg)
        storage = cfg.storage.path
        if storage is not None:
            make_dir(storage, cfg.storage.s3, "storage.path")
        wanted = cluster.runtime(cfg.ray, cfg.scaling)
        targets.result()  # a wrong argument of a part fails before Ray starts
        parallel.check_blocks(cfg.model, cfg.train, cfg.scaling)  # builds the model, with fsdp or recomputed blocks
        # then the store: later clients of the same store reuse it (MLflow caches a store per URI); it
        # holds no run until one is started
        store = helper.submit(mlflow_store.connect, cfg.tracking.uri, cfg.paths.outputs)
        cluster.connect(wanted)
        store.result()
    if wanted.address is None:  # a cluster may autoscale; a local runtime never grows
        check_resources(ray.cluster_resources(), wanted, build.transform_cpus(splits))
    shared = {f"source.{name}": split.files[0] for name, split in splits.items() if split.local}
    cluster.check_shared(wanted.address, {**shared, "storage.path": storage})
    return splits, initial


def check_resources(available: dict[str, float], wanted: cluster.Runtime, transform_cpus: float) -> None:
    """Fail fast where Ray would wait forever: training workers that do not fit the runtime, or
    workers that take every CPU so preprocessing never gets one (Ray Data then stalls silently)."""
    for resource, amount in wanted.per_worker.items():
        needed, have = amount * wanted.num_workers, available.get(resource, 0.0)
        if needed > have:
            hint = " Use scaling=cpu on a machine without GPUs." if resource == "GPU" else ""
            raise PipelineError(
                f"scaling asks for {needed:g} {resource} ({wanted.num_workers} workers x {amount:g}, "
                f"scaling.resources_per_worker.{resource}) but the Ray runtime has {have:g}.{hint}"
            )
    cpus = available.get("CPU", 0.0)
    spare = cpus - wanted.per_worker.get("CPU", 0.0) * wanted.num_workers
    if spare < transform_cpus:
        raise PipelineError(
            f"training workers take {cpus - spare:g} of {cpus:g} CPUs, leaving {spare:g} for preprocessing, "
            f"which needs {transform_cpus:g} (transforms.*.num_cpus): lower scaling.resources_per_worker.CPU "
            "or scaling.num_workers, or raise ray.num_cpus."
        )
