"""Source stage: find the parquet files of each split, check them on the driver, read them lazily.

Splits are local paths or ``s3://`` URIs. Checks read only parquet footers, so a missing path,
bucket or column fails in milliseconds (an unreachable endpoint within its timeouts), before Ray
starts a worker.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.common.errors import PipelineError
from pipeline.config import Layout, SourceConfig, check_target
from pipeline.runtime.filesystems import is_s3, locate, s3_error

SPLITS = ("train", "valid")


@dataclass(kw_only=True)
class Split:
    """One split's parquet files, row count (capped by ``source.limit``) and the filesystem they are on,
    and, as a job reads it, what the model takes of its rows and the transform steps they go through
    (set by :func:`pipeline.jobs.preflight.sources`, or predict)."""

    uri: str  # as the config names it
    files: list[str]
    rows: int
    filesystem: pafs.FileSystem
    schema: pa.Schema  # the last file's (every file has the required columns)
    digest: str  # of the file list and footers: changes when the data does
    layout: Layout | None = None
    steps: dict[str, dict] = field(default_factory=dict)  # its transform steps, those set to null left out

    @property
    def tabular(self) -> bool:
        """Whether the features are numbers to stack into one vector per row (several columns, or a list column)."""
        return self.layout.stacked or self.vector_column(self.layout.inputs[0])

    @property
    def local(self) -> bool:
        return isinstance(self.filesystem, pafs.LocalFileSystem)

    @property
    def columns(self) -> list[str]:
        return self.schema.names

    def vector_column(self, name: str) -> bool:
        """Whether column ``name`` holds a list or array of numbers per row (a table's features)."""
        kind = self.schema.field(name).type
        return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def parquet_files(fs: pafs.FileSystem, path: str) -> list[str]:
    """The parquet files a split path names: a file, a directory or prefix (searched recursively),
    or, for local paths, a glob."""
    if isinstance(fs, pafs.LocalFileSystem) and glob.has_magic(path):
        return sorted(os.path.abspath(f) for f in glob.glob(path, recursive=True) if os.path.isfile(f))
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return [path]
    if info.type != pafs.FileType.Directory:
        return []
    found = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    return sorted(f.path for f in found if f.type == pafs.FileType.File and f.path.endswith(".parquet"))


def _missing(key: str, uri: str, fs: pafs.FileSystem, path: str) -> PipelineError:
    if is_s3(uri):
        bucket = path.split("/", 1)[0]
        if fs.get_file_info(bucket).type == pafs.FileType.NotFound:
            return PipelineError(
                f"{key}: the bucket {bucket!r} of {uri} does not exist (or is not "
                "visible with these credentials). Check the bucket name and source.s3.endpoint_url."
            )
        return PipelineError(
            f"{key}: no parquet files under {uri}. Check the prefix (source.root / {key}); files must end in .parquet."
        )
    return PipelineError(
        f"{key}: no parquet files at {uri!r} (resolved to {path!r}). "
        "Set PIPELINE_DATA_DIR to the directory that holds the data (for CIFAR-10 it must contain "
        f"cifar10/train and cifar10/test), or set source.root / {key} to a directory, file, glob or s3:// URI."
    )


def check_split(
    key: str,
    uri: str,
    fs: pafs.FileSystem,
    path: str,
    *,
    columns: list[str],
    num_classes: int | None = None,
    classes: list[str] | None = None,
) -> Split:
    """Find the files ``uri`` names (``path`` on ``fs``, from :func:`pipeline.runtime.filesystems.locate`) and count
    their rows from the footers, or fail naming the config key (``source.train``), the path, file or column.
    With ``num_classes``, the last of ``columns`` holds class labels, which must lie in ``[0, num_classes)``
    (checked from the footers' statistics where the files have them, else by reading that one column), or,
    with ``classes``, be one of those names."""
    try:
        files = parquet_files(fs, path)
        if not files:
            raise _missing(key, uri, fs, path)
    except OSError as err:
        if is_s3(uri):
            raise s3_error(key, uri, err) from err
        raise PipelineError(f"{key}: cannot list {path} ({err}).") from err
    rows, digest = 0, hashlib.sha256()
    for file in files:
        try:
            footer = pq.ParquetFile(file, filesystem=fs)  # one footer read (one request on S3)
            schema, rows = footer.schema_arrow, rows + footer.metadata.num_rows
        except (pa.ArrowInvalid, OSError) as err:
            raise PipelineError(f"{key}: {file} is not a readable parquet file ({err}).") from err
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise PipelineError(
                f"{key}: {file} has no column {', '.join(map(repr, missing))} "
                f"(it has {', '.join(schema.names)}). Set source.feature_column / source.label_column."
            )
        if classes is not None:
            check_names(key, file, footer, columns[-1], classes)
        elif num_classes is not None:
            check_labels(key, file, footer, columns[-1], num_classes)
        digest.update(json.dumps([file, footer.metadata.to_dict()], sort_keys=True, default=str).encode())
    return Split(uri=uri, files=files, rows=rows, filesystem=fs, schema=schema, digest=digest.hexdigest()[:16])


def check_names(key: str, file: str, footer: pq.ParquetFile, label: str, classes: list[str]) -> None:
    """Class-name labels that are all among ``classes`` (the training split's), or an error naming the first
    that is not, its file and row."""
    kind = footer.schema_arrow.field(label).type
    if not is_names(kind):
        raise PipelineError(
            f"{key}: {file} column {label!r} holds {kind}, but the classes are names ({', '.join(classes[:5])}, ...); "
            "every split's labels must be the same kind."
        )
    values = footer.read(columns=[label]).column(label).cast(pa.string()).to_pylist()
    known = set(classes)
    bad = [row for row, value in enumerate(values) if value not in known]
    if bad:
        raise PipelineError(
            f"{key}: {file} row {bad[0]} has label {values[bad[0]]!r} in column {label!r}, which is not one of the "
            f"{len(classes)} classes of the training split ({', '.join(classes[:20])}); {len(bad)} such row(s) in this "
            "file. Fix or drop those rows, or set source.classes to every class name."
        )


def check_labels(key: str, file: str, footer: pq.ParquetFile, label: str, num_classes: int) -> None:
    """Class labels in ``[0, num_classes)``: the footers' min/max statistics answer without reading data;
    a file without them, or with a label out of range, has its label column read to name the row."""
    kind = footer.schema_arrow.field(label).type
    if not pa.types.is_integer(kind):
        raise PipelineError(
            f"{key}: {file} column {label!r} holds {kind}, not integer class labels; a classification task "
            "needs labels 0..source.num_classes-1 (numbers to predict: task=regression source.num_classes=null)."
        )
    meta = footer.metadata  # statistics are per leaf column: a struct column has several
    index = next(j for j in range(meta.num_columns) if meta.schema.column(j).path == label)
    stats = [meta.row_group(g).column(index).statistics for g in range(meta.num_row_groups)]
    known = all(s is not None and s.has_min_max and s.null_count == 0 for s in stats)
    if known and all(s.min >= 0 and s.max < num_classes for s in stats):
        return
    values = footer.read(columns=[label]).column(label).to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(np.isnan(values.astype(float)) | (values < 0) | (values >= num_classes))
    if len(bad):
        raise PipelineError(
            f"{key}: {file} row {bad[0]} has label {values[bad[0]]} in column {label!r}, outside [0, {num_classes}) "
            f"({len(bad)} such row(s) in this file). Set source.num_classes to the number of classes (labels "
            "must run from 0 to num_classes-1), or fix the labels."
        )


def is_names(kind: pa.DataType) -> bool:
    """Whether a label column of this type holds class names (strings, or a dictionary of them)."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def class_names(source: SourceConfig) -> list[str] | None:
    """The classes of a classification whose labels are names: the training split's distinct labels,
    sorted. None when its labels are numbers, or when its files cannot be read (the source checks then
    say why)."""
    fs, path = locate(source.train, source.s3, "source.train")
    try:
        files = parquet_files(fs, path)
        if not files or not is_names(pq.read_schema(files[0], filesystem=fs).field(source.label_column).type):
            return None
        labels = pq.read_table(files, filesystem=fs, columns=[source.label_column]).column(0)
    except (OSError, KeyError, pa.ArrowException):
        return None
    return sorted(str(name) for name in pc.unique(labels.cast(pa.string())).to_pylist() if name is not None)


def with_classes(cfg) -> None:
    """Class names as labels, before the config is resolved (models take ``${source.num_classes}``):
    ``source.classes`` found in the training split when unset, and ``source.num_classes`` from them when
    null. ``cfg``: the composed DictConfig, changed in place."""
    from omegaconf import OmegaConf

    if cfg.task.type != "classification":
        return
    if cfg.source.classes is None:
        names = class_names(OmegaConf.to_object(cfg.source))
        if names is None:
            return
        cfg.source.classes = names
    count = len(cfg.source.classes)
    if cfg.source.num_classes is None:
        cfg.source.num_classes = count
    elif cfg.source.num_classes != count:
        raise PipelineError(
            f"source.num_classes is {cfg.source.num_classes}, but the labels are names of {count} classes "
            f"({', '.join(cfg.source.classes)}). Leave source.num_classes out (null); it is their count."
        )


def labels(split: Split) -> np.ndarray:
    """The split's label column, its first ``split.rows`` rows in file order (``source.limit``, as read)."""
    table = pq.read_table(split.files, filesystem=split.filesystem, columns=[split.layout.label])
    return table.column(split.layout.label).slice(0, split.rows).to_numpy()


def prepare(source: SourceConfig) -> dict[str, Split]:
    """Resolve and check every split, downloading the data first when it is local, missing and allowed.

    Row counts come back already capped by ``source.limit``, each split with its :class:`Layout`.
    """
    layout = Layout.of(source)
    places = {split: locate(getattr(source, split), source.s3, f"source.{split}") for split in SPLITS}
    downloadable = source.download is not None and not any(is_s3(getattr(source, s)) for s in SPLITS)
    if downloadable and not all(parquet_files(*place) for place in places.values()):
        from hydra.utils import instantiate

        check_target(source.download, "source.download", runtime_args=("root",))
        download = instantiate(source.download, _partial_=True)  # called here so its errors stay ours
        download(root=source.root)
    columns, num_classes, classes = [*layout.inputs, layout.label], source.num_classes, source.classes
    checked = {
        split: check_split(
            f"source.{split}",
            getattr(source, split),
            *places[split],
            columns=columns,
            num_classes=num_classes,
            classes=classes,
        )
        for split in SPLITS
    }
    limit = source.limit
    for split in checked.values():
        split.rows = split.rows if limit is None else min(split.rows, limit)
        split.layout = layout
    return checked


def read(split: Split, columns: list[str], source: SourceConfig, placement: dict | None = None):
    """A lazy Ray Dataset over the split's files (nothing is read until a worker iterates); each row
    also carries its file in ``path``, so a transform can name the file of a bad row. ``placement``:
    Ray options (custom resources, node labels) for the read tasks. ``source.limit`` caps the rows.

    ``source.task_per_file``: one read task per file, its rows never split into more blocks than
    files, so Ray Data can fuse the read with transforms that take whole blocks (faster:
    docs/performance.md); off, Ray splits them, for clusters with far more CPUs than files."""
    import ray.data

    ray.data.DataContext.get_current().use_datasource_v2 = source.reader_v2
    blocks = len(split.files) if source.task_per_file else None
    ds = ray.data.read_parquet(
        split.files,
        filesystem=split.filesystem,
        columns=columns,
        include_paths=True,
        override_num_blocks=blocks,
        **(placement or {}),
    )
    return ds if source.limit is None else ds.limit(source.limit)
