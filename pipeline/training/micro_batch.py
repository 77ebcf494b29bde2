"""``train.micro_batch``: each batch's forward and backward in parts of fewer rows, their gradients accumulated, so
the batch, its optimizer step and the LR schedule are those of the recipe. ``auto`` finds the part that fits, as
Composer's ``device_train_microbatch_size="auto"`` does: the whole batch first, and on an out-of-memory error
half as many rows, the same batch run again, every rank alike. Runs in every worker (:mod:`replica` steps with it).

With ``auto`` on several workers the parts run on the model without DDP's hooks (a rank that fails mid-batch would
leave the others in DDP's all-reduce) and one all-reduce afterwards carries every rank's gradients and whether it
ran out of memory: the ranks halve together or step together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.common.errors import PipelineError

# torch 2.14's CPU allocator raises a RuntimeError with this text, not torch.OutOfMemoryError as CUDA's does
# (tests/test_ray_canaries.py pins it)
CPU_OUT_OF_MEMORY = "DefaultCPUAllocator: can't allocate memory"


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocator's: the device's memory (CUDA) or the process's (CPU) is spent."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and CPU_OUT_OF_MEMORY in str(error)
    )


@dataclass
class MicroBatch:
    """The rows of a batch each forward and backward takes (None: the whole batch), whether ``auto`` finds them, and
    the rows of a worker's batch (``ingest.batch_size`` over the workers; an epoch's last may hold fewer)."""

    rows: int | None
    auto: bool
    batch: int

    @property
    def size(self) -> int:
        """The rows of a part of a whole batch, the same on every rank: the figure logged as ``micro_batch``."""
        return min(self.rows or self.batch, self.batch)

    def parts(self, rows: int) -> list[slice]:
        """A batch of ``rows`` rows as the parts each forward takes."""
        size = min(self.size, rows)
        return [slice(start, start + size) for start in range(0, rows, size)]

    def agreed(self, model: torch.nn.Module, failed: bool) -> bool:
        """With ``auto``, after a batch's parts: True when every rank's fitted. On several workers this is the one
        all-reduce of the step: every rank's gradients (averaged, as DDP's) with its out-of-memory flag after them."""
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return not failed
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None and not failed else torch.zeros_like(p) for p in params]
        flag = torch.tensor([float(failed)], dtype=grads[0].dtype, device=grads[0].device)
        flat = torch.cat([*(grad.reshape(-1) for grad in grads), flag])
        dist.all_reduce(flat)
        if flat[-1].item() > 0:
            return False
        flat /= dist.get_world_size()
        offset = 0
        for param in params:
            if param.grad is not None:  # a parameter no forward used has none on any rank
                param.grad.copy_(flat[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        return True

    def halve(self, device: torch.device) -> None:
        """After an out-of-memory error on some rank: half the rows per part, every rank alike (whatever the rows of
        its own batch)."""
        size = self.size
        if size == 1:
            raise PipelineError(
                f"train.micro_batch=auto: a single row does not fit in a worker's memory ({device}): the model's "
                "weights, gradients and optimizer state and one row's activations need more than it has. Use a "
                "smaller model or input, train.activation_checkpointing=true, train.amp=true, or shard the model "
                "over several GPUs with scaling.strategy=fsdp and train.micro_batch set to a number of rows."
            )
        self.rows = size // 2
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the failed part's blocks back to the device, as Composer does
