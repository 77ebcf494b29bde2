"""Runs in every Ray Train worker process: the training loop, top to bottom.

A worker gets the typed config (:class:`WorkerJob`; no Hydra context exists here), streams its shard
of each split with ``iter_torch_batches``, trains its DDP replica or FSDP shard of the model
(:mod:`pipeline.training.parallel`), all-reduces the validation sums so every world size reports the same
numbers for the same weights, and reports metrics plus a checkpoint once per epoch, its upload to storage
overlapping the next epoch (``train.checkpoint_upload``); within an epoch too, every ``train.checkpoint_every`` and
on a stop with notice (:mod:`pipeline.training.reports`). Where a restarted or resumed worker group continues is
:mod:`pipeline.training.resume`'s; what the driver does meanwhile, :mod:`pipeline.training.trainer`'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from pipeline.common.metrics import LOSSES
from pipeline.config import OnNonfinite, PipelineConfig, TaskType
from pipeline.data.feed import Feed, Reading
from pipeline.runtime.filesystems import RunStorage
from pipeline.training import parallel, preemption, profile, records
from pipeline.training.early_stop import EarlyStopping
from pipeline.training.events import CheckpointRestored, MicroBatchHalved, StepTaken, WorkerStarted
from pipeline.training.ledger import Ledger
from pipeline.training.local_mode import LocalReports
from pipeline.training.replica import Replica
from pipeline.training.reports import StepCheckpoints, report
from pipeline.training.resume import EpochSteps, restore_point, steps_per_epoch
from pipeline.training.telemetry import EpochTelemetry, sum_over_workers

PROGRESS_INTERVAL_S = 1.0  # how often rank 0 sends the driver its step and loss
HELD_OUT_ROWS = 64  # validation rows each checkpoint keeps, for train.export to check the exported files on


@dataclass(kw_only=True)
class WorkerJob:
    """What the driver hands every worker (:func:`pipeline.training.trainer.build_trainer`), as Ray Train's
    ``train_loop_config={"job": WorkerJob(...)}``."""

    cfg: PipelineConfig
    events: Any  # the ray.util.queue.Queue the driver reads the workers' events from
    reading: Reading  # how this worker reads each split (pipeline.data.feed, the data layer's door)
    statistics: dict | None  # the features' mean and std, with ingest.standardize
    train_rows: int  # the training split's rows: each worker group splits them among its workers
    initial: ray.ObjectRef | None  # the weights training starts from (finetune.weights, matched), or None
    start: str | None  # FSDP: where every tensor the model starts from is, as DCP in the run's storage
    storage: RunStorage  # the run's checkpoints: a (re)started worker group continues from the newest whole one
    notice: Any = None  # the driver's preemption.Notice: a stop with notice, answered with a checkpoint
    local: LocalReports | None = None  # Ray Train's local mode (this is the driver's process): reports persisted here


def train_loop_per_worker(config: dict) -> None:
    """One worker's run: set up, restore, then per epoch: batches -> steps -> validate -> report."""
    phases = {"worker": time.time()}  # rank 0's start-up (pipeline.common.startup), sent with its first step
    job: WorkerJob = config["job"]
    cfg, events = job.cfg, job.events
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()  # elastic: this worker group's size
    steps = steps_per_epoch(job.train_rows, world_size, cfg.ingest.batch_size, cfg.ingest.drop_last)
    if cfg.scaling.torch_threads:
        torch.set_num_threads(cfg.scaling.torch_threads)
    device = ray.train.torch.get_device() if cfg.scaling.use_gpu else torch.device("cpu")  # local mode sees every GPU
    events.put(WorkerStarted(**where_this_runs(rank)))
    feed = Feed(job.reading, device)  # each split's batches, on this worker's device

    restore = restore_point(job.storage)  # a restarted worker group, or a resumed run
    start, epochs = (restore.next_epoch if restore else 0), cfg.train.epochs
    within = restore if restore is not None and restore.step else None  # a checkpoint taken within its epoch

    # Ray Data starts reading and decoding the first epoch while the model is built, without the rows trained on
    # before the checkpoint within it
    trained = within.trained if within else None
    shard = {"rank": rank, "world": world_size}
    first = feed.train(epoch=start, **shard, trained=trained) if start < epochs else ()
    first_batches = prefetched(first)
    initial = ray.get(job.initial) if job.initial is not None else None  # finetune.weights, matched
    sharded = ray.train.Checkpoint(job.start, filesystem=job.storage.filesystem) if job.start else None
    with sharded.as_directory() if sharded else contextlib.nullcontext() as start_dir:  # in place on a local path
        replica = Replica.build(cfg, device, planned_updates(cfg, job.train_rows), job.statistics, initial, start_dir)
    stopper = EarlyStopping.of(cfg)  # train.early_stop, or None
    if restore is not None:
        state = replica.restore(restore.checkpoint, device)
        if stopper is not None:
            stopper.load_state_dict(state.get("early_stop"))
        if rank == 0:  # the driver counts every restore, once the records of what it abandons are gone
            records.drop_after(job.storage, restore.report)
            step = within.step if within else 0
            events.put(CheckpointRestored(start, world_size, step, start * steps + step))
    phases["model"] = time.time()
    progress = events.put if rank == 0 else None
    stalled = 0.0  # seconds the last checkpoint held training up
    checkpoints = StepCheckpoints(
        due=preemption.Due(cfg.train, job.notice),
        replica=replica,
        stopper=stopper,
        cfg=cfg,
        rank=rank,
        storage=job.storage,
        local=job.local,
    )

    try:
        for epoch in range(start, epochs):
            later = epoch != start
            batches = feed.train(epoch=epoch, **shard) if later else first_batches
            resumed = within if epoch == start else None  # the epoch goes on from a checkpoint within it
            ledger = Ledger(job.train_rows, device, rank, resumed.trained if resumed else None)
            profiled = cfg.train.profile.enabled and rank == 0  # train.profile: rank 0's steps, every epoch's reads
            steps_profile = profiled and epoch == cfg.train.profile.epoch - 1
            trained = train_epoch(
                replica,
                batches,
                cfg,
                epoch=epoch,
                steps=EpochSteps.of(cfg, job.train_rows, world_size, resumed),
                progress=progress,
                ledger=ledger,
                checkpoints=checkpoints,
                resumed=resumed.figures if resumed else None,
                phases=phases if epoch == start else None,
                profiler=profile.StepProfile(cfg.train.profile, device, job.storage, epoch) if steps_profile else None,
            )
            if trained is None:  # the command is stopping: the checkpoint is saved
                return
            telemetry, step = trained
            if profiled:
                profile.write(job.storage, f"ray_data_epoch{epoch + 1}.txt", feed.stats("train").encode())
            metrics = telemetry.totals() | ledger.figures() | parallel.memory(replica.model, replica.optimizer)
            valid = feed.valid(epoch=epoch, **shard)
            scores = validate(replica, valid, checkpoints.notice_seen)
            if scores is None:  # the notice came during validation: the epoch's steps are saved, validated on resume
                checkpoints.save(epoch=epoch, step=step, global_step=epoch * steps + step, within=(telemetry, ledger))
                return
            metrics |= scores
            # every rank holds the same all-reduced metrics, so every rank decides alike
            stopped = stopper.update(metrics[stopper.metric], epoch) if stopper is not None else None
            metrics |= {
                "epoch": epoch,
                "rank": rank,
                "weights_sha256": weights_digest(replica.module),
                "checkpoint_stall_s": stalled,  # the previous epoch's: this one's is not over yet
                "micro_batch": replica.micro.size,
                **where_this_runs(rank),
                **({"stopped_early": stopped} if stopped else {}),
            }
            before = time.perf_counter()
            report(
                metrics,
                replica,
                epoch,
                stopper,
                rank,
                cfg.train.checkpoint_upload,
                storage=job.storage,
                steps=checkpoints.carried(),
                local=job.local,
            )
            stalled = time.perf_counter() - before
            if stopped:
                break

    finally:
        checkpoints.due.end()  # local mode: the driver ends its notice next, in this process


def planned_updates(cfg: PipelineConfig, train_rows: int) -> int:
    """The optimizer steps the LR schedule spans: every epoch at the most steps any allowed worker count
    takes (the global batch stays the same, so they differ by rounding only), the same for every worker
    group of the run, so a schedule restored from a checkpoint fits the group that restores it."""
    ingest, scaling = cfg.ingest, cfg.scaling
    steps = max(steps_per_epoch(train_rows, n, ingest.batch_size, ingest.drop_last) for n in scaling.worker_counts)
    return updates_through(cfg.train.epochs, 0, batches_per_epoch=steps, accumulate=cfg.train.accumulate)


def updates_through(epoch: int, batch: int, *, batches_per_epoch: int, accumulate: int) -> int:
    """The optimizer steps of a run once batch ``batch`` (from 1) of ``epoch`` (from 0) is trained on: one every
    ``accumulate`` batches and one on each epoch's last, so ceil(batches / accumulate) an epoch: what the LR schedule
    spans and what ``train.checkpoint_every`` in steps counts."""
    return epoch * -(-batches_per_epoch // accumulate) + -(-batch // accumulate)


def train_epoch(
    replica: Replica,
    batches: Iterable[dict],
    cfg: PipelineConfig,
    *,
    epoch: int,
    steps: EpochSteps,
    progress,
    ledger: Ledger,
    checkpoints: StepCheckpoints,
    resumed: dict | None,
    phases: dict[str, float] | None = None,
    profiler: profile.StepProfile | None = None,
) -> tuple[EpochTelemetry, int] | None:
    """One pass over the worker's training shard (steps ``done + 1`` to ``last``): its figures
    (:class:`pipeline.training.telemetry.EpochTelemetry`, with those of the steps ``resumed`` from) and its last
    step, or None when the command is stopping and the step's checkpoint is saved. ``progress`` (rank 0) gets the
    step and batch loss once a second, and every ``tracking.log_every_n_steps`` steps for MLflow (``log``, with the
    global step), and with the first step the worker's start-up ``phases`` and its first batch's arrival. After an
    optimizer step, a checkpoint when one is due (``checkpoints``), with the ``ledger`` of the rows trained on.
    ``profiler`` (``train.profile``'s epoch, rank 0) steps with each batch.

    The optimizer steps every ``train.accumulate`` batches and on the epoch's last; should a shard hold
    fewer batches than ``last`` (rows skipped by a transform), what they accumulated after the last step
    is dropped with the next epoch's first ``zero_grad``."""
    features, labels = replica.layout.model_input, replica.layout.label
    replica.model.train()
    replica.optimizer.zero_grad(set_to_none=True)
    classes = cfg.source.num_classes if cfg.task.type == TaskType.classification else None
    telemetry = EpochTelemetry(next(replica.model.parameters()).device, classes)
    if resumed is not None:
        telemetry.resume(resumed, checkpoints.rank)
    log_every, accumulate, last_sent = cfg.tracking.log_every_n_steps, cfg.train.accumulate, -math.inf
    step = steps.done  # a resumed epoch may have no batch left: it only validates
    batches = profiler.around(batches) if profiler is not None else batches
    for step, batch in enumerate(telemetry.timed(batches), start=steps.done + 1):
        if phases is not None:
            phases.setdefault("first_batch", time.time())
        if replica.example is None:
            replica.example = batch[features][[0, -1]].cpu()  # two rows: MLflow's export keeps the batch size free
        update = step % accumulate == 0 or step == steps.last  # an optimizer step after this batch
        parts = replica.micro.size
        loss = replica.train_batch(batch[features], batch[labels], accumulate=accumulate, update=update)
        if progress is not None and replica.micro.size != parts:  # train.micro_batch=auto
            progress(MicroBatchHalved(epoch=epoch, step=step, was=parts, rows=replica.micro.size))
        ledger.add(batch)
        global_step = epoch * steps.per_epoch + step
        if update:
            telemetry.skipped += not replica.step()
        telemetry.batch(step, loss, len(batch[labels]))
        telemetry.batch_labels(batch[labels])
        log = log_every > 0 and step % log_every == 0
        if progress is not None and (log or time.monotonic() - last_sent >= PROGRESS_INTERVAL_S):
            value, at = loss.item(), time.time()  # .item() waits for the step (rarely), as the time after it must
            progress(
                StepTaken(epoch=epoch, step=step, global_step=global_step, log=log, loss=value, at=at, phases=phases)
            )
            if log:  # kept with the checkpoints too: the driver logs those that never reached it
                checkpoints.logged.append((global_step, value, at))
            last_sent, phases = time.monotonic(), None
        if update:
            updates = updates_through(epoch, step, batches_per_epoch=steps.per_epoch, accumulate=accumulate)
            if checkpoints.taken(
                epoch=epoch, step=step, global_step=global_step, updates=updates, within=(telemetry, ledger)
            ):
                return None  # the command is stopping
    if replica.on_nonfinite == OnNonfinite["raise"] and (batch_number := telemetry.nonfinite_batch()):
        raise FloatingPointError(
            f"the loss became NaN or inf at epoch {epoch + 1}, batch {batch_number}: training diverged, "
            "most often from a learning rate too high for the model (the last step's: "
            f"{replica.optimizer.param_groups[0]['lr']:g}). Lower optim.lr, clip the gradients with "
            "train.grad_clip, or skip such steps with train.on_nonfinite=skip."
        )
    return telemetry, step


@torch.no_grad()
def validate(replica: Replica, batches: Iterable[dict], stop: threading.Event | None = None) -> dict | None:
    """Loss and the task's metrics over every worker's shard: sums and counts are all-reduced, then divided; with
    ``train.ema``, the averaged weights' too, on the same batches (:func:`scored_weights`). None when ``stop`` was
    set while a worker read its batches (the command is stopping: every rank agrees first)."""
    features, labels = replica.layout.model_input, replica.layout.label
    model, task = replica.module.eval(), replica.task
    rank0_buffers(model)
    device = next(model.parameters()).device
    declared = {"loss": LOSSES["val_loss"], **task.metrics}  # how each sum finishes (pipeline.common.metrics)
    weights = scored_weights(replica)
    sums = {
        (prefix, name): torch.zeros((), dtype=torch.float64, device=device) for prefix in weights for name in declared
    }
    count = 0
    held_out = [] if replica.held_out is None else None  # rows never trained on, for train.export's check
    for batch in batches:
        if held_out is not None and sum(map(len, held_out)) < HELD_OUT_ROWS:
            held_out.append(batch[features][:HELD_OUT_ROWS].cpu())
        rows = len(batch[labels])
        for part in replica.micro.parts(rows):  # train.micro_batch's parts: what fits in training fits here
            inputs, truth = batch[features][part], batch[labels][part]
            for prefix, applied in weights.items():
                with applied(), replica.autocast:
                    outputs = model(replica.scale(inputs))
                sums[prefix, "loss"] += task.loss(outputs.float(), truth).double() * len(truth)
                for name, value in task.sums(outputs, truth).items():
                    sums[prefix, name] += value.double()
        count += rows
        if stop is not None and stop.is_set():
            break
    parallel.reshard(model)
    if held_out:
        replica.held_out = torch.cat(held_out)[:HELD_OUT_ROWS]
    if stop is not None and sum_over_workers([stop.is_set()], device)[0]:
        return None
    *totals, count = sum_over_workers([value.item() for value in sums.values()] + [count], device)
    values = {f"{prefix}val_{name}": declared[name].value(total, count) for (prefix, name), total in zip(sums, totals)}
    return values | {"val_rows": int(count)}


def scored_weights(replica: Replica) -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    """The weights validation scores, by the prefix of their metrics, each as a context in which the model holds
    them: the trained ones (``val_*``); with ``train.ema`` the averages too, which are ``val_*`` when they are the run's
    model (``train.ema_model``; the trained ones then ``raw_val_*``), else ``ema_val_*``."""
    ema, model = replica.ema, replica.module
    if ema is None:
        return {"": contextlib.nullcontext}

    @contextlib.contextmanager
    def averages() -> Iterator[None]:
        with ema.applied(model):
            rank0_buffers(model)  # the averaged BatchNorm statistics rank 0 checkpoints
            yield

    if replica.ema_model:
        return {"": averages, "raw_": contextlib.nullcontext}
    return {"": contextlib.nullcontext, "ema_": averages}


def rank0_buffers(model: torch.nn.Module) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) on every rank, so that validation scores the model rank 0
    checkpoints: DDP broadcasts them before each training forward, and each rank's own last batch then moves its
    copy apart (a no-op outside a process group)."""
    if parallel.world_size() > 1:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def weights_digest(model: torch.nn.Module) -> str:
    """A sha256 of every parameter's bytes, the same on every rank: equal digests mean bit-identical replicas.
    Sharded, each rank hashes its own shards and the ranks' hashes are hashed together, in rank order (nothing is
    gathered whole)."""
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(parallel.local(param.detach()).cpu().contiguous().numpy().tobytes())
    if not parallel.is_sharded(model):
        return digest.hexdigest()
    return hashlib.sha256("".join(parallel.from_every_rank(digest.hexdigest())).encode()).hexdigest()


def where_this_runs(rank: int) -> dict:
    """This worker's rank, process, node, placement group and copy of the code, for the run's
    ``workers.jsonl`` and each epoch's report (a Tune sweep's driver releases the group, workarounds.py)."""
    group = ray.util.get_current_placement_group()
    return {
        "rank": rank,
        "pid": os.getpid(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "placement_group": group.id.hex() if group is not None else None,
        "code": os.path.dirname(os.path.abspath(__file__)),
    }


def prefetched(batches: Iterable) -> Iterator:
    """``batches`` with its first item already on its way: a helper thread asks for it now, so Ray Data
    starts its split coordinator, reads and decodes while the caller builds the model."""
    iterator = iter(batches)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="first-batch")
    end = object()
    first = pool.submit(next, iterator, end)
    pool.shutdown(wait=False)

    def chained() -> Iterator:
        batch = first.result()
        if batch is not end:
            yield batch
            yield from iterator

    return chained()
