"""What every benchmark records beside its figures: the machine, the versions and the commit."""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from cpu import Meter
from mlflow import MlflowClient

from pipeline.common import startup

OUT_DIR = Path("outputs/bench")
PACKAGES = ("ray", "torch", "torchvision", "pyarrow", "hydra-core", "mlflow")


def data_dir() -> str:
    """The real data (``PIPELINE_DATA_DIR``, default ../shared/data), as an absolute path for every process."""
    path = str(Path(os.environ.get("PIPELINE_DATA_DIR", "../shared/data")).resolve())
    os.environ["PIPELINE_DATA_DIR"] = path
    return path


def machine() -> dict:
    """The machine a figure was taken on: cores, memory, GPU (none: CPU only), platform."""
    import psutil
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    memory = round(psutil.virtual_memory().total / 2**30)
    return {"cpus": os.cpu_count(), "memory_gib": memory, "gpu": gpu, "platform": platform.platform()}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True).stdout.rstrip("\n")  # status's leading space


def write(name: str, figures: dict, rows: list[dict] | None = None) -> Path:
    """Write ``outputs/bench/<name>.json`` (the figures, the comparisons ``rows`` that docs/figures.md shows, the
    command, date, machine, versions and commit, and the tracked files with uncommitted changes); return its path."""
    report = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "figures": figures,
        "rows": rows or [],
        "taken": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git("rev-parse", "--short", "HEAD"),
        "uncommitted_changes": [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()],
        "versions": {p: version(p) for p in PACKAGES},
        "machine": machine(),
    }
    out = OUT_DIR / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return out


def spread(values: list[float], digits: int = 2) -> dict:
    """Mean, least and most of a figure over runs."""
    return {
        "mean": round(statistics.mean(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "runs": len(values),
    }


def describe(baseline: tuple[str, str], cached: bool) -> tuple[str, str]:
    """A baseline's name in a row, and what the comparison holds equal (or what differs)."""
    data, transforms = baseline
    name = "the pipeline's steps" if transforms == "pipeline" else "torchvision's transforms"
    name += ", decoded once, in memory" if data == "decoded" else ", decoded every epoch"
    kind = "like for like" if transforms == "pipeline" else "the usual code"
    if cached and data == "encoded":
        kind = "cache against re-decode"
    return f"plain loop: {name}", kind


def comparison(run: str, baseline: str, kind: str, ours: list[dict], theirs: list[dict]) -> dict:
    """One row of docs/figures.md: the pipeline's runs ``ours`` against the baseline's runs ``theirs`` (paired by
    index: the same seed), per epoch (samples/s and their ratio), over the whole command (seconds from the command
    to its last validation, and the baseline's over ours: above 1, the pipeline's command ends sooner) and in
    accuracy. ``kind`` says what is held equal: ``like for like`` or what differs (e.g. a cache against a
    re-decode)."""
    pairs = list(zip(ours, theirs))
    epochs = len(ours[0]["samples_s"])
    return {
        "run": run,
        "baseline": baseline,
        "kind": kind,
        "samples_s": [
            {
                "pipeline": spread([o["samples_s"][e] for o in ours], 0),
                "baseline": spread([t["samples_s"][e] for t in theirs], 0),
                "ratio": spread([o["samples_s"][e] / t["samples_s"][e] for o, t in pairs]),
                "data_wait": {
                    "pipeline": spread([o["data_wait_fraction"][e] for o in ours]),
                    "baseline": spread([t["data_wait_fraction"][e] for t in theirs]),
                },
            }
            for e in range(epochs)
        ],
        "startup_s": {
            "pipeline": spread([o["startup_s"] for o in ours], 1),
            "baseline": spread([t["startup_s"] for t in theirs], 1),
        },
        "to_validation_s": {
            "pipeline": spread([o["to_validation_s"] for o in ours], 1),
            "baseline": spread([t["to_validation_s"] for t in theirs], 1),
            "ratio": spread([t["to_validation_s"] / o["to_validation_s"] for o, t in pairs]),
        },
        "val_accuracy": {
            "pipeline": spread([o["val_accuracy"][-1] for o in ours], 4),
            "baseline": spread([t["val_accuracy"][-1] for t in theirs], 4),
        },
        "cpu_per_1k": {  # CPU-seconds per 1,000 training samples (cpu_figures)
            figure: {
                "pipeline": spread([o["cpu"][figure] for o in ours], 3),
                "baseline": spread([t["cpu"][figure] for t in theirs], 3),
                "ratio": spread([o["cpu"][figure] / max(t["cpu"][figure], 1e-9) for o, t in pairs]),
            }
            for figure in ("per_1k", "warm_trainer_per_1k", "warm_rest_per_1k")
        },
    }


def table(rows: list[tuple], header: tuple) -> str:
    """A plain text table: the first column left-aligned, the others right-aligned."""
    cells = [tuple(str(c) for c in row) for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells
    )


def command(args: list[str], log: Path | None = None, env: dict | None = None) -> tuple[float, float, str, Meter]:
    """Run ``args`` as a command (its console to ``log`` when given), its CPU metered (:class:`cpu.Meter`: every
    process it starts); its wall-clock start, its seconds to exit, the console's last line and the meter. A failure
    raises with the console's tail."""
    launched, start, meter = time.time(), time.perf_counter(), Meter()
    if log:
        log.parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has no outputs/bench yet
    with open(log, "w+") if log else tempfile.TemporaryFile("w+") as console:
        process = subprocess.Popen(
            args, stdout=console, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, preexec_fn=meter.enter
        )
        meter.watch(process.pid)
        returncode = process.wait()
        meter.stop()
        console.seek(0)
        said = console.read()
    if returncode:
        raise RuntimeError(f"{' '.join(args)} exited {returncode}:\n{said[-3000:]}")
    return launched, round(time.perf_counter() - start, 1), said.strip().splitlines()[-1] if said.strip() else "", meter


def cpu_figures(meter: Meter, samples: int, warm: tuple[float, float], warm_samples: int, trainers: set[int]) -> dict:
    """CPU-seconds per 1,000 training samples: the whole command's (every process, from its start to its exit), and
    over the warm epochs (``warm``: wall-clock from the end of epoch 1 to the end of the last, ``warm_samples``
    trained in between) those of the training process(es) ``trainers`` and of every other process apart."""
    during = meter.between(*warm)
    trainer = sum(cpu for pid, cpu in during.items() if pid in trainers)
    rest = sum(cpu for pid, cpu in during.items() if pid not in trainers)
    per_1k = 1000 / max(warm_samples, 1)
    return {
        **meter.figures(),
        "per_1k": round(meter.total_s * 1000 / max(samples, 1), 3),
        "warm_trainer_per_1k": round(trainer * per_1k, 3),
        "warm_rest_per_1k": round(rest * per_1k, 3),
        "warm_rest": sorted(
            ([meter.names.get(pid, "?"), round(cpu, 2)] for pid, cpu in during.items() if pid not in trainers),
            key=lambda item: -item[1],
        )[:15],
    }


def bench_env() -> dict:
    """What a benchmark's commands need: bench/ on the path (its model, ``probe``)."""
    here = str(Path(__file__).resolve().parent)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}


def pipeline_run(args: list[str], outputs: Path, env: dict | None = None, log: Path | None = None) -> dict:
    """Run ``python -m pipeline ARGS`` as a user does; its figures come back from the MLflow run it logged
    in ``outputs``: samples/s, data_wait_fraction and val_accuracy per epoch, startup_s (command to first
    training step), the cache's build seconds (when it cached), seconds from the command to its last
    validation (``to_validation_s``, the whole run as the plain loop's is timed) and to its exit (``wall_s``), and
    its CPU-seconds (:func:`cpu_figures`; the training workers' process ids from the run's workers.jsonl)."""
    argv = [sys.executable, "-m", "pipeline", *args, f"paths.outputs={outputs}"]
    launched, wall, _, meter = command(argv, log, {**bench_env(), **(env or {})})
    client, run = last_run(outputs)

    def history(key: str) -> list[float]:
        return metric_history(client, run, key)

    validations = sorted(client.get_metric_history(run.info.run_id, "val_accuracy"), key=lambda m: m.step)
    ends = [m.timestamp / 1000 for m in validations]  # each epoch's report: its training and validation done
    rows = history("train_rows")
    newest = max(outputs.glob("runs/*/*/workers.jsonl"), key=lambda path: path.stat().st_mtime)
    trainers = {json.loads(line)["pid"] for line in newest.read_text().splitlines()}
    return {
        "samples_s": [round(v) for v in history("train_throughput")],
        "data_wait_fraction": [round(v, 3) for v in history("data_wait_fraction")],
        "val_accuracy": [round(m.value, 4) for m in validations],
        "label_mix": [round(v, 3) for v in history("label_mix")],
        "startup_s": round(history("startup_s")[0], 1),
        "startup_phases": {  # when each start-up phase ended (pipeline.common.startup)
            phase: round(run.data.metrics[startup.metric(phase)], 1) for phase in startup.PHASES
        },
        "cache_train_s": [round(v, 1) for v in history("cache_train_s")],
        "to_validation_s": round(validations[-1].timestamp / 1000 - launched, 1),
        "wall_s": wall,
        "cpu": cpu_figures(meter, int(sum(rows)), (ends[0], ends[-1]), int(sum(rows[1:])), trainers),
    }


def plain_run(data: str, transforms: str, overrides: list[str], device: str = "cpu", log: Path | None = None) -> dict:
    """Run the plain loop (``bench/plain.py``, the baseline ``data`` x ``transforms``) as a command of its own:
    its per-epoch figures, seconds from the command to its first training step (``startup_s``, as the pipeline's),
    to its last validation and to its exit, and its CPU-seconds (:func:`cpu_figures`: the loop's own process as
    the trainer, its DataLoader workers the rest)."""
    script = str(Path(__file__).with_name("plain.py"))
    argv = [sys.executable, script, "--data", data, "--transforms", transforms, "--device", device, *overrides]
    launched, wall, last, meter = command(argv, log, bench_env())
    figures = json.loads(last)
    first_step_s, to_validation_s = (round(figures.pop(key) - launched, 1) for key in ("first_step_at", "validated_at"))
    ends, rows = figures.pop("epoch_ends"), figures.pop("train_rows")
    warm = (ends[0], ends[-1]), rows * (len(ends) - 1)
    cpu = cpu_figures(meter, rows * len(ends), *warm, trainers={figures.pop("pid")})
    return {**figures, "startup_s": first_step_s, "to_validation_s": to_validation_s, "wall_s": wall, "cpu": cpu}


def last_run(outputs: Path):
    """The MLflow client of the store in ``outputs`` and the newest run there."""
    client = MlflowClient(f"sqlite:///{outputs / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    return client, client.search_runs(experiments, order_by=["start_time DESC"])[0]


def metric_history(client: MlflowClient, run, key: str) -> list[float]:
    """A run's values of ``key``, by step."""
    return [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]


def ray_floor(overrides: list[str], local_mode: bool = False) -> float:
    """Seconds from command to first batch for Ray Train + Ray Data alone (``bench/floor.py``, a fresh process),
    for a job of the shape ``overrides`` give: its workers, CPUs per worker, a training and a validation dataset;
    with ``local_mode``, Ray Train's local mode instead of its worker group (``num_workers=0``)."""
    from pipeline.api import compose

    scaling = compose(overrides).scaling
    cpus = scaling.resources_per_worker.get("CPU", 1.0)
    workers = 0 if local_mode else scaling.max_workers
    shape = ["--workers", str(workers), "--cpus-per-worker", str(cpus), "--datasets", "2"]
    command = [sys.executable, str(Path(__file__).with_name("floor.py")), *shape]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["startup_s"]


def span(figure: dict, unit: str = "", digits: int = 2) -> str:
    """``min - max`` of a :func:`spread` (one value when they agree), thousands separated."""
    low, high = (f"{figure[k]:,.{digits}f}{unit}" for k in ("min", "max"))
    return low if low == high else f"{low} - {high}"


def comparison_cells(row: dict) -> tuple[str, ...]:
    """A :func:`comparison` as table cells: what ran, against what (and what is held equal), the ratio per epoch,
    the whole command's seconds and ratio, its CPU-seconds per 1,000 samples and their ratio, and mean accuracy
    (each range over the runs)."""
    whole, cpu = row["to_validation_s"], row.get("cpu_per_1k", {}).get("per_1k")
    cpu_cell = "not measured"
    if cpu:
        cpu_cell = f"{span(cpu['pipeline'], digits=2)} vs {span(cpu['baseline'], digits=2)}: {span(cpu['ratio'], 'x')}"
    return (
        row["run"],
        f"{row['baseline']} ({row['kind']})",
        " / ".join(span(epoch["ratio"], "x") for epoch in row["samples_s"]),
        f"{span(whole['pipeline'], ' s', 1)} vs {span(whole['baseline'], ' s', 1)}: {span(whole['ratio'], 'x')}",
        cpu_cell,
        f"{row['val_accuracy']['pipeline']['mean']:.3f} / {row['val_accuracy']['baseline']['mean']:.3f}",
    )


COMPARISON_HEADER = (
    "run",
    "baseline",
    "pipeline / baseline, samples/s per epoch",
    "command to its last validation, pipeline vs baseline (baseline / pipeline)",
    "CPU-seconds per 1,000 samples, whole command, pipeline vs baseline (pipeline / baseline)",
    "val_accuracy, pipeline / baseline (mean)",
)


def comparisons_table(rows: list[dict]) -> str:
    return table([comparison_cells(row) for row in rows], COMPARISON_HEADER)
