"""The fused update reading a bfloat16 gradient itself (runtime/gpu/gradient_casts.py), which
values a GPU program passes between its items as bfloat16 (runtime/gpu/buffers.py
``bfloat16_edges``), and the element type of a collective's bucket between sessions
(``bucket_dtype``).

CPU: on the GPT's bf16 step graph the rewrite gives every update whose gradient was a lone Cast of
a bfloat16 value that value, marked, and drops the Cast; a Cast read elsewhere, a Cast from
float16, a gradient the graph outputs, and every fp32 step stay as they were. The kernel reading
the marked gradients is tested in tests/test_gpu_fused_update.py (GPU) and
tests/test_fused_update_host.py (its source compiled for the host).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import with_a_body_reading
from onnx import TensorProto, helper

from commands.main import main
from contract.ops import FUSED_UPDATE_DOMAIN
from runtime.collectives import TensorSpec
from runtime.errors import RunError
from runtime.gpu.buffers import bfloat16_edges, bucket_dtype
from runtime.gpu.gradient_casts import GRADIENT_TYPE, bfloat16_gradients, fold_gradient_casts
from runtime.plan import load_plan


def _step(model_dir, tmp_path, precision: str) -> onnx.ModelProto:
    out = tmp_path / precision
    assert main(["compile", str(model_dir("gpt") / "model.onnx"), "--gpus", "1", "--precision", precision,
                 "--optimizer", "adamw", "-o", str(out)]) == 0
    return onnx.load(str(out / "rank0.onnx"))


def _types(model: onnx.ModelProto) -> dict[str, int]:
    graph = model.graph
    return {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.value_info, *graph.output]}


def test_every_weight_update_of_the_bf16_gpt_reads_its_bfloat16_gradient(model_dir, tmp_path):
    step = _step(model_dir, tmp_path, "bf16")
    producer = {o: n for n in step.graph.node for o in n.output}
    lone_casts = [n.input[1] for n in step.graph.node if n.domain == FUSED_UPDATE_DOMAIN
                  and producer[n.input[1]].op_type == "Cast" and _types(step)[producer[n.input[1]].input[0]] == TensorProto.BFLOAT16]
    before = len(step.graph.node)
    folded = fold_gradient_casts(step)
    onnx.checker.check_model(folded)
    updates = [n for n in folded.graph.node if n.domain == FUSED_UPDATE_DOMAIN]
    marked = bfloat16_gradients(updates)
    # The GPT's weights (4 blocks of 4 MatMuls, and the head): each one's gradient a bf16 product.
    assert len(lone_casts) >= 17 and len(marked) == len(lone_casts)
    assert len(folded.graph.node) == before - len(lone_casts)
    types = _types(folded)
    assert all(types[name] == TensorProto.BFLOAT16 for name in marked)
    produced = {o for n in folded.graph.node for o in n.output}
    assert not set(lone_casts) & produced  # the widened copies are gone, with their value_info
    assert not set(lone_casts) & {v.name for v in folded.graph.value_info}
    for node in updates:  # the rest read float32 gradients as before, unmarked
        if node.input[1] not in marked:
            assert types[node.input[1]] == TensorProto.FLOAT
            assert not any(a.name == GRADIENT_TYPE for a in node.attribute)


def test_an_fp32_step_is_left_as_it_is(model_dir, tmp_path):
    step = _step(model_dir, tmp_path, "fp32")
    expected = step.SerializeToString()
    assert fold_gradient_casts(step).SerializeToString() == expected


def _update_of(cast_from: int, second_reader: bool = False, output: bool = False) -> onnx.ModelProto:
    """w' = SGD(w, Cast(g, float32), lr), g of type ``cast_from``."""
    nodes = [helper.make_node("Cast", ["g"], ["wide"], to=TensorProto.FLOAT),
             helper.make_node("SGD", ["w", "wide", "lr"], ["w2"], domain=FUSED_UPDATE_DOMAIN, weight_decay=0.0)]
    outputs = [helper.make_tensor_value_info("w2", TensorProto.FLOAT, [4])]
    if second_reader:
        nodes.append(helper.make_node("Neg", ["wide"], ["other"]))
        outputs.append(helper.make_tensor_value_info("other", TensorProto.FLOAT, [4]))
    if output:
        outputs.append(helper.make_tensor_value_info("wide", TensorProto.FLOAT, [4]))
    inputs = [helper.make_tensor_value_info("w", TensorProto.FLOAT, [4]), helper.make_tensor_value_info("g", cast_from, [4]),
              helper.make_tensor_value_info("lr", TensorProto.FLOAT, [])]
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(FUSED_UPDATE_DOMAIN, 1)])


def test_a_lone_cast_from_bfloat16_is_folded():
    folded = fold_gradient_casts(_update_of(TensorProto.BFLOAT16))
    assert [n.op_type for n in folded.graph.node] == ["SGD"]
    assert bfloat16_gradients(folded.graph.node) == {"g"}


@pytest.mark.parametrize("case", ["float16", "second reader", "graph output", "read in a subgraph"])
def test_a_cast_the_update_does_not_read_alone_or_not_from_bfloat16_stays(case):
    model = _update_of(TensorProto.FLOAT16 if case == "float16" else TensorProto.BFLOAT16,
                       second_reader=case == "second reader", output=case == "graph output")
    if case == "read in a subgraph":
        model = with_a_body_reading(model, "wide")
    expected = model.SerializeToString()
    assert fold_gradient_casts(model).SerializeToString() == expected


# -- which values cross between items as bfloat16 --------------------------------------------------

SESSION = None  # an item that reads any value as its graph types it


@pytest.mark.parametrize("items, producer, io, expected", [
    # a session's gradient read by the update that takes it: kept
    ([(["x"], SESSION), (["g"], frozenset({"g"}))], {"g": 0}, set(), {"g"}),
    # ... and by a later session too: kept (the session binds it as bfloat16)
    ([(["x"], SESSION), (["g"], frozenset({"g"})), (["g"], SESSION)], {"g": 0}, set(), {"g"}),
    # read also by a collective (takes nothing as bfloat16): widened
    ([(["x"], SESSION), (["g"], frozenset({"g"})), (["g"], frozenset())], {"g": 0}, set(), set()),
    # computed by a native runner, not a session: it writes float32
    ([(["x"], frozenset()), (["g"], frozenset({"g"}))], {"g": 0}, set(), set()),
    # a program output: the caller reads float32
    ([(["x"], SESSION), (["g"], frozenset({"g"}))], {"g": 0}, {"g"}, set()),
    # passed between sessions only: no runner asks for it
    ([(["x"], SESSION), (["g"], SESSION)], {"g": 0}, set(), set()),
])
def test_a_value_crosses_as_bfloat16_only_where_every_reader_takes_it(items, producer, io, expected):
    assert bfloat16_edges(items, producer, io) == expected


BF16 = helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16)  # the graph's type of a bfloat16 spec (ml_dtypes)


def test_a_bfloat16_bucket_between_sessions_moves_as_the_float32_its_inputs_crossed_as():
    """--grad-dtype bf16 with the collectives cut out of the sessions: the gradients reach the
    AllReduce widened (a collective takes no bfloat16 between sessions), so its bucket is float32,
    whatever the bfloat16 spec of its outputs says; the second call used to refuse it."""
    specs = [TensorSpec((4,), BF16), TensorSpec((2, 3), BF16)]
    seen = {"g0": np.float32, "g1": np.float32, "m0": np.float32, "m1": np.float32}
    assert bucket_dtype(["g0", "g1"], ["m0", "m1"], specs, seen, "rank0.onnx: AllReduce") == np.float32
    # A Reduce's outputs off its root: no values, the inputs decide.
    assert bucket_dtype(["g0", "g1"], [], [], seen, "rank1.onnx: Reduce") == np.float32
    # A Broadcast's receiver: no inputs, the spec decides.
    assert bucket_dtype([], ["p"], [TensorSpec((4,), np.dtype(np.float32))], {}, "rank1.onnx: Broadcast") == np.float32


def test_a_bucket_of_two_dtypes_is_an_error_naming_the_collective():
    seen = {"g0": np.float32, "g1": np.float16}
    with pytest.raises(RunError, match=r"rank0.onnx: AllReduce: the nccl backend needs one dtype per bucket, "
                                       r"got \['float16', 'float32'\]"):
        bucket_dtype(["g0", "g1"], [], [], seen, "rank0.onnx: AllReduce")


@pytest.mark.parametrize("strategy", ["allreduce", "sharded", "zero"])
def test_with_bf16_gradients_on_the_wire_each_update_reads_its_collectives_output(strategy, model_dir, tmp_path):
    """--grad-dtype bf16: a bucket's collective gives bfloat16 means and a Cast widens each for its
    update; after the rewrite every update of the rank reads the collective's output itself."""
    out = tmp_path / strategy
    assert main(["compile", str(model_dir("gpt") / "model.onnx"), "--gpus", "2", "--precision", "bf16",
                 "--grad-dtype", "bf16", "--strategy", strategy, "--optimizer", "adamw", "-o", str(out)]) == 0
    plan = load_plan(out)
    for rank in (0, 1):
        folded = fold_gradient_casts(onnx.load(str(out / plan.graphs(rank).step.name)))
        producer = {o: n for n in folded.graph.node for o in n.output}
        updates = [n for n in folded.graph.node if n.domain == FUSED_UPDATE_DOMAIN]
        assert updates and bfloat16_gradients(updates) == {n.input[1] for n in updates}
        assert {producer[n.input[1]].op_type for n in updates} <= {"AllReduce", "Reduce", "ReduceScatter"}
