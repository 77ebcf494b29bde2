"""What a person sees: a progress bar per epoch and one line of metrics per epoch.

Workers and the Train controller push events into a Ray queue; a driver thread renders them while
``trainer.fit()`` runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator

from ray.exceptions import RayError
from ray.util.queue import Empty, Queue
from tqdm import tqdm

# How long the driver's thread waits on the queue per call. Each call is a message to the queue actor, so
# a short wait costs CPU all run long (at 0.2 s: 3-4% of a core between the driver and the actor); the
# end of a run wakes the thread at once with a "stop" event, this is only the fallback.
WAIT_S = 5.0


def quiet_libraries() -> None:
    """Keep Ray's, Ray Data's and MLflow's chatter off the console (Ray's own log files keep it all)."""
    import ray.data

    logging.getLogger("ray").setLevel(logging.ERROR)
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    ray.data.DataContext.get_current().enable_progress_bars = False
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def format_metrics(epoch: int, epochs: int, metrics: dict) -> str:
    return (
        f"epoch {epoch + 1}/{epochs}  train_loss {metrics['train_loss']:.4f}  val_loss {metrics['val_loss']:.4f}  "
        f"val_accuracy {metrics['val_accuracy']:.4f}  train_throughput {metrics['train_throughput']:,.0f} samples/s  "
        f"data_wait {metrics['data_wait_fraction']:.0%}"
    )


def _consume(
    events: Queue,
    stop: threading.Event,
    epochs: int,
    steps: int,
    on_report: Callable[[dict], dict],
    on_restore: Callable[[int], None],
    errors: list[BaseException],
) -> None:
    bar: tqdm | None = None
    while True:
        try:
            kind, payload = events.get(timeout=WAIT_S)
        except Empty:
            if stop.is_set():
                break
            continue
        if kind == "stop":
            break
        try:
            if kind == "progress":
                if bar is None:
                    bar = tqdm(
                        total=steps,
                        desc=f"epoch {payload['epoch'] + 1}/{epochs}",
                        unit="batch",
                        dynamic_ncols=True,
                        leave=False,
                    )
                bar.update(payload["step"] - bar.n)
                bar.set_postfix(loss=f"{payload['loss']:.4f}", refresh=False)
            elif kind == "report":
                if bar is not None:
                    bar.close()
                    bar = None
                metrics = on_report(payload)
                tqdm.write(format_metrics(metrics["epoch"], epochs, metrics))
            elif kind == "restored":
                if bar is not None:  # the interrupted epoch starts over
                    bar.close()
                    bar = None
                tqdm.write(f"restored from the latest checkpoint: continuing at epoch {payload['epoch'] + 1}/{epochs}")
                on_restore(payload["epoch"])
        except BaseException as err:  # handed to the main thread, which raises it after fit()
            errors.append(err)
    if bar is not None:
        bar.close()


@contextlib.contextmanager
def follow(
    events: Queue, epochs: int, steps: int, on_report: Callable[[dict], dict], on_restore: Callable[[int], None]
) -> Iterator[None]:
    """Render events while the body runs; then drain the queue and raise what a callback raised."""
    stop, errors = threading.Event(), []
    thread = threading.Thread(
        target=_consume, args=(events, stop, epochs, steps, on_report, on_restore, errors), daemon=True
    )
    thread.start()
    try:
        yield
    finally:
        stop.set()
        with contextlib.suppress(RayError):  # a lost queue actor: the thread sees `stop` within WAIT_S instead
            events.put(("stop", None))
        thread.join()
    if errors:
        raise errors[0]
