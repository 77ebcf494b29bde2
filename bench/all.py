"""Every benchmark, one after another (never beside tests or each other: they share two cores).

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data python bench/all.py

About 55 minutes on 2 cores (ingest.py, three seeds of four sets: about 30); each script prints its
table and writes outputs/bench/<name>.json.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPTS = ("ingest.py", "train.py", "startup.py", "step.py", "sweep_overhead.py", "tune_sweep.py")

if __name__ == "__main__":
    for script in SCRIPTS:
        print(f"\n== bench/{script}", flush=True)
        subprocess.run([sys.executable, str(Path(__file__).with_name(script))], check=True)
