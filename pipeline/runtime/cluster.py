"""Where a job runs: a local Ray runtime, or an existing cluster joined with the project's code, and which of
its nodes a step may use.

Joining a cluster ships ``ray.py_modules`` (the pipeline and its transforms) in the job's runtime
environment, so nodes need only the dependencies. What is checked once Ray is up: :mod:`.checks`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

import ray

from pipeline.common import workarounds
from pipeline.common.errors import PipelineError
from pipeline.config import RayConfig, ScalingConfig

log = logging.getLogger(__name__)


def runtime_env(address: str | None, py_modules: list[str], extra: dict) -> dict:
    """The job's runtime_env: ``extra`` (the config's), plus, joining a cluster, ``py_modules`` uploaded
    from this checkout, so every node imports the same code the driver runs. A submitted Ray job ships
    none: its own runtime_env (``--working-dir``) already carries the code it was submitted with, and
    Ray merges the two. Environment variables become strings, as Ray requires (YAML reads ``1`` as a
    number)."""
    env = dict(extra)
    if env.get("env_vars"):
        env["env_vars"] = {key: str(value) for key, value in env["env_vars"].items()}
    if address is not None and py_modules and not workarounds.in_submitted_job():
        env["py_modules"] = [*env.get("py_modules", []), *(module_dir(name) for name in py_modules)]
        env.setdefault("excludes", ["__pycache__/"])
    return env


def module_dir(name: str) -> str:
    """Where module ``name`` is imported from: a package's directory, or a module's file. A path, not the
    module: a Ray job deep-copies the runtime_env it merges with its own, and a module cannot be copied."""
    try:
        module = importlib.import_module(name)
    except ImportError as err:
        raise PipelineError(f"ray.py_modules: cannot import {name!r} to ship it to the cluster ({err}).") from err
    return next(iter(getattr(module, "__path__", [])), None) or str(module.__file__)


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """The Ray runtime a job asks for, worked out once from ``ray`` and ``scaling``: where it runs, what a
    local runtime holds, and what the training workers take of it."""

    address: str | None
    num_cpus: int
    env: dict
    object_store_memory: int | None
    num_workers: int  # the fewest training workers the run starts with (elastic: MIN)
    per_worker: dict[str, float]  # scaling.resources_per_worker


def runtime(ray_cfg: RayConfig, scaling: ScalingConfig) -> Runtime:
    """The runtime ``ray.*`` and ``scaling.*`` ask for, with the project's code shipped to a cluster."""
    return Runtime(
        address=ray_cfg.address,
        num_cpus=ray_cfg.num_cpus or local_cpus(scaling),
        env=runtime_env(ray_cfg.address, ray_cfg.py_modules, ray_cfg.runtime_env),
        object_store_memory=ray_cfg.object_store_memory,
        num_workers=scaling.min_workers,
        per_worker=dict(scaling.resources_per_worker),
    )


_early: Future | None = None  # a start begun by start_early, which connect or abandon_start joins


def start_early(wanted: Runtime) -> None:
    """Begin starting or joining the runtime in a helper thread, so that Ray's processes start while this one
    imports the job's modules and checks its inputs: on a machine with cores to spare, their seconds overlap (on 2
    busy cores, within noise: docs/performance.md); :func:`connect` joins it, :func:`abandon_start` ends it when a
    check fails first."""
    global _early
    if ray.is_initialized() or _early is not None:
        return
    _early = workarounds.in_a_lasting_thread(
        partial(init_ray, wanted.address, wanted.num_cpus, wanted.env, wanted.object_store_memory)
    )


def connect(wanted: Runtime) -> None:
    """Start or join the runtime, or wait for the start :func:`start_early` began (its errors raised here)."""
    global _early
    early, _early = _early, None
    if early is None:
        start_ray(wanted.address, wanted.num_cpus, wanted.env, wanted.object_store_memory)
        return
    with workarounds.own_sigterm_handler():  # put back at the C level, where Ray's start may have replaced it
        early.result()


def abandon_start() -> None:
    """A check failed while :func:`start_early`'s start ran: wait for it, then shut Ray down, leaving no process."""
    global _early
    early, _early = _early, None
    if early is not None:
        with workarounds.own_sigterm_handler(), contextlib.suppress(Exception):  # the failed check's error is raised
            early.result()
        ray.shutdown()


def local_cpus(scaling: ScalingConfig) -> int:
    """A local runtime's logical CPUs: the machine's cores, plus those the training workers reserve, plus one.

    Ray Data's budget is what training leaves of the logical CPUs, so without the extra ones a worker that
    waits for its batches keeps its reserved core idle; with them preprocessing may use every core, as a
    DataLoader's worker processes do beside their training process, and one task more, since its tasks
    wait on Ray's object store part of the time. When training is the bound, the OS shares the cores
    between both: ``data_wait_fraction`` shows which way an epoch went (docs/performance.md)."""
    training = scaling.max_workers * scaling.resources_per_worker.get("CPU", 0.0)
    return (os.cpu_count() or 1) + math.ceil(training) + 1


def start_ray(
    address: str | None, num_cpus: int | None, env: dict | None = None, object_store_memory: int | None = None
) -> None:
    """Join ``address`` or start a local runtime (never a cluster RAY_ADDRESS names by accident), once
    per process: a sweep's jobs share it. Worker and Ray Data logs stay in Ray's session log files."""
    if ray.is_initialized():
        return
    with workarounds.own_sigterm_handler():
        init_ray(address, num_cpus, env, object_store_memory)


def init_ray(address: str | None, num_cpus: int | None, env: dict | None, object_store_memory: int | None) -> None:
    """:func:`start_ray`'s ``ray.init``, on any thread (the caller puts the SIGTERM handler back, on the main one)."""
    if address is None:
        workarounds.local_runtime_settings(num_cpus or os.cpu_count() or 1)
    else:
        workarounds.check_reachable(address, unreachable)
    try:
        ray.init(
            address=address or "local",
            num_cpus=num_cpus if address is None else None,
            object_store_memory=object_store_memory if address is None else None,
            runtime_env=env or None,
            log_to_driver=False,
            logging_level=logging.ERROR,
            include_dashboard=False if address is None else None,
        )
    except (ConnectionError, TimeoutError) as err:  # e.g. address=auto with no cluster on this machine
        if workarounds.refused_token(err):
            raise token_refused(address) from None  # Ray's chain repeats a long traceback as text
        raise unreachable(address, err) from err
    if address is None:
        workarounds.end_agents_at_exit()
    resources = ray.cluster_resources()
    log.info(
        "Ray runtime up (%s): %d node(s), %g CPU, %g GPU",
        address or "local",
        len(alive_nodes()),
        resources.get("CPU", 0),
        resources.get("GPU", 0),
    )


def unreachable(address: str, err: Exception) -> PipelineError:
    return PipelineError(
        f"ray.address: cannot reach a Ray cluster at {address!r} ({err}). Check the address (ray.address, or "
        "the RAY_ADDRESS variable) and that the cluster is up (`ray status` on its head node), or leave "
        "ray.address unset (null) to start a local runtime."
    )


def token_refused(address: str | None) -> PipelineError:
    """The cluster uses Ray's token authentication and refused what this process sent."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        cause = "the token it sent (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) is not the cluster's"
    else:
        cause = (
            "this process sent no token: Ray sends one to an address it is given only when RAY_AUTH_MODE=token "
            "is exported (`ray start` turns authentication on wherever a token exists, such as the "
            "~/.ray/auth_token any local Ray run writes)"
        )
    return PipelineError(
        f"ray.address: the Ray cluster at {address!r} uses token authentication and refused this process: "
        f"{cause}. Export RAY_AUTH_MODE=token with the cluster's token (`ray get-auth-token` on the head node "
        "prints it) in ~/.ray/auth_token, or in RAY_AUTH_TOKEN or a file named by RAY_AUTH_TOKEN_PATH; "
        "`ray job submit` needs the same (docs/cluster.md)."
    )


def on_this_node() -> dict:
    """Ray options that keep an actor on this process's node: the job's own actors (its epochs actor, event
    queue and stop notice) go with the driver, never with a preprocessing node that a cluster may lose."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)}


def alive_nodes() -> list[dict]:
    return [node for node in ray.nodes() if node["Alive"]]


def placeable_nodes(where: dict) -> list[dict]:
    """The alive nodes with CPUs where a task placed with ``where`` (Ray's ``resources`` and ``label_selector``
    options, :func:`pipeline.data.steps.placement`) may run."""
    wanted = {"CPU": 1e-9, **where.get("resources", {})}
    return [
        node
        for node in alive_nodes()
        if all(node["Resources"].get(key, 0.0) >= amount for key, amount in wanted.items())
        and selected(node.get("Labels", {}), where.get("label_selector", {}))
    ]


def selected(labels: dict[str, str], selector: dict[str, str]) -> bool:
    """Whether a node's ``labels`` satisfy a Ray label selector: ``value``, ``!value``, ``in(a,b)``, ``!in(a,b)``."""
    for key, condition in selector.items():
        negated = condition.startswith("!")
        wanted = condition.removeprefix("!")
        if wanted.startswith("in(") and wanted.endswith(")"):
            values = {value.strip() for value in wanted[3:-1].split(",")}
        else:
            values = {wanted}
        if (labels.get(key) in values) == negated:
            return False
    return True
