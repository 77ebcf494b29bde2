"""train.micro_batch: a batch in parts, by hand or found on an out-of-memory error (``auto``).

The memory is short for real: the model's process caps its address space (tests/memory_model.py), so a batch of
many rows fails in torch's CPU allocator, as a large one does on a GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import compose_cfg
from memory_model import cap_memory
from mlflow import MlflowClient
from test_parallel import join_group
from test_pipeline import cli_env

from pipeline.common.errors import PipelineError
from pipeline.training.micro_batch import CPU_OUT_OF_MEMORY
from pipeline.training.replica import Replica

TESTS = Path(__file__).parent
CPU = torch.device("cpu")
# plain SGD: the weights move by the gradients themselves (Adam's first step divides each by its own size, which
# makes float rounding in a gradient near zero a whole step)
MODEL = [
    "optim._target_=torch.optim.SGD",
    "model._target_=memory_model.WideMLP",
    "~model.hidden_channels",
    "+model.num_classes=3",
]
ROWS = 64  # each rank's batch


def rows(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(ROWS, 13, generator=generator), torch.randint(0, 3, (ROWS,), generator=generator)


def step(rank: int, world: int, cfg, out: str, cap_mb: float | None) -> None:
    """In a process of a gloo group of ``world``: one optimizer step on this rank's batch, its memory capped when
    ``cap_mb``; the rows per part it ended with and the weights into ``out/rank<R>.pt``."""
    torch.set_num_threads(1)  # no OpenMP threads to start under the cap
    if world > 1:
        join_group(rank, world, out)
    replica = Replica.build(cfg, CPU, total_steps=10, statistics=None)
    if cap_mb is not None:
        cap_memory(cap_mb)
    try:
        features, labels = rows(rank) if world > 1 else map(torch.cat, zip(rows(0), rows(1)))
        loss = replica.train_batch(features, labels, accumulate=1, update=True)
        assert replica.step()
        result = {"rows": replica.micro.size, "loss": loss.item(), "weights": replica.module.state_dict()}
    except PipelineError as error:
        result = {"error": str(error)}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def run(cfg, world: int, out: Path, caps: list[float | None]) -> list[dict]:
    """``step`` in ``world`` processes, rank R's memory capped at ``caps[R]`` MB above what it maps once built; one
    process takes both ranks' rows as one batch."""
    out.mkdir()
    context = mp.get_context("spawn")
    processes = [context.Process(target=step, args=(r, world, cfg, str(out), caps[r])) for r in range(world)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
        assert process.exitcode == 0
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def config(*overrides: str):
    return compose_cfg(["+experiment=wine_mlp", *MODEL, "ingest.batch_size=128", *overrides])


def test_the_ranks_halve_together_when_one_runs_out_of_memory_and_step_as_the_whole_batch_would(tmp_path):
    """Rank 1 alone is short of memory: both ranks take half the rows per part, and the step is the recipe's (two
    ranks' means averaged, as DDP's step on the whole batches), the weights alike on both ranks."""
    two = run(config("train.micro_batch=auto", "scaling.num_workers=2"), 2, tmp_path / "two", caps=[None, 600])
    (whole,) = run(config(), 1, tmp_path / "whole", caps=[None])
    assert whole["rows"] == 2 * ROWS  # one process: both ranks' rows as one batch, in one part
    assert two[0]["rows"] == two[1]["rows"] < ROWS  # rank 0 never ran out of memory; it halved with rank 1
    for name, tensor in two[0]["weights"].items():
        assert torch.equal(tensor, two[1]["weights"][name]), name
        assert torch.allclose(tensor, whole["weights"][name], atol=1e-6), name
    assert (two[0]["loss"] + two[1]["loss"]) / 2 == pytest.approx(whole["loss"], rel=1e-5)


def test_a_single_row_that_does_not_fit_is_one_paragraph(tmp_path):
    (alone,) = run(config("train.micro_batch=auto"), 1, tmp_path / "one", caps=[30])
    assert "a single row does not fit in a worker's memory (cpu)" in alone["error"]
    assert "train.activation_checkpointing=true" in alone["error"]


def test_a_batch_in_parts_set_by_hand_steps_as_the_whole_batch():
    features, labels = map(torch.cat, zip(rows(0), rows(1)))
    weights, losses = {}, {}
    for micro in ("null", "16"):
        replica = Replica.build(config(f"train.micro_batch={micro}"), CPU, total_steps=10, statistics=None)
        losses[micro] = replica.train_batch(features, labels, accumulate=1, update=True).item()
        assert replica.step()
        weights[micro] = replica.module.state_dict()
    assert losses["16"] == pytest.approx(losses["null"], rel=1e-5)
    for name, tensor in weights["null"].items():
        assert torch.allclose(tensor, weights["16"][name], atol=1e-6), name


def test_torchs_cpu_allocator_fails_with_a_runtime_error_that_names_itself():
    """Canary of torch 2.14: the CPU allocator's error is a RuntimeError, not torch.OutOfMemoryError (CUDA's), so
    micro_batch.out_of_memory reads its text."""
    with pytest.raises(RuntimeError, match=CPU_OUT_OF_MEMORY) as caught:
        torch.empty(10**14, dtype=torch.uint8)
    assert not isinstance(caught.value, torch.OutOfMemoryError)


def cli(tmp_path: Path, data_root: Path, *overrides: str, returncode: int = 0) -> str:
    """``python -m pipeline`` on wine with the wide model, 2 DDP workers of 64 rows a batch; its output."""
    args = [*MODEL, "+experiment=wine_mlp", "ingest.batch_size=128", "scaling.num_workers=2", "train.epochs=2"]
    args += ["ingest.preserve_order=true"]  # each worker the same rows in each run
    args += ["tracking.log_model=false", f"paths.outputs={tmp_path / 'outputs'}", "hydra.run.dir=run", *overrides]
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        cwd=tmp_path,
        env={**cli_env(data_root), "PYTHONPATH": str(TESTS)},  # the workers import the model
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == returncode, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def histories(tmp_path: Path) -> dict[str, dict[str, list[float]]]:
    """Each run's micro_batch and val_loss per epoch, by run name."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    found = {}
    for run in client.search_runs(client.get_experiment_by_name("wine_mlp").experiment_id):
        found[run.info.run_name] = {
            key: [m.value for m in client.get_metric_history(run.info.run_id, key)]
            for key in ("micro_batch", "val_loss")
        } | {"status": run.info.status}
    return found


@pytest.mark.slow
def test_a_run_short_of_memory_finds_its_parts_learns_as_one_set_by_hand_and_resumes_with_them(tmp_path, data_root):
    """Two DDP workers whose memory fits fewer than their 64 rows: the run halves on its first batch until the parts
    fit; it fails as epoch 2 starts, and its resume (uncapped, where 64 rows fit) keeps the size found; the run
    learns as the same run with that train.micro_batch set by hand does."""
    capped = ["train.micro_batch=auto", "+model.cap_mb=1000", "tracking.run_name=found", "train.checkpoint_upload=sync"]
    output = cli(tmp_path, data_root, *capped, "+model.fail_epoch=1", returncode=1)  # fails as epoch 2 starts
    (rows,) = histories(tmp_path)["found"]["micro_batch"]
    assert 1 <= rows < ROWS
    # found on the first batch of 64 rows (each worker's 71 rows are a batch of 64 and one of 7), once
    assert (
        len(re.findall(rf"out of memory with 64 rows per forward at epoch 1, step [12]; {rows:.0f} from now", output))
        == 1
    )
    assert output.count("out of memory with") == 1
    cli(tmp_path, data_root, "train.micro_batch=auto", "train.resume=true", "tracking.run_name=found")  # uncapped
    cli(tmp_path, data_root, f"train.micro_batch={rows:.0f}", "tracking.run_name=by_hand")
    runs = histories(tmp_path)
    assert runs["found"]["micro_batch"] == [rows] * 2  # the resumed epoch 2 kept it: uncapped, it fits 64 rows
    assert runs["by_hand"]["micro_batch"] == [rows] * 2
    assert runs["found"]["val_loss"] == pytest.approx(runs["by_hand"]["val_loss"], rel=1e-4)
    assert runs["found"]["status"] == "FINISHED"
