"""Transforms for tables of numbers: numeric columns in, one float32 (N, F) feature array out."""

from __future__ import annotations

import logging

import numpy as np
import pyarrow.parquet as pq

log = logging.getLogger(__name__)
Batch = dict[str, np.ndarray]


def stack_features(
    batch: Batch, columns: list[str], output: str = "features", on_missing: str = "raise", path_column: str = "path"
) -> Batch:
    """Stack ``columns`` into one float32 array ``output`` of shape (N, F): several numeric columns side by
    side, or one column that holds a list or array of numbers per row (lists must share a length).
    The input columns are dropped; the others pass through.

    A missing value (null), NaN or infinity, as exports hold them: ``on_missing=raise`` fails naming the
    column, file and row (``path_column`` is the source file, which the pipeline's reader adds); ``drop``
    drops the row; ``mean`` keeps it as NaN, for training to fill in with the training split's mean."""
    if not len(batch[columns[0]]):
        values = np.empty((0, len(columns)), dtype=np.float32)
    elif len(columns) == 1 and batch[columns[0]].dtype == object:  # a list column arrives as an array of arrays
        rows = [floats(np.asarray(row)) if row is not None else None for row in batch[columns[0]]]
        width = next((len(row) for row in rows if row is not None), 0)  # a missing list: a row of NaN
        values = np.stack([row if row is not None else np.full(width, np.nan, np.float32) for row in rows])
    elif len(columns) == 1 and batch[columns[0]].ndim == 2:  # a fixed-size list arrives as (N, F)
        values = batch[columns[0]].astype(np.float32)
    else:
        values = np.stack([floats(batch[column]) for column in columns], axis=1)
    rest = {key: value for key, value in batch.items() if key not in columns}
    bad = ~np.isfinite(values)
    if bad.any():
        if on_missing == "raise":
            row, feature = np.argwhere(bad)[0]
            column = columns[feature] if len(columns) > 1 else columns[0]
            where = _row_in_file(rest[path_column][row], column) if path_column in rest else ""
            shown = column if len(columns) > 1 else f"{column}[{feature}]"
            raise ValueError(
                f"stack_features: column {shown!r}{where} is missing, NaN or infinite ({bad.any(axis=1).sum()} such "
                "row(s) in this batch); drop such rows with source.on_missing: drop, or fill in the training "
                "mean with source.on_missing: mean."
            )
        if on_missing == "drop":
            keep = ~bad.any(axis=1)
            log.warning("stack_features: dropped %d row(s) holding a missing, NaN or infinite value", (~keep).sum())
            rest, values = {key: value[keep] for key, value in rest.items()}, values[keep]
        else:
            values[bad] = np.nan
    return {**rest, output: values}


def floats(values: np.ndarray) -> np.ndarray:
    """A column of numbers as float32: nulls (a column with nulls may arrive as objects holding None) and
    values beyond float32's range become NaN and infinity, which :func:`stack_features` then finds."""
    if values.dtype == object:
        values = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
    with np.errstate(over="ignore"):
        return values.astype(np.float32)


def _row_in_file(path: str, column: str) -> str:
    """`` row R of FILE``: the first row of a local parquet file whose ``column`` holds a value that is not a
    finite number; `` in FILE`` where the file cannot be read here (a remote one)."""
    try:
        values = pq.read_table(path, columns=[column]).column(column).to_numpy(zero_copy_only=False)
    except (OSError, ValueError):
        return f" in {path}"
    rows = [i for i, v in enumerate(values) if v is None or not np.all(np.isfinite(floats(np.asarray(v))))]
    return f" row {rows[0]} of {path}" if rows else f" in {path}"
