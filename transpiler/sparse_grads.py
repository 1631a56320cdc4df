"""--sparse-grads: a table's gradient sent as the rows its batch touched, not as a dense table.

The gradient of an embedding lookup (Gather of a [V, D] table by token ids) is, as the backward
builds it, ScatterND(add) of the batch's R rows into a [V, D] table of zeros: GPT-2-small's token
table is 154 MB of gradient, the backward's last, all-reduced dense with nothing left to overlap
(docs/gpu.md, "Designs for what is left"). Sent as rows it is R x (D + 1) floats a rank (the rows and,
beside each, its row index as a float: exact below 2^24 rows), one AllConcat, then on every rank
that updates the table the scatter-add of all ranks' rows times 1/N into zeros: the mean gradient,
as an AllReduce(mean) gives it, in another summation order (float32 rounding apart, the same
numbers; tests/test_sparse_grads.py). Horovod sends such gradients the same way (allgather of
indices and values) unless told to densify them.

Which parameters: those whose whole gradient is such a ScatterND (``rows_of``), float32, with fewer
than 2^24 rows. Each gets a bucket of its own (transpiler/bucketing.py ``alone``); its collective is
the AllConcat instead of the strategy's reduction (``Strategy.reduce_rows``). Only where the whole
gradient is one rank's rows: not with --grad-accumulation (the mean of micro-batches is dense) and
not under `zero` (its ReduceScatter slices cut across the table; ``Options.validate`` refuses both).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from transpiler.collectives import append_collective
from transpiler.optimizer import Emitter

if TYPE_CHECKING:
    from transpiler.bucketing import Bucket
    from transpiler.job import Job
    from transpiler.rank_step import RankStep

MAX_ROWS = 1 << 24  # row indices travel as float32, exact below this
ROWS_SUFFIX = ".rows"  # the AllConcat's input and output: the grad's name + these (plan.json names
ALL_ROWS_SUFFIX = ".all_rows"  # them by their parameter)


def rows_of(grad: ir.Value, param: ir.Value) -> tuple[ir.Value, ir.Value] | None:
    """(indices [..., 1], rows [..., D]) where ``grad`` is wholly ScatterND(add) of rows into zeros
    of ``param``'s shape (through Identity), else None."""
    node = grad.producer()
    while node is not None and node.op_type == "Identity" and node.domain == "":
        node = node.inputs[0].producer()
    if node is None or node.op_type != "ScatterND" or node.domain != "":
        return None
    reduction = node.attributes.get("reduction")
    if reduction is None or reduction.as_string() != "add":
        return None
    data, indices, rows = node.inputs
    shape = param.shape
    if shape is None or len(shape) != 2 or not all(isinstance(d, int) for d in shape) or shape[0] >= MAX_ROWS:
        return None
    if not _zeros_of(data, param) or rows.shape is None or rows.shape[-1] != shape[1] or not _one_index(indices, rows):
        return None
    if rows.dtype != ir.DataType.FLOAT or param.dtype != ir.DataType.FLOAT:
        return None
    return indices, rows


def _constant(value: ir.Value) -> np.ndarray | None:
    """``value``'s contents where constants alone give them (onnx-ir's constant, or a Concat of
    such: how the backward writes a table's shape), else None."""
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is not None:
        return tensor.numpy()
    node = value.producer()
    if node is not None and node.op_type == "Concat" and node.domain == "":
        parts = [_constant(v) for v in node.inputs]
        if all(p is not None for p in parts):
            return np.concatenate([np.atleast_1d(p) for p in parts])
    return None


def _zeros_of(data: ir.Value, param: ir.Value) -> bool:
    """Whether ``data`` is a ConstantOfShape of zeros of ``param``'s shape."""
    node = data.producer()
    if node is None or node.op_type != "ConstantOfShape" or node.domain != "":
        return False
    value = node.attributes.get("value")
    if value is not None and np.any(value.as_tensor().numpy() != 0):
        return False
    shape = _constant(node.inputs[0])
    return shape is not None and tuple(int(d) for d in shape) == tuple(param.shape)


def _one_index(indices: ir.Value, rows: ir.Value) -> bool:
    """Whether each index picks one row (ScatterND's index depth 1): the indices' last dimension is 1,
    by their shape or by the Unsqueeze that makes it (the backward's, on the token ids)."""
    if indices.shape is not None:
        return len(indices.shape) == len(rows.shape) and indices.shape[-1] == 1
    node = indices.producer()
    if node is None or node.op_type != "Unsqueeze" or node.domain != "" or len(node.inputs) < 2:
        return False
    axes = _constant(node.inputs[1])
    last = len(rows.shape) - 1
    return axes is not None and axes.size == 1 and int(axes.reshape(-1)[0]) in (-1, last)


def sparse_params(job: Job, graph: ir.Graph) -> list[str]:
    """The parameters whose gradient goes as rows (``graph``: the ranks' forward + backward)."""
    values = {v.name: v for v in graph.inputs} | dict(graph.initializers)
    values |= {out.name: out for node in graph for out in node.outputs}
    return [p for p in job.grad_order
            if p in values and job.grad_names[p] in values and rows_of(values[job.grad_names[p]], values[p]) is not None]


def emit_rows_mean(step: RankStep, bucket: Bucket, *, holds: bool) -> list[ir.Value] | None:
    """The bucket's one parameter's mean gradient from every rank's rows: its AllConcat on every
    rank, the scatter-add where ``holds`` (the ranks that update it); None elsewhere."""
    (param,) = bucket.params
    value = step.params[param]
    indices, rows = rows_of(step.grads[param], value)
    vocab, width = value.shape
    name = step.job.grad_names[param]
    e = Emitter(step.graph, prefix=f"sparse_grads/{param}")
    i64, f32 = ir.DataType.INT64, ir.DataType.FLOAT

    def ints(values, what):
        return e.op("Constant", [], what, i64, [len(values)], {"value": ir.tensor(np.array(values, dtype=np.int64))})

    flat_rows = e.op("Reshape", [rows, ints([-1, width], "row_shape")], "rows", f32, [None, width])
    flat_index = e.op("Reshape", [indices, ints([-1, 1], "index_shape")], "indices", i64, [None, 1])
    index_as_float = e.op("Cast", [flat_index], "indices_f32", f32, [None, 1], {"to": f32})
    packed = e.op("Concat", [flat_rows, index_as_float], "packed", f32, [None, width + 1], {"axis": 1},
                  output_name=name + ROWS_SUFFIX)
    like = ir.val("like", f32, ir.Shape([None, width + 1]))
    (gathered,) = append_collective(step.graph, "AllConcat", [packed], like=[like], output_names=[name + ALL_ROWS_SUFFIX],
                                    order=step.next_order(), bucket=bucket.id, phase="step")
    if not holds:
        return None
    split = e.tape.op_multi_out("Split", [gathered, ints([width, 1], "split_sizes")], {"axis": 1}, num_outputs=2,
                                name=f"sparse_grads/{param}.split")
    all_rows, all_index_f = split
    for v, cols, what in ((all_rows, width, "all_rows_values"), (all_index_f, 1, "all_rows_indices_f32")):
        v.name, v.dtype, v.shape = e.unique_value_name(f"sparse_grads/{param}.{what}"), f32, ir.Shape([None, cols])
    # The indices as the backward writes an embedding's (1-D, then Unsqueeze over the last axis): the
    # GPU's row scatter-add kernel takes that form (runtime/gpu/scatter_add.py).
    flat_f = e.op("Reshape", [all_index_f, ints([-1], "flat")], "all_rows_indices_flat_f32", f32, [None])
    flat_i = e.op("Cast", [flat_f], "all_rows_indices_flat", i64, [None], {"to": i64})
    all_index = e.op("Unsqueeze", [flat_i, ints([-1], "last_axis")], "all_rows_indices", i64, [None, 1])
    scaled = e.op("Mul", [all_rows, e.constant32(1.0 / step.world, "inverse_world")], "all_rows_mean", f32, [None, width])
    zeros = e.op("ConstantOfShape", [ints([vocab, width], "table_shape")], "zeros", f32, [vocab, width],
                 {"value": ir.tensor(np.zeros(1, dtype=np.float32))})
    mean = e.op("ScatterND", [zeros, all_index, scaled], "scatter", f32, [vocab, width], {"reduction": "add"},
                output_name=f"{name}.mean")
    return [mean]
