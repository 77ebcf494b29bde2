"""Runs on the driver: the TorchTrainer built from the config, ``fit()`` run to the end off the main thread,
a failure explained by its causes, and the checkpoints Ray Train kept.

The workers run :func:`pipeline.training.worker.train_loop_per_worker` (through :mod:`.entry`, which keeps its
imports out of Ray Train's controller); while ``fit()`` runs, their events
reach the driver through :mod:`pipeline.training.relay`. Canaries of the Ray behaviour this module works
around: ``tests/test_ray_canaries.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import pyarrow.fs as pafs
import ray
import ray.data
import ray.train
import torch
from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig
from ray.train.torch import TorchConfig, TorchTrainer
from ray.util.queue import Queue

from pipeline.common import signals
from pipeline.common.errors import PipelineError, root_cause
from pipeline.config import PipelineConfig, ScalingConfig, Strategy
from pipeline.data.preprocess import TrainingData
from pipeline.runtime.cluster import alive_nodes, on_this_node
from pipeline.runtime.filesystems import RunStorage
from pipeline.training import checkpoint, finetune, parallel, preemption
from pipeline.training.entry import train_loop_per_worker
from pipeline.training.finetune import Initial
from pipeline.training.local_mode import LocalReports
from pipeline.training.relay import EventHandler, ReportRelay, relayed
from pipeline.training.resume import steps_per_epoch
from pipeline.training.worker import WorkerJob

log = logging.getLogger(__name__)

FIT_THREAD_EXIT_S = 10.0  # at exit on a stop: how long Ray Train's run may take to end before Ray is shut down


def trainer_settings(scaling: ScalingConfig) -> tuple[ray.train.ScalingConfig, TorchConfig]:
    """Ray's scaling and process-group settings: nccl on GPU workers, gloo on CPU workers; workers go
    only to nodes with their resources (custom ones included) and ``label_selector`` labels."""
    scaling_config = ray.train.ScalingConfig(
        num_workers=(scaling.min_workers, scaling.max_workers) if scaling.elastic else scaling.num_workers,
        elastic_resize_monitor_interval_s=scaling.elastic_resize_monitor_interval_s,
        use_gpu=scaling.use_gpu,
        resources_per_worker=dict(scaling.resources_per_worker),
        label_selector=dict(scaling.label_selector) or None,
    )
    return scaling_config, TorchConfig(backend="nccl" if scaling.use_gpu else "gloo")


def execution_options(cfg: PipelineConfig) -> ray.data.ExecutionOptions | None:
    """How Ray Data executes the datasets training reads: Ray's defaults (None), unless the config changes them."""
    data_cpus = cfg.scaling.data_cpus
    if data_cpus is None and not cfg.ingest.preserve_order:
        return None
    options = ray.data.ExecutionOptions(preserve_order=cfg.ingest.preserve_order)
    if data_cpus is not None:
        options.resource_limits = ray.data.ExecutionResources(cpu=data_cpus)
    return options


def worker_group_reason(cfg: PipelineConfig, tuned: bool) -> str | None:
    """Why this run trains on Ray Train's worker group, or None: in this process, Ray Train's local mode (no
    worker group to start: on 2 cores the first step comes ~15 s sooner, docs/performance.md). ``auto`` takes local
    mode wherever nothing needs a group; ``tuned``: a Tune trial, whose reports reach Tune through Ray Train's
    controller."""
    scaling = cfg.scaling
    if scaling.local_mode is not True:
        nodes = len(alive_nodes())
        reasons = {
            "scaling.local_mode=false": scaling.local_mode is False,
            scaling.needs_worker_group(cfg.train.max_failures): True,
            "a Tune trial (it reports to Tune through Ray Train's controller)": tuned,
            f"{nodes} nodes (the worker goes where its resources are)": nodes > 1,
            "scaling.use_gpu with no GPU in the driver's process": scaling.use_gpu and not torch.cuda.is_available(),
        }
        return next((reason for reason, needed in reasons.items() if reason and needed), None)
    return None


def local_datasets(cfg: PipelineConfig, data: TrainingData) -> dict[str, ray.data.Dataset]:
    """The datasets as a run in local mode reads them whole (Ray Train's local mode applies no DataConfig): executed
    as :func:`execution_options` says, Ray Data's CPUs (``scaling.data_cpus``: null) what the worker a group would
    start leaves of the runtime's."""
    options = execution_options(cfg) or ray.data.ExecutionOptions()
    if cfg.scaling.data_cpus is None:
        left = ray.cluster_resources().get("CPU", 0) - cfg.scaling.resources_per_worker.get("CPU", 0)
        options.resource_limits = ray.data.ExecutionResources(cpu=max(left, 1))
    for dataset in data.datasets.values():
        dataset.context.execution_options = options
    return data.datasets


@contextmanager
def local_threads(scaling: ScalingConfig) -> Iterator[None]:
    """The intra-op threads a worker of ``scaling.resources_per_worker`` gets from Ray (its CPUs, at least one:
    OMP_NUM_THREADS, unless exported) while this process trains in local mode; then as before."""
    cpus = scaling.resources_per_worker.get("CPU", 1)
    threads = scaling.torch_threads or (None if "OMP_NUM_THREADS" in os.environ else max(math.floor(cpus), 1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_trainer(
    cfg: PipelineConfig,
    data: TrainingData,
    storage: RunStorage,
    events: Queue,
    callbacks: list,
    *,
    initial: Initial | None,
    notice: ray.actor.ActorHandle | None = None,
    local: bool = False,
) -> TorchTrainer:
    """A TorchTrainer for the typed config; workers send their events to ``events`` and answer ``notice`` (a stop
    with notice: :mod:`pipeline.training.preemption`); ``callbacks``
    run in Ray Train's controller besides the one that relays each report to ``events``; ``initial``
    (the weights training starts from) goes to Ray's object store once, for every worker. With FSDP, every
    tensor of the model is built here instead and saved to the run's storage (:func:`save_start`): the workers
    build theirs on the meta device and each reads its shards. ``local``: the one worker in this process (Ray Train's
    local mode), its reports persisted and relayed by the worker itself (:mod:`pipeline.training.local_mode`)."""
    scaling_config, torch_config = trainer_settings(cfg.scaling)
    datasets, reports = data.datasets, None
    if local:
        scaling_config, datasets = ray.train.ScalingConfig(num_workers=0), local_datasets(cfg, data)
        train = cfg.train
        mode = checkpoint.checkpoint_mode(train, cfg.task)
        reports = LocalReports(
            storage=storage, num_to_keep=train.num_to_keep, metric=train.checkpoint_metric, mode=mode, events=events
        )
    start = None
    if cfg.scaling.strategy == Strategy.fsdp:
        start = save_start(finetune.whole_start(cfg.model, cfg.finetune, initial, cfg.train.seed).state, storage)
        initial = None
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "job": ray.put(  # an object ref: only the workers import what the job holds (entry.py)
                WorkerJob(
                    cfg=cfg,
                    events=events,
                    reading=data.reading(cfg),
                    statistics=data.statistics,
                    train_rows=data.rows["train"],
                    initial=ray.put(initial) if initial is not None else None,
                    start=start,
                    storage=storage,
                    notice=notice,
                    local=reports,
                )
            )
        },
        scaling_config=scaling_config,
        torch_config=torch_config,
        datasets=datasets,
        dataset_config=DataConfig(execution_options=execution_options(cfg)),
        run_config=RunConfig(
            name=storage.name,
            storage_path=storage.path,
            storage_filesystem=storage.filesystem,
            checkpoint_config=CheckpointConfig(
                num_to_keep=cfg.train.num_to_keep,
                checkpoint_score_attribute=cfg.train.checkpoint_metric,
                checkpoint_score_order=checkpoint.checkpoint_mode(cfg.train, cfg.task),
            ),
            failure_config=FailureConfig(max_failures=cfg.train.max_failures),
            callbacks=[ReportRelay(events), *callbacks],
        ),
    )


def save_start(state: dict[str, torch.Tensor], storage: RunStorage) -> str:
    """An FSDP run's starting weights saved as DCP in the run's storage (``start/``), where every worker reads
    its shards: not whole in Ray's object store, nor in each node's. Its path there."""
    target = f"{storage.path}/{storage.name}/start"
    with tempfile.TemporaryDirectory() as local:
        parallel.save_start(state, local)
        storage.filesystem.create_dir(target)
        pafs.copy_files(local, target, destination_filesystem=storage.filesystem)
    return target


def epoch_steps(cfg: PipelineConfig, data: TrainingData) -> int:
    """Batches each worker sees per epoch of this job (elastic: with the most workers it allows)."""
    scaling, ingest = cfg.scaling, cfg.ingest
    return steps_per_epoch(data.rows["train"], scaling.max_workers, ingest.batch_size, ingest.drop_last)


def fit(
    cfg: PipelineConfig,
    data: TrainingData,
    storage: RunStorage,
    handler: EventHandler | None,
    initial: Initial | None = None,
    callbacks: tuple = (),
) -> ray.train.Result:
    """Train to the end, handing every worker event to ``handler`` (:class:`pipeline.jobs.train.JobEvents` for
    a job; none for a Tune trial, whose reports reach Tune); a worker or controller failure becomes one PipelineError
    naming its cause. ``initial``: the weights training starts from (None: random ones). ``callbacks``:
    more Ray Train callbacks (a Tune trial's TuneReportCallback)."""
    here = on_this_node()  # they go with the driver, never with a node the cluster loses
    events, notice = Queue(actor_options={"num_cpus": 0, **here}), preemption.Notice.options(**here).remote()
    group = worker_group_reason(cfg, tuned=bool(callbacks))
    log.info(
        "training %s", f"on Ray Train's worker group: {group}" if group else "in this process (Ray Train's local mode)"
    )
    try:
        trainer = build_trainer(
            cfg, data, storage, events, list(callbacks), initial=initial, notice=notice, local=group is None
        )
        with relayed(events, handler), local_threads(cfg.scaling) if group is None else contextlib.nullcontext():
            try:
                stop = partial(stop_with_notice, notice, cfg.train.stop_grace_s, handler)
                return fit_off_main_thread(trainer, on_stop=stop if cfg.train.checkpoint_on_stop else None)
            except ray.train.TrainingFailedError as err:
                raise explain(err) from err
            except Exception as err:  # local mode: the training function's own error, raised in this process
                if group is not None or isinstance(err, PipelineError):
                    raise
                raise failed_here(err) from err
    finally:
        ray.kill(events.actor)
        ray.kill(notice)


def stop_with_notice(
    notice: ray.actor.ActorHandle,
    grace_s: float,
    handler: EventHandler | None,
    error: BaseException,
    ended: threading.Event,
) -> bool:
    """The workers asked for a checkpoint at the step they are on
    (:func:`pipeline.training.preemption.checkpoint_before_stop`), the stop (``error``) handed to ``handler`` while
    they save it, then the checkpoint, handed to it at once: the command ends before Ray Train's controller would
    relay it. Whether it came: the workers then end, and Ray Train's run with them."""
    recorded = partial(handler.stopping, error) if handler is not None else lambda: None
    saved = preemption.checkpoint_before_stop(notice, grace_s, recorded, ended)
    if saved is not None and handler is not None:
        handler.step_checkpointed(saved)
    return saved is not None


def fit_off_main_thread(
    trainer: TorchTrainer, on_stop: Callable[[BaseException, threading.Event], bool] | None = None
) -> ray.train.Result:
    """``trainer.fit()`` in a helper thread, waited on from this one; on Ctrl-C or SIGTERM, ``on_stop`` runs
    before the stop goes on (the workers' checkpoint at the step they are on, given the event ``fit()`` sets when it
    returns; True when the workers end after it).

    Ray 2.60: ``TorchTrainer.fit()`` on the main thread installs its own SIGINT handler and leaves it
    installed; it turns Ctrl-C into exit status 0 and keeps the run's controller actor (and its
    dataset split coordinators) alive after the run, so a sweep piles them up. Off the main thread it
    installs none: Ctrl-C and SIGTERM reach the pipeline as KeyboardInterrupt / SystemExit, the run
    is recorded as KILLED, and leaving the process takes the run's actors with it.
    """
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as err:  # re-raised on the calling thread
            outcome["error"] = err
        finally:
            done.set()

    threading.Thread(target=target, name="ray-train-fit", daemon=True).start()
    try:
        # An Event, not Thread.join: Python 3.11's join, interrupted by a signal handler's exception, marks a
        # thread that still runs as ended (threading.py's bpo-45274 branch), so no later join would wait for it.
        while not done.wait(timeout=0.5):  # a bounded wait lets signals through
            signals.raise_requested()
    except BaseException:
        # At exit Ray is shut down, after Ray Train's run has ended when the workers end after their stop checkpoint
        # (the controller returns within about a second). Ray 2.60: ray.shutdown() while the fit thread still
        # blocked in ray.get crashed the command with SIGSEGV instead of exit 143, in 3 of 11 stops on a loaded
        # machine (tests/test_preemption.py; none in 12 once the run had ended). Exit handlers run last registered
        # first: this one also leaves Ray before pyarrow's finalizes S3 (an s3:// storage path's filesystem), which
        # a reply the fit thread unpickled after it reported as "Attempt to initialize S3 after it has been finalized".
        workers_end = False

        def leave_ray() -> None:
            if workers_end and not done.wait(timeout=FIT_THREAD_EXIT_S):
                log.warning("Ray Train's run did not end within %gs of the stop; shutting Ray down", FIT_THREAD_EXIT_S)
            ray.shutdown()

        atexit.register(leave_ray)
        error = sys.exc_info()[1]
        if isinstance(error, (KeyboardInterrupt, SystemExit)) and on_stop is not None:
            workers_end = on_stop(error, done)
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def explain(err: ray.train.TrainingFailedError) -> PipelineError:
    """One line per distinct cause, instead of Ray's truncated multi-rank traceback snippet."""
    if isinstance(err, ray.train.WorkerGroupError):
        causes = sorted({root_cause(e) for e in err.worker_failures.values()})
        where = f"on rank(s) {sorted(err.worker_failures)}"
    else:  # ControllerError: the controller itself failed (storage, a callback, scheduling)
        causes, where = [root_cause(getattr(err, "controller_failure", err))], "in Ray Train's controller"
    return PipelineError(
        f"training failed {where}: {'; '.join(causes)} "
        "(full tracebacks: Ray's session logs, /tmp/ray/session_latest/logs on the head node)."
    )


def failed_here(err: Exception) -> PipelineError:
    """The training function's error in local mode, as :func:`explain` words a worker's: its cause, and where."""
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return PipelineError(
        f"training failed in this process (Ray Train's local mode): {root_cause(err)} "
        f"(raised at {frame.filename}:{frame.lineno}, in {frame.name})."
    )


def kept_checkpoints(result: ray.train.Result, storage: RunStorage) -> set[str]:
    """The paths of every checkpoint Ray Train keeps on storage at the end of a run.

    Ray 2.60: with ``num_to_keep``, Ray Train keeps the best ``num_to_keep`` checkpoints and, always, the
    latest; ``Result.best_checkpoints`` lists only the former, so a latest checkpoint that is not among the
    best is on storage but in no list but ``Result.checkpoint``. Local mode's Result has no path and lists none:
    what the run's storage holds is what :mod:`pipeline.training.local_mode` kept."""
    if result.path is None:
        directory = f"{storage.path}/{storage.name}"
        return {path for path, _ in checkpoint.reports(storage.filesystem, directory)}
    kept = {checkpoint.path for checkpoint, _ in result.best_checkpoints or []}
    if result.checkpoint is not None:
        kept.add(result.checkpoint.path)
    return kept
