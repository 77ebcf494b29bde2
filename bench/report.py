"""What every benchmark records beside its figures: the machine, the versions and the commit."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from importlib.metadata import version
from pathlib import Path

OUT_DIR = Path("outputs/bench")
PACKAGES = ("ray", "torch", "torchvision", "pyarrow", "hydra-core", "mlflow")


def data_dir() -> str:
    """The real data (``PIPELINE_DATA_DIR``, default ../shared/data), as an absolute path for every process."""
    path = str(Path(os.environ.get("PIPELINE_DATA_DIR", "../shared/data")).resolve())
    os.environ["PIPELINE_DATA_DIR"] = path
    return path


def write(name: str, figures: dict) -> Path:
    """Write ``outputs/bench/<name>.json`` and return its path."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "figures": figures,
        "commit": commit,
        "versions": {p: version(p) for p in PACKAGES},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor()},
    }
    out = OUT_DIR / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return out


def table(rows: list[tuple], header: tuple) -> str:
    """A plain text table: the first column left-aligned, the others right-aligned."""
    cells = [tuple(str(c) for c in row) for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells
    )
