"""``python -m pipeline +experiment=NAME [overrides]``: compose the config and run one job."""
from __future__ import annotations

import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from pipeline.config import PipelineError, register
from pipeline.run import run

log = logging.getLogger("pipeline")
register()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    runtime = HydraConfig.get().runtime
    try:
        metrics = run(
            OmegaConf.to_container(cfg, resolve=True),
            run_dir=runtime.output_dir,
            experiment=runtime.choices.get("experiment") or "default",
            config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
        )
    except PipelineError as err:
        log.error("%s", err)
        sys.exit(1)
    return metrics["val_accuracy"]


if __name__ == "__main__":
    main()
