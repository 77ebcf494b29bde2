"""The check of a run's exported files (``train.export``) as a serving team makes it: loaded in a fresh process that
imports torch, numpy and onnxruntime but never ``pipeline``, and compared with the eager model on held-out rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import torch
from mlflow import MlflowClient

from pipeline.tracking import models, run_config
from pipeline.tracking.export import TOLERANCE
from pipeline.training import checkpoint

LOAD_EXPORTS = """
import json, os, sys
import numpy as np
import torch

files, rows, rtol, atol = sys.argv[1], np.load(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
outputs = {}
if os.path.exists(os.path.join(files, "model.pt2")):
    program = torch.export.load(os.path.join(files, "model.pt2")).module()
    outputs["torch_export"] = program(torch.as_tensor(rows["inputs"])).detach().numpy()
if os.path.exists(os.path.join(files, "model.onnx")):
    import onnxruntime
    session = onnxruntime.InferenceSession(os.path.join(files, "model.onnx"), providers=["CPUExecutionProvider"])
    outputs["onnx"] = session.run(None, {"features": rows["inputs"]})[0]
assert "pipeline" not in sys.modules
eager = rows["eager"]
found = {name: [float(np.abs(out - eager).max()), bool(np.allclose(out, eager, rtol=rtol, atol=atol))]
         for name, out in outputs.items()}
print(json.dumps(found))
"""


def loaded_alone(files: Path, inputs: np.ndarray, eager: np.ndarray, into: Path) -> dict[str, tuple[float, bool]]:
    """The exported files in ``files`` run on ``inputs`` in a fresh process without this repo's code: per format, the
    largest difference from ``eager`` and whether it is within :data:`TOLERANCE`."""
    np.savez(into / "rows.npz", inputs=inputs, eager=eager)
    completed = subprocess.run(
        [
            sys.executable,
            "-c",
            LOAD_EXPORTS,
            str(files),
            str(into / "rows.npz"),
            str(TOLERANCE["rtol"]),
            str(TOLERANCE["atol"]),
        ],
        capture_output=True,
        text=True,
        cwd=into,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return {name: tuple(found) for name, found in json.loads(completed.stdout.splitlines()[-1]).items()}


def best_model_exports(client: MlflowClient, run_id: str, into: Path) -> tuple[dict, dict]:
    """The run's best model's ``export/`` files checked alone against the eager model rebuilt from its checkpoint, on
    the checkpoint's held-out rows: per format (max |diff|, within tolerance), and ``export.json``."""
    model = client.get_logged_model(client.get_run(run_id).data.tags[models.BEST_MODEL_TAG])
    files = Path(
        mlflow.artifacts.download_artifacts(
            f"{model.artifact_location}/export", dst_path=str(into), tracking_uri=client.tracking_uri
        )
    )
    state = checkpoint.load_whole(model.tags[models.CHECKPOINT_TAG], "test")
    served = models.served_model(run_config.logged_config(client, run_id), state)
    held_out = state["held_out"]
    with torch.no_grad():
        eager = served(held_out).numpy()
    return loaded_alone(files, held_out.numpy(), eager, into), json.loads((files / "export.json").read_text())
