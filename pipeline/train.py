"""Training stage: the DDP loop each Ray Train worker runs, and the TorchTrainer that runs it.

Workers get a plain dict (no Hydra context exists there), stream their shard with
``iter_torch_batches``, all-reduce validation sums so every world size reports the same numbers for
the same weights, and report metrics plus a checkpoint once per epoch.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs
import ray.data
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from pipeline.config import PipelineError
from pipeline.filesystems import is_s3, locate, s3_error

CHECKPOINT_FILE = "checkpoint.pt"
PROGRESS_INTERVAL_S = 1.0


@dataclass
class RunStorage:
    """Where Ray Train keeps a run's checkpoints: ``path``/``name`` on ``filesystem``, shown as ``uri``."""

    path: str
    name: str
    filesystem: pafs.FileSystem
    uri: str


def run_storage(storage: dict, run_dir: str, run_id: str, resume_from: str | None = None) -> RunStorage:
    """Each run's checkpoints live under its MLflow run id, in ``storage.path`` (a shared path or
    ``s3://`` URI) or else the job's output directory (``<run_dir>/checkpoints``). Ray Train restores
    from whatever it finds there, so a fresh run, with a fresh id, never resumes by accident; a
    resumed run passes the place its first attempt recorded (``resume_from``)."""
    if resume_from is not None:
        parent, name = resume_from.rsplit("/", 1)
    else:
        parent, name = (storage["path"] or os.path.join(run_dir, "checkpoints")).rstrip("/"), run_id
    fs, path = locate(parent, storage["s3"], "storage.path")
    return RunStorage(path, name, fs, f"{parent if is_s3(parent) else path}/{name}")


def check_storage(uri: str, s3: dict) -> None:
    """Create the storage directory now, so a missing bucket or a read-only store fails before training."""
    fs, path = locate(uri, s3, "storage.path")
    try:
        fs.create_dir(path, recursive=True)
    except OSError as err:
        if is_s3(uri):
            raise s3_error("storage.path", uri, err) from err
        raise PipelineError(f"storage.path: cannot create {uri} ({err}).") from err


def trainer_settings(scaling: dict) -> tuple[ScalingConfig, TorchConfig]:
    """Ray's scaling and process-group settings: nccl on GPU workers, gloo on CPU workers; workers go
    only to nodes with their resources (custom ones included) and ``label_selector`` labels."""
    scaling_config = ScalingConfig(
        num_workers=scaling["num_workers"],
        use_gpu=scaling["use_gpu"],
        resources_per_worker=dict(scaling["resources_per_worker"]),
        label_selector=dict(scaling["label_selector"]) or None,
    )
    return scaling_config, TorchConfig(backend="nccl" if scaling["use_gpu"] else "gloo")


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
    spare = available.get("CPU", 0.0) - per_worker.get("CPU", 0.0) * scaling["num_workers"]
    if spare < transform_cpus:
        raise PipelineError(
            f"training workers take {available.get('CPU', 0.0) - spare:g} of {available.get('CPU', 0.0):g} CPUs, "
            f"leaving {spare:g} for preprocessing, which needs {transform_cpus:g} (transforms.*.num_cpus): "
            "lower scaling.resources_per_worker.CPU or scaling.num_workers, or raise ray.num_cpus."
        )


def amp_plan(device_type: str, train: dict) -> tuple[bool, torch.dtype, bool]:
    """(autocast on?, its dtype, GradScaler on?): mixed precision only on CUDA and only when asked;
    float16 needs loss scaling, bfloat16 does not."""
    enabled = train["amp"] and device_type == "cuda"
    dtype = getattr(torch, train["amp_dtype"])
    return enabled, dtype, enabled and dtype == torch.float16


def autocast_settings(device: torch.device, train: dict) -> tuple[torch.autocast, torch.amp.GradScaler]:
    """The autocast context and GradScaler that :func:`amp_plan` asks for."""
    enabled, dtype, scale = amp_plan(device.type, train)
    return torch.autocast(device.type, dtype=dtype, enabled=enabled), torch.amp.GradScaler(device.type, enabled=scale)


def steps_per_epoch(train_rows: int, num_workers: int, global_batch: int, drop_last: bool) -> int:
    """Batches each worker sees per epoch: Ray Train splits a dataset into equal shards."""
    rows, batch = train_rows // num_workers, global_batch // num_workers
    return rows // batch if drop_last else -(-rows // batch)


def _sum_over_workers(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor.tolist()


def weights_digest(model: torch.nn.Module) -> str:
    """A sha256 of every parameter's bytes: equal digests mean bit-identical replicas."""
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def pixel_scaling(normalize: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, shift)`` with ``x * scale + shift == (x / 255 - mean) / std``, shaped for (N, C, H, W)."""
    mean = torch.tensor(normalize["mean"], dtype=torch.float32, device=device).view(1, -1, 1, 1)
    std = torch.tensor(normalize["std"], dtype=torch.float32, device=device).view(1, -1, 1, 1)
    return 1.0 / (255.0 * std), -mean / std


def batches(shard, cfg: dict, device: torch.device, world_size: int, seed: int | None, training: bool) -> Iterator:
    """The worker's shard as torch batches (``ingest`` settings); validation never drops its last partial batch.

    Features arrive as uint8 (a quarter of float32's bytes through Ray's object store and to a GPU)
    and ``ingest.normalize`` turns them into floats here, on the training device.
    """
    ingest, feature = cfg["ingest"], cfg["source"]["feature_column"]
    stream = shard.iter_torch_batches(
        batch_size=ingest["batch_size"] // world_size,
        prefetch_batches=ingest["prefetch_batches"],
        local_shuffle_buffer_size=ingest["local_shuffle_buffer_size"],
        local_shuffle_seed=seed,
        drop_last=ingest["drop_last"] and training,
        device=device,
    )
    if ingest["normalize"] is None:
        return stream
    scale, shift = pixel_scaling(ingest["normalize"], device)
    return ({**batch, feature: batch[feature].float() * scale + shift} for batch in stream)


class WaitClock:
    """Seconds a loop spent waiting for its next batch, against the seconds it ran: is ingest the bottleneck?"""

    def __init__(self) -> None:
        self.waited, self.started = 0.0, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def wrap(self, batches: Iterator) -> Iterator:
        iterator = iter(batches)
        while True:
            before = time.perf_counter()
            batch = next(iterator, None)
            self.waited += time.perf_counter() - before
            if batch is None:
                return
            yield batch


def _train_epoch(model, optimizer, scheduler, autocast, scaler, batches, cfg, epoch, device, progress) -> dict:
    features, labels = cfg["source"]["feature_column"], cfg["source"]["label_column"]
    model.train()
    # Sums stay on the device: a .item() per step would stall a GPU on every batch.
    loss_sum, seen, last_sent = torch.zeros((), dtype=torch.float64, device=device), 0, float("-inf")
    clock, first_step_at = WaitClock(), None
    for step, batch in enumerate(clock.wrap(batches), start=1):
        with autocast:
            loss = torch.nn.functional.cross_entropy(model(batch[features]), batch[labels])
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if scheduler is not None:
            scheduler.step()
        loss_sum += loss.detach().double() * len(batch[labels])
        seen += len(batch[labels])
        first_step_at = first_step_at or time.time()
        if progress is not None and time.monotonic() - last_sent >= PROGRESS_INTERVAL_S:
            progress({"epoch": epoch, "step": step, "loss": loss.item()})
            last_sent = time.monotonic()
    elapsed = clock.elapsed()
    total_loss, total_seen, waited, ran = _sum_over_workers([loss_sum.item(), seen, clock.waited, elapsed], device)
    return {
        "train_loss": total_loss / max(total_seen, 1),
        "train_throughput": total_seen / elapsed,
        "train_rows": int(total_seen),
        "data_wait_fraction": waited / max(ran, 1e-9),
        "first_step_at": first_step_at,
    }


@torch.no_grad()
def evaluate(model, autocast, batches, cfg) -> dict:
    """Loss and accuracy over every worker's shard: sums and counts are all-reduced, then divided."""
    features, labels = cfg["source"]["feature_column"], cfg["source"]["label_column"]
    model.eval()
    device = next(model.parameters()).device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct, count = torch.zeros((), dtype=torch.int64, device=device), 0
    for batch in batches:
        with autocast:
            logits = model(batch[features])
        loss_sum += torch.nn.functional.cross_entropy(logits.float(), batch[labels], reduction="sum").double()
        correct += (logits.argmax(dim=1) == batch[labels]).sum()
        count += len(batch[labels])
    loss_sum, correct, count = _sum_over_workers([loss_sum.item(), correct.item(), count], device)
    return {"val_loss": loss_sum / max(count, 1), "val_accuracy": correct / max(count, 1), "val_rows": int(count)}


def started(batches: Iterable) -> Iterator:
    """``batches`` with its first item already on its way: a helper thread asks for it now, so Ray Data
    starts its split coordinator, reads and decodes while the caller builds the model (about 2 s of
    start-up on 2 cores that would otherwise run one after the other)."""
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


def train_loop_per_worker(config: dict) -> None:
    """One worker's training: restore, start the first epoch's data, build the model, then per epoch
    train, validate, report + checkpoint."""
    cfg, progress_queue = config["cfg"], config["events"]
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    if cfg["scaling"]["torch_threads"]:
        torch.set_num_threads(cfg["scaling"]["torch_threads"])
    device = ray.train.torch.get_device()

    state, start_epoch, epochs = None, 0, cfg["train"]["epochs"]
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as path:
            state = torch.load(os.path.join(path, CHECKPOINT_FILE), map_location=device, weights_only=True)
        start_epoch = state["epoch"] + 1

    def train_batches(epoch: int) -> Iterator:
        shard = ray.train.get_dataset_shard("train")
        return batches(shard, cfg, device, world_size, cfg["train"]["seed"] + epoch, True)

    first_epoch_batches = started(train_batches(start_epoch)) if start_epoch < epochs else iter(())

    torch.manual_seed(cfg["train"]["seed"])
    model = ray.train.torch.prepare_model(instantiate(cfg["model"], _convert_="all"))
    replica = getattr(model, "module", model)  # evaluation and checkpoints use the bare module
    optimizer = instantiate(cfg["optim"], params=model.parameters(), _convert_="all")
    scheduler = None
    if cfg["scheduler"] is not None:
        total_steps = epochs * config["steps_per_epoch"]
        scheduler = instantiate(cfg["scheduler"], optimizer=optimizer, total_steps=total_steps, _convert_="all")
    autocast, scaler = autocast_settings(device, cfg["train"])

    if state is not None:
        replica.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        if rank == 0:  # the driver records every restore (a restarted worker group or a resumed run)
            progress_queue.put(("restored", {"epoch": start_epoch}))

    def progress(event: dict) -> None:
        progress_queue.put(("progress", event))

    for epoch in range(start_epoch, epochs):
        metrics = _train_epoch(
            model,
            optimizer,
            scheduler,
            autocast,
            scaler,
            first_epoch_batches if epoch == start_epoch else train_batches(epoch),
            cfg,
            epoch,
            device,
            progress if rank == 0 else None,
        )
        valid_batches = batches(ray.train.get_dataset_shard("valid"), cfg, device, world_size, None, False)
        metrics.update(evaluate(replica, autocast, valid_batches, cfg))
        metrics.update(
            epoch=epoch,
            rank=rank,
            weights_sha256=weights_digest(replica),  # where each rank ran,
            pid=os.getpid(),
            node_id=ray.get_runtime_context().get_node_id(),  # and which copy of the
            code=os.path.dirname(os.path.abspath(__file__)),
        )  # code: metrics.jsonl keeps it
        with tempfile.TemporaryDirectory() as tmp:
            saved = None
            if rank == 0:
                state = {
                    "model": replica.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch,
                    "scaler": scaler.state_dict(),
                    "torch_rng": torch.get_rng_state(),
                }
                if scheduler is not None:
                    state["scheduler"] = scheduler.state_dict()
                torch.save(state, os.path.join(tmp, CHECKPOINT_FILE))
                saved = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=saved)


class _ReportRelay(ray.train.UserCallback):
    """Forwards every report (all ranks' metrics and the persisted checkpoint) to the driver."""

    def __init__(self, events: Any):
        self.events = events

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        self.events.put(("report", {"ranks": metrics, "checkpoint": checkpoint.path if checkpoint else None}))


_stop_requests: list[BaseException] = []


def request_stop(error: BaseException) -> None:
    """A signal handler's body: raise ``error`` (KeyboardInterrupt, SystemExit) now, and again from
    :func:`fit`'s wait loop. An exception a handler raises while a finalizer runs on the main thread
    (Ray's handles have ``__del__``) is only printed, and a lost Ctrl-C would leave training running."""
    _stop_requests.append(error)
    raise error


def fit(trainer: TorchTrainer) -> ray.train.Result:
    """``trainer.fit()`` in a helper thread, waited on from this one.

    On the main thread Ray Train installs its own SIGINT handler, which turns Ctrl-C into exit status 0
    and keeps the run's controller actor (and its dataset split coordinators) alive after the run, so
    a sweep piles them up. Off the main thread it installs none: Ctrl-C and SIGTERM reach the pipeline
    as KeyboardInterrupt / SystemExit, the run is recorded as KILLED, and leaving the process takes
    the run's actors with it.
    """
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as err:  # re-raised on the calling thread
            outcome["error"] = err

    thread = threading.Thread(target=target, name="ray-train-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=0.5)  # a bounded wait lets signals through
        if _stop_requests:
            raise _stop_requests[0]
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def data_config(cfg: dict) -> DataConfig:
    """How Ray Train executes the datasets it splits: Ray's defaults, unless the config changes them."""
    data_cpus = cfg["scaling"]["data_cpus"]
    execution_options = None
    if data_cpus is not None or cfg["ingest"]["preserve_order"]:
        execution_options = ray.data.ExecutionOptions(preserve_order=cfg["ingest"]["preserve_order"])
        if data_cpus is not None:
            execution_options.resource_limits = ray.data.ExecutionResources(cpu=data_cpus)
    return DataConfig(execution_options=execution_options)


def build_trainer(cfg: dict, datasets: dict, storage: RunStorage, steps: int, events: Any) -> TorchTrainer:
    """A TorchTrainer for the resolved config; ``events`` is a ray.util.queue.Queue read by the driver."""
    scaling_config, torch_config = trainer_settings(cfg["scaling"])
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": cfg, "events": events, "steps_per_epoch": steps},
        scaling_config=scaling_config,
        torch_config=torch_config,
        datasets=datasets,
        dataset_config=data_config(cfg),
        run_config=RunConfig(
            name=storage.name,
            storage_path=storage.path,
            storage_filesystem=storage.filesystem,
            checkpoint_config=CheckpointConfig(
                num_to_keep=cfg["train"]["num_to_keep"],
                checkpoint_score_attribute=cfg["train"]["checkpoint_metric"],
                checkpoint_score_order=cfg["train"]["checkpoint_mode"],
            ),
            failure_config=FailureConfig(max_failures=cfg["train"]["max_failures"]),
            callbacks=[_ReportRelay(events)],
        ),
    )
