"""``python -m pipeline.reshuffle SOURCE TARGET``: a split's parquet rewritten once, its rows in random order and in
small row groups, so that every window of a streamed epoch mixes its labels as a full shuffle does (a split stored
by class streams in windows of a few row groups each: docs/own-data.md, "Data stored by class").

Ray Data's full shuffle (``random_shuffle``: each row moves once, through the object store, which spills to disk
past its size) on the runtime the command starts or joins (``RAY_ADDRESS``: a cluster's nodes share the work).
SOURCE and TARGET are local paths or ``s3://`` URIs (the AWS SDK's credentials, ``AWS_ENDPOINT_URL``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import pyarrow.fs as pafs

from pipeline.common import console
from pipeline.common.errors import PipelineError
from pipeline.config import S3Config
from pipeline.data.source import parquet_files
from pipeline.runtime import cluster, filesystems

log = logging.getLogger("pipeline.reshuffle")


def reshuffle(source: str, target: str, seed: int, rows_per_group: int, rows_per_file: int) -> int:
    """Every row of the parquet at ``source`` written to ``target`` in an order drawn from ``seed``, in files of at
    most ``rows_per_file`` rows and row groups of ``rows_per_group``; the rows written."""
    import ray.data

    s3 = S3Config(endpoint_url=os.environ.get("AWS_ENDPOINT_URL"))
    source_fs, source_path = filesystems.locate(source, s3, "SOURCE")
    target_fs, target_path = filesystems.locate(target, s3, "TARGET")
    files = parquet_files(source_fs, source_path)
    if not files:
        raise PipelineError(f"SOURCE: no parquet files at {source}: name a split's directory, file or s3:// prefix.")
    if target_fs.get_file_info(target_path).type != pafs.FileType.NotFound:
        raise PipelineError(f"TARGET: {target} exists already; name a new directory (nothing is overwritten).")
    cluster.start_ray(os.environ.get("RAY_ADDRESS"), None)
    console.quiet_libraries()
    rows = ray.data.read_parquet(files, filesystem=source_fs).random_shuffle(seed=seed)
    # no min_rows_per_file: Ray 2.60 raises the row groups to it
    rows.write_parquet(
        target_path, filesystem=target_fs, max_rows_per_file=rows_per_file, row_group_size=rows_per_group
    )
    return ray.data.read_parquet(target_path, filesystem=target_fs).count()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.reshuffle", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="the split's parquet: a directory, file or s3:// prefix")
    parser.add_argument("target", help="a new directory or s3:// prefix for the rewritten split")
    parser.add_argument("--seed", type=int, default=0, help="the order's seed (default 0)")
    parser.add_argument("--rows-per-group", type=int, default=500, help="rows per row group (default 500)")
    parser.add_argument("--rows-per-file", type=int, default=10_000, help="rows per file at most (default 10,000)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        rows = reshuffle(args.source, args.target, args.seed, args.rows_per_group, args.rows_per_file)
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    log.info(
        "wrote %s rows to %s in random order, row groups of %s rows", f"{rows:,}", args.target, args.rows_per_group
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
