"""One worker's model and what steps with it (runs in every Ray Train worker): the DDP replica or FSDP shard, its
optimizer, schedule, loss scaling and autocast, the input scaling, one optimizer step, and its checkpoint's save
and restore. The loop that drives it is :mod:`pipeline.training.worker`."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray.train
import torch
from hydra.utils import instantiate

from pipeline.common.errors import PipelineError
from pipeline.config import Layout, OnNonfinite, PipelineConfig, Strategy
from pipeline.training import checkpoint, finetune, parallel
from pipeline.training.early_stop import EarlyStopping
from pipeline.training.ema import Ema
from pipeline.training.finetune import Initial
from pipeline.training.micro_batch import MicroBatch, out_of_memory
from pipeline.training.precision import autocast_settings
from pipeline.training.scaling import feature_scaler
from pipeline.training.task import Task


@dataclass(kw_only=True)
class Replica:
    """One worker's model (a DDP replica or an FSDP shard, :func:`pipeline.training.parallel.parallelize`) and
    everything that steps with it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # a torch LR scheduler stepped per batch, or None
    scaler: torch.amp.GradScaler
    autocast: torch.autocast
    task: Task  # the loss and metrics
    statistics: dict | None  # the features' mean and std, with ``ingest.standardize``
    scale: Callable[[torch.Tensor], torch.Tensor]  # features as the transforms wrote them -> the model's floats
    layout: Layout  # which column of a batch is the model's input, which its label
    grad_clip: float | None  # train.grad_clip
    on_nonfinite: OnNonfinite  # train.on_nonfinite: raise or skip
    example: torch.Tensor | None = None  # two training rows' features, unscaled: the logged models' input example
    held_out: torch.Tensor | None = None  # up to 64 validation rows' features, unscaled: what exports are checked on
    ema: Ema | None = None  # train.ema's averages of the weights
    ema_model: bool = True  # train.ema_model: the averages are the run's model
    micro: MicroBatch  # train.micro_batch: the rows of each forward and backward

    @classmethod
    def build(
        cls,
        cfg: PipelineConfig,
        device: torch.device,
        total_steps: int,
        statistics: dict | None,
        initial: Initial | None = None,
        start: str | None = None,
    ) -> Replica:
        """The configured model (from ``initial``'s weights when given), loss, optimizer and schedule, seeded
        with ``train.seed`` (every rank alike). With FSDP the model is built on the meta device and ``start`` is a
        local directory of every tensor it starts from (:func:`pipeline.training.parallel.save_start`): each rank
        reads its shards of them."""
        torch.manual_seed(cfg.train.seed)
        if cfg.scaling.strategy == Strategy.fsdp:
            with torch.device("meta"):  # the structure only: no rank ever holds the whole model
                bare = finetune.build_model(cfg.model, cfg.finetune, None)
            model = parallel.parallelize(bare, cfg.train, cfg.scaling, device, start=start)
        else:
            bare = finetune.build_model(cfg.model, cfg.finetune, initial)  # random weights, or the given ones
            model = parallel.parallelize(bare, cfg.train, cfg.scaling, device)
        torch.manual_seed(cfg.train.seed + 1)  # training's own draws (dropout): alike whether weights were drawn here
        optimizer = instantiate(cfg.optim, _partial_=True, _convert_="all")(finetune.param_groups(bare, cfg.finetune))
        for group in optimizer.param_groups:  # the backbone at finetune.backbone_lr_scale of the head's rate
            group["lr"] *= group["lr_scale"]
        scheduler = None
        if cfg.scheduler is not None:
            schedule = instantiate(cfg.scheduler, _partial_=True, _convert_="all")
            scheduler = schedule(
                optimizer=optimizer, total_steps=total_steps, **finetune.scaled_schedule(cfg.scheduler, optimizer)
            )
        module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        ema = Ema(module, cfg.train.ema) if cfg.train.ema is not None else None
        autocast, scaler = autocast_settings(device, cfg.train)
        if cfg.scaling.strategy == Strategy.fsdp:  # FSDP's mixed-precision policy casts instead
            autocast = torch.autocast(device.type, enabled=False)
        return cls(
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            autocast=autocast,
            task=Task(cfg.task),
            statistics=statistics,
            scale=feature_scaler(cfg.ingest.normalize, statistics, device),
            layout=Layout.of(cfg.source),
            grad_clip=cfg.train.grad_clip,
            on_nonfinite=cfg.train.on_nonfinite,
            ema=ema,
            ema_model=cfg.train.ema_model,
            micro=MicroBatch(*cfg.train.micro_rows(), batch=cfg.ingest.batch_size // parallel.world_size()),
        )

    @property
    def module(self) -> torch.nn.Module:
        """The model without DDP's wrapper (FSDP's is the model itself): for validation and the weights' digest."""
        model = self.model
        return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model

    def train_batch(
        self, features: torch.Tensor, labels: torch.Tensor, *, accumulate: int, update: bool
    ) -> torch.Tensor:
        """One batch's forward and backward, in ``train.micro_batch``'s parts, adding its share of the gradients; its
        mean loss. Gradients are synchronized over the workers only on the last part of the batch before an optimizer
        step (:func:`pipeline.training.parallel.gradient_sync`). With ``auto``, a part out of memory on any rank
        halves every rank's parts and the batch runs again (:mod:`pipeline.training.micro_batch`)."""
        while True:
            loss = self.forward_backward(features, labels, accumulate, update)
            if not self.micro.auto or self.micro.agreed(self.model, failed=loss is None):
                return loss
            self.optimizer.zero_grad(set_to_none=True)  # auto: this batch's alone (train.accumulate=1)
            self.micro.halve(labels.device)

    def forward_backward(
        self, features: torch.Tensor, labels: torch.Tensor, accumulate: int, update: bool
    ) -> torch.Tensor | None:
        """The batch's parts through the model and back; None when one ran out of memory with ``auto``. With
        ``auto`` the parts run on the model without DDP's wrapper: the gradients' all-reduce is ``agreed``'s."""
        rows, parts = len(labels), self.micro.parts(len(labels))
        model = self.module if self.micro.auto else self.model
        losses = []  # each part's mean loss, detached, and its rows
        try:
            for index, part in enumerate(parts):
                synced = update and index == len(parts) - 1 and not self.micro.auto
                with parallel.gradient_sync(self.model, synced):  # DDP's no_sync takes the forward too
                    with self.autocast:
                        loss = self.task.loss(model(self.scale(features[part])), labels[part])
                    share = len(labels[part]) / rows / accumulate  # of the optimizer step's mean loss
                    self.scaler.scale(loss * share).backward()
                losses.append((loss.detach(), len(labels[part])))
        except RuntimeError as error:
            if not (self.micro.auto and out_of_memory(error)):
                raise
            return None  # the traceback, and the failed part's tensors with it, are released here
        if len(losses) == 1:  # the whole batch in one part (the default): its loss as it is, no extra kernel
            return losses[0][0]
        return sum(loss.float() * count for loss, count in losses) / rows

    def step(self) -> bool:
        """The optimizer step on the accumulated gradients, their norm clipped to ``train.grad_clip``. With
        ``train.on_nonfinite=skip``, a NaN or inf gradient (after DDP's all-reduce: the same on every rank)
        is not stepped on (False): that decision costs a device sync per step, so only skip mode makes it;
        raise mode checks the losses once an epoch (:func:`train_epoch`)."""
        self.scaler.unscale_(self.optimizer)  # the true gradients (a no-op without float16's GradScaler)
        skipping = (
            self.on_nonfinite == OnNonfinite.skip and not self.scaler.is_enabled()
        )  # the GradScaler skips overflows
        norm = None
        if self.grad_clip is not None or skipping:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip or math.inf)
        taken = not skipping or bool(torch.isfinite(parallel.full(norm)))
        if taken:
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.scheduler is not None:
                self.scheduler.step()
            if self.ema is not None:
                self.ema.update(self.module)
        self.optimizer.zero_grad(set_to_none=True)
        return taken

    def save(self, directory: str, epoch: int, stopper: EarlyStopping | None, rank: int) -> None:
        """This epoch's checkpoint into ``directory``: a sharded model's and optimizer's shards from every rank,
        a replica's whole from rank 0, and rank 0's ``checkpoint.pt`` with the rest."""
        sharded = parallel.is_sharded(self.model)
        if sharded:
            parallel.save_shards(self.model, self.optimizer, directory)
            if self.ema is not None:
                parallel.save_tensors(self.ema.named(), os.path.join(directory, checkpoint.EMA_KEY))
        if rank != 0:
            return
        state = {
            "scaler": self.scaler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "epoch": epoch,
            "feature_statistics": self.statistics,  # predict standardizes features with these
            "classes": self.layout.classes,  # the class names, index order, where labels are names
            "input_example": self.example,
            "held_out": self.held_out,
            "micro_batch": self.micro.rows,  # train.micro_batch=auto's size found: a resume starts from it
        }
        if sharded:
            state[checkpoint.SHARDED_KEY] = [*checkpoint.SHARDED_DIRS, *([checkpoint.EMA_KEY] if self.ema else [])]
        else:
            state |= {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}
            if self.ema is not None:
                state[checkpoint.EMA_KEY] = self.ema.state_dict()
        if self.ema is not None:
            state[checkpoint.EMA_MODEL_KEY], state[checkpoint.EMA_UPDATES_KEY] = self.ema_model, self.ema.updates
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if stopper is not None:
            state["early_stop"] = stopper.state_dict()
        checkpoint.write_state(state, directory)

    def restore(self, saved: ray.train.Checkpoint, device: torch.device) -> dict:
        """Continue from ``saved`` (written on any number of workers); its state besides the model's."""
        with saved.as_directory() as path:
            state = checkpoint.load(path, "the restored checkpoint", device, sharded=True)
            sharded = checkpoint.SHARDED_KEY in state
            if sharded != parallel.is_sharded(self.model):
                raise PipelineError(
                    f"the checkpoint at {saved.path} was written with scaling.strategy={'fsdp' if sharded else 'ddp'}: "
                    "resume the run with the strategy it was trained with."
                )
            if sharded:
                parallel.load_shards(self.model, self.optimizer, path)
            else:
                self.module.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
            if self.ema is not None:
                self.restore_ema(state, path)
        self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"].cpu())
        if self.micro.auto and state.get("micro_batch"):
            self.micro.rows = state["micro_batch"]
        if state.get("input_example") is not None:  # a run resumed at its epoch's last step trains no batch in it
            self.example = state["input_example"].cpu()
        if state.get("held_out") is not None:  # nor validates before its checkpoint
            self.held_out = state["held_out"].cpu()
        return state

    def restore_ema(self, state: dict, path: str) -> None:
        """The averages as the checkpoint at ``path`` holds them; a checkpoint without them (a run that turns
        ``train.ema`` on when resumed) starts them at the restored weights."""
        if checkpoint.EMA_KEY in state.get(checkpoint.SHARDED_KEY, ()):
            parallel.load_tensors(self.ema.named(), os.path.join(path, checkpoint.EMA_KEY))
        elif checkpoint.EMA_KEY in state:
            self.ema.load_state_dict(state[checkpoint.EMA_KEY])
        else:
            self.ema = Ema(self.module, self.ema.decay)
        self.ema.updates = state.get(checkpoint.EMA_UPDATES_KEY, 0)
