"""A run's driver beating on a team's tracking server (or database), so that a command on another machine can tell
a run whose driver is gone (a lost machine, a SIGKILLed Ray job's driver) from one still training: its process
cannot be looked at from there (:func:`pipeline.tracking.mlflow_store.end_orphans`).

Every :data:`BEAT_S` a thread sets the run's :data:`~pipeline.tracking.mlflow_store.HEARTBEAT_TAG` to the time.
A beat the server does not take is tried again at the next one (the run's spool says when the server is away). A
driver cut off from the server for longer than :data:`~pipeline.tracking.mlflow_store.STALE_S` may find its run
ended KILLED by another command once it gets through: it sets it RUNNING again, and says so.
"""

from __future__ import annotations

import logging
import threading
import time

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from pipeline.tracking.mlflow_store import ERROR_TAG, HEARTBEAT_TAG

log = logging.getLogger(__name__)

BEAT_S = 60.0  # a beat a minute: STALE_S is 15 of them missed


class Heartbeat:
    """The beat of run ``run_id``'s driver, from its first (at once, from the thread: the command never waits on
    the server for it) to :meth:`stop`."""

    def __init__(self, client: MlflowClient, run_id: str):
        self.client, self.run_id = client, run_id
        self.stopped = threading.Event()
        threading.Thread(target=self.run, name="mlflow-heartbeat", daemon=True).start()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.client.set_tag(self.run_id, HEARTBEAT_TAG, f"{time.time():.0f}")
                self.reclaim()
            except MlflowException as err:  # the server away: the next beat tries again
                log.info("heartbeat of run %s not taken: %s", self.run_id, err.message)
            self.stopped.wait(BEAT_S)

    def reclaim(self) -> None:
        """The run RUNNING again if another command took it for gone and ended it while this driver was cut off."""
        run = self.client.get_run(self.run_id)
        if run.info.status != "RUNNING" and not self.stopped.is_set():  # not this driver's own end
            log.warning(
                "run %s was ended %s by another command while this driver could not reach the server (%s); "
                "it is RUNNING again",
                self.run_id,
                run.info.status,
                run.data.tags.get(ERROR_TAG, ""),
            )
            self.client.update_run(self.run_id, status="RUNNING")
            if ERROR_TAG in run.data.tags:
                self.client.delete_tag(self.run_id, ERROR_TAG)

    def stop(self) -> None:
        """No beat from now on: the run is about to end."""
        self.stopped.set()
