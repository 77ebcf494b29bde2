"""``python -m pipeline.sync SPOOL``: a training run's record that the tracking server never took, uploaded
into the same MLflow run once the server answers again (the run's last paragraph names SPOOL, its
``mlflow-spool.jsonl``). Records the server already holds are not sent twice. The server is
``--tracking-uri``, else MLFLOW_TRACKING_URI, else the one the run logged to; an ``s3://`` SPOOL is read with
the AWS SDK's credentials and AWS_ENDPOINT_URL.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

from mlflow.exceptions import MlflowException

from pipeline.common.errors import PipelineError, redact
from pipeline.common.metrics import first_task_metric
from pipeline.config import S3Config
from pipeline.runtime import filesystems
from pipeline.tracking import mlflow_store, run_config, spool
from pipeline.tracking.delivery import Delivery

log = logging.getLogger("pipeline.sync")


def sync(path: str, tracking_uri: str | None) -> str:
    """Deliver what the local spool at ``path`` holds beyond what was sent; a line saying what was done."""
    header, _, _ = spool.read(path)
    client, uri = mlflow_store.connect(tracking_uri or header["tracking_uri"], outputs=os.path.dirname(path))
    run_id = header["run_id"]
    cfg = run_config.logged_config(client, run_id)
    deliver = Delivery(client, header["experiment_id"], run_id, cfg, first_task_metric(cfg.task.metrics))
    try:
        _, count = spool.replay(path, deliver)
    except MlflowException as err:
        raise PipelineError(
            f"the MLflow store at {redact(uri)} did not take run {run_id}'s record ({err.message}); what it took "
            f"is marked in {spool.sent_marker(path)}. Run the same command again to send the rest."
        ) from None
    run = client.get_run(run_id)
    link = mlflow_store.run_link(uri, run_id)
    return f"sent {count} record(s) into run {run.info.run_name!r}, now {run.info.status}; {link}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.sync", description=__doc__.split("\n\n")[0])
    parser.add_argument("spool", help="the run's mlflow-spool.jsonl, a local path or s3:// URI")
    parser.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    try:
        if not filesystems.is_s3(args.spool):
            log.info("%s", sync(args.spool, args.tracking_uri))
            return 0
        fs, remote = filesystems.locate(args.spool, S3Config(endpoint_url=os.environ.get("AWS_ENDPOINT_URL")), "spool")
        with tempfile.TemporaryDirectory() as tmp:
            local = os.path.join(tmp, spool.SPOOL_FILE)
            for source, target in ((remote, local), (spool.sent_marker(remote), spool.sent_marker(local))):
                if fs.get_file_info(source).is_file:
                    with fs.open_input_stream(source) as stream, open(target, "wb") as out:
                        out.write(stream.read())
            log.info("%s", sync(local, args.tracking_uri))
        return 0
    except (PipelineError, OSError) as err:
        log.error("%s", err)
        return 1


if __name__ == "__main__":
    sys.exit(main())
