"""--export: the user's model (OUT/model.onnx) with the trained values in its initializers; with
``--outputs NAMES``, its forward up to those values only, ready for inference (runtime/inference.py)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from runtime.errors import RunError, os_error_text
from runtime.inference import inference_model
from runtime.plan import Plan
from runtime.segments import load_graph


def export_model(plan: Plan, parameters: dict[str, np.ndarray], path: str | Path, outputs: tuple[str, ...] = ()) -> None:
    """Write the user's model with trained values in its initializers, atomically (temp file + rename);
    with ``outputs`` (value names of the model), only the forward up to them, in inference mode."""
    path = Path(path)
    model = load_graph(plan.model)
    by_name = {t.name: t for t in model.graph.initializer}
    missing = [name for name in parameters if name not in by_name]
    if missing:
        raise RunError(f"{plan.model}: has no initializer(s) {', '.join(missing)} to export trained values into")
    for name, value in parameters.items():
        old = by_name[name]
        if tuple(old.dims) != value.shape or onnx.helper.tensor_dtype_to_np_dtype(old.data_type) != value.dtype:
            raise RunError(f"{plan.model}: initializer '{name}' is {list(old.dims)} "
                           f"{onnx.helper.tensor_dtype_to_np_dtype(old.data_type)}, trained value is {list(value.shape)} {value.dtype}")
        old.CopyFrom(numpy_helper.from_array(value, name))
    if outputs:
        model = inference_model(model, tuple(outputs), str(plan.model))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise RunError(f"--export {path}: {os_error_text(exc)}") from None
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes it private; the export is an ordinary new file
        with os.fdopen(fd, "wb") as f:
            f.write(model.SerializeToString())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise RunError(f"--export {path}: {os_error_text(exc)}; the partial file was removed") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
