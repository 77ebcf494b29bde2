"""Hydra sweeps on Ray Tune (``hparams_search=tune``), on the driver: the search space from Hydra's
sweep syntax, a ``Tuner`` whose trials each run the pipeline's training job (``trial.py``, in Tune's
trial actors, as many at once as the cluster holds), and every trial recorded in MLflow from here.

Hydra's syntax maps onto Tune's search space: a comma list or ``range()`` is a grid (every value, as
Hydra's basic sweeper does) with Tune's random/grid generator, ``choice()`` is sampled, and
``interval()`` (with ``tag(log, ...)`` or ``tag(int, ...)``) is a continuous range; a model-based
search algorithm (HyperOpt) samples every one of them. Config groups (``model=mlp,vit``) are
composed here, once per combination, so trials on any node need no config files.

A sweep keeps Tune's state in ``<sweep dir>/tune``: the same command with the same ``hydra.sweep.dir``
continues it (finished trials stay, unfinished ones continue from their checkpoints).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
from dataclasses import dataclass

import hydra
import ray
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from ray import tune
from ray.tune.search.basic_variant import BasicVariantGenerator

from pipeline.common import console, workarounds
from pipeline.common.errors import PipelineError
from pipeline.common.metrics import lower_is_better
from pipeline.config import PipelineConfig, ScalingConfig, experiment_choice, load
from pipeline.data import source
from pipeline.jobs import build, preflight
from pipeline.jobs.build import Job
from pipeline.jobs.trial import GROUP_KEY, run_trial, trial_config, trial_dir
from pipeline.runtime import filesystems
from pipeline.tracking import mlflow_store
from pipeline.tracking.tracker import STOPPED_TAG, Tracker
from pipeline.training.trainer import checkpoint_mode

log = logging.getLogger("pipeline")
TUNE_DIR = "tune"  # <sweep dir>/tune: Tune's experiment state, what a resumed sweep restores
SWEEP_FILE = "tune_sweep.yaml"  # <sweep dir>/tune_sweep.yaml: the sweep as first run, to refuse a different one
# A trial's actor only waits on the Ray Train run it starts (whose workers hold the resources); Tune
# needs a non-zero request, so it takes a sliver of a CPU.
TRIAL_ACTOR_CPU = 0.01
TRIAL_TAG = "pipeline.tune_trial_id"


def sweep(config: DictConfig, loader, arguments: list[str], settings: DictConfig) -> None:
    """Run (or continue) the sweep that ``arguments`` (the command line) and ``settings.params``
    describe; each trial is a child run of the sweep's parent run in MLflow."""
    console.quiet_libraries()
    workarounds.quiet_tune_state_upload_race()
    sweep_dir = os.path.abspath(str(config.hydra.sweep.dir))
    overrides = OverridesParser.create(config_loader=loader).parse_overrides(
        [*(f"{key}={value}" for key, value in (settings.params or {}).items()), *arguments]  # the command line wins
    )
    generator = settings.search_alg or {"_target_": f"{BasicVariantGenerator.__module__}.BasicVariantGenerator"}
    search_alg = hydra.utils.instantiate(generator)
    grid = isinstance(search_alg, BasicVariantGenerator)
    fixed = [o.input_line for o in overrides if not o.is_sweep_override()]
    groups = {o.get_key_element(): o for o in overrides if o.is_sweep_override() and is_group(config, o)}
    space = {
        o.get_key_element(): domain(o, grid) for o in overrides if o.is_sweep_override() and o not in groups.values()
    }
    combos = group_combinations(groups)
    bases = {name: base_config(loader, config, [*fixed, *choices]) for name, choices in combos.items()}
    if len(combos) > 1:
        space[GROUP_KEY] = (tune.grid_search if grid else tune.choice)(list(combos))
    if not space:
        raise PipelineError("hparams_search=tune: nothing to sweep; give a sweep on the command line or in params.")

    resolved = {name: load(base) for name, base in bases.items()}
    splits = {name: preflight.checked(cfg)[0] for name, cfg in resolved.items()}
    first = next(iter(resolved.values()))
    metric = first.optimized_metric
    experiment = experiment_choice(config.hydra.runtime.choices)
    scheduler = settings.scheduler._target_.rsplit(".", 1)[-1] if settings.scheduler else None
    recorder = TrialRecorder(bases, splits, sweep_dir, experiment, fixed, scheduler)
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, bases=bases, sweep_dir=sweep_dir), {"CPU": TRIAL_ACTOR_CPU}
    )
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "1")  # a finished trial is in Tune's saved state at once
    path = os.path.join(sweep_dir, TUNE_DIR)
    described = {"arguments": list(arguments), "settings": OmegaConf.to_container(settings, resolve=True)}
    if tune.Tuner.can_restore(path):
        check_same_sweep(sweep_dir, described)
        log.info("continuing the sweep in %s: finished trials stay, unfinished ones resume", sweep_dir)
        tuner = tune.Tuner.restore(path, trainable, resume_unfinished=True, resume_errored=False, param_space=space)
    else:
        os.makedirs(sweep_dir, exist_ok=True)
        with open(os.path.join(sweep_dir, SWEEP_FILE), "w") as out:
            yaml.safe_dump(described, out)
        transform_cpus = build.transform_cpus(next(iter(splits.values())))
        concurrent = settings.max_concurrent_trials or concurrency(
            first.scaling, transform_cpus, ray.cluster_resources()
        )
        log.info("sweep %s on Ray Tune: up to %d trial(s) at once", sweep_dir, concurrent)
        if grid:  # Tune applies max_concurrent_trials to a Searcher only; its generator takes it itself
            search_alg = hydra.utils.instantiate(generator, max_concurrent=concurrent)
        tuner = tune.Tuner(
            trainable,
            param_space=space,
            tune_config=tune.TuneConfig(
                metric=metric,
                mode="min" if lower_is_better(first.task.type, first.task.metrics, metric) else "max",
                search_alg=search_alg,
                scheduler=hydra.utils.instantiate(settings.scheduler) if settings.scheduler else None,
                num_samples=settings.num_samples,
                max_concurrent_trials=None if grid else concurrent,
            ),
            run_config=tune.RunConfig(name=TUNE_DIR, storage_path=sweep_dir, callbacks=[recorder], verbose=0),
        )
    tuner.fit()


def is_group(config: DictConfig, override: Override) -> bool:
    """Whether the override chooses a config group (``model=mlp,vit``) rather than sets a value."""
    return override.get_key_element() in config.hydra.runtime.choices


def domain(override: Override, grid: bool):
    """A Tune search space for one Hydra sweep override (see the module's docstring)."""
    key, sweep = override.get_key_element(), override.value()
    if isinstance(sweep, IntervalSweep):
        low, high = sweep.start, sweep.end
        if "int" in sweep.tags:
            return (tune.lograndint if "log" in sweep.tags else tune.randint)(int(low), int(high) + 1)
        return (tune.loguniform if "log" in sweep.tags else tune.uniform)(low, high)
    if isinstance(sweep, (ChoiceSweep, RangeSweep)):
        values = list(override.sweep_iterator())
        simple = isinstance(sweep, RangeSweep) or sweep.simple_form
        return tune.grid_search(values) if grid and simple else tune.choice(values)
    raise PipelineError(f"hparams_search=tune: cannot sweep {key} with {override.input_line!r}.")


def group_combinations(groups: dict[str, Override]) -> dict[str, list[str]]:
    """Every combination of the swept config groups, by name (``model=mlp optim=sgd``), as overrides."""
    choices = [[f"{key}={value}" for value in override.sweep_iterator()] for key, override in groups.items()]
    return {" ".join(combo): list(combo) for combo in itertools.product(*choices)}


def base_config(loader, config: DictConfig, overrides: list[str]) -> DictConfig:
    """The job config Hydra composes for ``overrides``, without its ``hydra`` node: typed by the
    schema, interpolations unresolved (a trial's values change what they resolve to)."""
    composed = loader.load_sweep_config(config, overrides)
    with read_write(composed), open_dict(composed):
        del composed["hydra"]
        source.with_classes(composed)  # found once here, not in each trial
    return composed


def concurrency(scaling: ScalingConfig, transform_cpus: float, resources: dict) -> int:
    """Trials at once, when ``max_concurrent_trials`` is unset: as many as the runtime holds, each
    taking its training workers' resources (``scaling``) and at least a CPU for its preprocessing."""
    need = {key: amount * scaling.max_workers for key, amount in scaling.resources_per_worker.items()}
    need["CPU"] = need.get("CPU", 0) + max(transform_cpus, 1)
    return max(1, min(math.floor(resources.get(key, 0) / amount) for key, amount in need.items() if amount > 0))


def check_same_sweep(sweep_dir: str, described: dict) -> None:
    """A sweep continues only as it began: Tune restores its first search space and algorithm."""
    with open(os.path.join(sweep_dir, SWEEP_FILE)) as file:
        before = yaml.safe_load(file)
    if before != described:
        raise PipelineError(
            f"hydra.sweep.dir={sweep_dir} holds a sweep begun with other arguments or settings "
            f"({before['arguments']}); continue it with those, or start a new one in another hydra.sweep.dir."
        )


def error_text(trial) -> str:
    """A failed trial's traceback, from the file Tune writes beside its driver (or from storage)."""
    path = trial.error_file
    if path and os.path.exists(path):
        with open(path) as file:
            return file.read()
    return trial.get_error() or "the trial failed; Tune recorded no error."


def trial_overrides(params: dict) -> list[str]:
    """A trial's sampled values as Hydra overrides (``optim.lr=0.0012``)."""
    shown = []
    for key, value in params.items():
        shown.append(
            value if key == GROUP_KEY else f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
        )
    return shown


@dataclass
class OpenTrial:
    """A running trial as the driver sees it: its MLflow run and typed config."""

    tracker: Tracker
    cfg: PipelineConfig


class TrialRecorder(tune.Callback):
    """Runs in the sweep's driver (Tune calls it there): each trial's MLflow run, from its start to its
    end, nested under the sweep's parent run. A trial a scheduler stopped ends FINISHED, tagged
    ``pipeline.stopped_early``; a trial that failed ends FAILED with its error."""

    def __init__(self, bases: dict, splits: dict, sweep_dir: str, experiment: str, fixed: list[str], scheduler):
        self.bases, self.splits, self.sweep_dir, self.experiment = bases, splits, sweep_dir, experiment
        self.fixed, self.scheduler = fixed, scheduler
        self.open_trials: dict[str, OpenTrial] = {}
        self.groups: dict[str, str] = {}  # trial id -> its training placement group

    def __getstate__(self) -> dict:  # Tune saves its callbacks with the sweep's state: open runs stay here
        return {**self.__dict__, "open_trials": {}, "groups": {}}

    def on_trial_start(self, iteration: int, trials: list, trial, **info) -> None:
        trial_id, params = trial.trial_id, trial.config
        os.makedirs(trial_dir(self.sweep_dir, trial_id), exist_ok=True)  # its metrics.jsonl, wherever checkpoints go
        cfg = trial_config(self.bases, params)
        store = mlflow_store.Store.open(cfg.tracking, cfg.paths.outputs, self.experiment)
        tracker = self.reopen(store, cfg, trial_id) or self.open(store, cfg, trial_id, params)
        storage = filesystems.run_storage(cfg.storage, trial_dir(self.sweep_dir, trial_id), trial_id)
        tracker.set_storage(storage)
        self.open_trials[trial_id] = OpenTrial(tracker, cfg)
        log.info("trial %s started: %s", trial_id, " ".join(trial_overrides(params)))

    def open(self, store: mlflow_store.Store, cfg: PipelineConfig, trial_id: str, params: dict) -> Tracker:
        """A new child run, named for its number in the sweep and its sampled values."""
        overrides = [*self.fixed, *trial_overrides(params)]
        shown = " ".join(o for o in overrides if o != f"+experiment={self.experiment}")
        parent = store.sweep_parent(self.sweep_dir)
        name = f"trial {len(store.runs_where('mlflow.parentRunId', parent))}: {shown}"
        job = Job(trial_dir(self.sweep_dir, trial_id), self.experiment, overrides, self.sweep_dir, name)
        tracker = Tracker.start(store, cfg, job, name, parent, {TRIAL_TAG: trial_id})
        tracker.log_data(self.splits[params.get(GROUP_KEY, "")], None)
        return tracker

    def reopen(self, store: mlflow_store.Store, cfg: PipelineConfig, trial_id: str) -> Tracker | None:
        """The run of a trial that Tune restarts (a resumed sweep), RUNNING again; None for a new trial."""
        tracker = Tracker.reopen_tagged(store, cfg, TRIAL_TAG, trial_id)
        if tracker is not None:
            log.info("trial %s continues in MLflow run %s", trial_id, tracker.run_id)
        return tracker

    def on_trial_result(self, iteration: int, trials: list, trial, result: dict, **info) -> None:
        if result.get("epoch") is None:  # Tune's own final result of a trial
            return
        running = self.open_trials[trial.trial_id]
        tracker = running.tracker
        tracker.log_epoch(result, result.get("checkpoint_path"))  # TuneReportCallback's key for a report's checkpoint
        if result.get("placement_group"):
            self.groups[trial.trial_id] = result["placement_group"]
        if "node_id" in result:
            tracker.tag("pipeline.node_id", result["node_id"])
        with open(os.path.join(trial_dir(self.sweep_dir, trial.trial_id), "metrics.jsonl"), "a") as out:
            out.write(json.dumps({k: v for k, v in result.items() if k != "config"}, default=str) + "\n")
        log.info(
            "trial %s: %s",
            trial.trial_id,
            console.format_metrics(
                result["epoch"], running.cfg.train.epochs, result, running.cfg.tracking.data_wait_warning
            ),
        )

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        running = self.end_of(trial)
        if running is None:
            return
        tracker, epochs = running.tracker, running.cfg.train.epochs
        done = max(tracker.logged, default=-1) + 1
        if done == 0:
            tracker.end("FAILED", PipelineError("the trial ended without reporting an epoch."))
            return
        if done < epochs and tracker.stopped_early is None:  # stopped by the scheduler, not by itself
            note = f"after epoch {done} of {epochs}" + (f" by {self.scheduler}" if self.scheduler else "")
            tracker.tag(STOPPED_TAG, note)
            log.info("trial %s stopped early %s", trial.trial_id, note)
        train = running.cfg.train
        tracker.finish_models(  # the alias: the sweep's best trial's, when it ends
            None,
            train.checkpoint_metric,
            checkpoint_mode(train, running.cfg.task),
            running.cfg.tracking.register_as,
            None,
        )
        tracker.end("FINISHED")

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        running = self.end_of(trial)
        if running is not None:
            error = PipelineError(workarounds.root_cause(RuntimeError(error_text(trial))))
            log.error("trial %s failed: %s", trial.trial_id, error)
            running.tracker.end("FAILED", error)

    def on_experiment_end(self, trials: list, **info) -> None:
        """Trials still open when the sweep stops (Ctrl-C): KILLED, to be continued by a resumed sweep."""
        for trial_id in list(self.open_trials):
            self.open_trials.pop(trial_id).tracker.end("KILLED")
            log.warning(
                "trial %s interrupted; continue the sweep with the same command plus: hydra.sweep.dir=%s",
                trial_id,
                self.sweep_dir,
            )

    def end_of(self, trial) -> OpenTrial | None:
        """The trial, no longer open, with its placement group released (see workarounds.py)."""
        group = self.groups.pop(trial.trial_id, None)
        if group is not None:
            workarounds.release_placement_group(group)
        return self.open_trials.pop(trial.trial_id, None)
