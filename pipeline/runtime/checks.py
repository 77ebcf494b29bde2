"""What is checked where the job runs, before its MLflow run exists, each a function:

- :func:`check_outlives_job`: a submitted Ray job writes its record where it outlives the job;
- :func:`check_resources`: the training workers, and the preprocessing beside them, fit a local runtime;
- :func:`check_shared`: every node of a cluster reaches each local path the workers open.

What is checked before Ray starts: :mod:`pipeline.jobs.preflight`.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipeline.common import workarounds
from pipeline.common.errors import PipelineError
from pipeline.config import PipelineConfig, Stage
from pipeline.runtime.cluster import Runtime, alive_nodes
from pipeline.runtime.filesystems import is_s3, local_store

NODE_CHECK_TIMEOUT_S = 120.0


def check_resources(available: dict[str, float], wanted: Runtime, transform_cpus: float) -> None:
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


@ray.remote(num_cpus=0)
def _missing_here(paths: list[str]) -> list[str]:
    return [path for path in paths if not os.path.exists(path)]


def check_shared(address: str | None, paths: dict[str, str | None]) -> None:
    """On a cluster of more than one node, fail unless each of ``paths`` (config key -> path or URI) is
    set, and every node sees each local one as the driver does. A directory gets a marker file written
    here and looked for on each node, so a same-named but separate local directory fails too. Through
    Ray Client (``ray://``) the driver's files are not the cluster's, so only the first part is checked."""
    nodes = alive_nodes()
    if len(nodes) < 2:
        return
    for key, path in paths.items():
        if path is None:
            raise PipelineError(
                f"{key} must be set on a cluster of {len(nodes)} nodes: to a directory every node "
                "mounts at the same path (NFS, a cloud file system) or an s3:// URI."
            )
    if (address or "").startswith("ray://"):
        return
    probes = {key: os.path.abspath(path) for key, path in paths.items() if not is_s3(path)}
    markers = []
    for key, path in probes.items():
        if os.path.isdir(path):
            markers.append(os.path.join(path, f".pipeline-shared-{uuid.uuid4().hex}"))
            open(markers[-1], "w").close()
            probes[key] = markers[-1]
    try:
        refs = [
            _missing_here.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            ).remote(list(probes.values()))
            for node in nodes
        ]
        try:
            results = ray.get(refs, timeout=NODE_CHECK_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as err:
            raise PipelineError(
                f"checking that every node sees {', '.join(probes)} took over "
                f"{NODE_CHECK_TIMEOUT_S:g} s: is a node of the cluster down?"
            ) from err
    finally:
        for marker in markers:
            os.remove(marker)
    for node, missing in zip(nodes, results):
        for key, probe in probes.items():
            if probe in missing:
                raise PipelineError(
                    f"{key}: {paths[key]} is not visible on node {node['NodeManagerAddress']} ({node['NodeID'][:12]}) "
                    f"as it is on this driver. On a cluster of {len(nodes)} nodes every node must reach it: "
                    "use a shared mount (NFS, a cloud file system) at the same path, or an s3:// URI."
                )


def check_outlives_job(cfg: PipelineConfig) -> None:
    """In a submitted Ray job, fail unless the run's record outlives the job. Its entrypoint runs in a
    temporary copy of the submitted working directory, which Ray deletes: a local MLflow store,
    checkpoints or predictions written there (relative paths, and the defaults under ``paths.outputs``)
    would be a finished run nobody finds. An absolute path outside it is the user's opt-in: their disk stays."""
    if not workarounds.in_submitted_job():
        return
    workdir = Path.cwd().resolve()
    places = {"tracking.uri (MLFLOW_TRACKING_URI)": local_store(cfg.tracking.uri, cfg.paths.outputs)}
    if cfg.stage == Stage.train:
        places["storage.path"] = cfg.storage.path or cfg.paths.outputs
    else:
        places["predict.output"] = cfg.predict.output or cfg.paths.outputs
    lost = [
        f"{key} ({path})"
        for key, path in places.items()
        if path is not None and not is_s3(path) and Path(path).resolve().is_relative_to(workdir)
    ]
    if lost:
        raise PipelineError(
            f"this command runs as a Ray job, in a temporary copy of the submitted working directory ({workdir}) "
            f"that Ray deletes with the job, and {' and '.join(lost)} would be written there: a run nobody finds. "
            "Log to your team's MLflow server: set MLFLOW_TRACKING_URI in the job's runtime_env "
            '(ray job submit --runtime-env-json \'{"env_vars": {"MLFLOW_TRACKING_URI": "http://HOST:5000"}}\') or '
            "tracking.uri, and storage.path to s3://BUCKET/PREFIX or a shared mount; or, where the head node's disk "
            "outlives the job, set paths.outputs (or each of these) to an absolute path (docs/cluster.md)."
        )
