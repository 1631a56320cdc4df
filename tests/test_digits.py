"""The digits example end to end, as docs/models.md shows it: a small CNN (Conv-BN-ReLU-MaxPool x2,
Linear; 3.7k parameters) on scikit-learn's bundled 8x8 digits, transpiled for 4 ranks with
synchronized BatchNorm and trained by the real ``transpile run`` on 4 MPI processes; the exported
model, evaluated with onnxruntime (BatchNorm on its trained running statistics), classifies at
least 95% of the 360 held-out digits.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")


@pytest.mark.mpi
def test_digits_cnn_trains_on_four_mpi_ranks(tmp_path):
    from models import digits

    start = time.perf_counter()
    trained, curve, accuracy = digits.train(tmp_path, log_every=25)
    elapsed = time.perf_counter() - start
    print(f"\ndigits: {len(curve)} logged steps, loss {curve[0][1]:.3f} -> {curve[-1][1]:.4f}, "
          f"held-out accuracy {accuracy:.4f}, {elapsed:.1f} s")
    assert curve and curve[-1][1] < 0.25 * curve[0][1], curve
    assert accuracy >= 0.95, f"held-out accuracy {accuracy:.4f}"
    # --export wrote the trained running statistics back (state of kind "buffer"), not the initial ones.
    import numpy as np
    import onnx
    from onnx import numpy_helper

    before = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "model.onnx").graph.initializer}
    after = {t.name: numpy_helper.to_array(t) for t in onnx.load(trained).graph.initializer}
    assert not np.allclose(before["bn1.running_var"], after["bn1.running_var"])
    assert not np.allclose(before["conv1.weight"], after["conv1.weight"])
