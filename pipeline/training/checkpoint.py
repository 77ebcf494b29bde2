"""The checkpoint format: what a training worker writes, and what logged models, fine-tuning and prediction
read back. One module, so the writer and its readers cannot drift.

A checkpoint is a directory holding ``checkpoint.pt``: a dict of tensors and plain values (the model's and
optimizer's state dicts, the epoch, the features' statistics, the class names, an input example, 64 held-out
validation rows, ``train.ema``'s averages), always read with ``weights_only=True``; and ``report.json``, the
epoch's metrics as rank 0 reported them with it, and the size every file was written at (a copy cut short by a
stop is not taken for whole). A checkpoint taken within an epoch (``train.checkpoint_every``, a stop) says so in
its report and keeps where the epoch stands in ``position.pt``. A sharded model's checkpoint
(``scaling.strategy=fsdp``) keeps its model, optimizer state and averages in ``torch.distributed.checkpoint``
directories beside ``checkpoint.pt`` instead (:mod:`pipeline.training.parallel`), each rank's shards there.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import sys
import tempfile

import numpy as np
import pyarrow.fs as pafs
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from pipeline.common.errors import PipelineError
from pipeline.common.metrics import lower_is_better
from pipeline.config import TaskConfig, TrainConfig
from pipeline.training.events import STEP_KEY

CHECKPOINT_FILE = "checkpoint.pt"
REPORT_FILE = "report.json"
SIZE_KEY = "checkpoint_bytes"  # in the report of a checkpoint written before FILES_KEY: checkpoint.pt's size
FILES_KEY = "checkpoint_files"  # in the report: every file of the checkpoint (all ranks'), and its size when whole
SHARDED_KEY = "sharded"  # in a sharded checkpoint's state: the DCP directories that hold its model and optimizer
SHARDED_DIRS = ("model", "optimizer")  # those directories, beside checkpoint.pt
EMA_KEY = "ema"  # train.ema's averages: a state dict in checkpoint.pt, or a sharded run's DCP directory beside it
EMA_MODEL_KEY = "ema_model"  # in checkpoint.pt: whether the averages are the run's model (train.ema_model)
EMA_UPDATES_KEY = "ema_updates"  # in checkpoint.pt: the steps the averages took (their warm-up's count)
POSITION_FILE = "position.pt"  # beside it: the epoch's rows trained on (packed bits) and its figures so far


def write_state(state: dict, directory: str) -> None:
    """Rank 0's ``state`` as ``directory/checkpoint.pt``."""
    torch.save(state, os.path.join(directory, CHECKPOINT_FILE))


def files(directory: str) -> dict[str, int]:
    """Each file under ``directory`` (relative path) and its size: what this rank adds to a checkpoint."""
    found = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            found[os.path.relpath(path, directory)] = os.path.getsize(path)
    return found


def write_report(directory: str, metrics: dict, written: dict[str, int]) -> None:
    """The epoch's ``metrics`` beside its checkpoint, with every file ``written`` to it (by any rank): a resume
    finds where the checkpoint stands in the run, and knows one whose copy was cut short by a file's size. (What
    MLflow must hold of the report is kept apart from the checkpoint too: :mod:`pipeline.training.records`.)"""
    with open(os.path.join(directory, REPORT_FILE), "w") as out:
        json.dump({**metrics, FILES_KEY: written}, out)


def read_report(filesystem: pafs.FileSystem, path: str) -> dict:
    """The report beside the checkpoint at ``path``."""
    with filesystem.open_input_stream(f"{path}/{REPORT_FILE}") as stream:
        return json.loads(stream.read())


def reports(filesystem: pafs.FileSystem, directory: str) -> list[tuple[str, dict]]:
    """(checkpoint path, its epoch's metrics) for every checkpoint in a run's storage ``directory``, oldest
    epoch first; checkpoints written before reports were kept beside them are left out."""
    found = []
    for info in filesystem.get_file_info(pafs.FileSelector(directory, allow_not_found=True)):
        report = f"{info.path}/{REPORT_FILE}"
        if info.type == pafs.FileType.Directory and filesystem.get_file_info(report).is_file:
            found.append((info.path, read_report(filesystem, info.path)))
    return sorted(found, key=lambda item: place(item[1]))


def place(report: dict) -> tuple[int, int, int]:
    """Where a checkpoint stands in its run, by its report: after the steps of its epoch it names, or at the
    epoch's end, after every checkpoint within it."""
    step = report.get(STEP_KEY)
    return (report["epoch"], 0, step) if step is not None else (report["epoch"], 1, 0)


def write_position(directory: str, trained: np.ndarray, figures: dict[str, float]) -> None:
    """A checkpoint within an epoch: the rows trained on (:mod:`pipeline.training.ledger`'s bits) and the epoch's
    figures so far (:meth:`pipeline.training.telemetry.EpochTelemetry.carried`)."""
    torch.save({"trained": torch.from_numpy(trained), "figures": figures}, os.path.join(directory, POSITION_FILE))


def read_position(filesystem: pafs.FileSystem, path: str) -> tuple[np.ndarray, dict[str, float]]:
    """What :func:`write_position` wrote beside the checkpoint at ``path`` (tensors and numbers only)."""
    with filesystem.open_input_stream(f"{path}/{POSITION_FILE}") as stream:
        position = torch.load(io.BytesIO(stream.read()), weights_only=True)
    return position["trained"].numpy(), position["figures"]


def newest(filesystem: pafs.FileSystem, directory: str) -> str | None:
    """The newest checkpoint in a run's storage ``directory`` whose ``checkpoint.pt`` is there whole: where a
    resumed run continues when Ray Train never registered it (Ray registers a checkpoint only once it is
    copied to storage, so a job stopped between the two leaves one that only this finds)."""
    for path, report in reversed(reports(filesystem, directory)):
        if whole(filesystem, path, report):
            return path
    return None


def whole(filesystem: pafs.FileSystem, path: str, report: dict) -> bool:
    """Whether every file the checkpoint at ``path`` was written with is there at the size its ``report`` says: a
    copy to storage cut short (a SIGKILL) leaves some missing or short."""
    written = report.get(FILES_KEY, {CHECKPOINT_FILE: report.get(SIZE_KEY)})
    return all(filesystem.get_file_info(f"{path}/{name}").size == size for name, size in written.items())


def load(path: str, key: str, device: torch.device | str = "cpu", sharded: bool = False) -> dict:
    """The dict saved at ``path`` (a file, or a checkpoint directory), as tensors and plain values only
    (nothing pickled runs); a file that is no such thing fails naming ``key``, the setting that named it. A
    sharded checkpoint's state (its model in DCP shards) only where ``sharded`` says the caller reads those."""
    if os.path.isdir(path):
        path = os.path.join(path, CHECKPOINT_FILE)
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except (OSError, RuntimeError, pickle.UnpicklingError) as err:
        raise PipelineError(f"{key}: cannot load {path} as weights ({err}).") from err
    if not isinstance(state, dict):
        raise PipelineError(f"{key}: {path} holds no state dict (a mapping of name to tensor).")
    if SHARDED_KEY in state and not sharded:
        raise PipelineError(
            f"{key}: {path} is a sharded checkpoint (scaling.strategy=fsdp): its weights are shards of "
            "torch.distributed.checkpoint, whose index is a pickle, read only from a run's own storage. Give the "
            "run's logged model instead (runs:/RUN_ID/model, models:/NAME@ALIAS): its weights are one state dict."
        )
    return state


def load_whole(directory: str, key: str) -> dict:
    """A checkpoint of the run's own storage with its model's state dict whole: a sharded one's ``model/``
    shards gathered into one (on the driver: the logged models are made from these)."""
    state = load(directory, key, sharded=True)
    for name in {"model", EMA_KEY} & set(state.get(SHARDED_KEY, ())):
        with tempfile.TemporaryDirectory() as tmp:
            gathered = os.path.join(tmp, f"{name}.pt")
            dcp_to_torch_save(os.path.join(directory, name), gathered)
            state[name] = torch.load(gathered, weights_only=True)
    return state


def handed_on(state: dict) -> dict:
    """The weights a whole checkpoint's ``state`` hands on (logged models, prediction, fine-tuning): the averages
    where ``train.ema_model`` made them the run's model (the rest of the state dict, integer buffers, as trained),
    else the trained weights."""
    if state.get(EMA_MODEL_KEY) and EMA_KEY in state:
        return {**state["model"], **state[EMA_KEY]}
    return state["model"]


def is_checkpoint(state: dict) -> bool:
    """Whether ``state`` is a whole pipeline checkpoint (its model's state dict under ``model``) rather than
    a bare state dict, whose values are tensors."""
    return isinstance(state.get("model"), dict)


def checkpoint_mode(train: TrainConfig, task: TaskConfig) -> str:
    """``train.checkpoint_mode``, or, when null, min for a loss or an error metric and max otherwise."""
    if train.checkpoint_mode is not None:
        return train.checkpoint_mode
    metric = train.checkpoint_metric
    return "min" if metric is not None and lower_is_better(task.type, task.metrics, metric) else "max"


def unscored(train: TrainConfig, task: TaskConfig) -> float:
    """The ``train.checkpoint_metric`` a checkpoint within an epoch reports (it has no validation): below every
    epoch's score, so Ray Train lets it go first. Finite: Ray's record of its checkpoints turns NaN and inf into
    null, which a resumed run cannot rank."""
    return sys.float_info.max if checkpoint_mode(train, task) == "min" else -sys.float_info.max
