"""The source stage's driver-side checks: they must fail fast and name the path, file or column."""

from __future__ import annotations

import dataclasses

import pyarrow.fs as pafs
import pytest
from conftest import compose_cfg, write_split

from pipeline.common.errors import PipelineError
from pipeline.config import SourceConfig
from pipeline.data.source import check_split, parquet_files, prepare

LOCAL = pafs.LocalFileSystem()
COLUMNS = ["image", "label"]


def source_cfg(root, *overrides: str) -> SourceConfig:
    return compose_cfg([f"source.root={root}", "source.download=null", *overrides]).source


def test_directory_glob_and_file_name_the_same_files(data_root):
    directory = parquet_files(LOCAL, str(data_root / "cifar10" / "train"))
    assert len(directory) == 2
    assert parquet_files(LOCAL, str(data_root / "cifar10" / "train" / "*.parquet")) == directory
    assert parquet_files(LOCAL, directory[0]) == directory[:1]


def test_prepare_counts_rows_and_applies_the_limit(data_root):
    assert {s: split.rows for s, split in prepare(source_cfg(data_root)).items()} == {"train": 512, "valid": 256}
    limited = prepare(source_cfg(data_root, "source.limit=300"))
    assert {s: split.rows for s, split in limited.items()} == {"train": 300, "valid": 256}


def test_missing_path_says_how_to_point_at_data(tmp_path):
    with pytest.raises(PipelineError, match=r"source.train: no parquet files at .*nowhere.*PIPELINE_DATA_DIR"):
        check_split("source.train", str(tmp_path / "nowhere"), LOCAL, str(tmp_path / "nowhere"), columns=COLUMNS)


def test_missing_column_names_file_and_column(tmp_path):
    write_split(tmp_path / "train", 8, 1, seed=0, columns=("image",))
    with pytest.raises(PipelineError, match=r"part-00000.parquet has no column 'label' \(it has image\)"):
        check_split("source.train", str(tmp_path / "train"), LOCAL, str(tmp_path / "train"), columns=COLUMNS)


def test_corrupt_parquet_names_the_file(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(PipelineError, match=r"bad.parquet is not a readable parquet file"):
        check_split("source.valid", str(tmp_path), LOCAL, str(tmp_path), columns=COLUMNS)


def test_truncated_parquet_names_the_file(tmp_path):
    write_split(tmp_path / "valid", 32, 1, seed=0)
    path = tmp_path / "valid" / "part-00000.parquet"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(PipelineError, match=r"source.valid: .*valid/part-00000.parquet is not a readable parquet file"):
        check_split("source.valid", str(tmp_path / "valid"), LOCAL, str(tmp_path / "valid"), columns=COLUMNS)


def test_offline_download_fails_with_a_clear_message(tmp_path):
    """Port 9 on loopback refuses at once: the same path as a machine without internet."""
    download = {
        "_target_": "pipeline.data.datasets.download_cifar10",
        "url": "http://127.0.0.1:9/cifar-10-python.tar.gz",
    }
    with pytest.raises(PipelineError, match=r"CIFAR-10 is not at .*downloading it .* failed.*PIPELINE_DATA_DIR"):
        prepare(dataclasses.replace(source_cfg(tmp_path), download=download))
