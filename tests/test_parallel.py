"""The GPU levers on CPU (gloo): FSDP2 shards, torch.compile, activation checkpointing, sharded checkpoints that
resume on another worker count, and the configs that combine them wrongly.

The worker-level tests run the pipeline's own Replica in two processes joined by a gloo process group (no Ray);
the end-to-end ones run whole jobs on 2 Ray Train workers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import mlflow
import psutil
import pytest
import ray
import ray.train
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision
from conftest import compose_cfg, in_process
from hydra.utils import instantiate
from mlflow import MlflowClient
from test_fault_tolerance import assert_each_epoch_once, wait_for_epochs
from test_pipeline import no_runs_logged, run_cli

from pipeline.common.errors import PipelineError
from pipeline.config import validate
from pipeline.training import checkpoint, finetune, parallel, scaling
from pipeline.training.replica import Replica
from pipeline.training.worker import weights_digest

TINY = ["model.num_layers=2", "model.hidden_dim=32", "model.mlp_dim=64"]
VIT = ["+experiment=smoke", "scaling.num_workers=2", *TINY]
MLP = ["+experiment=wine_mlp", "scaling.num_workers=2"]
CPU = torch.device("cpu")


def batch(cfg, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank its own batch of 8 rows: uint8 images for the ViT, 13 float features for the MLP."""
    generator = torch.Generator().manual_seed(100 * rank + step)
    if "VisionTransformer" in cfg.model["_target_"]:
        return torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, generator=generator), torch.randint(0, 10, (8,))
    return torch.randn(8, 13, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def join_group(rank: int, world: int, out: str) -> None:
    """This process into a gloo group of ``world``, met through a file in ``out``: no port to collide with another
    test's (a free port picked first can be taken before the group listens on it)."""
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'group')}", rank=rank, world_size=world)


def train_and_save(rank: int, world: int, cfg, out: str, restore: str | None, start) -> None:
    """In a process of a gloo group of ``world``: the worker's Replica (from ``start``, the driver's whole starting
    weights, with FSDP), restored from ``restore`` when given, two optimizer steps on this rank's batches (two
    accumulated per step, gradients clipped when the config says), then its checkpoint (``out/rank<R>``), and
    rank 0's figures (``out/result.pt``)."""
    join_group(rank, world, out)
    try:
        replica = Replica.build(cfg, CPU, total_steps=10, statistics=None, start=start)
        traced = []  # whether each block's first layer ran while torch.compile traced the block
        plain = instantiate(cfg.model)  # the blocks' names (FSDP renames their classes)
        found = parallel.blocks(plain, cfg.train.blocks)
        for name in [n for n, m in plain.named_modules() if any(m is b for b in found)]:
            block = replica.module.get_submodule(name)
            first = next(block.children(), block)  # FSDP's own hooks on the block run outside the trace
            first.register_forward_pre_hook(lambda *_: traced.append(torch.compiler.is_compiling()))
        restored = None
        if restore is not None:
            replica.restore(ray.train.Checkpoint.from_directory(restore), CPU)
            restored = {k: parallel.full(v).clone() for k, v in replica.module.state_dict().items()}
        for step in range(2):  # two optimizer steps, each on two accumulated batches
            for micro in range(2):
                features, labels = batch(cfg, rank, 2 * step + micro)
                replica.train_batch(features, labels, accumulate=2, update=micro == 1)
            assert replica.step()
        memory = parallel.memory(replica.model, replica.optimizer)
        whole = {k: parallel.full(v) for k, v in replica.module.state_dict().items()}
        digest = weights_digest(replica.module)
        directory = os.path.join(out, f"rank{rank}")
        os.makedirs(directory)
        replica.save(directory, 0, None, rank)
        written = parallel.from_every_rank(checkpoint.files(directory))
        steps = [int(s["step"]) for s in replica.optimizer.state.values()]
        if rank == 0:
            torch.save(
                {
                    "memory": memory,
                    "whole": whole,
                    "restored": restored,
                    "digest": digest,
                    "files": written,
                    "steps": steps,
                    "compiled": any(traced),
                },
                os.path.join(out, "result.pt"),
            )
    finally:
        dist.destroy_process_group()


def spawn(cfg, world: int, out: Path, restore: Path | None = None) -> dict:
    """Train as :func:`train_and_save` says in ``world`` processes; rank 0's figures."""
    out.mkdir(parents=True)
    start = None  # what the driver saves for FSDP's workers (trainer.save_start)
    if cfg.scaling.strategy == "fsdp":
        start = str(out.parent / f"{out.name}-start")
        parallel.save_start(finetune.whole_start(cfg.model, cfg.finetune, None, cfg.train.seed).state, start)
    args = (world, cfg, str(out), restore and str(restore), start)
    mp.spawn(train_and_save, args=args, nprocs=world)
    return torch.load(out / "result.pt", weights_only=True)


class AnonymousPeak(threading.Thread):
    """The highest of this process's anonymous resident memory (the kernel's RssAnon: what the process holds of its
    own; not the pages it maps of a file or of Ray's shared object store), sampled every millisecond until stopped."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.before = self.peak = self.now()
        self.running = True
        self.start()

    @staticmethod
    def now() -> int:
        status = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("RssAnon:"))) * 1024

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.now())
            time.sleep(0.001)

    def grown(self) -> int:
        """How far above its first sample it has peaked so far."""
        return max(self.peak, self.now()) - self.before


def growth(rank: int, world: int, cfg, start_dir: str | None, out: str) -> None:
    """In a process of a gloo group of ``world``: how far the process's own memory peaked above where it was while it
    built its Replica (FSDP: its shards of the weights the driver saved in ``start_dir``), and through one optimizer
    step (the gradients and AdamW's moments); into ``out/rank<R>.json``."""
    join_group(rank, world, out)
    try:
        memory = AnonymousPeak()
        replica = Replica.build(cfg, CPU, total_steps=10, statistics=None, start=start_dir)
        built = memory.grown()
        features, labels = batch(cfg, rank, 0)
        replica.train_batch(features, labels, accumulate=1, update=True)
        assert replica.step()
        memory.running = False
        Path(out, f"rank{rank}.json").write_text(json.dumps({"built": built, "stepped": memory.grown()}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two pairs of processes training a 101 M-parameter model: about 40 s
def test_fsdp_workers_never_hold_the_whole_model_and_peak_at_half_a_ddp_workers_memory(tmp_path):
    """A 101 M-parameter MLP (404 MB) on 2 workers: an FSDP worker's resident memory grows by less than the model
    while it builds (it is made on the meta device; each worker reads only its shards of the driver's weights),
    and by at most 0.6x a DDP worker's through a training step (half the weights, gradients and AdamW moments)."""
    widths = "[" + ",".join(["4096"] * 7) + ",3]"
    cfg = compose_cfg([*MLP, f"model.hidden_channels={widths}", "scaling.strategy=fsdp"])
    whole = full_bytes(cfg)
    assert whole > 400e6
    start_dir = tmp_path / "start"  # the driver's, as it saves it to the run's storage
    parallel.save_start(finetune.whole_start(cfg.model, cfg.finetune, None, cfg.train.seed).state, str(start_dir))
    figures = {}
    for strategy, weights in (("fsdp", str(start_dir)), ("ddp", None)):
        out = tmp_path / strategy
        out.mkdir()
        strategy_cfg = replace(cfg, scaling=replace(cfg.scaling, strategy=strategy))
        mp.spawn(growth, args=(2, strategy_cfg, weights, str(out)), nprocs=2)
        figures[strategy] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for fsdp, ddp in zip(figures["fsdp"], figures["ddp"]):
        assert fsdp["built"] < 0.75 * whole < ddp["built"], figures  # never the whole model on an FSDP rank
        assert fsdp["stepped"] <= 0.6 * ddp["stepped"], figures


def merged(out: Path) -> Path:
    """The ranks' checkpoint directories as Ray Train merges them in storage."""
    target = out / "merged"
    for rank_dir in sorted(out.glob("rank*")):
        shutil.copytree(rank_dir, target, dirs_exist_ok=True)
    return target


def full_bytes(cfg) -> int:
    return sum(p.numel() * p.element_size() for p in instantiate(cfg.model).parameters())


@pytest.mark.parametrize("model", [VIT, MLP], ids=["vit", "mlp"])
def test_fsdp_holds_half_a_replica_per_worker_and_resumes_on_one(tmp_path, model):
    """Two FSDP workers train to the weights two DDP replicas reach (clipped, accumulated gradients), each holding
    about half the parameters and optimizer state; their checkpoint (each rank its shards) restores on one worker to
    the very weights and optimizer steps, and the driver gathers it whole."""
    cfg = compose_cfg([*model, "scaling.strategy=fsdp", "train.grad_clip=0.5"])
    two = spawn(cfg, 2, tmp_path / "two")
    replicas = spawn(replace(cfg, scaling=replace(cfg.scaling, strategy="ddp")), 2, tmp_path / "ddp")
    for name, weights in replicas["whole"].items():  # the same training, sharded or replicated
        assert torch.allclose(two["whole"][name], weights, atol=1e-5), name
    full = full_bytes(cfg)
    assert 0.3 * full < two["memory"]["param_bytes"] < 0.7 * full, (two["memory"], full)
    assert 0.6 * full < two["memory"]["optimizer_bytes"] < 1.4 * full  # AdamW: two moments, each half of the model
    files = {name for written in two["files"] for name in written}
    assert {"checkpoint.pt", "model/.metadata", "model/__0_0.distcp", "model/__1_0.distcp"} <= files
    assert {"optimizer/__0_0.distcp", "optimizer/__1_0.distcp"} <= files
    saved = merged(tmp_path / "two")
    whole = checkpoint.load_whole(str(saved), "test")["model"]  # what the logged models are made from
    assert whole.keys() == two["whole"].keys() and all(torch.equal(whole[k], two["whole"][k]) for k in whole)

    one = spawn(cfg, 1, tmp_path / "one", restore=saved)
    assert all(torch.equal(one["restored"][k], two["whole"][k]) for k in whole)
    assert one["steps"] and set(one["steps"]) == {4}  # two steps before the checkpoint, two after
    assert one["memory"]["param_bytes"] == full


def test_a_sharded_checkpoint_is_refused_where_a_user_names_weights(tmp_path):
    """finetune.weights and predict.checkpoint read weights only (no pickle): a sharded checkpoint's DCP index is
    one, so they point the user at the run's logged model."""
    cfg = compose_cfg([*MLP, "scaling.strategy=fsdp"])
    spawn(cfg, 2, tmp_path / "two")
    with pytest.raises(PipelineError, match=r"finetune.weights: .* is a sharded checkpoint .* \(runs:/RUN_ID/model"):
        checkpoint.load(str(merged(tmp_path / "two")), "finetune.weights")


@pytest.mark.slow  # compiling takes 20-40 s a model on 2 cores
@pytest.mark.parametrize(("model", "strategy"), [(VIT, "fsdp"), (MLP, "ddp")], ids=["vit-fsdp", "mlp-ddp"])
def test_a_compiled_model_trains_and_its_checkpoint_has_the_plain_keys(tmp_path, model, strategy):
    """The blocks run under torch.compile (their forwards were traced); the state dict keeps the plain keys."""
    cfg = compose_cfg(
        [*model, "train.compile=true", f"scaling.strategy={strategy}", "train.activation_checkpointing=true"]
    )
    two = spawn(cfg, 2, tmp_path / "two")
    assert two["compiled"]
    plain = instantiate(cfg.model).state_dict().keys()
    assert two["whole"].keys() == plain  # no _orig_mod. prefix
    saved = merged(tmp_path / "two")
    assert checkpoint.load_whole(str(saved), "test")["model"].keys() == plain
    one = spawn(cfg, 1, tmp_path / "one", restore=saved)
    assert all(torch.equal(one["restored"][k], two["whole"][k]) for k in plain)


def test_blocks_are_the_outermost_modules_of_the_named_classes():
    vit = torchvision.models.VisionTransformer(32, 4, 2, 2, 32, 64, num_classes=10)
    found = parallel.blocks(vit, None)
    assert [type(b).__name__ for b in found] == ["EncoderBlock", "EncoderBlock", "Linear"]  # the head
    resnet = torchvision.models.resnet18(num_classes=3)
    assert [type(b).__name__ for b in parallel.blocks(resnet, None)] == ["BasicBlock"] * 8 + ["Linear"]
    mlp = torchvision.ops.MLP(13, [64, 64, 3])
    assert [type(b).__name__ for b in parallel.blocks(mlp, None)] == ["Linear"] * 3
    dotted = "torchvision.models.vision_transformer.MLPBlock"
    assert [type(b).__name__ for b in parallel.blocks(vit, [dotted])] == ["MLPBlock"] * 2


def test_activation_checkpointing_recomputes_each_block_in_backward_and_keeps_the_gradients():
    """Recomputing the blocks' activations in backward: each layer inside a block runs its forward again there,
    autograd saves fewer tensors, and the gradients are the same numbers."""
    figures = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = torchvision.models.VisionTransformer(32, 4, 2, 2, 32, 64, num_classes=10)
        units = parallel.blocks(model, None)
        if recompute:
            for block in units:
                parallel.recompute_in_backward(block)
        inner = [m for b in units[:-1] for m in b.modules() if type(m) is torch.nn.Linear]  # the MLPs; not the head
        calls = []
        for module in inner:
            module.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        saved = []
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t)
        with hooks, torch.utils.checkpoint.set_checkpoint_early_stop(False):  # whole blocks recomputed, not part
            loss = model(torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))).sum()
        forward_calls = len(calls)
        loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
        figures.append({"forward": forward_calls, "all": len(calls), "saved": len(saved), "grads": grads})
    plain, recomputed = figures
    assert plain["forward"] == recomputed["forward"] == len(inner) > 0
    assert plain["all"] == len(inner) and recomputed["all"] == 2 * len(inner)  # every block's layers once more
    assert recomputed["saved"] < plain["saved"] / 2, (recomputed["saved"], plain["saved"])
    assert all(torch.allclose(plain["grads"][k], recomputed["grads"][k], atol=1e-6) for k in plain["grads"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.compile_mode=max-autotuned"], r"train.compile_mode: expected one of default, reduce-overhead, max-"),
        (["scaling.strategy=zero3"], r"scaling.strategy: expected one of ddp, fsdp, got 'zero3'"),
        (
            ["scaling.strategy=fsdp", "train.amp=true", "train.amp_dtype=float16"],
            r"scaling.strategy=fsdp casts to train.amp_dtype .* Set train.amp_dtype=bfloat16",
        ),
        (["train.blocks=[]"], r"train.blocks must be null or a non-empty list"),
    ],
)
def test_wrong_lever_settings_name_the_key(overrides, message):
    with pytest.raises(PipelineError, match=message):
        validate(compose_cfg(overrides))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["scaling.strategy=fsdp", "train.blocks=[EncoderBlok]"],
            "train.blocks: 'EncoderBlok' names no module class of model._target_ torchvision.models.VisionTransformer",
        ),
        (
            ["train.activation_checkpointing=true", "train.blocks=[Bottleneck]"],
            "'Bottleneck' names no module class of model._target_ torchvision.models.VisionTransformer",
        ),
    ],
)
def test_blocks_missing_from_the_model_fail_before_ray_starts(tmp_path, data_root, overrides, message):
    result = run_cli(["+experiment=smoke", *overrides], tmp_path, data_root)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert message in output and "Traceback" not in output and "Ray runtime up" not in output
    assert no_runs_logged(tmp_path)


def test_the_default_blocks_must_be_found_when_a_lever_needs_them():
    cfg = compose_cfg(["scaling.strategy=fsdp"])
    model = {"_target_": "torchvision.models.squeezenet1_0", "num_classes": 10}
    with pytest.raises(PipelineError, match=r"has none of the default blocks .* e.g. train.blocks=\[Conv2d\]"):
        parallel.check_blocks(model, cfg.train, cfg.scaling)


# ---- whole jobs on 2 Ray Train workers ----------------------------------------------------------------


def the_run(tmp_path: Path, experiment: str = "smoke", name: str | None = None):
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, next(r for r in runs if name is None or r.info.run_name == name)


@pytest.mark.slow
def test_a_compiled_fsdp_vit_logs_a_model_mlflow_loads_alone_and_a_fine_tune_starts_from_it(
    tmp_path, data_root, ray_runtime, monkeypatch
):
    """FSDP + torch.compile + activation checkpointing on 2 workers: the run logs each worker's share of the
    parameters; its LoggedModel (gathered from the shards) loads with MLflow alone and predicts as the run's weights
    do; and a DDP run fine-tunes from its models:/ URI."""
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(data_root))
    store = f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)  # the runs' store, and where MLflow loads the model from
    levers = ["scaling.strategy=fsdp", "train.compile=true", "train.activation_checkpointing=true"]
    metrics, _ = in_process(tmp_path, "fsdp", [*VIT[1:], *levers, "train.epochs=2", "tracking.run_name=fsdp"])
    client, run_info = the_run(tmp_path, name="fsdp")
    assert run_info.info.status == "FINISHED" and metrics["val_accuracy"] > 0.2  # 10 classes: chance is 0.1
    cfg = compose_cfg(VIT)
    full = full_bytes(cfg)
    assert 0.3 * full < run_info.data.metrics["param_bytes"] < 0.7 * full
    assert run_info.data.metrics["optimizer_bytes"] > 0.6 * full

    model_id = run_info.data.tags["pipeline.model_id"]
    served = mlflow.pytorch.load_model(f"models:/{model_id}")
    weights = torch.load(
        mlflow.artifacts.download_artifacts(
            run_id=run_info.info.run_id, artifact_path="model/state_dict.pt", tracking_uri=client.tracking_uri
        ),
        weights_only=True,
    )
    model = instantiate(cfg.model)
    model.load_state_dict(weights)
    images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
    scale = scaling.feature_scaler(cfg.ingest.normalize, None, CPU)
    with torch.no_grad():
        assert torch.allclose(served(images), model.eval()(scale(images)), atol=1e-5)

    tuned, _ = in_process(tmp_path, "tuned", [*TINY, f"finetune.weights=models:/{model_id}", "tracking.run_name=tuned"])
    _, tuned_run = the_run(tmp_path, name="tuned")
    assert (
        tuned_run.info.status == "FINISHED" and f"models:/{model_id}" in tuned_run.data.tags["pipeline.start_weights"]
    )


class LargestObject(threading.Thread):
    """The largest object in Ray's object store, as ``ray memory`` lists every object reference and its size,
    sampled every 2 s or so until stopped (a call takes about 1.5 s)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.largest, self.samples, self.running = 0.0, 0, True
        self.address = ray.get_runtime_context().gcs_address
        self.start()

    def run(self) -> None:
        while self.running:
            listed = subprocess.run(
                ["ray", "memory", "--address", self.address, "--units", "B"], capture_output=True, text=True, check=True
            ).stdout
            columns = [line.split("|") for line in listed.splitlines() if line.count("|") == 8]
            sizes = [float(row[6].split()[0]) for row in columns if row[6].strip().endswith(" B")]
            self.largest = max([self.largest, *sizes])
            self.samples += 1
            time.sleep(2)  # each call is a Python process: leave the cores to the run


@pytest.mark.slow
def test_an_fsdp_run_interrupted_on_two_workers_resumes_on_one(tmp_path, data_root, ray_runtime, monkeypatch):
    """A worker SIGKILLed during epoch 2 fails the 2-worker FSDP run of a ViT of 1.6 M parameters; resumed on 1
    worker it continues from epoch 1's sharded checkpoint (DCP reshards it) and finishes, each epoch in MLflow once.
    While the run starts and trains, no object in Ray's object store is as large as the model's weights: the driver
    saves the starting weights to the run's storage, where each worker reads its shards. (Sampled until the first
    run fails: the resumed one starts from its checkpoint, and each sample is a Python process.)"""
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(data_root))
    wide = ["model.num_layers=2", "model.hidden_dim=256", "model.mlp_dim=1024"]
    weights = full_bytes(compose_cfg([*VIT, *wide]))
    assert weights > 6e6
    store = LargestObject()

    killed = []

    def kill_a_worker() -> None:
        wait_for_epochs(tmp_path / "run", 1)
        workers = [json.loads(line) for line in (tmp_path / "run" / "workers.jsonl").read_text().splitlines()]
        worker = psutil.Process(next(w["pid"] for w in workers if w["rank"] == 1))
        worker.kill()
        worker.wait(timeout=10)  # gone: not the process of another run
        killed.append(worker.pid)

    run = [*wide, "scaling.num_workers=2", "scaling.strategy=fsdp", "train.epochs=3", "ingest.batch_size=16"]
    run.append("tracking.run_name=sharded")
    run.append("train.ema=0.99")  # the averages: sharded as the weights, resharded on resume, the logged model
    killer = threading.Thread(target=kill_a_worker, daemon=True)
    killer.start()
    with pytest.raises(PipelineError, match="training failed"):
        in_process(tmp_path, "run", run)
    killer.join(timeout=5)
    store.running = False
    assert len(killed) == 1, killed
    saved = len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines())  # epochs checkpointed before the kill
    metrics, _ = in_process(tmp_path, "resumed", [*run, "train.resume=true", "scaling.num_workers=1"])
    client, run_info = the_run(tmp_path, name="sharded")
    assert run_info.info.status == "FINISHED" and metrics["workers"] == 1
    assert_each_epoch_once(client, run_info.info.run_id, 3)
    restores = client.get_metric_history(run_info.info.run_id, "restores")
    assert [r.step for r in restores] == [saved], (restores, saved)  # continued after the last epoch saved
    store.join()
    assert store.samples > 5 and 0 < store.largest < weights / 2, (store.largest, weights)

    last = max(p for p in Path(run_info.data.tags["pipeline.storage"]).glob("checkpoint_*") if p.is_dir())
    assert (last / checkpoint.EMA_KEY / ".metadata").exists()  # DCP's: each rank wrote its shards of the averages
    state = checkpoint.load_whole(str(last), "test")
    logged = torch.load(
        client.download_artifacts(run_info.info.run_id, "model/state_dict.pt", str(tmp_path)), weights_only=True
    )
    assert all(torch.equal(logged[name], average) for name, average in state[checkpoint.EMA_KEY].items())
    assert not torch.equal(logged["heads.head.weight"], state["model"]["heads.head.weight"])
    assert "raw_val_loss" in run_info.data.metrics
