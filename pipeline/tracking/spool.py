"""A training run's record on its way to MLflow (on the driver): each write is appended to a journal file
beside the run's outputs, and a helper thread delivers the records in order. Training never waits on the
tracking server; a server away for minutes gets everything once it is back; a server that never comes back
leaves the journal for ``python -m pipeline.sync`` to upload into the same run later. W&B's offline
directory and ``wandb sync`` are the model.

A record may be delivered twice (its first delivery cut off by the outage, or replayed by ``sync``), so
delivering one must be idempotent: :mod:`pipeline.tracking.delivery` makes it so.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import requests
from mlflow.exceptions import MlflowException, RestException

log = logging.getLogger(__name__)

SPOOL_FILE = "mlflow-spool.jsonl"  # the header (which run), then one record a line
RETRY_S = 2.0  # between tries of a record the tracking server did not take


def server_away(err: BaseException) -> bool:
    """Whether ``err`` says the tracking server did not answer (or answered 5xx), rather than refused the record."""
    if isinstance(err, RestException):
        return err.get_http_status_code() >= 500
    return isinstance(err, (MlflowException, requests.RequestException, ConnectionError))


def sent_marker(path: str) -> str:
    """The file beside a spool that counts its records already delivered."""
    return path + ".sent"


def read(path: str) -> tuple[dict, list[dict], int]:
    """A spool's header, its records and how many of them were delivered."""
    with open(path) as file:
        header, *records = [json.loads(line) for line in file if line.strip()]
    marker = Path(sent_marker(path))
    return header, records, int(marker.read_text()) if marker.exists() else 0


def mark_sent(path: str, count: int) -> None:
    """Record that the first ``count`` records of the spool at ``path`` were delivered."""
    Path(sent_marker(path) + ".tmp").write_text(str(count))
    os.replace(sent_marker(path) + ".tmp", sent_marker(path))


def replay(path: str, deliver: Callable[[dict], None]) -> tuple[dict, int]:
    """Deliver, in order, the records of the spool at ``path`` that were not delivered; its header and how many."""
    header, records, sent = read(path)
    for done, record in enumerate(records[sent:], sent + 1):
        deliver(record)
        mark_sent(path, done)
    return header, len(records) - sent


class Spool:
    """Records appended to ``path`` and delivered in order by ``deliver`` on a helper thread. Over HTTP
    (``remote``), a record the server could not take is tried again every ``RETRY_S`` until it is; any other
    error stops delivery and is raised by :meth:`flush`."""

    def __init__(self, path: str, header: dict, deliver: Callable[[dict], None], remote: bool):
        self.path, self.deliver, self.remote = path, deliver, remote
        self.records: list[dict] = []
        self.sent = 0
        self.error: BaseException | None = None
        self.away_since: float | None = None  # when the server stopped answering, while it does not
        self._changed = threading.Condition()
        with open(path, "w") as out:
            out.write(json.dumps(header) + "\n")
        self._thread = threading.Thread(target=self._send, name="mlflow-spool", daemon=True)
        self._thread.start()

    def add(self, record: dict) -> None:
        """Keep ``record`` on disk, then hand it to the sender: the caller never waits on the server."""
        with open(self.path, "a") as out:
            out.write(json.dumps(record) + "\n")
        with self._changed:
            self.records.append(record)
            self._changed.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every record to be delivered; whether they were. A record the store
        refused is raised here."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self.sent < len(self.records) and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        if self.error is not None:
            raise self.error
        return True

    def _send(self) -> None:
        while True:
            with self._changed:
                while self.sent == len(self.records):
                    self._changed.wait()
                record = self.records[self.sent]
            try:
                self.deliver(record)
            except Exception as err:
                if not (self.remote and server_away(err)):
                    with self._changed:
                        self.error = err
                        self._changed.notify_all()
                    return
                if self.away_since is None:
                    self.away_since = time.monotonic()
                    log.warning(
                        "the MLflow tracking server does not answer; training goes on, its record kept in %s", self.path
                    )
                time.sleep(RETRY_S)
                continue
            if self.away_since is not None:
                log.warning(
                    "the MLflow tracking server answers again after %.0f s; sending the record kept meanwhile",
                    time.monotonic() - self.away_since,
                )
                self.away_since = None
            mark_sent(self.path, self.sent + 1)
            with self._changed:
                self.sent += 1
                self._changed.notify_all()
