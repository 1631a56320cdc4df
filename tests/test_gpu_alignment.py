"""A segment input that is a view at an odd address into a collective's bucket (the packed
ReduceScatter/AllGather layout, ZeRO) runs: OrtCudaSegment copies it into a buffer of its own, on
the first call and on bound runs, so cuDNN's Conv never sees a misaligned weight
(CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER on 2 GPUs before)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from runtime.gpu import cuda_available, gpu_count
from runtime.segments import Segment

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 1 or not cuda_available(),
                                                  reason="needs a CUDA GPU, CuPy and onnxruntime-gpu")]


def _conv_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3, 16, 16])
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [8, 3, 3, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8, 16, 16])
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1])
    model = helper.make_model(helper.make_graph([node], "g", [x, w], [y]), opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("graphs", [False, True])
def test_a_conv_weight_at_an_odd_address_runs_and_equals_the_cpu(graphs):
    import cupy as cp
    import onnxruntime as ort

    from runtime.gpu import GpuBackend
    from runtime.gpu.session import ALIGN_BYTES, OrtCudaSegment, misaligned

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 3, 16, 16)).astype(np.float32)
    w = rng.normal(size=(8, 3, 3, 3)).astype(np.float32)
    model = _conv_model()
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x, "w": w})[0]

    backend = GpuBackend(0, tf32=False)
    segment = OrtCudaSegment(Segment(0, ("conv",), ("x", "w"), ("y",), model), "test", backend.policy)
    segment.capture_allowed = graphs  # as GpuProgram decides it
    bucket = cp.zeros(w.size + 3, dtype=cp.float32)  # 3 elements in: 12 bytes off the bucket's start
    weight = bucket[3:].reshape(w.shape)
    weight[...] = cp.asarray(w)
    assert misaligned(weight)
    feeds = {"x": cp.asarray(x), "w": weight}
    first = cp.asnumpy(segment.run(feeds)[0])
    np.testing.assert_allclose(first, expected, rtol=1e-5, atol=1e-5)

    out = cp.empty(expected.shape, dtype=cp.float32)
    segment.prepare(0, {"y": out})
    for step in range(4):  # bound runs; with graphs the later ones replay a captured graph
        weight[...] = cp.asarray(w * (step + 1))  # the copy follows the view's new values every run
        segment.run_bound(0, feeds)
        cp.cuda.get_current_stream().synchronize()
        np.testing.assert_allclose(cp.asnumpy(out), expected * (step + 1), rtol=1e-5, atol=1e-4)
    assert segment.graphs == graphs
    # onnxruntime read the aligned copy, not the view: every bound pointer is aligned.
    assert list(segment.realigned) == ["w"]
    assert segment.bound[0]["w"] == segment.realigned["w"].data.ptr
    assert all(ptr % ALIGN_BYTES == 0 for ptr in segment.bound[0].values())
