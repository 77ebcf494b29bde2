"""The training worker's loop and helpers, without a Ray runtime (two DDP workers: two processes and gloo)."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing
from conftest import free_port

from pipeline.common.metrics import epoch_metrics
from pipeline.config import Layout, OnNonfinite, PipelineConfig, TaskConfig, TrackingConfig, TrainConfig
from pipeline.training import parallel, preemption
from pipeline.training.early_stop import EarlyStopping
from pipeline.training.ledger import Ledger
from pipeline.training.micro_batch import MicroBatch
from pipeline.training.precision import autocast_settings
from pipeline.training.replica import Replica
from pipeline.training.reports import StepCheckpoints
from pipeline.training.resume import EpochSteps
from pipeline.training.task import Task
from pipeline.training.worker import prefetched, train_epoch, validate
from transforms.randomness import ROW

CLASSIFY = TaskConfig()  # classification: cross-entropy, accuracy


def one_epoch(replica, batches, cfg, epoch: int, steps: int):
    """``train_epoch`` as the worker calls it for an epoch not resumed, with no checkpoint within it due; the
    epoch's figures as the worker reports them."""
    checkpoints = StepCheckpoints(
        due=preemption.Due(cfg.train, None, drains=False),
        replica=replica,
        stopper=None,
        cfg=cfg,
        rank=0,
        storage=None,  # no checkpoint is due, so no report is recorded
    )
    ledger = Ledger(sum(len(batch["y"]) for batch in batches), torch.device("cpu"), 0)
    telemetry, _ = train_epoch(
        replica,
        batches,
        cfg,
        epoch=epoch,
        steps=EpochSteps(done=0, last=steps, per_epoch=steps),
        progress=None,
        ledger=ledger,
        checkpoints=checkpoints,
        resumed=None,
    )
    return telemetry.totals() | ledger.figures() | parallel.memory(replica.model, replica.optimizer)


def replica_of(model, task=CLASSIFY, optimizer=torch.optim.SGD, lr=0.1, grad_clip=None, on_nonfinite="raise"):
    """A worker's Replica around ``model`` as Replica.build makes it, minus Ray Train's prepare_model."""
    autocast, scaler = autocast_settings(torch.device("cpu"), TrainConfig())
    layout = Layout(["x"], "x", "y", stacked=False)
    params = model.parameters()
    return Replica(
        model=model,
        optimizer=optimizer(params, lr=lr),
        scheduler=None,
        scaler=scaler,
        autocast=autocast,
        task=Task(task),
        statistics=None,
        scale=lambda x: x,
        layout=layout,
        grad_clip=grad_clip,
        on_nonfinite=OnNonfinite[on_nonfinite],
        micro=MicroBatch(None, auto=False, batch=4),
    )


def epoch_cfg(accumulate: int = 1) -> PipelineConfig:
    return PipelineConfig(tracking=TrackingConfig(log_every_n_steps=0), train=TrainConfig(accumulate=accumulate))


def weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def rows(count: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(count, 4, generator=generator), "y": torch.randint(0, 3, (count,), generator=generator)}


def test_prefetched_asks_for_the_first_batch_before_anyone_iterates():
    asked = threading.Event()

    def batches():
        asked.set()
        yield from range(5)

    stream = prefetched(batches())
    assert asked.wait(timeout=10)  # fetched in the background: the model can be built meanwhile
    assert list(stream) == [0, 1, 2, 3, 4]


def test_prefetched_passes_an_empty_stream_and_errors_through():
    assert list(prefetched(iter(()))) == []

    def failing():
        raise OSError("cannot read part-00003.parquet")
        yield  # a generator

    with pytest.raises(OSError, match="part-00003"):
        list(prefetched(failing()))


@pytest.mark.parametrize(
    "task",
    [
        TaskConfig("classification", {"_target_": "torch.nn.CrossEntropyLoss"}, ["top2_accuracy"]),
        TaskConfig("regression", {"_target_": "torch.nn.MSELoss"}, ["mae", "rmse"]),
    ],
)
def test_an_epoch_reports_exactly_the_declared_metrics(task):
    """What train_epoch and evaluate return is what pipeline.common.metrics declares, so the tracker, which logs
    the declared names, drops nothing and misses nothing (outside a process group: one worker)."""
    torch.manual_seed(0)
    outputs = 3 if task.type == "classification" else 1
    replica = replica_of(torch.nn.Linear(4, outputs), task)
    labels = torch.tensor([0, 1, 2, 1]) if outputs == 3 else torch.tensor([0.5, 1.0, -1.0, 2.0])
    batches = [{"x": torch.randn(4, 4), "y": labels, ROW: torch.arange(4) + 4 * i} for i in range(3)]
    cfg = epoch_cfg()
    cfg = replace(cfg, task=task, source=replace(cfg.source, num_classes=3 if task.type == "classification" else None))
    metrics = one_epoch(replica, batches, cfg, 0, 3) | validate(replica, batches)
    # the loop adds what an epoch cannot know of itself: what the previous checkpoint held training up, and the
    # rows per forward (train.micro_batch), which the loop reads from the replica at the epoch's end
    assert set(metrics) | {"checkpoint_stall_s", "micro_batch"} == set(epoch_metrics(task.type, task.metrics))
    assert metrics["param_bytes"] == 4 * (4 * outputs + outputs)  # float32 weight and bias
    assert metrics["optimizer_bytes"] == 0  # plain SGD keeps no state
    assert metrics["train_rows"] == metrics["val_rows"] == metrics["train_rows_distinct"] == 12
    assert 0 <= metrics["data_wait_fraction"] < 1
    again = [{**batch, ROW: torch.arange(4)} for batch in batches]  # the same four rows three times
    assert one_epoch(replica, again, cfg, 1, 3)["train_rows_distinct"] == 4
    assert all(value == value for value in metrics.values())  # no NaN


@pytest.mark.parametrize("clip", [None, 0.5])
def test_grad_clip_bounds_the_norm_of_the_gradient_a_step_applies(clip):
    """Measured on the update itself: SGD with lr=1 moves the weights by exactly the gradient it applied."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    replica = replica_of(model, lr=1.0, grad_clip=clip)
    batch = {"x": torch.randn(8, 4) * 100, "y": torch.randint(0, 3, (8,))}  # large inputs: a large gradient
    before = weights(model)
    one_epoch(replica, [batch], epoch_cfg(), 0, 1)
    applied = (weights(model) - before).norm().item()
    if clip is None:
        assert applied > 10 * 0.5  # unclipped, far above the bound
    else:
        assert applied == pytest.approx(clip, rel=1e-4)


def test_a_nan_gradient_fails_naming_epoch_and_batch_or_with_skip_is_left_out_and_counted():
    torch.manual_seed(0)
    good = [rows(8, seed) for seed in range(3)]
    poisoned = {"x": good[0]["x"].clone(), "y": good[0]["y"]}
    poisoned["x"][2, 1] = float("nan")
    batches = [good[0], good[1], poisoned, good[2]]

    with pytest.raises(FloatingPointError, match=r"the loss became NaN or inf at epoch 2, batch 3: .*Lower optim.lr"):
        one_epoch(replica_of(torch.nn.Linear(4, 3)), batches, epoch_cfg(), 1, 4)

    torch.manual_seed(0)
    skipping = replica_of(torch.nn.Linear(4, 3), on_nonfinite="skip")
    metrics = one_epoch(skipping, batches, epoch_cfg(), 1, 4)
    torch.manual_seed(0)
    clean = replica_of(torch.nn.Linear(4, 3))
    expected = one_epoch(clean, good, epoch_cfg(), 1, 3)
    assert metrics["skipped_steps"] == 1 and metrics["train_rows"] == 32
    assert torch.equal(weights(skipping.model), weights(clean.model))  # as if the batch had not been there
    assert metrics["train_loss"] == pytest.approx(expected["train_loss"])  # its NaN loss left out


RUNS = ((16, 1), (4, 4), (4, 1))  # (batch size, batches per optimizer step)


def accumulated(rank: int, world: int, port: int, out: str) -> None:
    """For each of RUNS, two epochs of AdamW from the same seed over this rank's 32 rows; the weights
    saved to ``out.<batch>x<accumulate>.<rank>``. One process per rank trains them all (a process starts in seconds)."""
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    shard = rows(32, seed=rank)
    for batch, accumulate in RUNS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        if world > 1:
            model = torch.nn.parallel.DistributedDataParallel(model)
        replica = replica_of(model, optimizer=torch.optim.AdamW, lr=0.05)
        batches = [{key: value[i : i + batch] for key, value in shard.items()} for i in range(0, 32, batch)]
        for epoch in range(2):
            one_epoch(replica, batches, epoch_cfg(accumulate), epoch, len(batches))
        torch.save(weights(replica.module), f"{out}.{batch}x{accumulate}.{rank}")
    if world > 1:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_accumulating_k_batches_steps_like_one_batch_k_times_larger(world, tmp_path):
    """Batches of 4 accumulated 4 at a time end at the weights batches of 16 reach (DDP syncing only on the
    fourth: ``no_sync``); stepping on every batch of 4 does not."""
    out = str(tmp_path / "weights")
    if world == 1:
        accumulated(0, world, 0, out)
    else:
        torch.multiprocessing.spawn(accumulated, args=(world, free_port(), out), nprocs=world)
    large, small, each = (
        [torch.load(f"{out}.{batch}x{accumulate}.{rank}", weights_only=True) for rank in range(world)]
        for batch, accumulate in RUNS
    )
    assert all(torch.equal(large[0], w) for w in large)  # the replicas agree
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(large, small))
    assert not torch.allclose(large[0], each[0], atol=1e-3)


def validated(rank: int, world: int, port: int, out: str) -> None:
    """One DDP training step of a BatchNorm model on this rank's own rows, then validation; saves this rank's
    running mean as validation left it."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    replica = replica_of(torch.nn.parallel.DistributedDataParallel(model))
    shard = rows(16, seed=rank)
    shard["x"] = shard["x"] + 3 * rank  # each rank's batch moves its running statistics elsewhere
    one_epoch(replica, [shard], epoch_cfg(), 0, 1)
    validate(replica, [rows(16, seed=7)])
    torch.save(model[1].running_mean.clone(), f"{out}.{rank}")
    dist.destroy_process_group()


def test_every_rank_validates_with_rank_0s_batchnorm_statistics(tmp_path):
    """DDP broadcasts buffers before a training forward, not after: each rank's last batch leaves its own
    running statistics. Validation uses rank 0's, the ones its checkpoint holds, on every rank."""
    out = str(tmp_path / "validated")
    torch.multiprocessing.spawn(validated, args=(2, free_port(), out), nprocs=2)
    first, second = (torch.load(f"{out}.{rank}", weights_only=True) for rank in range(2))
    assert torch.equal(first, second)


@pytest.mark.parametrize(
    ("lower_is_better", "curve", "stop_after"),
    [
        (True, [1.0, 0.8, 0.795, 0.81, 0.7], 3),  # 0.795 improves by less than min_delta; patience ends at epoch 3
        (False, [0.5, 0.6, 0.7, 0.705, 0.708, 0.9], 4),  # 0.7 best; 0.705 and 0.708 gain too little
        (True, [1.0, 0.9, 0.8, 0.7], None),  # improving every epoch: never stops
    ],
)
def test_early_stopping_stops_when_patience_runs_out_on_a_scripted_curve(lower_is_better, curve, stop_after):
    stopper = EarlyStopping(metric="val_metric", patience=2, min_delta=0.01, lower_is_better=lower_is_better)
    reasons = [stopper.update(value, epoch) for epoch, value in enumerate(curve)]
    stops = [epoch for epoch, reason in enumerate(reasons) if reason]
    assert (stops[0] if stops else None) == stop_after
    if stop_after is not None:
        best = 1 if lower_is_better else 2
        why = f"did not improve by more than 0.01 for 2 epoch(s) (best {curve[best]:.4g} after epoch {best + 1})"
        assert reasons[stop_after] == f"val_metric {why}"


def test_the_average_moves_by_its_decay_each_step_and_the_model_holds_it_only_within_applied():
    """Each average (BatchNorm's running mean too) moves 1 - decay of the way to the trained tensor, the decay warming
    up as (1 + n) / (10 + n) over the first n steps; within
    ``applied`` the model computes with the averages, after it with its trained weights, bit for bit."""
    from pipeline.training.ema import Ema

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    ema = Ema(model, decay=0.75)
    start = {name: t.clone() for name, t in ema.named().items()}
    with torch.no_grad():
        model[0].weight.add_(1.0)
        model[1].running_mean.add_(2.0)
    ema.update(model)  # the first step's decay: 1 / 10
    assert torch.allclose(ema.named()["0.weight"], start["0.weight"] + 0.9)
    assert torch.allclose(ema.named()["1.running_mean"], start["1.running_mean"] + 1.8)
    ema.updates = 1000  # warmed up: the decay itself
    before = ema.named()["0.weight"].clone()
    ema.update(model)
    assert torch.allclose(ema.named()["0.weight"], 0.75 * before + 0.25 * model[0].weight)
    assert "1.num_batches_tracked" not in ema.named()  # an integer buffer stays as trained

    rows = torch.randn(5, 3)
    trained = model.eval()(rows)
    with ema.applied(model):
        averaged = model(rows)
        assert torch.equal(model[0].weight, ema.named()["0.weight"])
    assert not torch.allclose(averaged, trained) and torch.equal(model(rows), trained)
