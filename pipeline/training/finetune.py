"""Where training starts and what of the model trains (the ``finetune`` section).

On the driver, before Ray starts, :func:`initial_weights` reads ``finetune.weights`` (a torchvision
weight name, a file, or an MLflow model that :func:`pipeline.jobs.preflight.start_weights` downloads) as tensors
only, and matches it to the configured model: every parameter must fit, except the head's, which start
fresh where their shape differs (another class count). A mismatch fails there, naming the parameter. In
each training worker, :func:`build_model` loads what was matched and freezes ``finetune.freeze``, and
:func:`param_groups` gives the backbone its own learning rate.
"""

from __future__ import annotations

import fnmatch
import os
import re
import urllib.error
from dataclasses import dataclass

import torch
from hydra.utils import get_method, instantiate

from pipeline.common.errors import PipelineError
from pipeline.config import FinetuneConfig
from pipeline.training import checkpoint

STATE_FILES = ("state_dict.pt", "checkpoint.pt")  # a logged model's file, a pipeline checkpoint's
TORCHVISION_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")  # IMAGENET1K_V1, DEFAULT
LR_ARGUMENTS = ("max_lr", "base_lr")  # a schedule's rates, which replace the optimizer's


@dataclass
class Initial:
    """The weights a job starts from, matched to its model."""

    state: dict[str, torch.Tensor]  # every entry of the model's state dict but the fresh head's (whole_start: all)
    fresh: list[str]  # the head's entries that start from random weights (their shape differed)
    source: str  # finetune.weights, as given

    def summary(self) -> str:
        fresh = f"; starting fresh (another shape): {', '.join(self.fresh)}" if self.fresh else ""
        return f"started from {self.source}{fresh}"


# ---- on the driver ----------------------------------------------------------------------------------


def initial_weights(model_cfg: dict, finetune: FinetuneConfig, files: str | None = None) -> Initial | None:
    """``finetune.weights`` read (from ``files``, an MLflow model's weights as downloaded) and matched to
    the model built from ``model_cfg`` (None: random weights);
    ``finetune.freeze`` and ``finetune.head`` patterns checked against its parameter names. Without any
    of those settings the model is not built here."""
    if finetune.weights is None and not finetune.freeze and not finetune.head:
        return None
    model = instantiate(model_cfg, _convert_="all")
    names = [name for name, _ in model.named_parameters()]
    for pattern in finetune.freeze:
        if not matching([pattern], names):
            raise PipelineError(f"finetune.freeze: {pattern!r} matches no parameter of the model ({hint(names)}).")
    if names and len(matching(finetune.freeze, names)) == len(names):
        raise PipelineError("finetune.freeze: every parameter of the model is frozen, so nothing would train.")
    head = head_names(model, finetune.head)
    if not head:
        raise PipelineError(f"finetune.head: {finetune.head} matches no parameter of the model ({hint(names)}).")
    if finetune.weights is None:
        return None
    state = read_weights(finetune.weights, model_cfg["_target_"], files)
    return matched(model.state_dict(), state, head, finetune.weights)


def read_weights(weights: str, target: str, files: str | None) -> dict[str, torch.Tensor]:
    """The state dict that ``weights`` names, loaded with ``weights_only=True`` (nothing pickled runs)."""
    if files is not None or os.path.exists(weights):
        return load_state(state_file(files or weights, weights), weights)
    if TORCHVISION_NAME.match(weights):
        return torchvision_weights(weights, target)
    raise PipelineError(
        f"finetune.weights: {weights!r} is neither a file nor a directory, an MLflow model URI (runs:/RUN_ID/model, "
        "models:/NAME@ALIAS, models:/NAME/VERSION) nor a torchvision weight name (IMAGENET1K_V1, DEFAULT)."
    )


def state_file(path: str, weights: str) -> str:
    """The weights file at ``path``: the file itself, or a logged model's or checkpoint's in that directory."""
    if not os.path.isdir(path):
        return path
    for name in STATE_FILES:
        for root, _, files in os.walk(path):
            if name in files:
                return os.path.join(root, name)
    raise PipelineError(f"finetune.weights: {weights} holds no {' or '.join(STATE_FILES)}.")


def load_state(path: str, weights: str) -> dict[str, torch.Tensor]:
    """A state dict from ``path``: a bare one, or a pipeline checkpoint's ``model`` entry."""
    state = checkpoint.load(path, "finetune.weights")
    if checkpoint.is_checkpoint(state):
        state = checkpoint.handed_on(state)
    if not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise PipelineError(f"finetune.weights: {path} ({weights}) holds no state dict (a mapping of name to tensor).")
    return state


def torchvision_weights(name: str, target: str) -> dict[str, torch.Tensor]:
    """torchvision's weights ``name`` for the builder ``target``, from torch's hub cache, downloaded there
    first when missing; offline, an error that says which file to put where."""
    import torchvision

    try:
        entry = torchvision.models.get_model_weights(get_method(target))[name]
    except (ValueError, KeyError, AttributeError, ImportError) as err:
        raise PipelineError(
            f"finetune.weights: {name!r} is not a torchvision weight name of model._target_ {target} ({err}). "
            "torchvision names weights for its model builders, e.g. torchvision.models.resnet18 with "
            "IMAGENET1K_V1; other models take a file or an MLflow model URI."
        ) from err
    cached = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(entry.url))
    try:
        return torch.hub.load_state_dict_from_url(entry.url, progress=False, weights_only=True, map_location="cpu")
    except (urllib.error.URLError, OSError) as err:
        raise PipelineError(
            f"finetune.weights: torchvision's {name} weights for {target} are not in torch's cache and could "
            f"not be downloaded ({err}). Download {entry.url} where there is internet and put it at {cached} "
            "(torch's hub cache; TORCH_HOME moves it), or give the file's path as finetune.weights."
        ) from err


def matched(own: dict[str, torch.Tensor], state: dict, head: set[str], weights: str) -> Initial:
    """``state`` checked against the model's own state dict ``own``: every entry must be there with the
    same shape, except the head's, which start fresh when missing or shaped otherwise."""
    shaped = {k for k in own if k in state and state[k].shape != own[k].shape}
    modules = {module_of(name) for name in head}  # the head's buffers start fresh with its parameters
    fresh = sorted(k for k in own if module_of(k) in modules and (k not in state or k in shaped))
    problems = [
        f"{k} has shape {tuple(state[k].shape)} there and {tuple(own[k].shape)} here" for k in shaped - set(fresh)
    ]
    problems += [f"{k} is missing there" for k in own if k not in state and k not in fresh]
    problems += [f"{k} is not in the model" for k in state if k not in own]
    if problems:
        listed = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise PipelineError(
            f"finetune.weights: {weights} does not fit the model: {listed}. Only the head "
            f"({', '.join(sorted(head))}; finetune.head sets it) may differ; is model._target_ (or its size) "
            "the one these weights were trained for?"
        )
    return Initial({k: v for k, v in state.items() if k not in fresh}, fresh, weights)


def whole_start(model_cfg: dict, finetune: FinetuneConfig, initial: Initial | None, seed: int) -> Initial:
    """Every tensor the model starts from (parameters and buffers, persistent or not), built here once with
    ``seed``, as a worker builds its replica, from ``initial``'s weights where given: what FSDP's workers, which
    build on the meta device, each take their shards of (:func:`pipeline.training.parallel.save_start`)."""
    torch.manual_seed(seed)
    model = build_model(model_cfg, finetune, initial)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    state = {name: tensor.detach() for name, tensor in tensors.items()}
    return Initial(state, [], initial.source if initial is not None else f"random weights (train.seed={seed})")


def hint(names: list[str]) -> str:
    shown = ", ".join(names[:6])
    return f"its parameters: {shown}{', ...' if len(names) > 6 else ''}"


# ---- anywhere: the driver's checks and each worker ---------------------------------------------------


def matching(patterns: list[str], names: list[str]) -> set[str]:
    """The names that one of the fnmatch ``patterns`` matches."""
    return {name for name in names if any(fnmatch.fnmatchcase(name, p) for p in patterns)}


def head_names(model: torch.nn.Module, patterns: list[str]) -> set[str]:
    """The head's parameter names: those ``patterns`` match, or without patterns, the parameters of the
    model's last layer that has any (resnet's fc, the ViT's heads.head, the MLP's last Linear)."""
    if patterns:
        return matching(patterns, [name for name, _ in model.named_parameters()])
    last = None
    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is not None:
            last = name
    if last is None:
        return set()
    prefix = f"{last}." if last else ""
    return {prefix + name for name, _ in model.get_submodule(last).named_parameters(recurse=False)}


def module_of(name: str) -> str:
    """The module a state-dict entry belongs to ("" for the model's own)."""
    return name.rsplit(".", 1)[0] if "." in name else ""


# ---- in each training worker -------------------------------------------------------------------------


def build_model(model_cfg: dict, finetune: FinetuneConfig, initial: Initial | None) -> torch.nn.Module:
    """The configured model, with the weights it starts from loaded and ``finetune.freeze`` frozen."""
    model = instantiate(model_cfg, _convert_="all")
    if initial is not None:
        missing, unexpected = model.load_state_dict(initial.state, strict=False)
        assert sorted(missing) == initial.fresh and not unexpected, (missing, unexpected)  # as matched on the driver
    frozen = matching(finetune.freeze, [name for name, _ in model.named_parameters()])
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return model


def param_groups(model: torch.nn.Module, finetune: FinetuneConfig) -> list[dict]:
    """The optimizer's parameter groups: what trains, with the backbone (all but the head) in its own group
    at ``backbone_lr_scale`` (``lr_scale``, applied by the worker to the optimizer's and schedule's rate)."""
    head = head_names(model, finetune.head)
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    scale = finetune.backbone_lr_scale
    if scale == 1.0:
        return [{"params": [p for _, p in trainable], "lr_scale": 1.0}]
    groups = [
        {"params": [p for name, p in trainable if name in head], "lr_scale": 1.0},
        {"params": [p for name, p in trainable if name not in head], "lr_scale": scale},
    ]
    return [group for group in groups if group["params"]]


def scaled_schedule(scheduler_cfg: dict, optimizer: torch.optim.Optimizer) -> dict:
    """The schedule's rate arguments (OneCycleLR's and CyclicLR's ``max_lr``, ``base_lr``), given as one
    number, as one per parameter group at each group's ``lr_scale``: one number would set every group alike."""
    scales = [group["lr_scale"] for group in optimizer.param_groups]
    if len(set(scales)) == 1:
        return {}
    return {
        key: [scheduler_cfg[key] * scale for scale in scales]
        for key in LR_ARGUMENTS
        if isinstance(scheduler_cfg.get(key), (int, float))
    }
