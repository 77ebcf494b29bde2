"""What ``train.micro_batch`` costs and whether it keeps the recipe: ``+experiment=smoke`` on 2 DDP workers, several
seeds of three arms interleaved: the whole batch (DDP's own all-reduce), the batch in parts of 16 rows set by hand,
and ``auto`` where nothing runs out of memory (the whole batch again, its gradients all-reduced by the one
collective that also carries the ranks' out-of-memory flags). Per arm: the final val_accuracy's mean and spread over
seeds, samples/s of the warm epochs, seconds and CPU-seconds per 1,000 samples of the whole command.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data python bench/micro_batch.py [--seeds 3]

About 8 minutes on 2 cores with three seeds. Prints a table and writes outputs/bench/micro_batch.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from report import data_dir, pipeline_run, spread, table, write

RUN = ["+experiment=smoke", "scaling.num_workers=2", "train.epochs=3", "tracking.log_model=false"]
ARMS = {"whole batch": [], "16 rows by hand": ["train.micro_batch=16"], "auto (fits)": ["train.micro_batch=auto"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    data_dir()
    runs = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as workdir:
        for seed in range(args.seeds):
            for arm, extra in ARMS.items():  # interleaved: the machine's drift spreads over every arm
                outputs = Path(workdir) / f"run{seed}-{len(runs[arm])}-{arm.split()[0]}"
                run = pipeline_run([*RUN, f"train.seed={seed}", *extra], outputs)
                runs[arm].append(
                    {
                        "seed": seed,
                        "val_accuracy": run["val_accuracy"][-1],
                        "warm_samples_s": statistics.mean(run["samples_s"][1:]),
                        "wall_s": run["wall_s"],
                        "cpu_per_1k": run["cpu"]["per_1k"],
                    }
                )
    figures = {
        arm: {
            "runs": arm_runs,
            "val_accuracy": spread([r["val_accuracy"] for r in arm_runs], 4),
            "warm_samples_s": spread([r["warm_samples_s"] for r in arm_runs], 0),
            "wall_s": spread([r["wall_s"] for r in arm_runs], 1),
            "cpu_per_1k": spread([r["cpu_per_1k"] for r in arm_runs], 3),
        }
        for arm, arm_runs in runs.items()
    }
    whole = figures["whole batch"]["warm_samples_s"]["mean"]
    rows = [
        (
            arm,
            f"{f['val_accuracy']['mean']} ({f['val_accuracy']['min']}-{f['val_accuracy']['max']})",
            f"{f['warm_samples_s']['mean']:.0f} ({f['warm_samples_s']['mean'] / whole:.2f}x)",
            f["wall_s"]["mean"],
            f["cpu_per_1k"]["mean"],
        )
        for arm, f in figures.items()
    ]
    print(table(rows, ("arm", "val_accuracy mean (min-max)", "warm samples/s", "wall s", "CPU-s per 1k")))
    write("micro_batch", {"run": RUN, "seeds": args.seeds, "arms": figures})


if __name__ == "__main__":
    main()
