"""Runs in every Ray Train worker process: the training loop, top to bottom.

A worker gets the typed config (:class:`WorkerJob`; no Hydra context exists here), streams its shard
of each split with ``iter_torch_batches``, trains its DDP replica or FSDP shard of the model
(:mod:`pipeline.training.parallel`), all-reduces the validation sums so every world size reports the same
numbers for the same weights, and reports metrics plus a checkpoint once per epoch, its upload to storage
overlapping the next epoch (``train.checkpoint_upload``). What the driver does meanwhile is in
:mod:`pipeline.training.trainer`.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train import CheckpointUploadMode

from pipeline.common.metrics import LOSSES
from pipeline.config import CheckpointUpload, OnNonfinite, PipelineConfig, TaskType
from pipeline.training import checkpoint, parallel
from pipeline.training.early_stop import EarlyStopping
from pipeline.training.events import CheckpointRestored, StepTaken, WorkerStarted
from pipeline.training.replica import Replica
from pipeline.training.telemetry import EpochTelemetry, sum_over_workers

PROGRESS_INTERVAL_S = 1.0  # how often rank 0 sends the driver its step and loss


@dataclass(kw_only=True)
class WorkerJob:
    """What the driver hands every worker (:func:`pipeline.training.trainer.build_trainer`), as Ray Train's
    ``train_loop_config={"job": WorkerJob(...)}``."""

    cfg: PipelineConfig
    events: Any  # the ray.util.queue.Queue the driver reads the workers' events from
    coordinator: Any  # the job's data Coordinator: the epoch the seeded transforms read (pipeline.data.coordinator)
    statistics: dict | None  # the features' mean and std, with ingest.standardize
    train_rows: int  # the training split's rows: each worker group splits them among its workers
    initial: ray.ObjectRef | None  # the weights training starts from (finetune.weights, matched), or None
    saved: ray.train.Checkpoint | None  # the newest whole checkpoint the run's storage held at the start


def train_loop_per_worker(config: dict) -> None:
    """One worker's run: set up, restore, then per epoch: batches -> steps -> validate -> report."""
    job: WorkerJob = config["job"]
    cfg, events, coordinator = job.cfg, job.events, job.coordinator
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()  # elastic: this worker group's size
    steps = steps_per_epoch(job.train_rows, world_size, cfg.ingest.batch_size, cfg.ingest.drop_last)
    if cfg.scaling.torch_threads:
        torch.set_num_threads(cfg.scaling.torch_threads)
    device = ray.train.torch.get_device()
    events.put(WorkerStarted(**where_this_runs(rank)))

    restore = restore_point(job.saved)  # a restarted worker group, or a resumed run
    start, epochs = (restore.epoch + 1 if restore else 0), cfg.train.epochs

    # Ray Data starts reading and decoding the first epoch while the model is built.
    first = train_batches(cfg, start, coordinator, device, world_size) if start < epochs else ()
    first_batches = prefetched(first)
    initial = ray.get(job.initial) if job.initial is not None else None  # finetune.weights, matched
    replica = Replica.build(cfg, device, planned_updates(cfg, job.train_rows), job.statistics, initial)
    stopper = EarlyStopping.of(cfg)  # train.early_stop, or None
    if restore is not None:
        state = replica.restore(restore.checkpoint, device)
        if stopper is not None:
            stopper.load_state_dict(state.get("early_stop"))
        if rank == 0:  # the driver counts every restore
            events.put(CheckpointRestored(start, world_size))
    progress = events.put if rank == 0 else None
    stalled = 0.0  # seconds the last checkpoint held training up

    for epoch in range(start, epochs):
        batches = first_batches if epoch == start else train_batches(cfg, epoch, coordinator, device, world_size)
        metrics = train_epoch(replica, batches, cfg, epoch, steps, progress)
        valid = torch_batches(ray.train.get_dataset_shard("valid"), cfg, device, world_size, training=False)
        metrics |= validate(replica, valid)
        # every rank holds the same all-reduced metrics, so every rank decides alike
        stopped = stopper.update(metrics[stopper.metric], epoch) if stopper is not None else None
        metrics |= {
            "epoch": epoch,
            "rank": rank,
            "weights_sha256": weights_digest(replica.module),
            "checkpoint_stall_s": stalled,  # the previous epoch's: this one's is not over yet
            **where_this_runs(rank),
            **({"stopped_early": stopped} if stopped else {}),
        }
        before = time.perf_counter()
        report(metrics, replica, epoch, stopper, rank, cfg.train.checkpoint_upload)
        stalled = time.perf_counter() - before
        if stopped:
            break


def steps_per_epoch(train_rows: int, num_workers: int, global_batch: int, drop_last: bool) -> int:
    """Batches each worker sees per epoch: Ray Train splits a dataset into equal shards."""
    rows, batch = train_rows // num_workers, global_batch // num_workers
    return rows // batch if drop_last else -(-rows // batch)


def planned_updates(cfg: PipelineConfig, train_rows: int) -> int:
    """The optimizer steps the LR schedule spans: every epoch at the most steps any allowed worker count
    takes (the global batch stays the same, so they differ by rounding only), the same for every worker
    group of the run, so a schedule restored from a checkpoint fits the group that restores it."""
    ingest, scaling = cfg.ingest, cfg.scaling
    steps = max(steps_per_epoch(train_rows, n, ingest.batch_size, ingest.drop_last) for n in scaling.worker_counts)
    return cfg.train.epochs * -(-steps // cfg.train.accumulate)


def train_epoch(
    replica: Replica, batches: Iterable[dict], cfg: PipelineConfig, epoch: int, steps: int, progress
) -> dict:
    """One pass over the worker's training shard (``steps`` batches); its figures over all workers
    (:class:`pipeline.training.telemetry.EpochTelemetry`). ``progress`` (rank 0) gets the step and batch loss once a
    second, and every ``tracking.log_every_n_steps`` steps for MLflow (``log``, with the global step).

    The optimizer steps every ``train.accumulate`` batches and on the epoch's last; should a shard hold
    fewer batches than ``steps`` (rows skipped by a transform), what they accumulated after the last step
    is dropped with the next epoch's first ``zero_grad``."""
    features, labels = replica.layout.model_input, replica.layout.label
    replica.model.train()
    replica.optimizer.zero_grad(set_to_none=True)
    classes = cfg.source.num_classes if cfg.task.type == TaskType.classification else None
    telemetry = EpochTelemetry(next(replica.model.parameters()).device, classes)
    log_every, accumulate, last_sent = cfg.tracking.log_every_n_steps, cfg.train.accumulate, -math.inf
    for step, batch in enumerate(telemetry.timed(batches), start=1):
        if replica.example is None:
            replica.example = batch[features][[0, -1]].cpu()  # two rows: MLflow's export keeps the batch size free
        update = step % accumulate == 0 or step == steps  # an optimizer step after this batch
        with replica.autocast:
            loss = replica.task.loss(replica.model(replica.scale(batch[features])), batch[labels])
        replica.backward(loss, accumulate, update)
        if update:
            telemetry.skipped += not replica.step()
        telemetry.batch(step, loss, len(batch[labels]))
        telemetry.batch_labels(batch[labels])
        log = log_every > 0 and step % log_every == 0
        if progress is not None and (log or time.monotonic() - last_sent >= PROGRESS_INTERVAL_S):
            # .item() waits for the step: rarely
            progress(
                StepTaken(
                    epoch=epoch, step=step, global_step=epoch * steps + step, log=log, loss=loss.item(), at=time.time()
                )
            )
            last_sent = time.monotonic()
    if replica.on_nonfinite == OnNonfinite["raise"] and (batch_number := telemetry.nonfinite_batch()):
        raise FloatingPointError(
            f"the loss became NaN or inf at epoch {epoch + 1}, batch {batch_number}: training diverged, "
            "most often from a learning rate too high for the model (the last step's: "
            f"{replica.optimizer.param_groups[0]['lr']:g}). Lower optim.lr, clip the gradients with "
            "train.grad_clip, or skip such steps with train.on_nonfinite=skip."
        )
    return telemetry.totals() | parallel.memory(replica.model, replica.optimizer)  # what this worker holds


@torch.no_grad()
def validate(replica: Replica, batches: Iterable[dict]) -> dict:
    """Loss and the task's metrics over every worker's shard: sums and counts are all-reduced, then divided."""
    features, labels = replica.layout.model_input, replica.layout.label
    model, task = replica.module.eval(), replica.task
    rank0_buffers(model)
    device = next(model.parameters()).device
    declared = {"loss": LOSSES["val_loss"], **task.metrics}  # how each sum finishes (pipeline.common.metrics)
    sums = {name: torch.zeros((), dtype=torch.float64, device=device) for name in declared}
    count = 0
    for batch in batches:
        with replica.autocast:
            outputs = model(replica.scale(batch[features]))
        rows = len(batch[labels])
        sums["loss"] += task.loss(outputs.float(), batch[labels]).double() * rows
        for name, value in task.sums(outputs, batch[labels]).items():
            sums[name] += value.double()
        count += rows
    parallel.reshard(model)
    *totals, count = sum_over_workers([value.item() for value in sums.values()] + [count], device)
    values = {f"val_{name}": declared[name].value(total, count) for name, total in zip(sums, totals)}
    return values | {"val_rows": int(count)}


def rank0_buffers(model: torch.nn.Module) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) on every rank, so that validation scores the model rank 0
    checkpoints: DDP broadcasts them before each training forward, and each rank's own last batch then moves its
    copy apart (a no-op outside a process group)."""
    if parallel.world_size() > 1:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def report(metrics: dict, replica: Replica, epoch: int, stopper: EarlyStopping | None, rank: int, upload: str) -> None:
    """``ray.train.report`` (a barrier: every rank calls it once per epoch) with the epoch's checkpoint, written
    to a local directory that Ray Train uploads to storage and then deletes: with ``upload`` async
    (``train.checkpoint_upload``) in a thread while the next epoch trains. Every rank's files and their sizes go
    in rank 0's report, so a checkpoint cut short is never taken for whole (:func:`checkpoint.newest`)."""
    directory = tempfile.mkdtemp(prefix="checkpoint-")
    replica.save(directory, epoch, stopper, rank)
    every_rank = parallel.from_every_rank(checkpoint.files(directory))
    written = {name: size for files in every_rank for name, size in files.items()}
    if rank == 0:
        checkpoint.write_report(directory, metrics, written)
    saved = None
    if os.listdir(directory):
        saved = ray.train.Checkpoint.from_directory(directory)
    else:  # a replica's rank other than 0: nothing to upload
        os.rmdir(directory)
    mode = CheckpointUploadMode.ASYNC if upload == CheckpointUpload["async"] else CheckpointUploadMode.SYNC
    ray.train.report(metrics, checkpoint=saved, checkpoint_upload_mode=mode, delete_local_checkpoint_after_upload=True)


@dataclass(frozen=True)
class RestorePoint:
    checkpoint: ray.train.Checkpoint
    epoch: int


def restore_point(saved: ray.train.Checkpoint | None) -> RestorePoint | None:
    """Where training continues: the newer of the checkpoint Ray Train restores (a restarted worker group, or
    a resumed run) and ``saved``, the newest the storage held when the run started, which Ray never registered
    when a stop came between its copy and its registration. Their reports say their epochs."""
    points = [
        RestorePoint(found, checkpoint.read_report(found.filesystem, found.path)["epoch"])
        for found in (ray.train.get_checkpoint(), saved)
        if found is not None
    ]
    return max(points, key=lambda point: point.epoch, default=None)


def train_batches(
    cfg: PipelineConfig, epoch: int, coordinator, device: torch.device, world_size: int
) -> Iterator[dict]:
    """This worker's training shard for ``epoch``. The epoch is set on the job's coordinator first, since the
    seeded transforms of the pass read it (the pass starts once every worker has asked for it)."""
    ray.get(coordinator.set_epoch.remote(epoch))
    shard = ray.train.get_dataset_shard("train")
    return torch_batches(shard, cfg, device, world_size, training=True, seed=cfg.train.seed + epoch)


def torch_batches(
    shard, cfg: PipelineConfig, device: torch.device, world_size: int, training: bool, seed: int | None = None
) -> Iterator:
    """This worker's shard of a split as torch batches (``ingest`` settings), on the training device.
    Training shuffles in a local buffer and drops its last partial batch when ``ingest`` says so;
    validation never does. Pixels arrive as uint8 (a quarter of float32's bytes through Ray's object
    store and to a GPU): the replica scales them (:func:`pipeline.training.scaling.feature_scaler`)."""
    ingest = cfg.ingest
    return shard.iter_torch_batches(
        batch_size=ingest.batch_size // world_size,
        prefetch_batches=ingest.prefetch_batches,
        local_shuffle_buffer_size=ingest.local_shuffle_buffer_size if training else None,
        local_shuffle_seed=seed,
        drop_last=ingest.drop_last and training,
        device=device,
    )


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
