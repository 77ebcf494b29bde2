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
import logging
import math
import os

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
from pipeline.config import ScalingConfig, experiment_choice, load
from pipeline.data import source
from pipeline.jobs import preflight
from pipeline.jobs.trial import GROUP_KEY, TrialRecorder, run_trial

log = logging.getLogger("pipeline")
TUNE_DIR = "tune"  # <sweep dir>/tune: Tune's experiment state, what a resumed sweep restores
SWEEP_FILE = "tune_sweep.yaml"  # <sweep dir>/tune_sweep.yaml: the sweep as first run, to refuse a different one
# A trial's actor only waits on the Ray Train run it starts (whose workers hold the resources); Tune
# needs a non-zero request, so it takes a sliver of a CPU.
TRIAL_ACTOR_CPU = 0.01


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
    splits = {name: preflight.check(cfg)[0] for name, cfg in resolved.items()}
    first = next(iter(resolved.values()))
    metric = first.optimized_metric
    experiment = experiment_choice(config.hydra.runtime.choices)
    scheduler = settings.scheduler._target_.rsplit(".", 1)[-1] if settings.scheduler else None
    recorder = TrialRecorder(bases, splits, sweep_dir, experiment, fixed, scheduler)
    trial = tune.with_parameters(run_trial, bases=bases, sweep_dir=sweep_dir, experiment=experiment)
    trainable = tune.with_resources(trial, {"CPU": TRIAL_ACTOR_CPU})
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
        transform_cpus = preflight.transform_cpus(next(iter(splits.values())))
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
