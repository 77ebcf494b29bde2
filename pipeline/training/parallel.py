"""How one model is spread over a worker group, and how a sharded model's state is saved and restored.

In each worker, :func:`parallelize` applies the GPU levers in this order: activation checkpointing on the model's
blocks (their forward wrapped, so compile traces the recomputed region), ``torch.compile`` per block, in place
(``Module.compile``: the state dict's keys stay the plain module's, without ``_orig_mod.``), then DDP (a whole
replica per worker) or FSDP2 (``fully_shard`` per block, then the root: each worker holds 1/N of the parameters,
gradients and optimizer state), so FSDP's hooks stay outside the compiled blocks. An FSDP model is built on the
meta device and sharded there; each worker then materializes only its shards, read from the starting weights the
driver built once (:func:`pipeline.training.finetune.whole_start`) and saved as DCP in the run's storage
(:func:`save_start`): no worker, and nothing in Ray's object store, ever holds the whole model.

A sharded model's checkpoint is ``torch.distributed.checkpoint`` (DCP) directories, ``model/`` and
``optimizer/``, each rank writing its own shards; DCP reads them back on any worker count.
:func:`check_blocks` runs on the driver, before Ray starts.
"""

from __future__ import annotations

import contextlib
import os
import resource
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hydra.utils import instantiate
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from pipeline.common.errors import PipelineError
from pipeline.config import ScalingConfig, Strategy, TrainConfig
from pipeline.training.checkpoint import SHARDED_DIRS
from pipeline.training.precision import amp_plan

# train.blocks when null: torchvision's ViT (EncoderBlock), ResNet (BasicBlock, Bottleneck) and MLP (its Linear
# layers); the outermost ones count, so a ViT's Linear layers stay inside their EncoderBlock's unit
DEFAULT_BLOCKS = ("EncoderBlock", "BasicBlock", "Bottleneck", "Linear")


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def class_names(module: torch.nn.Module) -> set[str]:
    """The names a block class may be given by: its own, and its dotted path."""
    kind = type(module)
    return {kind.__name__, f"{kind.__module__}.{kind.__qualname__}"}


def blocks(model: torch.nn.Module, names: list[str] | None) -> list[torch.nn.Module]:
    """The model's outermost modules whose class is one of ``names`` (``train.blocks``; null: DEFAULT_BLOCKS)."""
    wanted, found, inside = set(names or DEFAULT_BLOCKS), [], set()
    for name, module in model.named_modules():
        if module is not model and class_names(module) & wanted and not any(name.startswith(p) for p in inside):
            found.append(module)
            inside.add(f"{name}.")
    return found


def check_blocks(model_cfg: dict, train: TrainConfig, scaling: ScalingConfig) -> None:
    """On the driver, before Ray starts: the blocks that FSDP shards and activation checkpointing recomputes
    exist in the model: every name of ``train.blocks``, or, with the default, at least one."""
    uses_blocks = scaling.strategy == Strategy.fsdp or train.activation_checkpointing
    if not uses_blocks and train.blocks is None:
        return
    model = instantiate(model_cfg, _convert_="all")
    present = set().union(*(class_names(m) for m in model.modules()))
    kinds = sorted({type(m).__name__ for m in model.modules() if next(m.parameters(recurse=False), None) is not None})
    if train.blocks is not None:
        unknown = [name for name in train.blocks if name not in present]
        if unknown:
            raise PipelineError(
                f"train.blocks: {', '.join(map(repr, unknown))} names no module class of model._target_ "
                f"{model_cfg['_target_']}. Name its repeated blocks by class name or dotted path; its modules "
                f"with parameters are: {', '.join(kinds)}."
            )
    elif uses_blocks and not blocks(model, None):
        raise PipelineError(
            f"train.blocks: model._target_ {model_cfg['_target_']} has none of the default blocks "
            f"({', '.join(DEFAULT_BLOCKS)}), which scaling.strategy=fsdp shards and train.activation_checkpointing "
            f"recomputes. Name its repeated blocks, e.g. train.blocks=[{kinds[0] if kinds else 'Block'}]."
        )


def parallelize(
    model: torch.nn.Module,
    train: TrainConfig,
    scaling: ScalingConfig,
    device: torch.device,
    start: str | None = None,
):
    """The model on ``device``, ready to train on this worker group: activation checkpointing, compiled, then DDP
    or FSDP2, as ``train`` and ``scaling`` say. With FSDP, ``model`` is on the meta device and ``start`` is the local
    directory of every tensor it starts from (:func:`save_start`), of which this worker reads its shards;
    with ``train.amp`` on a GPU, FSDP's policy casts the parameters to ``train.amp_dtype`` and reduces gradients in
    float32 (no autocast is needed then)."""
    units = blocks(model, train.blocks)
    if train.activation_checkpointing:
        for block in units:
            recompute_in_backward(block)
    if train.compile:
        for unit in units or [model]:  # a model without blocks compiles whole
            unit.compile(mode=str(train.compile_mode))
    if scaling.strategy == Strategy.fsdp:
        mesh = init_device_mesh(device.type, (world_size(),))
        amp, dtype, _ = amp_plan(device.type, train)  # float16 with FSDP is refused before Ray starts (checks.py)
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if amp else MixedPrecisionPolicy()
        for block in units + [model]:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        model.to_empty(device=device)
        take_shards(model, start)
        return model
    model.to(device)
    if world_size() > 1:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def save_start(state: dict[str, torch.Tensor], directory: str) -> None:
    """On the driver: every tensor an FSDP model starts from (parameters and buffers, persistent or not), as DCP in
    ``directory``, from which each worker reads its shards (:func:`take_shards`)."""
    with one_process():
        dcp.save(state, checkpoint_id=directory, no_dist=True)


def take_shards(model: torch.nn.Module, start: str) -> None:
    """This worker's shards of every parameter (and every buffer whole) read in place from the DCP directory
    ``start`` (:func:`save_start`): DCP reads each saved tensor and keeps this worker's part, one tensor at a time."""
    tensors = dict([*model.named_parameters(), *model.named_buffers()])
    with one_process():
        dcp.load(tensors, checkpoint_id=start, no_dist=world_size() == 1)


@contextlib.contextmanager
def one_process():
    """DCP's warning that it saves or loads in one process left out where that is the intent (the driver, one
    worker)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        yield


def recompute_in_backward(block: torch.nn.Module) -> None:
    """The block's activations are not kept for backward but recomputed there (``torch.utils.checkpoint``):
    its forward is wrapped in place, so its parameters keep their names."""
    forward = block.forward

    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def gradient_sync(model: torch.nn.Module, update: bool):
    """A context for one batch's backward: gradients are all-reduced (DDP) or reduce-scattered (FSDP) only on
    the batch whose optimizer step follows, so gradient accumulation costs no extra communication."""
    if is_sharded(model):
        model.set_requires_gradient_sync(update)
    elif isinstance(model, DistributedDataParallel) and not update:
        return model.no_sync()
    return contextlib.nullcontext()


def reshard(model: torch.nn.Module) -> None:
    """After a forward without backward (validation): FSDP's root keeps its parameters gathered for the backward
    it expects, which a state dict or the memory figures would then see; shard them again."""
    if is_sharded(model):
        model.reshard()


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) value gathered whole on every rank; any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """What this worker holds of ``tensor``: its shard of a sharded (DTensor) one, any other as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_bytes(tensors) -> int:
    """Bytes this worker holds of ``tensors``: its shards' for sharded ones."""
    return sum(t.numel() * t.element_size() for t in map(local, tensors))


def memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This worker's parameter and optimizer-state bytes (FSDP on N workers holds about 1/N of DDP's), and its peak
    memory so far: on a GPU what torch allocated there, on CPU the process's peak resident size as the OS counts it."""
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    device = next(model.parameters()).device
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {
        "param_bytes": local_bytes(model.parameters()),
        "optimizer_bytes": local_bytes(state),
        "peak_memory_bytes": peak,
    }


def save_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """Every rank's shards of the model and the optimizer state into ``directory``'s ``model/`` and ``optimizer/``
    (rank 0 also writes DCP's ``.metadata``): Ray Train merges the ranks' directories into one checkpoint."""
    states = dict(zip(SHARDED_DIRS, get_state_dict(model, optimizer)))
    for name, state in states.items():
        dcp.save(state, checkpoint_id=os.path.join(directory, name))


def load_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """The shards this worker now owns, read from a checkpoint saved on any number of workers."""
    states = dict(zip(SHARDED_DIRS, get_state_dict(model, optimizer)))
    for name, state in states.items():
        dcp.load(state, checkpoint_id=os.path.join(directory, name))
    set_state_dict(model, optimizer, model_state_dict=states["model"], optim_state_dict=states["optimizer"])


def save_tensors(tensors: dict[str, torch.Tensor], directory: str) -> None:
    """Named tensors, sharded (DTensors) or not, as DCP into ``directory``: each rank writes its shards."""
    dcp.save(tensors, checkpoint_id=directory)


def load_tensors(tensors: dict[str, torch.Tensor], directory: str) -> None:
    """The named tensors saved by :func:`save_tensors` on any number of workers, read into ``tensors`` in place."""
    dcp.load(tensors, checkpoint_id=directory)


def from_every_rank(value) -> list:
    """``value`` from every rank, in rank order (``[value]`` outside a process group)."""
    if world_size() == 1:
        return [value]
    values = [None] * world_size()
    dist.all_gather_object(values, value)
    return values
