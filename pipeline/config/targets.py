"""The pluggable parts (``_target_`` nodes: model, loss, optimizer, scheduler, transform steps): each target
imported and its arguments checked against the callable's signature and annotations, naming the key
(``optim.lr: expected a float, got 'fast'``), before Ray starts.
"""

from __future__ import annotations

import collections.abc
import enum
import inspect
import typing
from typing import Any

from hydra.utils import get_object

from pipeline.common.errors import PipelineError

BOOLEAN_TEXT = ("true", "false", "yes", "no", "on", "off", "y", "n", "1", "0")  # what OmegaConf reads as a bool
NAMES = {bool: "true or false", int: "an integer", float: "a float", str: "a string", type(None): "null"}


def check_target(
    node: Any, key: str, runtime_args: tuple[str, ...] = (), class_runtime_args: tuple[str, ...] | None = None
) -> None:
    """Import ``node._target_`` and check its keyword arguments: they bind to the callable's signature,
    and each value fits its parameter's annotation (``Literal[...]`` choices included).

    ``runtime_args`` are the arguments the pipeline itself passes (``params`` for an optimizer);
    ``class_runtime_args`` replace them when the target is a class (a transform class is built
    from its params alone; its instances take the batch).
    """
    if not isinstance(node, dict) or "_target_" not in node:
        raise PipelineError(f"{key}: expected a mapping with a _target_ key, got {node!r}.")
    try:
        target = get_object(node["_target_"])
    except Exception as err:  # ImportError, or whatever the module raises as it is imported
        raise PipelineError(f"{key}._target_: cannot import {node['_target_']!r} ({err}).") from err
    if class_runtime_args is not None and inspect.isclass(target):
        runtime_args = class_runtime_args
    kwargs = {k: v for k, v in node.items() if not (k.startswith("_") and k.endswith("_"))}
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return  # builtins without a signature: nothing to check
    try:
        signature.bind_partial(**{name: None for name in runtime_args}, **kwargs)
    except TypeError as err:
        params = ", ".join(p for p in signature.parameters if p not in runtime_args)
        raise PipelineError(
            f"{key}: {node['_target_']} does not accept these arguments ({err}). It takes: {params}."
        ) from err
    hints = annotations(target)
    for name, value in kwargs.items():
        if name in hints and not accepts(value, hints[name], strict=True):
            raise PipelineError(f"{key}.{name}: expected {describe(hints[name])}, got {value!r} ({node['_target_']}).")


def annotations(target: Any) -> dict[str, Any]:
    """The parameters' annotations of a function or a class's ``__init__``; {} where they do not resolve."""
    try:
        return typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    except Exception:  # forward references to names the module does not hold: nothing to check
        return {}


def accepts(value: Any, hint: Any, strict: bool = False) -> bool:
    """Whether a config value fits an annotation. ``strict``: as a callable receives it (a ``_target_``'s
    argument); else as OmegaConf converts it into a typed schema field (``"3"`` for an int). Annotations
    this does not understand accept anything: the check only refuses what surely cannot work."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or isinstance(hint, (typing.TypeVar, str)):
        return True
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        return any(accepts(value, arg, strict) for arg in args)
    if origin is typing.Literal:
        return value in args
    if isinstance(hint, type) and issubclass(hint, enum.Enum):  # a choice setting: one of its names
        return str(value) in hint.__members__
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool) or (not strict and str(value).lower() in BOOLEAN_TEXT)
    if hint is int:
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            not strict and isinstance(value, str) and _parses(int, value)
        )
    if hint is float:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
            not strict and _parses(float, value)
        )
    if hint is str:
        return isinstance(value, str) or (not strict and isinstance(value, (int, float, bool)))
    if origin in (list, tuple, collections.abc.Sequence, collections.abc.Iterable):
        return isinstance(value, (list, tuple))
    if origin in (dict, collections.abc.Mapping) or hint in (dict, list, tuple):
        return isinstance(value, (dict, list, tuple))
    if inspect.isclass(hint) and hint.__module__ != "builtins":  # a torch.Tensor, an nn.Module: not a YAML value
        return (isinstance(value, dict) and "_target_" in value) or _instance(value, hint)
    return True


def _parses(kind: type, value: Any) -> bool:
    try:
        kind(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, bool)


def _instance(value: Any, hint: type) -> bool:
    try:
        return isinstance(value, hint)
    except TypeError:  # a Protocol or generic alias isinstance cannot check
        return True


def describe(hint: Any) -> str:
    """An annotation in words: ``Union[float, Tensor]`` -> ``a float or a Tensor``."""
    if typing.get_origin(hint) is typing.Union or type(hint).__name__ == "UnionType":
        return " or ".join(describe(arg) for arg in typing.get_args(hint))
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(hint.__members__)
    if hint in NAMES:
        return NAMES[hint]
    if typing.get_origin(hint) in (list, tuple, collections.abc.Sequence, collections.abc.Iterable):
        return "a list"
    return f"a {getattr(hint, '__name__', str(hint))}"
