"""What ``train.ema`` buys on the quick start: ``cifar_vit_cpu`` (2 epochs of CIFAR-10 on 2 cores) with the averaged
weights validated beside the trained ones in the same run, over several seeds; the averages' final val_accuracy
(``val_accuracy``, ``train.ema_model`` being on) against the trained weights' (``raw_val_accuracy``), and the cost in
samples/s against a run without EMA (seed 0).

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data python bench/ema.py [--decay 0.999] [--seeds 3]

About 7 minutes a run on 2 cores. Prints a table and writes outputs/bench/ema.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from report import data_dir, last_run, metric_history, pipeline_run, table, write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decay", type=float, default=0.999)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    data_dir()
    runs = {}
    with tempfile.TemporaryDirectory() as workdir:
        arms = [(f"ema {args.decay}, seed {seed}", seed, [f"train.ema={args.decay}"]) for seed in range(args.seeds)]
        for name, seed, extra in [*arms, ("no ema, seed 0", 0, [])]:
            outputs = Path(workdir) / f"run{len(runs)}"
            run = pipeline_run(["+experiment=cifar_vit_cpu", f"train.seed={seed}", *extra], outputs)
            client, record = last_run(outputs)
            raw = metric_history(client, record, "raw_val_accuracy")
            runs[name] = {
                "val_accuracy": run["val_accuracy"][-1],  # the averages', with train.ema
                "raw_val_accuracy": round(raw[-1], 4) if raw else None,
                "samples_s": run["samples_s"],
                "wall_s": run["wall_s"],
            }
    with_ema = [r for name, r in runs.items() if name.startswith("ema")]
    figures = {
        "decay": args.decay,
        "runs": runs,
        "mean_ema_val_accuracy": round(statistics.mean(r["val_accuracy"] for r in with_ema), 4),
        "mean_raw_val_accuracy": round(statistics.mean(r["raw_val_accuracy"] for r in with_ema), 4),
    }
    rows = [(n, r["val_accuracy"], r["raw_val_accuracy"], r["samples_s"], r["wall_s"]) for n, r in runs.items()]
    print(table(rows, ("run", "val_accuracy (EMA)", "raw_val_accuracy", "samples/s", "wall s")))
    print(f"mean over seeds: EMA {figures['mean_ema_val_accuracy']}, raw {figures['mean_raw_val_accuracy']}")
    write("ema", figures)


if __name__ == "__main__":
    main()
