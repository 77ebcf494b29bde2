"""A run's best model as serving files (``train.export``), on the driver once training has ended: each format written
into the LoggedModel's ``export/``, loaded back as a server would load it and checked against the eager model on
held-out rows (validation rows, never trained on), with ``export.json`` beside them: the input the files take, the
steps that make it, the scaling inside them, the outputs and each check's figures. A format that cannot be exported
or does not match is one paragraph in the log and in the run's tag ``pipeline.export``: the run still finishes.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
from collections.abc import Callable

import numpy as np
import torch
from torch.export import Dim

from pipeline.config import ExportFormat, PipelineConfig

log = logging.getLogger(__name__)

EXPORT_DIR = "export"  # in the LoggedModel's artifacts
EXPORT_TAG = "pipeline.export"  # on the run: what each format came to
# on float32 outputs, as numpy.allclose reads them: a torch.export program runs the eager model's kernels (measured
# |diff| 0), ONNX Runtime its own (up to 9e-7 on ResNet-18's logits)
TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}

Runner = Callable[[np.ndarray], np.ndarray]  # an exported file, loaded: features in, outputs out


def reason(err: Exception) -> str:
    """An exporter's error in one line: its type and its message's first line (torch.export's run to pages)."""
    return f"{type(err).__name__}: {(str(err).strip() or '?').splitlines()[0]}"


def torch_export(served: torch.nn.Module, example: torch.Tensor, path: str) -> Runner:
    """A ``torch.export`` program (any batch size) saved as ``.pt2``: ``torch.export.load(path).module()``."""
    program = torch.export.export(served, (example,), dynamic_shapes=({0: Dim.AUTO},))
    torch.export.save(program, path)
    loaded = torch.export.load(path).module()
    return lambda rows: loaded(torch.as_tensor(rows)).detach().numpy()


def onnx(served: torch.nn.Module, example: torch.Tensor, path: str) -> Runner:
    """An ONNX model (input ``features``, output ``outputs``, any batch size), run back with ONNX Runtime."""
    import onnxruntime

    with contextlib.redirect_stdout(io.StringIO()):  # torch.onnx prints each of its passes
        torch.onnx.export(
            served,
            (example,),
            path,
            dynamo=True,
            dynamic_shapes=({0: Dim.AUTO},),
            input_names=["features"],
            output_names=["outputs"],
            external_data=False,  # one file, weights inside (ONNX's limit: 2 GB)
        )
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    return lambda rows: session.run(None, {"features": rows})[0]


EXPORTERS: dict[ExportFormat, tuple[Callable[..., Runner], str]] = {
    ExportFormat.torch_export: (torch_export, "model.pt2"),
    ExportFormat.onnx: (onnx, "model.onnx"),
}


def expected_input(cfg: PipelineConfig, example: torch.Tensor, statistics: dict | None, classes) -> dict:
    """What the exported files take and give: the feature column as the ``transforms.valid`` steps leave it (dtype,
    shape, any batch size), the scaling the files apply themselves, and the outputs."""
    normalize = cfg.ingest.normalize
    inside = {}
    if example.dtype == torch.uint8 and normalize is not None:
        inside["normalize"] = {"pixels": "x / 255", "mean": list(normalize.mean), "std": list(normalize.std)}
    if statistics is not None and example.is_floating_point():
        inside["standardize"] = {"mean": statistics["mean"], "std": statistics["std"], "missing": "the mean"}
    steps = [spec.fn for spec in cfg.transforms.active("valid").values()]
    return {
        "input": {
            "column": cfg.source.feature_column,
            "dtype": str(example.dtype).removeprefix("torch."),
            "shape": ["batch", *example.shape[1:]],
        },
        "steps_before": steps,  # what turns a stored row into the input (decode, resize, ...), as transforms.valid
        "scaling_inside": inside,
        "outputs": {"task": str(cfg.task.type), "classes": classes},  # classification: output i is classes[i]
    }


def export_model(
    served: torch.nn.Module,
    example: torch.Tensor,
    held_out: torch.Tensor,
    formats: list[ExportFormat],
    into: str,
    expects: dict,
) -> dict[str, str]:
    """Each of ``formats`` written into the directory ``into`` from the eager ``served`` (traced on ``example``),
    loaded back and compared with it on ``held_out``; ``export.json`` beside them. What each format came to."""
    with torch.no_grad():
        eager = served(held_out).numpy()
    rows, came_to, files = len(held_out), {}, {}
    for fmt in formats:
        exporter, name = EXPORTERS[fmt]
        path = os.path.join(into, name)
        try:
            outputs = exporter(served, example, path)(held_out.numpy())
            diff = float(np.abs(outputs - eager).max())
            if outputs.shape != eager.shape or not np.allclose(outputs, eager, **TOLERANCE):
                raise ValueError(
                    f"its outputs differ from the eager model's by up to {diff:.3g} on {rows} held-out rows "
                    f"(allowed: rtol {TOLERANCE['rtol']}, atol {TOLERANCE['atol']})"
                )
        except Exception as err:  # an exporter cannot take every model: the run still finishes, saying why
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            why = reason(err)
            came_to[fmt] = f"failed ({why})"
            log.warning(
                "train.export: the best model could not be exported as %s (%s). The run still finishes, with its "
                "LoggedModel and any other format; leave %s out of train.export, or make the model traceable "
                "(torch.export's docs list what it cannot trace: data-dependent Python control flow above all).",
                fmt,
                why,
                fmt,
            )
            continue
        files[str(fmt)] = {"file": name, "max_abs_diff": diff}
        came_to[fmt] = f"{name}: max |diff| {diff:.2g} on {rows} held-out rows"
    checked = {"rows": rows, "tolerance": TOLERANCE, "files": files}
    with open(os.path.join(into, "export.json"), "w") as out:
        json.dump({**expects, "checked": checked}, out, indent=2, default=str)
    return came_to
