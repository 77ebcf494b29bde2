"""Every figure the README shows, taken again by one command, one benchmark after another (never beside tests or
each other: they share the cores), and written where the docs read them:

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PIPELINE_DATA_DIR=../shared/data python bench/all.py --quick

- ``--quick`` (about 100 minutes on 2 cores): the README's figures, each over 3 seeds: the quick start's training
  (``train.py``), the ingest-bound sets (``ingest.py``), the feed alone (``feed.py``), the start-up
  (``startup.py``), and on a machine with a GPU the GPU rows (``gpu.py``; without one, the last GPU record stays);
- ``--full``: the same, then every other benchmark, each report kept in docs/records/ (docs/performance.md quotes
  them);
- ``--keep NAME [NAME ...]``: only keeps the reports of benchmarks run by hand (``outputs/bench/NAME.json``, with
  their command, date, machine and commit) in docs/records/;
- ``--render``: only writes docs/figures.md and the README's table again from docs/figures.json.

Writes docs/figures.json (every run's figures, with the date, machine, versions and commit), docs/figures.md
(every comparison in full) and the README's table between its ``figures`` markers.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from report import COMPARISON_HEADER, OUT_DIR, comparison_cells, span, spread

ROOT = Path(__file__).resolve().parent.parent
FIGURES, PAGE, README = ROOT / "docs" / "figures.json", ROOT / "docs" / "figures.md", ROOT / "README.md"
RECORDS = ROOT / "docs" / "records"  # the other benchmarks' newest reports, each as the bench wrote it
QUICK = ("feed.py", "train.py", "ingest.py", "startup.py")
REST = (
    "step.py",
    "sweep_overhead.py",
    "tune_sweep.py",
    "shuffle.py",
    "cluster.py",
    "checkpoint.py",
    "notice.py",
    "levers.py",
    "preemption.py",
    "micro_batch.py",
    "profiling.py",
)
MARKERS = ("<!-- figures: written by bench/all.py from docs/figures.json -->", "<!-- /figures -->")
EARLIER_GPU = (
    "No GPU has run these baselines yet. The earlier H100 figures (docs/performance.md#on-a-gpu) were taken with "
    "torch 2.11 against a plain loop that normalized to float32 on the CPU without pinned memory: read them as that."
)


def run(scripts: tuple[str, ...], gpu: bool) -> None:
    """Each benchmark in turn; ``gpu.py`` too where there is a GPU."""
    for script in (*scripts, "gpu.py") if gpu else scripts:
        print(f"\n== bench/{script}", flush=True)
        subprocess.run([sys.executable, str(Path(__file__).with_name(script))], check=True, cwd=ROOT)


def collect(names: list[str], earlier: dict) -> dict:
    """The benchmarks' reports (outputs/bench/<name>.json) as one record; a bench not run this time (the GPU's, on
    a machine without one) keeps its earlier report, which names its own date, machine and commit."""
    kept = {name: report for name, report in earlier.get("benches", {}).items() if name not in names}
    fresh = {n: json.loads((OUT_DIR / f"{n}.json").read_text()) for n in names}
    return {"command": "python bench/all.py --quick", "benches": {**fresh, **kept}}


def taken(reports: list[dict]) -> str:
    """When, on what and from which commit ``reports`` were taken."""
    first, last = min(r["taken"] for r in reports), max(r["taken"] for r in reports)
    setups = set()
    for report in reports:
        machine, versions = report["machine"], report["versions"]
        changed = report["uncommitted_changes"]
        dirty = f" with uncommitted changes to {', '.join(changed)}" if changed else ""
        by = "" if by_all(report) else f"`{report['command']}` on "
        setups.add(
            f"{by}{machine['cpus']} cores, {machine['memory_gib']} GiB, {machine['gpu'] or 'no GPU'}; commit "
            f"{report['commit']}{dirty}; ray {versions['ray']}, torch {versions['torch']}"
        )
    return f"{first if first == last else f'{first} to {last}'}; {'; '.join(sorted(setups))}"


def keep(names: list[str]) -> None:
    """The benchmarks' reports (outputs/bench/<name>.json) copied into docs/records/, where the repo keeps them."""
    RECORDS.mkdir(exist_ok=True)
    for name in names:
        (RECORDS / f"{name}.json").write_text((OUT_DIR / f"{name}.json").read_text())
        print(f"kept {RECORDS / name}.json")


def by_all(report: dict) -> bool:
    """Whether ``report`` was taken by this script: its bench run as it runs them, with no arguments."""
    command = shlex.split(report.get("command", "python bench/all.py"))
    return len(command) == 2 and Path(command[1]).parent.name == "bench"


def startup_line(report: dict) -> str:
    """The start-up against the plain loop and Ray's floors, as a sentence (an older record: the floor only)."""
    figures = report["figures"]
    ours, floor = spread(figures["pipeline_startup_s"], 1), spread(figures["floor_startup_s"], 1)
    line = f"From the command to the first training step, `+experiment=smoke` takes {span(ours, ' s', 1)}"
    if "pipeline_two_workers_startup_s" in figures:  # one worker in the driver's process, and the experiment's two
        two = spread(figures["pipeline_two_workers_startup_s"], 1)
        line += f" on one worker (in the driver's process, Ray Train's local mode) and {span(two, ' s', 1)} on two"
    line += f", Ray Train + Ray Data alone in a worker group of two (`bench/floor.py`) {span(floor, ' s', 1)}"
    if "plain_startup_s" not in figures:
        ratio = spread([p / f for p, f in zip(figures["pipeline_startup_s"], figures["floor_startup_s"])])
        return f"{line}: {span(ratio, 'x')} as long ({ours['runs']} interleaved pairs)."
    plain, local = spread(figures["plain_startup_s"], 1), spread(figures["local_mode_floor_startup_s"], 1)
    after = spread(figures["after_plain_s"], 1)
    return (
        f"{line}, in Ray Train's local mode {span(local, ' s', 1)}; the plain loop on the same rows and model "
        f"{span(plain, ' s', 1)}: the pipeline's first step on one worker came {span(after, ' s', 1)} after the loop's "
        f"({ours['runs']} interleaved rounds). Its phases, mean s from the command: "
        + ", ".join(f"{phase.replace('_', ' ')} {s}" for phase, s in figures["phases_mean"].items())
        + "."
    )


def markdown(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    lines = [header, tuple("---" for _ in header), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def readme_table(record: dict) -> str:
    """The README's figures: every comparison's headline and the start-up, each bench's date and machine."""
    benches = record["benches"]
    rows = [comparison_cells(row) for bench in benches.values() for row in bench["rows"]]
    lines = [
        f"Taken by `{record['command']}`: {taken(list(benches.values()))}. Ranges are over {runs(record)} runs "
        "(seeds); a ratio above 1x is the pipeline ahead. Every run's figures, the data waits and the absolute rates: "
        "[docs/figures.md](docs/figures.md).",
        "",
        markdown(rows, COMPARISON_HEADER),
        "",
        startup_line(benches["startup"]),
    ]
    if "gpu" not in benches:
        lines += ["", EARLIER_GPU]
    return "\n".join(lines)


def runs(record: dict) -> str:
    counts = {e["ratio"]["runs"] for b in record["benches"].values() for row in b["rows"] for e in row["samples_s"]}
    return " - ".join(str(c) for c in sorted(counts))


def detail(row: dict) -> str:
    """One comparison in full: per epoch each side's samples/s and data wait, the whole command, accuracy."""
    epochs = [
        (
            f"epoch {e + 1}",
            span(epoch["pipeline"], digits=0),
            span(epoch["baseline"], digits=0),
            span(epoch["ratio"], "x"),
            f"{span(epoch['data_wait']['pipeline'])} / {span(epoch['data_wait']['baseline'])}",
        )
        for e, epoch in enumerate(row["samples_s"])
    ]
    whole, first, accuracy = row["to_validation_s"], row["startup_s"], row["val_accuracy"]
    first_step = ("command to first training step", span(first["pipeline"], " s", 1), span(first["baseline"], " s", 1))
    epochs.append((*first_step, "", ""))
    epochs.append(
        (
            "command to last validation",
            span(whole["pipeline"], " s", 1),
            span(whole["baseline"], " s", 1),
            span(whole["ratio"], "x") + " (baseline / pipeline)",
            "",
        )
    )
    epochs.append(("val_accuracy", span(accuracy["pipeline"], digits=4), span(accuracy["baseline"], digits=4), "", ""))
    labels = {
        "per_1k": "CPU-seconds per 1,000 samples, whole command (every process)",
        "warm_trainer_per_1k": "CPU-seconds per 1,000 samples, warm epochs: the training process(es)",
        "warm_rest_per_1k": "CPU-seconds per 1,000 samples, warm epochs: every other process (Ray's; the DataLoader's)",
    }
    for figure, cpu in row.get("cpu_per_1k", {}).items():
        cells = (span(cpu["pipeline"], digits=3), span(cpu["baseline"], digits=3), span(cpu["ratio"], "x"))
        epochs.append((labels[figure], *cells, ""))
    header = ("", "pipeline, samples/s", "baseline, samples/s", "pipeline / baseline", "data wait, pipeline / baseline")
    return f"### {row['run']}, against the {row['baseline']} ({row['kind']})\n\n{markdown(epochs, header)}"


def page(record: dict) -> str:
    benches = record["benches"]
    sections = [
        "# Figures\n",
        f"Written by `{record['command']}` (bench/all.py) from docs/figures.json; do not edit by hand. Each "
        "side of a comparison is a command of its own, run one after the other, per seed. The plain loop is "
        "`bench/plain.py`; which baseline a row ran against is in its title. A baseline that holds its data "
        "decoded in memory decodes it before its first epoch, outside the epoch's clock, where the pipeline "
        "decodes while its first epoch trains: epoch 1's ratio is then a cold epoch against a warm one, and the "
        "command's time to its last validation is the fair comparison.\n",
    ]
    for name, bench in benches.items():
        sections.append(f"## bench/{name}.py\n\n{taken([bench])}.\n")
        sections += [detail(row) + "\n" for row in bench["rows"]]
    startup = benches["startup"]["figures"]
    each = ", ".join(f"{key}: {value}" for key, value in startup.items() if key.endswith("_startup_s"))
    sections.append(f"{startup_line(benches['startup'])} Each round's seconds: {each}.\n")
    return "\n".join(sections)


def render(record: dict) -> None:
    """docs/figures.md and the README's table from ``record``."""
    PAGE.write_text(page(record))
    text = README.read_text()
    block = f"{MARKERS[0]}\n{readme_table(record)}\n{MARKERS[1]}"
    pattern = re.escape(MARKERS[0]) + ".*?" + re.escape(MARKERS[1])
    README.write_text(re.sub(pattern, lambda _: block, text, count=1, flags=re.S))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Every README figure, taken again.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quick", action="store_true", help="the README's figures")
    mode.add_argument("--full", action="store_true", help="the README's figures, then every other benchmark")
    mode.add_argument("--render", action="store_true", help="docs/figures.md and the README from docs/figures.json")
    mode.add_argument("--keep", nargs="+", metavar="NAME", help="keep outputs/bench/NAME.json in docs/records/")
    parser.add_argument(
        "--only", nargs="+", choices=QUICK, help="with --quick: these benches; the rest keep their record"
    )
    arguments = parser.parse_args()
    if arguments.keep:
        keep(arguments.keep)
        sys.exit(0)
    if not arguments.render:
        import torch

        gpu = torch.cuda.is_available()
        quick = tuple(arguments.only or QUICK)
        run(quick, gpu)
        earlier = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
        record = collect([s.removesuffix(".py") for s in quick] + ["gpu"] * gpu, earlier)
        FIGURES.write_text(json.dumps(record, indent=1))
        if arguments.full:
            run(REST, gpu=False)
            keep([script.removesuffix(".py") for script in REST])
    render(json.loads(FIGURES.read_text()))
    print(f"wrote {FIGURES}, {PAGE} and the README's table")
