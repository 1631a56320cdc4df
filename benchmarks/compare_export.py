"""Compare a model exported by `transpile run --export` with the CPU backend's simulation (a check
for runs on other backends).

    python benchmarks/compare_export.py OUT DATA.npz BATCH STEPS TRAINED.onnx
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
from onnx import numpy_helper

from runtime import simulate


def main() -> None:
    out, data_path, batch, steps, trained = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    exported = {t.name: numpy_helper.to_array(t) for t in onnx.load(trained).graph.initializer}
    ref = simulate(out, dict(np.load(data_path)), batch=batch, steps=steps).parameters[0]
    error = max(float(np.max(np.abs(exported[k].astype(np.float64) - v))) / (float(np.max(np.abs(v))) or 1.0)
                for k, v in ref.items())
    print(f"{out}: {steps} steps, max relative error vs CPU backend {error:.3e} ({'OK' if error <= 1e-5 else 'MISMATCH'})")


if __name__ == "__main__":
    main()
