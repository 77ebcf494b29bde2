"""What ``train.profile`` costs, and what off costs: ``+experiment=smoke`` (one worker, the driver's process) for three
epochs, profiling epoch 2's steps 6-10 (the defaults: 3 waited, 2 warmed up, 5 recorded) against the same run with
profiling off, interleaved over several repeats: samples/s of the profiled epoch and of the others, the whole
command's seconds and CPU-seconds per 1,000 samples, and the trace's size.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data python bench/profiling.py [--repeats 3]

About 3 minutes on 2 cores with three repeats. Prints a table and writes outputs/bench/profiling.json.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from report import data_dir, pipeline_run, spread, table, write

RUN = ["+experiment=smoke", "train.epochs=3", "ingest.cache=false", "tracking.log_model=false"]
ARMS = {"off": [], "on, epoch 2": ["train.profile.enabled=true", "train.profile.epoch=2"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    data_dir()
    runs = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as workdir:
        for repeat in range(args.repeats):
            for arm, extra in ARMS.items():
                outputs = Path(workdir) / f"run{repeat}-{arm.split(',')[0]}"
                run = pipeline_run([*RUN, *extra], outputs)
                traces = list(outputs.glob("mlartifacts/*/artifacts/profile/trace_epoch2.json"))
                runs[arm].append(
                    {
                        "samples_s": run["samples_s"],
                        "wall_s": run["wall_s"],
                        "cpu_per_1k": run["cpu"]["per_1k"],
                        "trace_mb": round(traces[0].stat().st_size / 1e6, 1) if traces else None,
                    }
                )
    figures = {
        arm: {
            "runs": arm_runs,
            "epoch2_samples_s": spread([r["samples_s"][1] for r in arm_runs], 0),
            "epoch3_samples_s": spread([r["samples_s"][2] for r in arm_runs], 0),
            "wall_s": spread([r["wall_s"] for r in arm_runs], 1),
            "cpu_per_1k": spread([r["cpu_per_1k"] for r in arm_runs], 3),
        }
        for arm, arm_runs in runs.items()
    }
    off = figures["off"]

    def against_off(f: dict, key: str, digits: int = 0) -> str:
        return f"{f[key]['mean']:.{digits}f} ({f[key]['mean'] / off[key]['mean']:.2f}x)"

    rows = [
        (
            arm,
            against_off(f, "epoch2_samples_s"),
            against_off(f, "epoch3_samples_s"),
            against_off(f, "wall_s", 1),
            f["cpu_per_1k"]["mean"],
            runs[arm][0]["trace_mb"],
        )
        for arm, f in figures.items()
    ]
    header = ("profile", "epoch 2 samples/s", "epoch 3 samples/s", "wall s", "CPU-s per 1k", "trace MB")
    print(table(rows, header))
    write("profiling", {"run": RUN, "repeats": args.repeats, "arms": figures})


if __name__ == "__main__":
    main()
