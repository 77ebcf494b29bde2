"""Canaries: each pins a behaviour of Ray (2.60) that a workaround in ``pipeline/trainer.py`` exists
for. When one fails, Ray has changed: revisit the workaround it names, then the canary."""

from __future__ import annotations

import signal
import sys

import pytest
import ray
import ray.cloudpickle
import ray.data
import ray.train
from ray.train.torch import TorchTrainer

from pipeline.trainer import explain, root_cause


def read_a_bad_row(config: dict) -> None:
    """A training loop whose data holds a row its transform rejects, as a corrupt image would be."""
    for _ in ray.train.get_dataset_shard("train").iter_batches(batch_size=4):
        pass


def reject_row_7(batch: dict) -> dict:
    if 7 in batch["id"]:
        raise TypeError("row 7 holds None, not JPEG bytes")
    return batch


@pytest.mark.slow
def test_fit_on_the_main_thread_installs_a_sigint_handler_and_worker_errors_arrive_as_traceback_text(
    ray_runtime, tmp_path
):
    """Workarounds: ``fit_off_main_thread`` (Ray Train's own SIGINT handler, installed by ``fit()`` on
    the main thread and left there) and ``root_cause`` (a user error inside a Ray Data task inside a
    worker reaches the driver as traceback text whose last ``Type: message`` line is the user's)."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/
    ours = signal.getsignal(signal.SIGINT)
    trainer = TorchTrainer(
        read_a_bad_row,
        scaling_config=ray.train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 0.5}),
        datasets={"train": ray.data.range(16, override_num_blocks=2).map_batches(reject_row_7)},
        run_config=ray.train.RunConfig(storage_path=str(tmp_path), name="canary"),
    )
    try:
        with pytest.raises(ray.train.WorkerGroupError) as failed:
            trainer.fit()
        installed = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, ours)
    assert installed is not ours, "Ray Train no longer installs a SIGINT handler: fit_off_main_thread may go"
    (failure,) = failed.value.worker_failures.values()
    assert str(failure).strip() != root_cause(failure)  # wrapped in Ray's text: root_cause still needed
    assert root_cause(failure) == "TypeError: row 7 holds None, not JPEG bytes"
    assert "training failed on rank(s) [0]: TypeError: row 7 holds None" in str(explain(failed.value))


def test_a_controller_failure_is_explained_by_its_cause():
    err = ray.train.ControllerError(OSError("checkpoint_manager_snapshot.json: read-only file system"))
    assert str(explain(err)).startswith(
        "training failed in Ray Train's controller: OSError: checkpoint_manager_snapshot.json: read-only file system"
    )


def test_the_preemption_watcher_is_still_switched_by_its_environment_variable():
    """Workaround: ``local_runtime_settings`` turns the watcher off by this variable's name; Ray reads
    it in its controller and starts the watcher by default."""
    from ray.train.v2._internal import constants  # private on purpose: this test watches it

    assert constants.ENABLE_PREEMPTION_WATCHER_ENV_VAR == "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
    assert constants.DEFAULT_ENABLE_PREEMPTION_WATCHER is True
