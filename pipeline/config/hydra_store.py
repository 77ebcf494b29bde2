"""The config as Hydra knows it: the schema, the pipeline's sweepers and launcher registered in Hydra's config
store before a command composes its config, and the experiment a command chose, read back from Hydra's runtime."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from pipeline.config.schema import PipelineConfig


def register() -> None:
    """Make the schema available to ``conf/config.yaml`` as its first default, and the pipeline's sweeper
    and launcher (pipeline/plugins/hydra_plugins/pipeline_launcher.py) as ``hydra/{sweeper,launcher}=pipeline``."""
    store, plugins = ConfigStore.instance(), "hydra_plugins.pipeline_launcher"
    store.store(name="schema", node=PipelineConfig)
    store.store(group="hydra/launcher", name="pipeline", node={"_target_": f"{plugins}.PipelineLauncher"})
    sweeper = {"_target_": f"{plugins}.PipelineSweeper", "max_batch_size": None, "params": None}
    store.store(group="hydra/sweeper", name="pipeline", node=sweeper)
    tune = {  # conf/hparams_search/tune.yaml sets them, with comments
        "_target_": f"{plugins}.TuneSweeper",
        "_recursive_": False,  # search_alg and scheduler stay configs: jobs/tune.py instantiates them
        "num_samples": 1,
        "max_concurrent_trials": None,
        "seed": None,
        "search_alg": None,
        "scheduler": None,
        "params": None,
    }
    store.store(group="hydra/sweeper", name="tune", node=tune)


def experiment_choice(choices) -> str:
    """The ``+experiment=NAME`` a command chose (Hydra's runtime choices), or ``default``: a job's name for
    its experiment when ``tracking.experiment_name`` is unset."""
    return choices.get("experiment") or "default"
