"""An exponential moving average of a model's weights (``train.ema``), on each training worker: after every optimizer
step each averaged tensor moves ``1 - decay`` of the way to the trained one (torch's own EMA update,
:func:`torch.optim.swa_utils.get_ema_multi_avg_fn`), the decay ramping up as ``(1 + n) / (10 + n)`` over the first
``n`` updates (TensorFlow's and timm's ``ModelEma`` warm-up), so that the random starting weights do not linger in a
short run. Under FSDP the averages are DTensors sharded as the
parameters are, so each rank averages only its shards. Validation and checkpoints take the averages through the model
itself (:meth:`Ema.applied`): no second model is built, which FSDP could not copy anyway."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn

from pipeline.training import parallel


def averaged(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What the average covers, by state-dict name: every parameter and floating buffer (BatchNorm's running
    statistics are averaged too, as timm's ``ModelEmaV3`` does)."""
    buffers = [(name, b) for name, b in model.named_buffers() if b.is_floating_point()]
    return [*model.named_parameters(), *buffers]


class Ema:
    """The averages of one worker's model (a DDP replica's module, or an FSDP model's shards)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.updates = 0  # optimizer steps averaged so far: the warm-up's n, kept in checkpoints
        self.names = [name for name, _ in averaged(model)]
        self.tensors = [t.detach().clone() for _, t in averaged(model)]

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """After an optimizer step: each average moves toward the model's tensor."""
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        get_ema_multi_avg_fn(decay)(self.tensors, [t.detach() for _, t in averaged(model)], None)
        self.updates += 1

    @contextlib.contextmanager
    @torch.no_grad()
    def applied(self, model: torch.nn.Module) -> Iterator[None]:
        """Within: ``model`` holds the averages (to validate or save them); after, its trained weights again."""
        parallel.reshard(model)  # FSDP's root holds its parameters gathered after an eval forward
        live = [t for _, t in averaged(model)]
        trained = [t.detach().clone() for t in live]
        for tensor, average in zip(live, self.tensors, strict=True):
            tensor.copy_(average)
        try:
            yield
        finally:
            parallel.reshard(model)
            for tensor, kept in zip(live, trained, strict=True):
                tensor.copy_(kept)

    def named(self) -> dict[str, torch.Tensor]:
        """The averages by state-dict name, as they are (a sharded model's: this rank's DTensor shards, for DCP)."""
        return dict(zip(self.names, self.tensors, strict=True))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averages by state-dict name, on the CPU (an unsharded model's: a checkpoint's ``ema``)."""
        return {name: t.detach().cpu().clone() for name, t in zip(self.names, self.tensors, strict=True)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, tensor in zip(self.names, self.tensors, strict=True):
            tensor.copy_(state[name])
