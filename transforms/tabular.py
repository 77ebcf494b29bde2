"""Transforms for tables of numbers: numeric columns in, one float32 (N, F) feature array out."""

from __future__ import annotations

import numpy as np

Batch = dict[str, np.ndarray]


def stack_features(batch: Batch, columns: list[str], output: str = "features") -> Batch:
    """Stack ``columns`` into one float32 array ``output`` of shape (N, F): several numeric columns side by
    side, or one column that holds a list or array of numbers per row (lists must share a length).
    The input columns are dropped; the others pass through."""
    if not len(batch[columns[0]]):
        values = np.empty((0, len(columns)), dtype=np.float32)
    elif len(columns) == 1 and batch[columns[0]].dtype == object:  # a list column arrives as an array of arrays
        values = np.stack([np.asarray(row, dtype=np.float32) for row in batch[columns[0]]])
    elif len(columns) == 1 and batch[columns[0]].ndim == 2:  # a fixed-size list arrives as (N, F)
        values = batch[columns[0]].astype(np.float32)
    else:
        values = np.stack([batch[column].astype(np.float32) for column in columns], axis=1)
    rest = {key: value for key, value in batch.items() if key not in columns}
    return {**rest, output: values}
