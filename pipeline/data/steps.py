"""The configured transform steps (built on the driver, run in Ray Data's tasks and actors): which run once
and which every epoch, and how Ray runs them.

In training every step runs in the tasks that read each epoch's rows (:class:`Steps`, one ``map_batches`` fused
with the reads), a class step built once per process; in prediction functions run as stateless Ray tasks and
classes as an actor pool (built once per actor, for transforms with expensive set-up). Either way they use their
own CPUs, not the training workers'.

A transform function that declares an ``epoch`` parameter is called with the training epoch its pass belongs to,
so seeded random augmentation changes every epoch and a resumed run repeats exactly what an uninterrupted one
would do: each row carries the epoch it was read for (:mod:`pipeline.data.epochs`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import ray.data
from hydra.utils import get_object, instantiate

from pipeline.common.errors import PipelineError
from pipeline.config import PredictConfig, TransformSpec
from pipeline.data import source
from transforms.randomness import EPOCH, ROW
from transforms.tabular import stack_features


def streamed_steps(steps: dict[str, TransformSpec]) -> dict[str, TransformSpec]:
    """The steps a split that is not cached runs: without those that only make the cache's working size
    (``streamed: false``), whose work the next step does itself."""
    return {name: spec for name, spec in steps.items() if spec.streamed}


def read_steps(split: source.Split) -> list[tuple[Callable, dict]]:
    """What a split's rows go through as read, before any configured step: class names made their index,
    a table's numeric columns stacked into one vector (each a function and its arguments)."""
    layout, steps = split.layout, []
    if layout.classes is not None:
        steps.append((class_indices, {"column": layout.label, "classes": layout.classes}))
    if split.tabular:
        stacking = {"columns": layout.inputs, "output": layout.model_input, "on_missing": layout.on_missing}
        steps.append((stack_features, stacking))
    return steps


def class_indices(batch: dict[str, np.ndarray], column: str, classes: list[str]) -> dict[str, np.ndarray]:
    """Class names in ``column`` as their index in ``classes`` (every name is one: checked before training)."""
    order = np.argsort(classes)
    found = np.searchsorted(np.asarray(classes)[order], batch[column].astype(str))
    return {**batch, column: order[np.minimum(found, len(classes) - 1)].astype(np.int64)}


class Steps:
    """Transform steps run in one process, one after another, on a batch: ``first`` (:func:`read_steps`),
    then each step, those that take an ``epoch`` given the one the call passes; then, with ``keep``, only
    those columns. Steps are built on first use; a class step once per process (:func:`built`)."""

    def __init__(
        self, specs: dict[str, TransformSpec], first: list[tuple[Callable, dict]], keep: list[str] | None = None
    ):
        self.specs, self.first, self.keep, self.fns = specs, first, keep, None

    def __call__(self, batch: dict[str, np.ndarray], epoch: int | None = None) -> dict[str, np.ndarray]:
        if EPOCH in batch:  # rows read for an epoch (pipeline.data.epochs)
            batch = dict(batch)
            read_for = batch.pop(EPOCH)
            epoch = int(read_for[0]) if len(read_for) else epoch
        if self.fns is None:
            self.fns = [step_callable(spec) for spec in self.specs.values()]
        numbers = batch.get(ROW)
        for fn, kwargs in self.first:
            batch = fn(batch, **kwargs)
        for name, (fn, takes) in zip(self.specs, self.fns):
            batch = fn(batch, epoch=epoch) if takes and epoch is not None else fn(batch)
            numbers = carried(batch, numbers, name)
        if self.keep is None:
            return batch
        return {name: batch[name] for name in self.keep} | ({} if numbers is None else {ROW: numbers})


def carried(batch: dict[str, np.ndarray], numbers: np.ndarray | None, step: str) -> np.ndarray | None:
    """The rows' numbers (``ROW``) after ``step``: the batch's own, or, from a step that returns only its own
    columns, those it was given (it must keep the rows and their order). A step that drops rows must hand the
    other columns on (``{**batch, ...}``, as the built-in ones do), else the ledger would lose count."""
    if numbers is None or ROW in batch:
        return batch.get(ROW, numbers)
    if any(len(values) != len(numbers) for values in batch.values()):
        raise PipelineError(
            f"transform step {step!r} changed the number of rows ({len(numbers)} given) and dropped the column "
            f"{ROW!r} with them: a step that drops, adds or reorders rows must return the batch's other columns too "
            "({**batch, column: values}), so that each row's number stays with it (docs/configuration.md)."
        )
    return numbers


_instances: dict[str, Any] = {}  # a process's class steps, built once (a gathering task's process runs many)


def step_callable(spec: TransformSpec) -> tuple[Any, bool]:
    """A step's callable (a class step's instance, one per process) and whether it takes an ``epoch``."""
    fn = instantiate(spec.fn, _partial_=True, _convert_="all")
    if is_class(spec):
        key = repr(spec.fn)
        if key not in _instances:
            _instances[key] = fn.func(**fn.keywords)
        return _instances[key], False
    return fn, "epoch" in inspect.signature(fn).parameters


def is_class(spec: TransformSpec) -> bool:
    """Whether a step's ``fn`` names a class (run as an actor pool) rather than a function."""
    fn = instantiate(spec.fn, _partial_=True, _convert_="all")
    return isinstance(fn, functools.partial) and isinstance(fn.func, type)


def cached_steps(steps: dict[str, TransformSpec]) -> tuple[dict[str, TransformSpec], dict[str, TransformSpec]]:
    """The steps that run once (up to the first that runs every epoch) and those that run every epoch.
    A step runs every epoch when its ``cache`` says false, or, unset, when its function takes the
    ``epoch`` (seeded augmentation: a new draw each epoch), or when it is put on the device (``on_device: true``)."""
    names = list(steps)
    for i, spec in enumerate(steps.values()):
        per_epoch = not spec.cache if spec.cache is not None else takes_epoch(spec)
        if per_epoch or spec.on_device is True:
            return {n: steps[n] for n in names[:i]}, {n: steps[n] for n in names[i:]}
    return steps, {}


def device_split(
    steps: dict[str, TransformSpec], auto: bool
) -> tuple[dict[str, TransformSpec], dict[str, TransformSpec]]:
    """``steps`` (those that run every epoch) cut in two: the first run by Ray Data's CPU tasks, the rest by the
    training worker on its device (:mod:`transforms.device`), after the batches reach it. The device takes the first
    step put there (``on_device: true``) and every one after it (:func:`check_device` checks they can go), and before
    it each ``auto`` step with a device form, where ``auto`` sends them there (GPU workers, or a cache the workers
    read themselves: :func:`pipeline.data.preprocess.training_data`)."""
    names = list(steps)
    cut = next((i for i, spec in enumerate(steps.values()) if spec.on_device is True), len(names))
    while cut > 0 and on_device(steps[names[cut - 1]], auto):
        cut -= 1
    return {n: steps[n] for n in names[:cut]}, {n: steps[n] for n in names[cut:]}


def on_device(spec: TransformSpec, auto: bool) -> bool:
    """Whether a step may run on the training device as its ``on_device`` says: true, or ``auto`` where ``auto``
    sends steps there and the step's function has a device form that takes its parameters."""
    if spec.on_device is True:
        return True
    return spec.on_device == "auto" and auto and can_run_on_device(spec)


def can_run_on_device(spec: TransformSpec) -> bool:
    return device_form(spec) is not None and not unsupported(spec)


def device_form(spec: TransformSpec) -> type | None:
    """The class that runs a step on the training device: its function's ``device_form`` (a dotted path, as
    transforms/image.py sets for its functions), or None."""
    fn = instantiate(spec.fn, _partial_=True, _convert_="all")
    path = getattr(fn.func if isinstance(fn, functools.partial) else fn, "device_form", None)
    return get_object(path) if path else None


def device_params(spec: TransformSpec) -> dict[str, Any]:
    """The arguments a step's device form is built with: its function's, as the config binds them."""
    return {key: value for key, value in spec.fn.items() if key != "_target_"}


def unsupported(spec: TransformSpec) -> str | None:
    """Why a step's device form cannot take the step's parameters (None: it can)."""
    return device_form(spec).unsupported(**device_params(spec))


def check_device(split: str, steps: dict[str, TransformSpec]) -> None:
    """Before Ray starts: a step put on the device (``on_device: true``) and each step after it has a device form that
    takes its parameters (the device is where a batch goes last)."""
    names = list(steps)
    first = next((i for i, spec in enumerate(steps.values()) if spec.on_device is True), None)
    if first is None:
        return
    for name in names[first:]:
        spec, key = steps[name], f"transforms.{split}.{name}"
        form = device_form(spec)
        where = f"after transforms.{split}.{names[first]} (on_device=true)" if name != names[first] else ""
        if spec.on_device is False or form is None:
            what = "on_device=false" if spec.on_device is False else f"{spec.fn['_target_']} has no device form"
            raise PipelineError(
                f"{key} runs on the training device {where or '(on_device=true)'}, since a batch reaches the device "
                f"after every step in Ray Data's tasks, but {what}. Give the function a device form (a device_form "
                "attribute naming a class, as transforms/image.py does), move the step before the device steps, or "
                "set on_device: auto on the steps."
            )
        try:
            inspect.signature(form).bind(**device_params(spec))
        except TypeError as err:
            raise PipelineError(f"{key}: its device form {form.__name__} does not take its arguments: {err}.") from err
        if reason := unsupported(spec):
            raise PipelineError(
                f"{key} runs on the training device {where}, but {reason}: set on_device: auto or false."
            )


def takes_epoch(spec: TransformSpec) -> bool:
    """Whether a step's function (not a class: actors are not told the epoch) declares an ``epoch`` parameter."""
    fn = instantiate(spec.fn, _partial_=True, _convert_="all")
    target = fn.func if isinstance(fn, functools.partial) else fn
    return not isinstance(target, type) and "epoch" in inspect.signature(target).parameters


def check_streamed(split: str, steps: dict[str, TransformSpec]) -> None:
    """A step marked ``streamed: false`` only fills the cache: it must be one that runs once."""
    once, _ = cached_steps(steps)
    for name, spec in steps.items():
        if not spec.streamed and name not in once:
            raise PipelineError(
                f"transforms.{split}.{name}.streamed=false skips the step wherever nothing is cached, but the step "
                "runs every epoch (its cache is false, it takes the epoch, or a step before it runs every epoch), so "
                "it would never run. Set streamed: true, or let the step run once (cache: true)."
            )


def apply(ds, specs: dict[str, TransformSpec], columns: list[str] | None):
    """Return ``ds`` with every transform in ``specs`` (name -> TransformSpec dict, none null) appended, in order,
    then only ``columns`` kept (the reader's ``path`` column serves error messages, not training),
    where the last step ran; ``None`` keeps every column. Prediction's steps: ``epoch`` keeps its default."""
    last: dict = {}
    for spec in specs.values():
        fn = instantiate(spec.fn, _partial_=True, _convert_="all")
        options = {
            "batch_format": "numpy",
            "batch_size": spec.batch_size,
            "num_cpus": spec.num_cpus,
            **placement(spec),
        }
        if isinstance(fn, functools.partial) and isinstance(fn.func, type):
            pool = ray.data.ActorPoolStrategy(size=spec.concurrency or 1)
            ds = ds.map_batches(fn.func, fn_constructor_kwargs=fn.keywords, compute=pool, **options)
        else:
            ds = ds.map_batches(fn, compute=ray.data.TaskPoolStrategy(size=spec.concurrency), **options)
        last = placement(spec)
    return ds if columns is None else ds.select_columns(columns, **last)


def placement(spec: TransformSpec | PredictConfig) -> dict:
    """Ray's options for where a step's tasks or actors (or predict's replicas) may run: the custom resources
    and node labels it asks for (none: any node with a free CPU)."""
    wanted = {"resources": spec.resources, "label_selector": spec.label_selector}
    return {key: dict(value) for key, value in wanted.items() if value}


def read_placement(specs: dict[str, TransformSpec]) -> dict:
    """Reading runs where the split's first step does, so a cluster's reads stay on its preprocessing
    nodes and Ray Data can fuse the read with that step into one task (select_columns, likewise,
    runs where the last step does)."""
    steps = list(specs.values())
    return placement(steps[0]) if steps else {}
