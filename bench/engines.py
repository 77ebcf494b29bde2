"""Ray Data's route against the pieces engine on one node, side by side in one run: the ``streamed`` photo set of
``bench/ingest.py`` (40,000 real-size photos, read and decoded every epoch), per seed the pipeline with
``ingest.engine=ray_data``, then with ``ingest.engine=pieces``, then the plain loop with the same steps, one command
after another. Per epoch: samples/s; per command: CPU-seconds per 1,000 samples (every process), seconds to the
first step and to the last validation; val_accuracy.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data python bench/engines.py [--seeds 0,1]

Writes outputs/bench/engines.json. The engine is gone after this comparison (docs/architecture.md has the figures and
the commit they were taken at).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ingest import BENCH, COMMON, SAME_STEPS, SETS
from report import data_dir, pipeline_run, plain_run, table, write

ENGINES = ("ray_data", "pieces")


def main(seeds: list[int], name: str, extra: list[str]) -> dict:
    from pipeline.api import compose
    from pipeline.data import source

    data_dir()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            overrides = [*COMMON, *SETS[name]["overrides"], f"train.seed={seed}", *extra]
            searchpath = f"hydra.searchpath=[file://{BENCH / 'conf'}]"
            source.prepare(compose([*overrides, searchpath]).source)
            run = {}
            for engine in ENGINES:
                args = ["--config-dir", str(BENCH / "conf"), *overrides, f"ingest.engine={engine}"]
                run[engine] = pipeline_run(args, Path(tmp) / f"{seed}-{engine}")
            run["plain"] = plain_run(*SAME_STEPS, [*overrides, searchpath])
            runs.append(run)
            print(seed, {side: (got["samples_s"], got["cpu"]["per_1k"]) for side, got in run.items()}, flush=True)
    rows = []
    for seed, run in zip(seeds, runs):
        plain = run["plain"]
        for side, got in run.items():
            ratios = " / ".join(f"{a / b:.2f}x" for a, b in zip(got["samples_s"], plain["samples_s"]))
            rows.append(
                (
                    f"seed {seed}: {side}",
                    " / ".join(f"{r:,}" for r in got["samples_s"]),
                    ratios,
                    f"{got['cpu']['per_1k']:.2f} ({got['cpu']['per_1k'] / plain['cpu']['per_1k']:.2f}x)",
                    f"{got['startup_s']:.1f}",
                    f"{got['to_validation_s']:.1f}",
                    f"{got['val_accuracy'][-1]:.3f}",
                )
            )
    header = ("run", "samples/s per epoch", "/ plain", "CPU-s per 1,000", "first step s", "to last val s", "val acc")
    print(table(rows, header))
    write("engines", {"set": name, "runs": runs})
    return {"runs": runs}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Ray Data's route against the pieces engine, one node.")
    parser.add_argument("--seeds", default="0", help="comma-separated train.seed values")
    parser.add_argument("--set", default="streamed", help=f"one of {', '.join(SETS)}")
    arguments, rest = parser.parse_known_args()
    main([int(s) for s in arguments.seeds.split(",")], arguments.set, rest)
