"""Checkpoints that do not stall training: a run whose checkpoint is a few hundred MB, stored on S3 (moto, on
loopback), with ``train.checkpoint_upload=sync`` (each epoch waits for its upload) and ``async`` (the next epoch
trains while Ray Train uploads), side by side; and ``async`` with checkpoints within the epoch every 6 s
(``train.checkpoint_every="0.1 min"``), so the cost of one, against the default's 10 minutes, is measured.

The model: the wine MLP widened to three hidden layers of 4096 (33.6 M parameters: 134 MB of weights, 403 MB of
checkpoint with AdamW's two moments). Figures per epoch from the run's MLflow record: ``checkpoint_stall_s``
(how long the previous epoch's checkpoint held training up), samples/s; and the command's wall time.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python bench/checkpoint.py

Takes about 5 minutes on 2 cores. Prints a table and writes outputs/bench/checkpoint.json.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs
from report import last_run, metric_history, pipeline_run, table, write

WIDE = [
    "+experiment=wine_mlp",
    "model.hidden_channels=[4096,4096,4096,3]",
    "train.epochs=4",
    "ingest.batch_size=8",
    "tracking.log_model=false",  # the logged models would download every checkpoint back after training
]
ARMS = {  # name: train.checkpoint_upload, train.checkpoint_every
    "sync": ("sync", "null"),
    "async": ("async", "null"),
    "async, every 0.1 min": ("async", "'0.1 min'"),
}
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def stalls(outputs: Path) -> list[float]:
    stalled = metric_history(*last_run(outputs), "checkpoint_stall_s")
    return [round(value, 2) for value in stalled[1:]]  # epoch 1 has no checkpoint before it


@contextlib.contextmanager
def moto_s3(bucket: str = "runs") -> Iterator[pafs.S3FileSystem]:
    """An S3-compatible server (moto) on loopback with ``bucket``, for this process and the commands it starts
    (``AWS_ENDPOINT_URL`` and credentials in the environment); its filesystem."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint)
    pafs.S3FileSystem(endpoint_override=endpoint, allow_bucket_creation=True).create_dir(bucket)
    try:
        yield pafs.S3FileSystem(endpoint_override=endpoint)
    finally:
        server.stop()


def main() -> None:
    figures = {}
    with moto_s3() as fs, tempfile.TemporaryDirectory() as workdir:
        os.environ.setdefault("PIPELINE_DATA_DIR", str(Path(workdir) / "data"))  # wine is written there
        for arm, (mode, every) in ARMS.items():
            outputs = Path(workdir) / f"arm{len(figures)}"
            args = [*WIDE, f"train.checkpoint_upload={mode}", f"train.checkpoint_every={every}"]
            run = pipeline_run([*args, f"storage.path=s3://runs/{mode}"], outputs, log=Path(workdir) / "log")
            figures[arm] = {
                "checkpoint_stall_s": stalls(outputs),
                "samples_s": run["samples_s"],
                "wall_s": run["wall_s"],
                "step_checkpoints": len(metric_history(*last_run(outputs), "checkpoint_step")),
            }
        sizes = [i.size for i in fs.get_file_info(pafs.FileSelector("runs/async", recursive=True)) if i.is_file]
        figures["checkpoint_mb"] = round(max(sizes) / 1e6)
    rows = [
        (mode, f["checkpoint_stall_s"], f["samples_s"], f["step_checkpoints"], f["wall_s"])
        for mode, f in figures.items()
        if mode != "checkpoint_mb"
    ]
    print(f"checkpoint: {figures['checkpoint_mb']} MB to S3 (moto, loopback)")
    columns = ("train.checkpoint_upload", "stall s (epochs 2..)", "samples/s", "within epochs", "wall s")
    print(table(rows, columns))
    write("checkpoint", figures)


if __name__ == "__main__":
    main()
