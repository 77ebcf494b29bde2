"""Ctrl-C and SIGTERM as exceptions the pipeline can always catch: raised at once by the handler, and again
where the main thread waits on training (:func:`raise_requested`), so a stop is never lost."""

from __future__ import annotations

import signal

_requests: list[BaseException] = []


def install() -> None:
    """Ctrl-C raises KeyboardInterrupt, SIGTERM ``SystemExit(143)``: both end a run as KILLED."""
    signal.signal(signal.SIGINT, lambda signum, frame: request_stop(KeyboardInterrupt()))
    signal.signal(signal.SIGTERM, lambda signum, frame: request_stop(SystemExit(128 + signum)))


def request_stop(error: BaseException) -> None:
    """A signal handler's body: raise ``error`` now, and again from :func:`raise_requested`. An exception a
    handler raises while a finalizer runs on the main thread (Ray's handles have ``__del__``) is only printed;
    a lost Ctrl-C would leave training running."""
    _requests.append(error)
    raise error


def stop_requested() -> bool:
    """Whether a signal has asked the command to stop."""
    return bool(_requests)


def raise_requested() -> None:
    """Raise the first stop a signal asked for, if any."""
    if _requests:
        raise _requests[0]
