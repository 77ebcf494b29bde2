"""What every layer shares about failing: the error a user reads as one paragraph, and the redaction that
keeps secrets in URIs out of those paragraphs, the logs and MLflow. Imports nothing of the pipeline."""

from __future__ import annotations

import re


class PipelineError(Exception):
    """A problem with the user's config or data, reported as one paragraph without a traceback."""


_URI_PASSWORD = re.compile(r"(://[^/@\s:]+):[^/@\s]+@")


def redact(text: str) -> str:
    """``https://user:token@host`` -> ``https://user:***@host``: secrets in URIs stay out of MLflow and logs."""
    return _URI_PASSWORD.sub(r"\1:***@", text)
