"""Command-line mistakes and wrong-typed arguments of pluggable parts: named before anything starts."""

from __future__ import annotations

import pytest
import torch

from pipeline.api import compose
from pipeline.common.errors import PipelineError
from pipeline.config import check_overrides, check_target, validate
from pipeline.config.targets import accepts


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["scheduler=null"], "a config group is dropped with ~scheduler (Hydra's delete), not set to null"),
        (["model=vitt"], "model=vitt: model has no option 'vitt'. Did you mean vit or vit_tiny?"),
        (["+experiment=cifar_vitt"], "experiment has no option 'cifar_vitt'. Did you mean cifar_vit"),
        (["train.epoch=2"], "train.epoch=2: train has no key 'epoch'. Did you mean epochs?"),
        (["trian.epochs=2"], "the config has no key 'trian'. Did you mean train"),
        (["train.early_stop.patiense=2"], "train.early_stop has no key 'patiense'. Did you mean patience?"),
        (["train.epochs=abc"], "train.epochs: expected an integer, got 'abc'."),
        (["ingest.cache_share=half"], "ingest.cache_share: expected a float, got 'half'."),
        (["scaling.use_gpu=maybe"], "scaling.use_gpu: expected true or false, got 'maybe'."),
    ],
)
def test_override_mistakes_name_the_key_and_the_closest_valid_names(args, message):
    with pytest.raises(PipelineError) as error:
        check_overrides(["+experiment=smoke", *args])
    assert message in str(error.value)


@pytest.mark.parametrize(
    "args",
    [
        ["~scheduler"],
        ["scheduler=onecycle", "+scheduler.anneal_strategy=linear"],
        ["train.epochs=3", "source.limit=null", "scaling.use_gpu=true", "ingest.cache=auto", "train.amp=1"],
        ["optim.lr=fast"],  # a part's argument: checked once composed (check_target)
        ["-m", "train.epochs=many,0"],  # a sweep's jobs fail one by one, recorded (test_sweeps)
        ["hydra.run.dir=x", "hydra/sweeper/search_alg=hyperopt", "hparams_search=tune"],
        ["+transforms.train.decode.resources.cpu_node=1", "tracking.run_name=123"],
    ],
)
def test_valid_overrides_raise_no_error(args):
    check_overrides(["+experiment=smoke", *args])


@pytest.mark.parametrize(
    ("node", "runtime_args", "message"),
    [
        ({"_target_": "torch.optim.AdamW", "lr": "fast"}, ("params",), "optim.lr: expected a float or a Tensor"),
        ({"_target_": "torch.optim.AdamW", "lr": 1e-3, "amsgrad": "yes"}, ("params",), "optim.amsgrad: expected"),
        (
            {"_target_": "torchvision.models.VisionTransformer", "image_size": 32, "hidden_dim": 1.5},
            (),
            "optim.hidden_dim: expected an integer, got 1.5",
        ),
        (
            {"_target_": "torch.optim.lr_scheduler.OneCycleLR", "max_lr": 0.1, "anneal_strategy": "sine"},
            ("optimizer", "total_steps"),
            "optim.anneal_strategy: expected one of 'cos', 'linear', got 'sine'",
        ),
        ({"_target_": "torch.optim.AdamW", "lrate": 0.1}, ("params",), "does not accept these arguments"),
        ({"_target_": "torch.optim.Adamw"}, ("params",), "optim._target_: cannot import 'torch.optim.Adamw'"),
    ],
)
def test_a_parts_arguments_are_checked_against_its_signature_and_annotations(node, runtime_args, message):
    with pytest.raises(PipelineError) as error:
        check_target(node, "optim", runtime_args)
    assert message in str(error.value)


def test_well_typed_arguments_raise_no_error():
    check_target(
        {"_target_": "torch.optim.AdamW", "lr": 1, "betas": [0.9, 0.99], "weight_decay": 0.0}, "o", ("params",)
    )
    check_target({"_target_": "transforms.random_crop", "size": 32, "padding": 4, "seed": None}, "t", ("batch",))
    check_target({"_target_": "transforms.decode_image", "on_error": "skip"}, "t", ("batch",))


@pytest.mark.parametrize(
    ("value", "hint", "strict", "expected"),
    [
        ("3", int, False, True),  # OmegaConf converts it into an int field
        ("3", int, True, False),  # a callable would get the string
        (True, int, False, False),
        (2, float, True, True),
        ("no", bool, False, True),
        (None, int | None, True, True),
        ([1, 2], list[int], True, True),
        ({"_target_": "torch.nn.ReLU"}, torch.nn.Module, True, True),
        ("relu", torch.nn.Module, True, False),
    ],
)
def test_accepts_follows_how_a_value_reaches_its_target(value, hint, strict, expected):
    assert accepts(value, hint, strict) is expected


def test_a_users_config_dir_adds_its_options(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\n")
    check_overrides(["--config-dir", str(tmp_path), "+experiment=mine"])
    check_overrides([f"--config-dir={tmp_path}", "+experiment=smoke"])  # the shipped ones stay
    with pytest.raises(PipelineError, match="experiment has no option 'mien'. Did you mean mine?"):
        check_overrides(["-cd", str(tmp_path), "+experiment=mien"])


def test_a_key_added_with_plus_names_the_closest_valid_one():
    with pytest.raises(PipelineError, match=r"train.epoch: unknown key\. train takes: .*\. Did you mean epochs\?"):
        validate(compose(["+experiment=smoke", "+train.epoch=3"]))
