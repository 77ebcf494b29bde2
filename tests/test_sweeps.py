"""Hydra multirun sweeps end to end: one process, one Ray runtime, a parent MLflow run per sweep,
failed jobs recorded and summarized; the MLflow UI shows the result in a real browser."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import free_port, wait_for_port
from mlflow import MlflowClient
from servers import NO_SERVER_JOBS
from test_pipeline import run_cli

from pipeline.tracking.mlflow_store import UI_VIEW

GRID = [
    "-m",
    "+experiment=smoke",
    "optim.lr=0.001",
    "train.epochs=1,0",
    "ingest.batch_size=64",
    "source.limit=256",
    "scaling.num_workers=1",
    "tracking.register_as=smoke_vit",  # each job's model a version; champion: the best job's
    "hydra.sweep.dir=sweep",
]


def children_of(client: MlflowClient, experiment_id: str, parent_id: str) -> list:
    return client.search_runs(
        [experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'",
        order_by=["attributes.start_time ASC"],
    )


@pytest.fixture(scope="module")
def grid_sweep(tmp_path_factory, data_root):
    """A grid of two jobs, the train.epochs=0 one failing validation (two training jobs on one runtime, and
    each job's start-up clock: the Optuna sweep)."""
    workdir = tmp_path_factory.mktemp("grid")
    result = run_cli(GRID, workdir, data_root)
    return workdir, result


@pytest.mark.slow
def test_grid_sweep_runs_every_job_on_one_ray_runtime(grid_sweep):
    workdir, result = grid_sweep
    output = result.stdout + result.stderr
    assert result.returncode == 1, output  # a job failed, so the sweep fails at the end
    assert output.count("Ray runtime up") == 1
    assert "2 jobs, 1 failed" in output
    table = output[output.index("2 jobs, 1 failed") :]
    assert re.search(r"0\s+FINISHED\s+[\d.]+\s+\+experiment=smoke optim.lr=0.001 train.epochs=1", table)
    assert re.search(r"1\s+FAILED\s+nan\s+.*train.epochs=0", table)
    assert "train.epochs must be >= 1, got 0" in table
    for job in range(2):
        assert (workdir / "sweep" / str(job) / ".hydra" / "overrides.yaml").exists()
    assert (workdir / "sweep" / "0" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_grid_sweep_is_one_parent_with_a_child_per_job(grid_sweep):
    workdir, _ = grid_sweep
    client = MlflowClient(f"sqlite:///{workdir / 'outputs' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("smoke")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and len(runs) == 3
    parent = parents[0]
    assert parent.data.tags["pipeline.sweep_dir"] == str(workdir / "sweep")
    assert parent.info.status == "FAILED"  # not every job succeeded

    children = children_of(client, experiment.experiment_id, parent.info.run_id)
    assert [c.data.params["optim.lr"] for c in children] == ["0.001", "0.001"]
    assert [c.data.params["train.epochs"] for c in children] == ["1", "0"]
    assert [c.info.status for c in children] == ["FINISHED", "FAILED"]
    assert "train.epochs must be >= 1, got 0" in children[1].data.tags["pipeline.error"]
    assert children[0].info.run_name == (
        "job 0: optim.lr=0.001 train.epochs=1 ingest.batch_size=64 source.limit=256 scaling.num_workers=1 "
        "tracking.register_as=smoke_vit"
    )
    for child in children:
        assert child.data.tags["pipeline.overrides"].startswith("+experiment=smoke optim.lr=")
        assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", child.data.tags["mlflow.source.git.commit"])
    (best,) = [c for c in children if c.info.status == "FINISHED"]
    assert {"learning_curve.png", "config.yaml", "model"} <= {a.path for a in client.list_artifacts(best.info.run_id)}
    assert parent.data.tags["pipeline.best_run_id"] == best.info.run_id
    assert parent.data.metrics["best_val_accuracy"] == best.data.metrics["val_accuracy"]
    champion = client.get_model_version_by_alias("smoke_vit", "champion")  # moved there as the sweep ended
    (model,) = client.search_logged_models([experiment.experiment_id], f"source_run_id = '{best.info.run_id}'")
    assert champion.run_id == best.info.run_id and champion.source == f"models:/{model.model_id}"  # its checkpoint


def test_a_job_whose_overrides_do_not_compose_is_a_failed_child_and_the_sweep_goes_on(tmp_path, data_root):
    """train.epochs=many fails Hydra's composition (the schema's int), epochs=0 our checks: neither
    starts Ray, both are recorded, and the sweep reports them and exits non-zero."""
    result = run_cli(["-m", "+experiment=smoke", "train.epochs=many,0", "hydra.sweep.dir=sweep"], tmp_path, data_root)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Traceback" not in output and "Ray runtime up" not in output
    assert "2 jobs, 2 failed" in output
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("smoke")
    (parent,) = [r for r in client.search_runs([experiment.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]
    children = children_of(client, experiment.experiment_id, parent.info.run_id)
    assert [c.info.status for c in children] == ["FAILED", "FAILED"]
    assert [c.info.run_name for c in children] == ["job 0: train.epochs=many", "job 1: train.epochs=0"]
    assert (
        "train.epochs" in children[0].data.tags["pipeline.error"] and "many" in children[0].data.tags["pipeline.error"]
    )
    assert "train.epochs must be >= 1, got 0" in children[1].data.tags["pipeline.error"]
    assert parent.info.status == "FAILED"


@pytest.mark.slow
def test_optuna_sweep_returns_the_metric_it_optimizes(tmp_path, data_root):
    result = run_cli(
        [
            "+experiment=smoke",
            "hparams_search=optuna",
            "hydra.sweeper.n_trials=2",
            "train.epochs=1",
            "ingest.batch_size=64",
            "source.limit=256",
            "scaling.num_workers=1",
            "hydra.sweep.dir=sweep",
        ],
        tmp_path,
        data_root,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert output.count("Ray runtime up") == 1  # the second training job reused the runtime
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("smoke")
    parent = client.search_runs([experiment.experiment_id], filter_string="tags.`pipeline.sweep_dir` LIKE '%sweep'")[0]
    children = children_of(client, experiment.experiment_id, parent.info.run_id)
    assert [c.info.status for c in children] == ["FINISHED", "FINISHED"]
    lrs = [float(c.data.params["optim.lr"]) for c in children]
    assert all(1e-4 <= lr <= 3e-3 for lr in lrs) and lrs[0] != lrs[1]  # sampled, not the default
    results = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    best = max(children, key=lambda c: c.data.metrics["val_accuracy"])
    assert results["best_value"] == pytest.approx(best.data.metrics["val_accuracy"])
    assert parent.data.tags["pipeline.best_run_id"] == best.info.run_id and parent.info.status == "FINISHED"
    # each job's start-up counts from its own start (job 0: the command's), not from the process's
    assert children[1].data.metrics["startup_s"] < children[0].data.metrics["startup_s"]  # Ray was up already


@pytest.fixture
def mlflow_ui(grid_sweep):
    """A real MLflow server on loopback over the sweep's store."""
    workdir, _ = grid_sweep
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{workdir / 'outputs' / 'mlflow.db'}",
            "--workers",
            "1",
        ],
        cwd=workdir,
        env={**os.environ, **NO_SERVER_JOBS},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_port(port)
    yield workdir, f"http://127.0.0.1:{port}"
    server.terminate()
    server.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.skipif(
    not (shutil.which("chromium") and shutil.which("chromedriver")),
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
)
def test_mlflow_ui_shows_the_sweep_in_a_real_browser(mlflow_ui, grid_sweep, tmp_path):
    """The link the run's last console line gives opens the run in the UI's "Model training" view, with its
    metrics, charts and registered model; the experiment's table shows the sweep. The experiment carries
    the experiment-kind tag, yet MLflow 3.17.2 opens its plain URL in the GenAI view: the canary of the
    view the links carry (``runs.UI_VIEW``)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    workdir, url = mlflow_ui
    client = MlflowClient(f"sqlite:///{workdir / 'outputs' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("smoke")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    child = next(r for r in runs if r.info.status == "FINISHED" and "mlflow.parentRunId" in r.data.tags)
    output = grid_sweep[1].stdout + grid_sweep[1].stderr
    (link,) = re.findall(r"see it with `mlflow ui --backend-store-uri \S+` at (http://127.0.0.1:5000/\S+)", output)
    assert link.endswith(f"#/experiments/{experiment.experiment_id}/runs/{child.info.run_id}?{UI_VIEW}")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'chrome'}",
        "--window-size=1400,900",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    text = lambda: driver.find_element("tag name", "body").text  # noqa: E731
    accuracy = f"{child.data.metrics['val_accuracy']:.4g}"[:4]
    try:
        wait = WebDriverWait(driver, 60)
        driver.get(link.replace("http://127.0.0.1:5000", url))  # the test's server, on a free port
        wait.until(
            lambda d: child.info.run_name in text() and "val_accuracy" in text() and "Registered models" in text()
        )
        run_page = text()
        driver.save_screenshot(str(tmp_path / "run.png"))
        driver.find_element("xpath", "//*[text()='Model metrics']").click()  # the run's charts
        wait.until(lambda d: len(d.find_elements("css selector", "svg.main-svg")) >= 4)  # plotly's, one per chart
        charts = text()
        driver.save_screenshot(str(tmp_path / "charts.png"))

        driver.get(f"{url}/#/experiments/{experiment.experiment_id}/runs?{UI_VIEW}")  # the table
        wait.until(lambda d: parent.info.run_name in text())
        table = text()
        driver.save_screenshot(str(tmp_path / "experiment.png"))
        driver.get(f"{url}/#/experiments/{experiment.experiment_id}")  # the plain URL, the tag notwithstanding
        wait.until(lambda d: "workflowType=" in d.current_url)
        plain = driver.current_url
    finally:
        driver.quit()
    # the training view's navigation (Runs, Models, Model registry), not the GenAI one's (Judges, Sessions)
    assert "Model registry" in run_page and "Judges" not in run_page and "Sessions" not in run_page
    assert child.info.run_name in run_page and accuracy in run_page
    assert "Registered models\nsmoke_vit\nv1" in run_page  # the model version it registered
    assert "checkpoint-0" in run_page  # its one epoch's checkpoint, a LoggedModel
    assert "data_wait_fraction" in charts  # a chart per metric, by name
    assert "3 matching runs" in table and "Judges" not in table  # the parent and 2 children
    assert plain.endswith("/overview/usage?workflowType=genai")  # when this fails, links need no UI_VIEW
    assert (tmp_path / "run.png").stat().st_size > 10_000
