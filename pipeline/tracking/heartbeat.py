"""A run's driver beating on a team's tracking server, so that a command on another machine can tell a run whose
driver is gone (a lost machine, a SIGKILLed Ray job's driver) from one still training: its process cannot be looked
at from there (:mod:`pipeline.tracking.liveness`).

Every :data:`BEAT_S` a thread stamps the run's :data:`~pipeline.tracking.liveness.HEARTBEAT_TAG` with the server's
own time, so no machine's clock is ever compared with another's. A beat the server does not take is tried again at
the next one (the run's spool says when the server is away). A driver cut off from the server for longer than
:data:`~pipeline.tracking.liveness.STALE_S` may find its run ended KILLED by another command once it gets through:
it takes it back, RUNNING again, unless another driver has taken the run since (a resume); a run ended any other way
(its own stop above all) stays ended.
"""

from __future__ import annotations

import logging
import threading

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from pipeline.common.errors import redact
from pipeline.tracking.liveness import DRIVER_TAG, HEARTBEAT_TAG, ORPHAN, beat_value, server_time, this_driver
from pipeline.tracking.mlflow_store import ERROR_TAG

log = logging.getLogger(__name__)

BEAT_S = 60.0  # a beat a minute: STALE_S is 15 of them missed


class Heartbeat:
    """The beat of run ``run_id``'s driver on the tracking server at ``uri``, from its first (at once, from the
    thread: the command never waits on the server for it) to :meth:`stop`."""

    def __init__(self, client: MlflowClient, uri: str, run_id: str):
        self.client, self.uri, self.run_id = client, uri, run_id
        self.driver = this_driver()
        self.stopped = threading.Event()
        self.superseded = False  # another driver holds the run now: its end is that one's to record
        threading.Thread(target=self.run, name="mlflow-heartbeat", daemon=True).start()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.beat()
            except MlflowException as err:  # the server away: the next beat tries again
                log.info("heartbeat of run %s not taken: %s", self.run_id, err.message)
            except Exception as err:  # whatever it was, the next beat tries again
                log.warning("heartbeat of run %s failed: %s: %s", self.run_id, type(err).__name__, redact(str(err)))
            self.stopped.wait(BEAT_S)

    def beat(self) -> None:
        at = server_time(self.uri)
        if at is None:  # no answer: no time to stamp, the next beat tries again
            log.info("heartbeat of run %s: the tracking server at %s does not answer", self.run_id, redact(self.uri))
            return
        self.client.set_tag(self.run_id, HEARTBEAT_TAG, beat_value(at))
        self.reclaim()

    def reclaim(self) -> None:
        """The run RUNNING again if another command took its driver for gone and ended it while this driver was cut
        off, and no other driver has taken it since; no more beats once another has."""
        if self.stopped.is_set():  # this driver began to end the run: whatever the store says stays
            return
        run = self.client.get_run(self.run_id)
        tags = run.data.tags
        if tags.get(DRIVER_TAG, self.driver) != self.driver:
            log.error(
                "run %s is held by another driver (%s) since this one was taken for gone: this driver no longer "
                "beats for it, takes it back or ends it; stop this command, whose records now mix with the other's",
                self.run_id,
                tags[DRIVER_TAG],
            )
            self.superseded = True
            self.stopped.set()
            return
        if run.info.status == "RUNNING" or not tags.get(ERROR_TAG, "").startswith(ORPHAN):
            return  # running, or ended by its own stop or a person: stays so
        log.warning(
            "run %s was ended %s by another command while this driver could not reach the server (%s); it is "
            "RUNNING again",
            self.run_id,
            run.info.status,
            tags[ERROR_TAG],
        )
        self.client.update_run(self.run_id, status="RUNNING")
        self.client.delete_tag(self.run_id, ERROR_TAG)

    def stop(self) -> None:
        """No beat from now on: the run is about to end (a stop, a failure or its finish)."""
        self.stopped.set()
