"""Config composition, the schema's type and key checks, and the GPU/CPU settings logic."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import yaml
from conftest import compose_cfg
from hydra.errors import ConfigCompositionException
from omegaconf.errors import OmegaConfBaseException

from pipeline.common.errors import PipelineError
from pipeline.config import CONF_DIR, PipelineConfig, TrainConfig, TransformSpec, validate
from pipeline.data.preprocess import placement, read_placement
from pipeline.jobs.predict import actor_options
from pipeline.runtime.checks import check_outlives_job, check_resources
from pipeline.runtime.cluster import Runtime, runtime, runtime_env
from pipeline.training.precision import amp_plan
from pipeline.training.resume import steps_per_epoch
from pipeline.training.trainer import trainer_settings
from pipeline.training.worker import planned_updates, updates_through


def test_cifar_vit_is_the_ray_train_tutorial():
    cfg = compose_cfg(["+experiment=cifar_vit"])
    assert cfg.model == {
        "_target_": "torchvision.models.VisionTransformer",
        "image_size": 32,
        "patch_size": 4,
        "num_layers": 12,
        "num_heads": 8,
        "hidden_dim": 384,
        "mlp_dim": 768,
        "num_classes": 10,
    }
    assert cfg.optim == {"_target_": "torch.optim.AdamW", "lr": 1e-3, "weight_decay": 1e-2}
    assert cfg.train.epochs == 1 and cfg.ingest.batch_size == 512
    assert cfg.scaling.use_gpu is True and cfg.scaling.resources_per_worker["GPU"] == 1
    validate(cfg)
    cpu = compose_cfg(["+experiment=cifar_vit", "scaling=cpu"])  # the documented CPU override
    assert cpu.scaling.use_gpu is False and cpu.model == cfg.model


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml")))
def test_every_experiment_composes_and_validates(experiment):
    cfg = compose_cfg([f"+experiment={experiment}"])
    validate(cfg)
    import hydra.utils

    model = hydra.utils.instantiate(cfg.model).eval()
    tabular = "in_channels" in cfg.model  # an MLP over a vector of features, else a CNN or ViT over RGB
    crop = cfg.transforms.active("train").get("crop")
    side = crop.fn.get("size", 32) if crop is not None else 32  # what training crops
    inputs = torch.zeros(2, cfg.model["in_channels"]) if tabular else torch.zeros(2, 3, side, side)
    assert model(inputs).shape == (2, cfg.source.num_classes or 1)  # classes, or one number


NO_DEFAULT = object()


def schema_default(schema: type, path: list[str]):
    """The schema's default at ``path`` below ``schema`` (a dataclass), or NO_DEFAULT where it sets none."""
    value = schema()
    for key in path:
        value = getattr(value, key, NO_DEFAULT) if dataclasses.is_dataclass(value) else NO_DEFAULT
    return value


def leaves(node: dict, prefix: list[str]):
    """(path, value) for every value of a YAML mapping that is not itself a mapping or a _target_ node."""
    for key, value in node.items():
        if isinstance(value, dict) and "_target_" not in value:
            yield from leaves(value, [*prefix, key])
        else:
            yield [*prefix, key], value


@pytest.mark.parametrize("group", ["source", "scaling", "transforms", "task"])  # the groups the schema types
def test_group_files_hold_only_what_their_choice_changes(group):
    """Every default is set once, in the schema: a group file that restates one could drift from it.
    (A file that extends another option of its group may set back what that option changed.)"""
    schema = next(f.default_factory for f in dataclasses.fields(PipelineConfig) if f.name == group)
    for path in (Path(CONF_DIR) / group).glob("*.yaml"):
        values = yaml.safe_load(path.read_text()) or {}
        extended = [
            yaml.safe_load((path.parent / f"{d}.yaml").read_text()) for d in values.pop("defaults", []) if d != "_self_"
        ]
        set_by_extended = {tuple(keys) for parent in extended for keys, _ in leaves(parent, [])}
        for keys, value in leaves(values, []):
            if tuple(keys) in set_by_extended:
                continue
            if group == "transforms":  # each step is a TransformSpec
                default = schema_default(TransformSpec, keys[2:]) if len(keys) > 2 else NO_DEFAULT
            else:
                default = schema_default(schema, keys)
            assert value != default, f"{path.name}: {'.'.join(keys)} restates the schema default"


def test_an_invalid_on_error_is_named_before_anything_runs():
    with pytest.raises(PipelineError, match="decode.fn.on_error: expected one of 'raise', 'skip', got 'ignore'"):
        validate(compose_cfg(["transforms.valid.decode.fn.on_error=ignore"]))


def test_cifar_vit_cpu_is_smaller_and_scheduled():
    cfg = compose_cfg(["+experiment=cifar_vit_cpu"])
    assert list(cfg.transforms.active("train")) == ["decode", "flip"]
    assert cfg.model["num_layers"] == 4 and cfg.model["hidden_dim"] == 128
    assert cfg.scheduler["_target_"] == "torch.optim.lr_scheduler.OneCycleLR"
    assert cfg.scheduler["max_lr"] == cfg.optim["lr"]


def test_data_root_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("PIPELINE_DATA_DIR", "/somewhere")
    cfg = compose_cfg()
    assert cfg.source.train == "/somewhere/cifar10/train"
    assert cfg.source.valid == "/somewhere/cifar10/test"
    monkeypatch.delenv("PIPELINE_DATA_DIR")
    assert compose_cfg().source.train == "data/cifar10/train"


def test_mlflow_uri_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert compose_cfg().tracking.uri is None
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert compose_cfg().tracking.uri == "http://127.0.0.1:5000"


@pytest.mark.parametrize("override", ["train.epochs=many", "scaling.use_gpu=maybe", "ingest.batch_size=1.5"])
def test_wrong_type_is_rejected_at_composition(override):
    """The command line's check names the key and the type (Hydra's own would be a traceback)."""
    with pytest.raises(PipelineError, match=f"{override.split('=')[0]}: expected"):
        compose_cfg([override])


def test_a_choice_outside_its_values_in_an_experiment_file_fails_naming_them(tmp_path):
    """Choice settings are Enum fields: a file Hydra composes gets the valid values from Hydra itself."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "typo.yaml").write_text("# @package _global_\ntrain:\n  on_nonfinite: ignore\n")
    with pytest.raises(ConfigCompositionException, match=r"expected one of \[raise, skip\]"):
        compose_cfg([f"hydra.searchpath=[file://{tmp_path}]", "+experiment=typo"])


def test_unknown_key_in_an_experiment_file_is_rejected(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "typo.yaml").write_text("# @package _global_\nscaling:\n  workers: 4\n")
    with pytest.raises((ConfigCompositionException, OmegaConfBaseException), match="workers"):
        compose_cfg([f"hydra.searchpath=[file://{tmp_path}]", "+experiment=typo"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+scaling.workers=2", r"scaling.workers: unknown key. scaling takes: num_workers, use_gpu"),
        ("+transforms.train.flip.cpus=1", r"transforms.train.flip.cpus: unknown key"),
        ("+extra=1", r"extra: unknown key. The config takes: source"),
    ],
)
def test_keys_added_with_plus_are_checked_too(override, message):
    with pytest.raises(PipelineError, match=message):
        validate(compose_cfg([override]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+model.num_layer=3"], r"model: torchvision.models.VisionTransformer does not accept"),
        (["optim._target_=torch.optim.Adamm"], r"optim._target_: cannot import 'torch.optim.Adamm'"),
        (["+transforms.train.crop.fn.pad=2"], r"transforms.train.crop.fn: transforms.random_crop does not accept"),
        (["ingest.batch_size=101"], r"ingest.batch_size \(101\) .* scaling.num_workers \(2\)"),
        (["scaling.num_workers=[2,1]"], r"scaling.num_workers must be a count >= 1, or \[MIN, MAX\] .* got \[2, 1\]"),
        (["scaling.num_workers=[1,2]"], r"scaling.num_workers=\[1, 2\] is elastic: .* Set train.max_failures"),
        (
            ["scaling.num_workers=[1,3]", "train.max_failures=1"],
            r"ingest.batch_size \(128\) .* scaling.num_workers \(\[1, 3\]: not 3 of them\)",
        ),
        (
            ["scaling.local_mode=true"],
            r"scaling.local_mode=true trains the one worker in the driver's process, but scaling.num_workers=2 needs",
        ),
        (
            ["scaling.local_mode=true", "scaling.num_workers=1", "train.max_failures=2"],
            r"but train.max_failures=2 \(a lost worker restarts\) needs Ray Train's worker group",
        ),
        (["scaling.local_mode=yes"], r"scaling.local_mode must be auto, true or false, got 'yes'"),
        (["train.epochs=0"], r"train.epochs must be >= 1"),
        (["ingest.local_shuffle_buffer_size=all"], r"ingest.local_shuffle_buffer_size must be auto, null or a number"),
        (["source.limit=0"], r"source.limit must be >= 1"),
        (["train.amp_dtype=float8"], r"train.amp_dtype: expected one of bfloat16, float16, got 'float8'"),
        (["train.accumulate=0"], r"train.accumulate must be >= 1, got 0"),
        (["train.grad_clip=0"], r"train.grad_clip must be > 0 or null"),
        (["train.on_nonfinite=ignore"], r"train.on_nonfinite: expected one of raise, skip, got 'ignore'"),
        (["source.on_missing=zero"], r"source.on_missing: expected one of raise, drop, mean, got 'zero'"),
        (["stage=predcit"], r"stage: expected one of train, predict, evaluate, got 'predcit'"),
        (["source.on_missing=mean"], r"source.on_missing=mean fills in the training mean that ingest.standardize"),
        (["train.early_stop.patience=0"], r"train.early_stop.patience must be >= 1 or null"),
        (["train.early_stop.metric=val_mae"], r"train.early_stop.metric must be null or one of train_loss, val_loss"),
        (["train.evaluate=true", "tracking.log_model=false"], r"train.evaluate evaluates the run's logged model"),
        (["train.checkpoint_every=10 hours"], r"train.checkpoint_every must be a number of steps .* got '10 hours'"),
        (["train.checkpoint_every=0"], r"train.checkpoint_every must be .* more than 0"),
        (["train.checkpoint_every=2.5"], r"train.checkpoint_every must be a number of steps"),
        (
            ["train.num_to_keep=null"],
            r"train.checkpoint_every='10 min' keeps .* Set train.num_to_keep .* or train.checkpoint_every=null",
        ),
        (["train.stop_grace_s=-1"], r"train.stop_grace_s must be >= 0"),
    ],
)
def test_validation_names_the_bad_key(overrides, message):
    with pytest.raises(PipelineError, match=message):
        validate(compose_cfg(overrides))


@pytest.mark.parametrize(
    ("every", "expected"),
    [
        (None, (None, None)),
        ("500", (500, None)),
        ("500 steps", (500, None)),
        ("1 step", (1, None)),
        ("10 min", (None, 600.0)),
        ("0.5min", (None, 30.0)),
    ],
)
def test_checkpoint_every_counts_optimizer_steps_or_minutes(every, expected):
    assert TrainConfig(checkpoint_every=every).step_checkpoints() == expected


def test_gpu_scaling_uses_nccl_and_gpus():
    scaling, torch_config = trainer_settings(compose_cfg(["scaling=gpu", "scaling.num_workers=4"]).scaling)
    assert scaling.use_gpu is True and scaling.num_workers == 4
    assert scaling.resources_per_worker == {"CPU": 1, "GPU": 1}
    assert torch_config.backend == "nccl"


def test_placement_is_declared_per_pool():
    """Training workers by resource and label; each transform step, and the reads before it, where it says."""
    cfg = compose_cfg(
        [
            "scaling=gpu",
            "+scaling.resources_per_worker.gpu_node=1",
            "+scaling.label_selector.tier=gpu",
            "+transforms.train.decode.resources.cpu_node=1",
            "+transforms.train.decode.label_selector.tier=cpu",
            "transforms.train.decode.concurrency=3",
        ]
    )
    scaling, _ = trainer_settings(cfg.scaling)
    assert scaling.resources_per_worker == {"CPU": 1, "GPU": 1, "gpu_node": 1}
    assert scaling.label_selector == {"tier": "gpu"}
    decode = cfg.transforms.train["decode"]
    assert placement(decode) == {"resources": {"cpu_node": 1}, "label_selector": {"tier": "cpu"}}
    assert read_placement(cfg.transforms.train) == placement(decode)
    assert placement(cfg.transforms.train["crop"]) == {}  # the defaults: anywhere with a free CPU
    assert trainer_settings(compose_cfg([]).scaling)[0].label_selector is None


def test_predict_replicas_take_a_gpu_each_on_gpu_runs():
    gpu = compose_cfg(["scaling=gpu", "predict.concurrency=4", "+predict.resources.gpu_node=1"])
    options = actor_options(gpu.predict, gpu.scaling.use_gpu)
    assert options["num_gpus"] == 1 and options["compute"].max_size == 4 and options["resources"] == {"gpu_node": 1}
    cpu = compose_cfg([])
    assert actor_options(cpu.predict, cpu.scaling.use_gpu)["num_gpus"] == 0
    half = compose_cfg(["scaling=gpu", "predict.num_gpus=0.5"])
    assert actor_options(half.predict, True)["num_gpus"] == 0.5


def test_joining_a_cluster_ships_the_code_and_a_local_runtime_does_not(monkeypatch):
    import pipeline
    import transforms

    local = compose_cfg(["+ray.runtime_env.env_vars.MY_FLAG=1"]).ray
    assert local.address is None
    assert runtime_env(local.address, local.py_modules, local.runtime_env) == {"env_vars": {"MY_FLAG": "1"}}
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")  # the standard variable picks the cluster
    joined = compose_cfg([]).ray
    assert joined.address == "10.0.0.5:6379"
    env = runtime_env(joined.address, joined.py_modules, joined.runtime_env)
    assert env["py_modules"] == [str(Path(pipeline.__file__).parent), str(Path(transforms.__file__).parent)]
    assert copy.deepcopy(env) == env  # a Ray job deep-copies the runtime_env it merges with its own
    with pytest.raises(PipelineError, match="ray.py_modules: cannot import 'my_transformz'"):
        runtime_env("auto", ["my_transformz"], {})
    # a submitted job's own runtime_env (--working-dir) carries the code: nothing more is shipped
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"runtime_env": {"working_dir": "gcs://_ray_pkg_x.zip"}}')
    assert runtime_env(joined.address, joined.py_modules, {}) == {}


@pytest.mark.parametrize(
    ("overrides", "lost"),
    [
        ([], ["tracking.uri (MLFLOW_TRACKING_URI) (outputs/mlflow.db)", "storage.path (outputs)"]),
        (
            ["tracking.uri=sqlite:///runs.db", "storage.path=s3://b/runs"],
            ["tracking.uri (MLFLOW_TRACKING_URI) (runs.db)"],
        ),
        (["tracking.uri=http://127.0.0.1:5000", "storage.path=ckpt"], ["storage.path (ckpt)"]),
        (["stage=predict", "tracking.uri=http://127.0.0.1:5000"], ["predict.output (outputs)"]),
        (["tracking.uri=http://127.0.0.1:5000", "storage.path=s3://b/runs"], []),
        (["paths.outputs=/var/pipeline"], []),  # the opt-in: an absolute path the user knows stays
    ],
)
def test_a_submitted_job_stops_where_its_record_would_vanish(overrides, lost, monkeypatch, tmp_path):
    cfg = compose_cfg(overrides)
    monkeypatch.chdir(tmp_path)  # the job's temporary copy of the working directory
    check_outlives_job(cfg)  # not a job: anything goes
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    if not lost:
        check_outlives_job(cfg)
        return
    with pytest.raises(PipelineError) as err:
        check_outlives_job(cfg)
    message = str(err.value)
    assert (
        f"runs as a Ray job, in a temporary copy of the submitted working directory ({tmp_path.resolve()})" in message
    )
    assert f"{' and '.join(lost)} would be written there" in message
    assert "MLFLOW_TRACKING_URI" in message and "paths.outputs" in message


def test_cpu_scaling_uses_gloo_and_leaves_cpu_for_data():
    scaling, torch_config = trainer_settings(compose_cfg(["scaling=cpu"]).scaling)
    assert scaling.use_gpu is False and torch_config.backend == "gloo"
    assert scaling.num_workers * scaling.resources_per_worker["CPU"] < 2  # a core stays free on 2 cores


@pytest.mark.parametrize(
    ("device", "amp", "dtype", "expected"),
    [
        ("cuda", True, "bfloat16", (True, torch.bfloat16, False)),
        ("cuda", True, "float16", (True, torch.float16, True)),
        ("cuda", False, "float16", (False, torch.float16, False)),
        ("cpu", True, "float16", (False, torch.float16, False)),
    ],
)
def test_amp_only_on_cuda_and_scaler_only_for_float16(device, amp, dtype, expected):
    assert amp_plan(device, TrainConfig(amp=amp, amp_dtype=dtype)) == expected


@pytest.mark.parametrize(
    ("rows", "workers", "batch", "drop_last", "steps"),
    [(50_000, 1, 128, False, 391), (50_000, 4, 512, False, 98), (2_000, 2, 128, False, 16), (2_000, 2, 128, True, 15)],
)
def test_steps_per_epoch_follow_equal_shards(rows, workers, batch, drop_last, steps):
    assert steps_per_epoch(rows, workers, batch, drop_last) == steps


def test_elastic_workers_ask_ray_for_a_range_and_the_schedule_spans_the_longest_epochs():
    """[MIN, MAX] goes to Ray Train as a tuple with the resize interval; the LR schedule planned for a run is
    the same whatever worker group computes it, and long enough for every size in the range."""
    cfg = compose_cfg(["scaling.num_workers=[1,4]", "ingest.batch_size=12", "train.max_failures=-1", "train.epochs=3"])
    validate(cfg)
    scaling, _ = trainer_settings(cfg.scaling)
    assert scaling.num_workers == (1, 4) and scaling.elastic_resize_monitor_interval_s == 60
    assert trainer_settings(compose_cfg([]).scaling)[0].num_workers == 2  # a count stays a count
    steps = {n: steps_per_epoch(109, n, 12, False) for n in range(1, 5)}
    assert steps == {1: 10, 2: 9, 3: 9, 4: 9}  # equal shards drop up to N-1 rows: one batch fewer here
    assert planned_updates(cfg, 109) == 3 * 10


def test_optimizer_steps_count_each_epochs_last_step_once_whatever_the_accumulation():
    """4 batches accumulated a step over epochs of 10: the steps after batches 4, 8 and 10 of each epoch are the
    run's 1st to 6th, none counted twice (train.checkpoint_every in steps keys on them), and the last is the
    schedule's length."""
    batches, k = 10, 4
    ends = [b for b in range(1, batches + 1) if b % k == 0 or b == batches]  # the worker's rule for an update
    counted = [updates_through(epoch, b, batches_per_epoch=batches, accumulate=k) for epoch in (0, 1) for b in ends]
    assert counted == [1, 2, 3, 4, 5, 6]
    assert counted[-1] == updates_through(2, 0, batches_per_epoch=batches, accumulate=k)


def wanted(overrides: list[str]) -> Runtime:
    cfg = compose_cfg(overrides)
    return runtime(cfg.ray, cfg.scaling)


def test_resources_that_fit_raise_no_error():
    check_resources({"CPU": 2.0}, wanted(["scaling=cpu"]), transform_cpus=1)
    check_resources({"CPU": 8.0, "GPU": 2.0}, wanted(["scaling=gpu", "scaling.num_workers=2"]), 1)


@pytest.mark.parametrize(
    ("available", "overrides", "message"),
    [
        ({"CPU": 2.0}, ["scaling=gpu"], r"asks for 1 GPU .* has 0. Use scaling=cpu"),
        ({"CPU": 16.0, "GPU": 1.0}, ["scaling=gpu", "scaling.num_workers=2"], r"asks for 2 GPU \(2 workers x 1"),
        ({"CPU": 2.0}, ["scaling=cpu", "scaling.resources_per_worker.CPU=1"], r"take 2 of 2 CPUs, leaving 0"),
        ({"CPU": 2.0}, ["scaling=cpu", "scaling.num_workers=5"], r"asks for 2.5 CPU"),
    ],
)
def test_resources_that_would_hang_fail_fast(available, overrides, message):
    with pytest.raises(PipelineError, match=message):
        check_resources(available, wanted(overrides), transform_cpus=1)
