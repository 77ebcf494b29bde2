"""S3 sources and run storage against real S3 HTTP servers (moto) on 127.0.0.1.

One server accepts any credentials and holds the generated data; a second checks credentials and
IAM policies, for the access-denied and credential-chain cases.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pyarrow.fs as pafs
import pytest
from conftest import compose_cfg, free_port, wait_for_port
from test_pipeline import run_cli

from pipeline.common.errors import PipelineError
from pipeline.config import SourceConfig
from pipeline.data.source import prepare
from pipeline.runtime.filesystems import make_dir

DATA_FILES = ["cifar10/train/part-00000.parquet", "cifar10/train/part-00001.parquet", "cifar10/test/part-00000.parquet"]


def s3_source(endpoint: str, root: str, *overrides: str) -> SourceConfig:
    return compose_cfg(
        [
            "source=s3",
            f"source.root={root}",
            f"source.s3.endpoint_url={endpoint}",
            "source.s3.anonymous=false",
            "source.s3.region=us-east-1",
            *overrides,
        ]
    ).source


def checkpoints(fs: pafs.FileSystem, storage: str) -> list[str]:
    """The checkpoint files under an s3:// run storage, oldest first (Ray names their folders by time)."""
    found = fs.get_file_info(pafs.FileSelector(storage.removeprefix("s3://"), recursive=True, allow_not_found=True))
    return sorted(f.path for f in found if f.path.endswith("/checkpoint.pt"))


def files_containing(root: Path, needle: bytes) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                if needle in path.read_bytes():
                    hits.append(str(path))
            except OSError:
                continue
    return hits


def test_s3_source_counts_rows_like_the_local_one(data_root, s3_endpoint):
    splits = prepare(s3_source(s3_endpoint, "s3://data/cifar10"))
    assert {name: (len(s.files), s.rows) for name, s in splits.items()} == {"train": (2, 512), "valid": (1, 256)}
    assert splits["train"].files == ["data/" + f for f in DATA_FILES[:2]]


@pytest.mark.parametrize(
    ("root", "overrides", "message"),
    [
        (
            "s3://nobucket/cifar10",
            [],
            r"source.train: the bucket 'nobucket' of s3://nobucket/cifar10/train does not exist",
        ),
        ("s3://data/empty", [], r"source.train: no parquet files under s3://data/empty/train"),
        ("s3://key:hunter2@data/cifar10", [], r"source.train: the s3:// URI carries credentials"),
    ],
)
def test_s3_source_errors_name_the_key_and_uri(s3_endpoint, root, overrides, message):
    with pytest.raises(PipelineError, match=message) as caught:
        prepare(s3_source(s3_endpoint, root, *overrides))
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize("server", ["refuses", "never answers"])
def test_unreachable_endpoint_fails_within_its_timeouts(server):
    """A closed port and a port that accepts but never answers: both end within the configured bounds."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    if server == "never answers":
        listener.listen(8)
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    started = time.monotonic()
    with pytest.raises(
        PipelineError,
        match=r"source.train: cannot read s3://data/cifar10/train: "
        r"(cannot connect to the endpoint|the endpoint did not answer in time)",
    ):
        prepare(
            s3_source(
                endpoint,
                "s3://data/cifar10",
                "source.s3.connect_timeout_s=1",
                "source.s3.request_timeout_s=1",
                "source.s3.max_attempts=2",
            )
        )
    assert time.monotonic() - started < 60  # a hang guard: 2 attempts of 1 s each, plus back-off
    listener.close()


def test_storage_in_a_missing_bucket_fails_before_training(s3_endpoint):
    storage = compose_cfg([f"storage.s3.endpoint_url={s3_endpoint}"]).storage
    with pytest.raises(PipelineError, match=r"storage.path: cannot read s3://nobucket/runs: the bucket does not exist"):
        make_dir("s3://nobucket/runs", storage.s3, "storage.path")


@pytest.fixture(scope="module")
def s3_with_auth(data_root, tmp_path_factory):
    """A moto server that enforces IAM: user ``reader`` may read bucket ``data``, user ``nobody`` nothing.

    Its first requests (the setup below, counted in INITIAL_NO_AUTH_ACTION_COUNT) run unchecked."""
    port = free_port()
    setup_requests = 1 + len(DATA_FILES) + 2 + 2 + 1
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(setup_requests)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_port(port)
    endpoint = f"http://127.0.0.1:{port}"
    s3, iam = (boto3.client(name, endpoint_url=endpoint) for name in ("s3", "iam"))
    s3.create_bucket(Bucket="data")
    for key in DATA_FILES:
        s3.put_object(Bucket="data", Key=key, Body=(data_root / key).read_bytes())
    keys = {}
    for user in ("reader", "nobody"):
        iam.create_user(UserName=user)
        keys[user] = iam.create_access_key(UserName=user)["AccessKey"]
    iam.put_user_policy(
        UserName="reader",
        PolicyName="read-data",
        PolicyDocument="""{"Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"],
                       "Resource": ["arn:aws:s3:::data", "arn:aws:s3:::data/*"]}]}""",
    )
    yield endpoint, keys
    server.terminate()
    server.wait(timeout=30)


def use_keys(monkeypatch, key: dict) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])


def test_credentials_come_from_the_environment(s3_with_auth, monkeypatch):
    endpoint, keys = s3_with_auth
    use_keys(monkeypatch, keys["reader"])
    assert prepare(s3_source(endpoint, "s3://data/cifar10"))["train"].rows == 512


def test_credentials_come_from_an_aws_profile(s3_with_auth, monkeypatch, tmp_path):
    endpoint, keys = s3_with_auth
    (tmp_path / "credentials").write_text(
        f"[pipeline]\naws_access_key_id = {keys['reader']['AccessKeyId']}\n"
        f"aws_secret_access_key = {keys['reader']['SecretAccessKey']}\n"
    )
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_PROFILE", "pipeline")
    assert prepare(s3_source(endpoint, "s3://data/cifar10"))["valid"].rows == 256


def test_access_denied_is_a_clear_error(s3_with_auth, monkeypatch):
    endpoint, keys = s3_with_auth
    use_keys(monkeypatch, keys["nobody"])
    with pytest.raises(
        PipelineError,
        match=r"source.train: cannot read s3://data/cifar10/train: access denied.*"
        r"AWS_ACCESS_KEY_ID",
    ):
        prepare(s3_source(endpoint, "s3://data/cifar10"))


def test_cli_exits_with_the_s3_error_and_logs_nothing(tmp_path, data_root):
    result = run_cli(
        [
            "+experiment=smoke",
            "source=s3",
            "source.root=s3://data/cifar10",
            "source.s3.endpoint_url=http://127.0.0.1:9",
            "source.s3.max_attempts=1",
        ],
        tmp_path,
        data_root,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1
    assert "source.train: cannot read s3://data/cifar10/train: cannot connect to the endpoint" in output
    assert "Traceback" not in output and not (tmp_path / "outputs" / "mlflow.db").exists()
