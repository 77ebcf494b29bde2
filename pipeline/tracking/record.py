"""How one run's writes reach MLflow, in order, and how the run ends there.

Each write is a record (:mod:`pipeline.tracking.delivery`) delivered at once or, once :meth:`RunRecord.spool_to`
is called, kept on disk and sent by the spool's thread (:mod:`pipeline.tracking.spool`), so training never
waits on the server. A stop is recorded first: ``ray job stop`` SIGKILLs the driver 3 s after SIGTERM by
default, too soon to wait behind the spool's backlog.
"""

from __future__ import annotations

import logging
import os

from pipeline.common.errors import PipelineError, redact
from pipeline.runtime.filesystems import RunStorage
from pipeline.tracking.delivery import Delivery
from pipeline.tracking.mlflow_store import MAX_TAG_LENGTH, Store, end_run, error_text
from pipeline.tracking.spool import SPOOL_FILE, Spool, sent_marker

log = logging.getLogger(__name__)

END_WAIT_S = 10.0  # how long a run that failed or was stopped waits for the tracking server to take the rest
SIGTERM_WAIT_S = 1.5  # ... on SIGTERM: ray job stop SIGKILLs 3 s after it by default; what is left stays in the spool


class RunRecord:
    """One MLflow run's writes (records, sent in order) and its end state."""

    def __init__(self, store: Store, run_id: str, delivery: Delivery, server_wait_s: float):
        self.client, self.uri, self.run_id, self.experiment_id = store.client, store.uri, run_id, store.experiment_id
        self.name = store.client.get_run(run_id).info.run_name  # for the messages given while the server is away
        self.delivery, self.server_wait_s = delivery, server_wait_s
        self.spool: Spool | None = None
        self.storage: RunStorage | None = None  # where the spool is copied when the server does not take it
        self.stopped = False  # the stop is in the store already (:meth:`stop_first`)

    def spool_to(self, directory: str) -> None:
        """From now on every write is kept in ``directory``'s spool and sent from there."""
        header = {"run_id": self.run_id, "experiment_id": self.experiment_id, "tracking_uri": redact(self.uri)}
        remote = self.uri.startswith(("http://", "https://"))
        self.spool = Spool(os.path.join(directory, SPOOL_FILE), header, self.delivery, remote)

    def write(self, record: dict) -> None:
        if self.spool is None:
            self.delivery(record)
        else:
            self.spool.add(record)

    def tag(self, key: str, value: str) -> None:
        self.write({"kind": "tags", "tags": {key: value[:MAX_TAG_LENGTH]}})

    @property
    def server_away(self) -> bool:
        return self.spool is not None and self.spool.away_since is not None

    def stop_first(self, status: str, error: BaseException | None) -> None:
        """A run that did not finish: its end state straight to the store, ahead of the spool's backlog (which
        follows, and ends it again the same way). While the server is away, the spool's end is the only try."""
        if self.server_away or self.stopped:
            return
        try:
            end_run(self.client, self.run_id, status, None if error is None else error_text(error))
            self.stopped = True
        except Exception as refused:  # the spool's own end follows and says what the store does
            log.warning("run %r (%s) could not be ended as %s at once: %s", self.name, self.run_id, status, refused)

    def end(self, status: str, error: BaseException | None = None) -> None:
        """The learning curve, if any epoch was logged, then the end state; with a spool, once the server has
        the whole record, for ``tracking.server_wait_s`` at most (a few seconds for a run that did not finish)."""
        self.write({"kind": "end", "status": status, "error": None if error is None else error_text(error)})
        if self.spool is None:
            return
        limit = SIGTERM_WAIT_S if isinstance(error, SystemExit) else END_WAIT_S
        wait = self.server_wait_s if status == "FINISHED" else min(self.server_wait_s, limit)
        try:
            if self.spool.flush(wait):
                return
        except Exception as refused:  # delivery stopped at a record the store refused: end the run as it is
            self.end_refused(status, error, refused)
            return
        kept = self.keep_spool()
        message = (
            f"the MLflow tracking server at {redact(self.uri)} did not take run {self.name!r} ({self.run_id}) "
            f"within {wait:.0f} s of its end (tracking.server_wait_s), so MLflow holds only part of it. The whole "
            f"record is kept in {self.spool.path}{f' and {kept}' if kept else ''}. Once the server answers, upload "
            f"it into the same run with: python -m pipeline.sync {self.spool.path}"
        )
        if status != "FINISHED":  # the run's own error stays the one raised
            log.error("%s", message)
            return
        raise PipelineError(message)

    def end_refused(self, status: str, error: BaseException | None, refused: Exception) -> None:
        """The store refused one of the run's records, so the rest, its end included, were not sent: the run is
        ended here, FAILED with the refusal if it had finished. A run that failed or was stopped ends with its
        own error, which stays the one raised; the refusal is said beside it."""
        if status == "FINISHED":
            end_run(self.client, self.run_id, "FAILED", error_text(refused))
            raise refused
        log.error("the MLflow store refused a record of run %r (%s): %s", self.name, self.run_id, error_text(refused))
        try:
            end_run(self.client, self.run_id, status, None if error is None else error_text(error))
        except Exception as again:  # the store is broken: the run's own error is still the one to raise
            log.error("run %r (%s) could not be ended as %s: %s", self.name, self.run_id, status, again)

    def keep_spool(self) -> str | None:
        """The spool copied beside the run's checkpoints (a job's output directory may not outlive it); where."""
        if self.storage is None:
            return None
        target = f"{self.storage.path}/{self.storage.name}/{SPOOL_FILE}"
        for source, name in ((self.spool.path, target), (sent_marker(self.spool.path), sent_marker(target))):
            if os.path.exists(source):
                with open(source, "rb") as file, self.storage.filesystem.open_output_stream(name) as out:
                    out.write(file.read())
        return f"{self.storage.uri}/{SPOOL_FILE}"
