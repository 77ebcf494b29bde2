"""A user's own data, by config alone: Hugging Face image parquet, class-sorted files, tables of numbers,
a declared task, labels checked before training, and what each run records of its data."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch
from conftest import compose_cfg, epoch_dataset, in_block_order, row_groups, write_split
from mlflow import MlflowClient
from PIL import Image
from test_pipeline import no_runs_logged, run_cli

from pipeline.common.errors import PipelineError
from pipeline.config import TaskConfig, validate
from pipeline.data import datasets, source
from pipeline.jobs import predict
from pipeline.jobs.job import Job
from pipeline.jobs.train import run
from pipeline.tracking import lineage
from pipeline.tracking.scores import per_class, report
from pipeline.training.task import Task, constant_baseline, no_learning

# The experiment a user keeps in their own directory: a Hugging Face image export (PNG in {bytes, path}
# structs, grayscale, mixed sizes), decoded to 16x16 RGB for a small ViT.
USER_EXPERIMENT = """\
# @package _global_
source:
  train: ${oc.env:USER_DATA}/train
  valid: ${oc.env:USER_DATA}/valid
  download: null
  num_classes: 4
transforms:
  train:
    decode: {fn: {_target_: transforms.decode_image, size: 16}}
    crop: null
  valid:
    decode: {fn: {_target_: transforms.decode_image, size: 16}}
model:
  image_size: 16
  num_layers: 2
  num_heads: 2
  hidden_dim: 32
  mlp_dim: 64
train:
  epochs: 4
ingest:
  batch_size: 32
scaling:
  num_workers: 1
"""


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def write_hf_split(directory: Path, rows: int, seed: int) -> None:
    """Grayscale PNGs of random sizes whose brightness follows the label (0-3), as Hugging Face's
    parquet export stores images: a struct column ``image`` of ``{bytes, path}``."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, size=rows)
    images = []
    for i, label in enumerate(labels):
        height, width = rng.integers(12, 40, size=2)
        pixels = np.clip(rng.normal(60 * label + 30, 15, (height, width)), 0, 255).astype(np.uint8)
        images.append({"bytes": png(pixels), "path": f"{i}.png"})
    kind = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    directory.mkdir(parents=True)
    pq.write_table(pa.table({"image": pa.array(images, kind), "label": labels}), directory / "data.parquet")


@pytest.mark.slow
def test_a_hugging_face_png_dataset_trains_from_an_experiment_in_the_users_config_dir(tmp_path, monkeypatch):
    data, conf = tmp_path / "hf", tmp_path / "my_conf"
    write_hf_split(data / "train", 384, seed=0)
    write_hf_split(data / "valid", 128, seed=1)
    (conf / "experiment").mkdir(parents=True)
    (conf / "experiment" / "mine.yaml").write_text(USER_EXPERIMENT)
    monkeypatch.setenv("USER_DATA", str(data))

    result = run_cli(["--config-dir", str(conf), "+experiment=mine"], tmp_path, tmp_path / "unused")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("mine").experiment_id])
    assert run.info.status == "FINISHED" and run.data.metrics["val_accuracy"] > 0.5  # chance: 0.25
    inputs = {d.dataset.name: d for d in run.inputs.dataset_inputs}  # the UI's Dataset column
    assert set(inputs) == {"hf/train", "hf/valid"}
    assert [t.value for t in inputs["hf/train"].tags] == ["training"]
    assert '"num_rows": 384' in inputs["hf/train"].dataset.profile
    assert '"name": "image"' in inputs["hf/train"].dataset.schema and str(data) in inputs["hf/train"].dataset.source


def write_sorted_and_shuffled(root: Path) -> None:
    """``root/{sorted,shuffled}/cifar10``: the same rows, stored class by class (a file per class) and shuffled."""
    write_split(root / "rows", 512, 1, seed=1)
    table = pq.read_table(root / "rows")
    order = np.argsort(table["label"].to_numpy(), kind="stable")
    for name, rows in (("sorted", order), ("shuffled", np.random.default_rng(0).permutation(len(order)))):
        train = root / name / "cifar10" / "train"
        train.mkdir(parents=True)
        ordered = table.take(rows)
        for label in range(10) if name == "sorted" else [None]:
            part = ordered if label is None else ordered.filter(pa.compute.equal(ordered["label"], label))
            pq.write_table(part, train / f"part-{label or 0:05d}.parquet")
        write_split(root / name / "cifar10" / "test", 256, 1, seed=2)


def sorted_wine(root: Path) -> None:
    """scikit-learn's wine data as a user may store it: the training rows class by class, a file per class."""
    datasets.write_sklearn(str(root), "wine")
    train = pq.read_table(root / "wine" / "train")
    for path in (root / "wine" / "train").iterdir():
        path.unlink()
    for label in range(3):
        part = train.filter(pa.compute.equal(train["target"], label))
        pq.write_table(part, root / "wine" / "train" / f"class-{label}.parquet")


CULTIVARS = ["barolo", "grignolino", "barbera"]  # the wine data's three cultivars, by name


def named(split: Path) -> None:
    """The split's integer ``target`` as class names, as CSV and database exports hold labels."""
    for path in split.glob("*.parquet"):
        table = pq.read_table(path)
        names = pa.array([CULTIVARS[i] for i in table["target"].to_pylist()])
        pq.write_table(table.set_column(table.schema.get_field_index("target"), "target", names), path)


@pytest.mark.slow
def test_class_sorted_files_train_as_well_as_shuffled_ones_and_the_model_predicts(tmp_path, ray_runtime):
    """The default shuffle mixes any layout (test_the_shuffle_is_new_each_epoch... shows a batch of a
    class-sorted split holding many classes), so a class-sorted copy of the rows reaches the accuracy of
    the shuffled copy scikit-learn's rows are written as. The shuffled copy holds its labels as names, with
    source.num_classes left out: the classes are found, sorted, logged, and the model (the newest run)
    predicts its validation rows by name: the tabular classification path end to end."""
    datasets.write_sklearn(str(tmp_path / "shuffled"), "wine")
    for split in ("train", "valid"):
        named(tmp_path / "shuffled" / "wine" / split)
    sorted_wine(tmp_path / "sorted")
    accuracy = {}
    for name in ("sorted", "shuffled"):
        args = ["+experiment=wine_mlp", f"source.root={tmp_path / name}", f"paths.outputs={tmp_path / 'out'}"]
        kept = ["train.epochs=8", "train.num_to_keep=1"]  # a LoggedModel for the best and the latest, not all 8
        cfg = compose_cfg([*args, *kept, *(["source.num_classes=null"] if name == "shuffled" else [])])
        accuracy[name] = run(cfg, Job(str(tmp_path / f"run-{name}"), "wine")).metrics["val_accuracy"]
    assert accuracy["shuffled"] >= 0.85, accuracy  # chance: about 0.4
    assert abs(accuracy["sorted"] - accuracy["shuffled"]) <= 0.06, accuracy  # two of 36 rows

    predict.run(compose_cfg([*args, "stage=evaluate"]), Job(str(tmp_path / "evaluate"), "wine"))
    training, written = predicted_as_validated(tmp_path / "out", "wine", ("val_accuracy",), stage="evaluate")
    assert training.data.metrics["val_accuracy"] == accuracy["shuffled"]
    assert training.data.params["source.classes"] == str(sorted(CULTIVARS))  # index order
    assert training.data.params["source.num_classes"] == "3"
    assert set(written["prediction"].to_pylist()) <= set(CULTIVARS) and "confidence" in written.column_names
    assert set(written["target"].to_pylist()) == set(CULTIVARS)  # the labels, as the data holds them
    checkpoint = sorted(Path(training.data.tags["pipeline.storage"]).glob("checkpoint_*/checkpoint.pt"))[-1]
    assert torch.load(checkpoint, weights_only=True)["classes"] == sorted(CULTIVARS)

    # stage=evaluate: the confusion matrix and each class's figures, as counted by hand from the written rows
    client = MlflowClient(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    (evaluation,) = client.search_runs([training.info.experiment_id], "tags.`pipeline.stage` = 'evaluate'")
    report = json.loads(
        (Path(client.download_artifacts(evaluation.info.run_id, "per_class.json", str(tmp_path)))).read_text()
    )
    assert "confusion_matrix.png" in {a.path for a in client.list_artifacts(evaluation.info.run_id)}
    truth, guess = np.array(written["target"].to_pylist()), np.array(written["prediction"].to_pylist())
    assert report["classes"] == sorted(CULTIVARS)
    for i, name in enumerate(sorted(CULTIVARS)):
        assert report["confusion_matrix"][i] == [
            int(np.sum((truth == name) & (guess == other))) for other in sorted(CULTIVARS)
        ]
        hits = np.sum((truth == name) & (guess == name))
        row = report["per_class"][i]
        assert row["precision"] == pytest.approx(hits / max(np.sum(guess == name), 1))
        assert row["recall"] == pytest.approx(hits / np.sum(truth == name)) and row["support"] == np.sum(truth == name)
    f1 = [r["f1"] for r in report["per_class"]]
    assert evaluation.data.metrics["macro_f1"] == pytest.approx(np.mean(f1))


def test_per_class_figures_match_a_hand_count():
    labels, predicted = np.array(["a", "a", "b", "b", "c"]), np.array(["a", "b", "b", "b", "a"])
    matrix, rows = per_class(labels, predicted, ["a", "b", "c"])
    assert matrix.tolist() == [[1, 1, 0], [0, 2, 0], [1, 0, 0]]
    assert [(r["precision"], r["recall"], r["support"]) for r in rows] == [
        (0.5, 0.5, 2),
        (2 / 3, 1.0, 2),
        (0.0, 0.0, 1),
    ]
    assert [r["f1"] for r in rows] == pytest.approx([0.5, 0.8, 0.0])  # c: never predicted, never found
    rows = pa.table({"label": [0, 1, 7], "prediction": [0, 1, 1]})  # 7: no class of a 3-class model
    with pytest.raises(PipelineError, match="predict.source has label.s. 7 in column 'label', which the model's"):
        report(None, "unused", rows, "label", TaskConfig(), [0, 1, 2])


def test_a_validation_label_the_training_split_lacks_fails_naming_it_file_and_row(tmp_path):
    """Classes by name come from the training split (sorted); a validation label outside them is an error
    before anything runs, as is a class count that disagrees with them."""
    datasets.write_sklearn(str(tmp_path), "wine")
    for split in ("train", "valid"):
        named(tmp_path / "wine" / split)
    args = ["+experiment=wine_mlp", f"source.root={tmp_path}", "source.num_classes=null"]
    cfg = compose_cfg(args)
    assert cfg.source.classes == sorted(CULTIVARS) and cfg.model["hidden_channels"][-1] == 3
    path = with_a_missing_value(tmp_path / "wine" / "valid", "target", row=4, value="nebbiolo")
    with pytest.raises(PipelineError, match=rf"^source.valid: {path} row 4 has label 'nebbiolo' in column 'target', "):
        source.prepare(cfg.source)
    with pytest.raises(PipelineError, match=r"source.num_classes is 4, but the labels are names of 3 classes"):
        compose_cfg([*args, "source.num_classes=4"])


def shuffled_rows(cfg: dict, split: source.Split, epoch: int) -> list[tuple[bytes, int]]:
    """The training split's rows (image bytes, label) in their order at ``epoch``, as a worker's pass would see them
    from a dataset built anew, its read tasks each holding a row group or two (a third of ingest.read_task_mib)."""
    with in_block_order(epoch) as actor:
        mib = sum(group.bytes for group in row_groups(split)) / 6 / 2**20
        ds = epoch_dataset(cfg, split, actor, seed=cfg.train.seed, task_mib=mib)
        return [(row["image"], row["label"]) for row in ds.take_all()]


def test_the_shuffle_is_new_each_epoch_and_the_same_for_the_same_epoch(tmp_path, ray_runtime):
    """Seeded by train.seed and the epoch only: a resumed run (a new dataset) repeats epoch N exactly, as
    DETERMINISTIC runs read it, in block order (ingest.preserve_order=true); a class-sorted layout read by tasks of a
    row group or two still gives a first batch of several classes (each task mixes the row groups it reads, drawn
    from all over the split)."""
    write_sorted_and_shuffled(tmp_path)
    cfg = compose_cfg([f"source.root={tmp_path / 'sorted'}", "source.download=null", "source.limit=null"])
    split = source.prepare(cfg.source)["train"]
    first, second, again = (shuffled_rows(cfg, split, epoch) for epoch in (0, 1, 1))
    stored = pq.read_table(split.files)
    assert sorted(first) == sorted(zip(stored["image"].to_pylist(), stored["label"].to_pylist()))
    assert first != second and second == again
    assert len({label for _, label in first[:32]}) >= 2  # a class-sorted layout, yet a batch holds several classes


def checked_split(path: Path, num_classes: int | None = None) -> source.Split:
    """``path`` checked as ``source.train`` of image + label rows."""
    return source.check_split(
        "source.train",
        str(path),
        pafs.LocalFileSystem(),
        str(path),
        columns=["image", "label"],
        num_classes=num_classes,
    )


def labelled(path: Path, labels, statistics: bool = True) -> None:
    path.mkdir(parents=True, exist_ok=True)
    table = pa.table({"image": [b"x"] * len(labels), "label": labels})
    pq.write_table(table, path / "part-00000.parquet", write_statistics=statistics, row_group_size=2)


@pytest.mark.parametrize("statistics", [True, False])  # from the footers, or read when they have none
def test_a_label_outside_the_classes_fails_before_training_naming_file_row_and_key(tmp_path, statistics):
    labelled(tmp_path / "train", [0, 1, 2, 9, 10, 3], statistics)
    with pytest.raises(PipelineError) as error:
        checked_split(tmp_path / "train", num_classes=10)
    message = str(error.value)
    assert "part-00000.parquet row 4 has label 10" in message and "outside [0, 10)" in message
    assert "source.num_classes" in message
    labelled(tmp_path / "ok", [0, 9, 3], statistics)
    assert checked_split(tmp_path / "ok", num_classes=10).rows == 3


def test_float_labels_for_classification_fail_naming_the_regression_task(tmp_path):
    labelled(tmp_path / "train", [0.5, 1.5])
    with pytest.raises(PipelineError, match="not integer class labels.*task=regression"):
        checked_split(tmp_path / "train", num_classes=2)


def test_task_metrics_match_their_definitions():
    outputs = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.1, 0.4], [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]])
    labels = torch.tensor([1, 2, 0, 0])
    loss = {"_target_": "torch.nn.CrossEntropyLoss"}
    task = Task(TaskConfig("classification", loss, ["accuracy", "top2_accuracy"]))
    sums = task.sums(outputs, labels)
    assert sums["accuracy"].item() == 2 and sums["top2_accuracy"].item() == 3  # row 3: label 0 is third
    regression = Task(TaskConfig("regression", {"_target_": "torch.nn.HuberLoss"}, ["mae", "rmse"]))
    predicted, actual = torch.tensor([[1.0], [2.0], [4.0]]), torch.tensor([1.0, 4.0, 1.0], dtype=torch.float64)
    sums = regression.sums(predicted, actual)
    assert regression.metrics["mae"].value(sums["mae"].item(), 3) == pytest.approx(5 / 3)
    assert regression.metrics["rmse"].value(sums["rmse"].item(), 3) == pytest.approx(np.sqrt(13 / 3))
    assert regression.loss(predicted, actual).item() == pytest.approx(
        torch.nn.HuberLoss()(predicted[:, 0], actual.float())
    )


def test_a_model_no_better_than_a_constant_prediction_is_named_with_the_constants_score():
    classification = ("classification", ["accuracy", "top2_accuracy"])
    baseline = constant_baseline(*classification, np.array([0, 2, 2, 1]))
    assert baseline == {"val_accuracy": 0.5}  # always class 2; top-k needs scores a constant has not
    verdict = no_learning(*classification, {"val_accuracy": 0.5, "val_top2_accuracy": 0.9}, baseline)
    assert verdict.startswith("val_accuracy 0.5 is no better than always predicting the validation split's most")
    assert no_learning(*classification, {"val_accuracy": 0.75}, baseline) is None
    regression = ("regression", ["mae", "rmse"])
    baseline = constant_baseline(*regression, np.array([0.0, 4.0, 2.0]))  # always 2
    assert baseline == pytest.approx({"val_mae": 4 / 3, "val_rmse": np.sqrt(8 / 3)})
    assert "val_mae 1.5 is no better than always predicting the validation split's mean (1.333" in no_learning(
        *regression, {"val_mae": 1.5, "val_rmse": 1.0}, baseline
    )
    assert no_learning(*regression, {"val_mae": 1.0, "val_rmse": 1.5}, baseline) is None


def test_the_task_sets_the_metric_names_and_what_is_optimized():
    regression = compose_cfg(["+experiment=diabetes_mlp"])
    assert regression.optimized_metric == "val_mae" and regression.task.metrics == ["mae", "rmse"]
    regression.train.checkpoint_metric = "val_rmse"
    validate(regression)
    top5 = compose_cfg(["task.metrics=[accuracy,top5_accuracy]", "optimized_metric=val_top5_accuracy"])
    validate(top5)
    with pytest.raises(PipelineError, match="task.metrics: 'mae' is not a classification metric"):
        validate(compose_cfg(["task.metrics=[mae]"]))
    with pytest.raises(PipelineError, match="optimized_metric must be one of .*val_mae"):
        validate(dataclasses.replace(regression, optimized_metric="val_accuracy"))


def test_runs_on_different_data_record_different_dataset_digests(tmp_path):
    """The dataset inputs MLflow shows tell two runs on different data apart."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("data")
    digests = []
    for name, labels in (("a", [0, 1]), ("b", [0, 1, 1])):
        labelled(tmp_path / name / "train", labels)
        split = checked_split(tmp_path / name / "train")
        run_id = client.create_run(experiment).info.run_id
        lineage.log_data(client, run_id, {"train": split}, None)
        (logged,) = client.get_run(run_id).inputs.dataset_inputs
        assert logged.dataset.digest == split.digest and f'"num_rows": {len(labels)}' in logged.dataset.profile
        digests.append(logged.dataset.digest)
    assert digests[0] != digests[1]


def predicted_as_validated(outputs: Path, experiment: str, metrics: tuple[str, ...], stage: str = "predict"):
    """The prediction (or evaluation) run in ``outputs`` and the training run whose model it used: both
    FINISHED, the predictions' metrics equal to that run's last validation metrics, over as many rows.
    Returns the training run and the written predictions."""
    client = MlflowClient(f"sqlite:///{outputs / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    (prediction,) = [r for r in runs if r.data.tags.get("pipeline.stage") == stage]
    training = client.get_run(prediction.data.tags["mlflow.parentRunId"])
    assert training.info.status == prediction.info.status == "FINISHED"
    for metric in metrics:
        name = metric.removeprefix("val_")
        assert prediction.data.metrics[f"predict_{name}"] == pytest.approx(training.data.metrics[metric], rel=1e-4)
    written = pq.read_table(prediction.data.tags["pipeline.predictions"])
    assert written.num_rows == training.data.metrics["val_rows"]
    return training, written


@pytest.mark.slow
def test_a_regression_table_trains_and_predicts_with_its_tasks_metrics(tmp_path, ray_runtime, monkeypatch):
    """scikit-learn's diabetes data: written to parquet on first use, trained, then evaluated with the
    same standardization (the predictions' metrics equal the last epoch's validation metrics; a residual
    plot). In-process
    on the shared runtime, as a sweep's jobs run (the CLI itself: test_pipeline.py; classification:
    the class-sorted test above)."""
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(tmp_path / "data"))
    datasets.write_sklearn(str(tmp_path / "data"), "diabetes", vector=True)
    with_a_missing_value(tmp_path / "data" / "diabetes" / "train", "features", row=3, value=float("nan"), index=2)
    with_a_missing_value(tmp_path / "data" / "diabetes" / "valid", "features", row=5, value=None, index=0)
    args = [
        "+experiment=diabetes_mlp",
        "train.epochs=5",
        "source.on_missing=mean",  # the missing values become the training mean; every row counts
        f"paths.outputs={tmp_path / 'outputs'}",
        "train.evaluate=true",  # evaluation as training's last step, on source.test: here the validation rows
        f"source.test={tmp_path / 'data' / 'diabetes' / 'valid'}",
    ]
    run(compose_cfg(args), Job(str(tmp_path / "train"), "diabetes_mlp"))
    training, written = predicted_as_validated(
        tmp_path / "outputs", "diabetes_mlp", ("val_mae", "val_rmse"), "evaluate"
    )
    assert pa.types.is_floating(written["prediction"].type) and written.num_rows == 88  # none dropped
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    (evaluation,) = client.search_runs([training.info.experiment_id], "tags.`pipeline.stage` = 'evaluate'")
    assert "residuals.png" in {a.path for a in client.list_artifacts(evaluation.info.run_id)}
    # the evaluation is linked to the LoggedModel it scored, and its metrics to the model and the rows
    model_id = training.data.tags["pipeline.model_id"]
    assert [m.model_id for m in client.get_run(evaluation.info.run_id).inputs.model_inputs] == [model_id]
    scored = {m.key: m for m in client.get_logged_model(model_id).metrics}
    assert scored["predict_mae"].value == evaluation.data.metrics["predict_mae"]
    assert scored["predict_mae"].dataset_name == "diabetes/valid" and scored["val_mae"].dataset_name == "diabetes/valid"
    assert training.data.metrics["val_mae"] < 60  # predicting the mean scores about 64
    assert "pipeline.no_learning" not in training.data.tags


def with_a_missing_value(split: Path, column: str, row: int, value, index: int | None = None) -> Path:
    """Rewrite the split's one file with ``value`` (NaN, or None: missing) at ``row`` of ``column`` (element
    ``index`` of a list column); returns the file."""
    (path,) = split.glob("*.parquet")
    table = pq.read_table(path)
    values = table[column].to_pylist()
    if index is None:
        values[row] = value
    else:
        values[row][index] = value
    pq.write_table(
        table.set_column(table.schema.get_field_index(column), column, pa.array(values, table[column].type)), path
    )
    return path


def test_a_nan_in_a_tables_training_rows_fails_before_any_run_naming_file_column_and_row(tmp_path, ray_runtime):
    """What CSV and database exports hold: one NaN in one feature of one training row. The default,
    source.on_missing: raise, refuses the job before its MLflow run exists, in one paragraph naming it: in
    the standardization statistics' pass (a bad value among the first rows: the cache's size estimate)."""
    datasets.write_sklearn(str(tmp_path / "data"), "wine")
    path = with_a_missing_value(tmp_path / "data" / "wine" / "train", "malic_acid", row=100, value=float("nan"))
    cfg = compose_cfg(
        ["+experiment=wine_mlp", f"source.root={tmp_path / 'data'}", f"paths.outputs={tmp_path / 'outputs'}"]
    )
    with pytest.raises(
        PipelineError, match=rf"^preprocessing failed: .*column 'malic_acid' row 100 of {path} is missing"
    ):
        run(cfg, Job(str(tmp_path / "run"), "wine"))
    assert no_runs_logged(tmp_path)
