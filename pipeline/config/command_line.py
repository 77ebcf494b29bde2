"""The command line checked before Hydra composes it (on the driver, before Ray starts): the mistakes Hydra would
report as a traceback or a bare "not in struct" (a group set to null, an unknown group option or key, a value of the
wrong type), each as one paragraph naming the key and the closest valid names. What it does not understand (sweep
functions, ``hydra.*`` settings, ``+key=value`` additions) it leaves to :mod:`pipeline.config.checks`.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import OverrideParseException

from pipeline.common.errors import PipelineError
from pipeline.config.checks import closest, unwrap_optional
from pipeline.config.schema import CONF_DIR, PipelineConfig
from pipeline.config.targets import accepts, describe


def check_overrides(args: list[str]) -> None:
    """Fail, as one paragraph, on an override of a config group or schema key that cannot be right."""
    texts = [a for a in args if "=" in a and not a.startswith("-")]
    if any(t.startswith("hydra.searchpath") for t in texts):
        return  # groups may come from elsewhere
    conf_dirs = [Path(CONF_DIR), *user_conf_dirs(args)]
    try:
        overrides = OverridesParser.create().parse_overrides(texts)
    except OverrideParseException:
        return  # Hydra reports its own syntax errors, pointing at the character
    for override in overrides:
        if override.is_delete() or override.package is not None or override.key_or_group.startswith("hydra"):
            continue
        if any((d / override.key_or_group).is_dir() for d in conf_dirs):
            check_group(override, conf_dirs)
        elif not override.is_add():
            check_key(override)


def values(override: Override) -> list:
    """The value an override sets; none for a sweep, whose jobs each fail on their own, recorded as a FAILED
    child run of the sweep (pipeline/plugins), while the others run."""
    return [] if override.is_sweep_override() else [override.value()]


def user_conf_dirs(args: list[str]) -> list[Path]:
    """The directories ``--config-dir DIR`` (``-cd DIR``, ``--config-dir=DIR``) adds to Hydra's search path."""
    found = []
    for i, arg in enumerate(args):
        if arg in ("--config-dir", "-cd") and i + 1 < len(args):
            found.append(Path(args[i + 1]))
        elif arg.startswith("--config-dir="):
            found.append(Path(arg.split("=", 1)[1]))
    return found


def check_group(override: Override, conf_dirs: list[Path]) -> None:
    """``GROUP=OPTION``: OPTION is a file of ``conf/GROUP`` (or of a ``--config-dir``'s); null is not (a group
    is dropped with ``~GROUP``)."""
    group = override.key_or_group
    options = sorted({p.stem for d in conf_dirs for p in (d / group).glob("*.yaml")})
    for value in values(override):
        if value is None:
            raise PipelineError(
                f"{override.input_line}: a config group is dropped with ~{group} (Hydra's delete), not set to "
                f"null. Write ~{group}, or choose one of its options: {', '.join(options)}."
            )
        if isinstance(value, str) and value not in options:
            raise PipelineError(f"{override.input_line}: {group} has no option {value!r}.{closest(value, options)}")


def check_key(override: Override) -> None:
    """``a.b.c=value`` for a key the schema declares: every part of the path exists, and the value has its type."""
    node: typing.Any = PipelineConfig
    parts = override.key_or_group.split(".")
    for depth, part in enumerate(parts):
        hints = typing.get_type_hints(node)
        if part not in hints:
            where = ".".join(parts[:depth]) or "the config"
            raise PipelineError(f"{override.input_line}: {where} has no key {part!r}.{closest(part, list(hints))}")
        node = unwrap_optional(hints[part])
        if not dataclasses.is_dataclass(node):
            break
    else:
        return  # a whole section set at once: Hydra checks it
    if depth != len(parts) - 1 or node is typing.Any or typing.get_origin(node) is dict:
        return  # inside a free-form part (model, optim, a mapping): checked once composed
    for value in values(override):
        if not accepts(value, hints[part]):
            raise PipelineError(f"{override.key_or_group}: expected {describe(hints[part])}, got {value!r}.")
