"""Where files live: local paths and ``s3://`` URIs, as pyarrow filesystems.

Used by the source (parquet files) and by Ray Train's run storage (checkpoints). Credentials are
never taken from the config: the AWS SDK inside pyarrow finds them itself (AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY, AWS_PROFILE and ~/.aws, or an instance role) in every process that opens
the filesystem, so they are not written into configs, MLflow params or the tasks Ray pickles.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from pipeline.common.errors import PipelineError
from pipeline.config import S3Config, StorageConfig

DEFAULT_STORE = "mlflow.db"  # tracking.uri unset: an SQLite store in paths.outputs

# AWS error codes in pyarrow's messages, and what the user should do about each.
S3_HINTS = {
    "curlCode: 28": "the endpoint did not answer in time (source.s3.request_timeout_s)",
    "NO_SUCH_BUCKET": "the bucket does not exist",
    "allow_bucket_creation": "the bucket does not exist",
    "ACCESS_DENIED": "access denied",
    "INVALID_ACCESS_KEY_ID": "the access key is not valid",
    "SIGNATURE_DOES_NOT_MATCH": "the secret key does not match the access key",
    "NETWORK_CONNECTION": "cannot connect to the endpoint",
}
CREDENTIALS_HELP = (
    "Credentials come from the AWS SDK's usual places: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
    "AWS_PROFILE (~/.aws/credentials) or an instance role; a public bucket needs {key}.s3.anonymous=true."
)


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def s3_filesystem(s3: S3Config, anonymous: bool = False) -> pafs.S3FileSystem:
    """An S3 filesystem from the config's connection settings (region, endpoint, timeouts)."""
    return pafs.S3FileSystem(
        region=s3.region,
        endpoint_override=s3.endpoint_url,
        anonymous=anonymous or s3.anonymous,
        connect_timeout=s3.connect_timeout_s,
        request_timeout=s3.request_timeout_s,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=s3.max_attempts),
    )


def locate(uri: str, s3: S3Config, key: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem for ``uri`` and the path inside it (``bucket/prefix`` for S3, absolute locally).

    ``s3://anonymous@bucket/...`` (Ray's spelling for public buckets) reads without credentials;
    any other user or password in the URI is refused, so a secret cannot reach logs or MLflow.
    """
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    parts = urlsplit(uri)
    if parts.scheme != "s3":
        raise PipelineError(f"{key}: unsupported scheme {parts.scheme}:// (use a local path or s3://bucket/prefix).")
    if parts.password is not None or parts.username not in (None, "anonymous"):
        raise PipelineError(
            f"{key}: the s3:// URI carries credentials; remove them from the config. "
            + CREDENTIALS_HELP.format(key=key.split(".")[0])
        )
    return s3_filesystem(s3, anonymous=parts.username == "anonymous"), f"{parts.hostname}{parts.path}".rstrip("/")


def s3_error(key: str, uri: str, err: OSError) -> PipelineError:
    """A pyarrow S3 failure as one paragraph that names the key, the URI and what to check."""
    text = str(err)
    reason = next((hint for code, hint in S3_HINTS.items() if code in text), "the request failed")
    section = key.split(".")[0]
    return PipelineError(
        f"{key}: cannot read {uri}: {reason} ({text.strip()}). Check the bucket name, "
        f"{section}.s3.endpoint_url (or AWS_ENDPOINT_URL) for S3-compatible stores, and {section}.s3.region. "
        + CREDENTIALS_HELP.format(key=section)
    )


def make_dir(uri: str, s3: S3Config, key: str) -> None:
    """Create the directory ``uri`` names now, so a missing bucket or a read-only store fails before training."""
    fs, path = locate(uri, s3, key)
    try:
        fs.create_dir(path, recursive=True)
    except OSError as err:
        if is_s3(uri):
            raise s3_error(key, uri, err) from err
        raise PipelineError(f"{key}: cannot create {uri} ({err}).") from err


@dataclass
class RunStorage:
    """Where Ray Train keeps a run's checkpoints: ``path``/``name`` on ``filesystem``, shown as ``uri``."""

    path: str
    name: str
    filesystem: pafs.FileSystem
    uri: str


def run_storage(storage: StorageConfig, run_dir: str, run_id: str, resume_from: str | None = None) -> RunStorage:
    """Each run's checkpoints live under its MLflow run id, in ``storage.path`` (a shared path or
    ``s3://`` URI) or else the job's output directory (``<run_dir>/checkpoints``). Ray Train restores
    from whatever it finds there, so a fresh run, with a fresh id, never resumes by accident; a
    resumed run passes the place its first attempt recorded (``resume_from``)."""
    if resume_from is not None:
        parent, name = resume_from.rsplit("/", 1)
    else:
        parent, name = (storage.path or os.path.join(run_dir, "checkpoints")).rstrip("/"), run_id
    fs, path = locate(parent, storage.s3, "storage.path")
    return RunStorage(path, name, fs, f"{parent if is_s3(parent) else path}/{name}")


def local_store(uri: str | None, outputs: str) -> str | None:
    """The local path an MLflow tracking URI writes to (``None`` for a server or database): unset, the
    SQLite store in ``outputs``."""
    if uri is None:
        return os.path.join(outputs, DEFAULT_STORE)
    if uri.startswith("sqlite:"):
        return uri.removeprefix("sqlite:").removeprefix("///")  # sqlite:///relative, sqlite:////absolute
    if uri.startswith("file:"):
        return urlsplit(uri).path
    return None if "://" in uri else uri  # a bare path: MLflow's file store
