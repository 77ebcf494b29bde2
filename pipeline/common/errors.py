"""What every layer shares about failing: the error a user reads as one paragraph, the user's error found in
Ray's traceback text, and the redaction that keeps secrets in URIs out of those paragraphs, the logs and MLflow.
Imports nothing of the pipeline."""

from __future__ import annotations

import re


class PipelineError(Exception):
    """A problem with the user's config or data, reported as one paragraph without a traceback."""


_URI_PASSWORD = re.compile(r"(://[^/@\s:]+):[^/@\s]+@")


def redact(text: str) -> str:
    """``https://user:token@host`` -> ``https://user:***@host``: secrets in URIs stay out of MLflow and logs."""
    return _URI_PASSWORD.sub(r"\1:***@", text)


def root_cause(err: BaseException) -> str:
    """The innermost error of a worker failure, as ``Type: message``.

    Ray 2.60 flattens an error raised in a task or actor (a Ray Data transform, a training worker)
    into traceback text; the last ``SomeError: ...`` line that is not one of Ray's wrappers is what
    user code raised.
    """
    lines = [
        line
        for line in str(err).splitlines()
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception)\b.*: ", line) and not line.startswith("ray.")
    ]
    return lines[-1] if lines else f"{type(err).__name__}: {err}"
