"""AllConcat (contract SHAPED_BY_INPUT): the ranks' tensors concatenated on axis 0, the output's
shape taken from the input's when it runs; its list form on thread ranks, its flat form, the cut
that takes its symbolic output, and the specialization that types it for the GPU's sessions."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper
from test_runtime_collectives import _run

from contract.collectives import DOMAIN
from runtime.collectives import make_collective
from runtime.specialize import specialize, static_values


def _node(order=0):
    return helper.make_node("AllConcat", ["rows"], ["all_rows"], domain=DOMAIN, name="concat", order=order,
                            bucket=0, phase="step")


def _rows(rank):
    return np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * rank


def test_every_rank_gets_the_rows_of_every_rank_in_rank_order():
    op = make_collective(_node(), [], 0, "test")
    results = _run(3, lambda comm: op.run(comm, [_rows(comm.rank)])[0])
    expected = np.concatenate([_rows(r) for r in range(3)])
    for got in results:
        np.testing.assert_array_equal(got, expected)


def test_the_flat_form_is_one_slice_a_rank_and_the_whole_buffer_out():
    """Rank r's input is the r-th slice of the bucket, the output the bucket as [N*R, ...]; an
    all-gather of the buffer in place (here: each rank's slice written as the others' would be)."""
    op = make_collective(_node(), [], 1, "test")
    layout = op.flat_layout([(2, 3)], 3, 1)
    assert (layout.total, layout.shard) == (18, 6)
    buf = np.zeros(layout.total, np.float32)
    op.flat_inputs(layout, buf)["rows"][...] = _rows(1)
    for r in (0, 2):
        buf[r * 6:(r + 1) * 6] = _rows(r).ravel()
    out = op.flat_outputs(layout, buf)["all_rows"]
    np.testing.assert_array_equal(out, np.concatenate([_rows(r) for r in range(3)]))


def _model():
    """rows [batch, 3] -> AllConcat -> Relu -> output: the batch symbolic, as the rank graphs leave it."""
    graph = helper.make_graph(
        [_node(), helper.make_node("Relu", ["all_rows"], ["out"])], "g",
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        value_info=[helper.make_tensor_value_info("all_rows", TensorProto.FLOAT, ["n_batch", 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])


def test_specialization_types_the_output_and_what_follows_it_from_the_world_size():
    model = specialize(_model(), {"rows": (2, 3)}, world=4)
    known = static_values(model.graph)
    assert known["all_rows"][0] == (8, 3)
    inferred = onnx.shape_inference.infer_shapes(model)
    assert static_values(inferred.graph)["out"][0] == (8, 3)
    # Without the world size the output stays untyped (the cut's collectives are shaped at run time).
    assert "all_rows" not in static_values(specialize(_model(), {"rows": (2, 3)}).graph)


def test_the_cut_takes_the_symbolic_output(tmp_path):
    """The CPU backend's cut of a graph whose AllConcat output has a symbolic first dimension: no
    'symbolic shape' refusal; the executor runs with the shape of what it is given."""
    from runtime.segments import cut_graph

    cut = cut_graph(_model(), rank=0, where="test")
    (op,) = cut.collectives
    results = _run(2, lambda comm: op.run(comm, [_rows(comm.rank)])[0])
    assert results[0].shape == (4, 3)
