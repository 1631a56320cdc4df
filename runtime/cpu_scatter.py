"""ScatterND(reduction="add") as ScatterElements on the CPU backend: race-free where indices repeat.

onnxruntime's CPU ScatterND splits its index tuples over the intra-op threads, and two threads that
add into one row race: with 2 threads, 32,768 repeated indices into 1,000 rows lost updates in 1
to 29 of 40 runs (onnxruntime 1.32.0; ``use_deterministic_compute`` changes nothing; reported
upstream as microsoft/onnxruntime#18048, closed; the race is still there in 1.32.0). The token
embedding's gradient is such a ScatterND (transpiler/autodiff/rules/indexing.py), and CPU ranks
run several threads each (runtime/cores.py). ScatterElements(reduction="add") adds one element
after another, on one thread: GPT-2-small's token-embedding gradient (4,096 rows of 768 into
50,304) takes 117 ms on 2 cores against the racy kernel's 26 (microsoft/onnxruntime#28584 asks for
a faster one), in a CPU step of tens of seconds. So each ScatterND(add) whose index depth k is known becomes: data's leading k axes
flattened into one; each index tuple (negative components counted from the back, as ScatterND
counts them) one linear index, broadcast over the update's trailing axes; ScatterElements(axis=0,
add); the result reshaped to data's shape. Every shape is read at run time, so symbolic batches
stay symbolic. A node whose k is not known stays as it is, and ``race_free_scatters`` says so: its
caller then runs that session on one thread.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from runtime.onnx_types import value_types, with_inferred_types


def race_free_scatters(model: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    """``model`` with each ScatterND(reduction="add") of its main graph rewritten (the module
    docstring; ``model`` itself where there is none), and whether a racy one is left."""
    graph = model.graph
    targets = [n for n in graph.node if _is_scatter_add(n)]
    if not targets:
        return model, False
    depths = _index_depths(model, targets)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes, left = [], False
    for i, node in enumerate(out.graph.node):
        racy = _is_scatter_add(node)
        k = depths.get(node.output[0]) if racy else None
        if racy and k is None:
            left = True
        nodes.extend(_rewritten(node, k, f"{node.output[0]}.race_free{i}") if k is not None else [node])
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out, left


def _is_scatter_add(node: onnx.NodeProto) -> bool:
    return (node.op_type == "ScatterND" and node.domain in ("", "ai.onnx")
            and any(a.name == "reduction" and a.s == b"add" for a in node.attribute))


def _index_depths(model: onnx.ModelProto, targets: list[onnx.NodeProto]) -> dict[str, int]:
    """Each target's index depth (the indices' last dimension) by its output name, where known:
    from the model's own types first, else from onnx's shape inference."""
    def known(types: dict[str, onnx.TypeProto]) -> dict[str, int]:
        depths = {}
        for node in targets:
            t = types.get(node.input[1])
            dims = t.tensor_type.shape.dim if t is not None and t.tensor_type.HasField("shape") else []
            if dims and dims[-1].HasField("dim_value"):
                depths[node.output[0]] = dims[-1].dim_value
        return depths

    depths = known(value_types(model.graph))
    if len(depths) < len(targets):  # an uninferable graph keeps its racy nodes, on one thread
        depths = known(value_types(with_inferred_types(model).graph))
    return depths


def _rewritten(node: onnx.NodeProto, k: int, p: str) -> list[onnx.NodeProto]:
    data, indices, updates = node.input[:3]
    (output,) = node.output

    def const(name: str, values) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [f"{p}/{name}"],
                                value=numpy_helper.from_array(np.asarray(values, np.int64), f"{p}/{name}"))

    def op(kind: str, inputs: list[str], name: str, **attrs) -> onnx.NodeProto:
        return helper.make_node(kind, inputs, [f"{p}/{name}"], **attrs)

    nodes = [
        const("zero", [0]), const("k", [k]), const("end", [np.iinfo(np.int64).max]), const("minus1", [-1]),
        const("scalar0", 0),
        op("Shape", [data], "dshape"),
        op("Slice", [f"{p}/dshape", f"{p}/zero", f"{p}/k"], "head"),  # data.shape[:k]
        op("Slice", [f"{p}/dshape", f"{p}/k", f"{p}/end"], "tail"),  # data.shape[k:]
        op("ReduceProd", [f"{p}/head"], "rows", keepdims=1),
        op("Concat", [f"{p}/rows", f"{p}/tail"], "flatshape", axis=0),
        op("Reshape", [data, f"{p}/flatshape"], "flatdata"),
        # ScatterND counts a negative index component from the back of its axis.
        op("Less", [indices, f"{p}/scalar0"], "negative"),
        op("Add", [indices, f"{p}/head"], "wrapped"),
        op("Where", [f"{p}/negative", f"{p}/wrapped", indices], "tuples"),
    ]
    # linear = sum_j tuple_j * prod(head[j+1:]), j < k (row-major over data's leading k axes)
    terms = []
    for j in range(k):
        nodes += [const(f"j{j}", [j]), const(f"after{j}", [j + 1]),
                  op("Gather", [f"{p}/tuples", f"{p}/j{j}"], f"part{j}", axis=-1),  # [..., 1]
                  op("Slice", [f"{p}/head", f"{p}/after{j}", f"{p}/k"], f"rest{j}"),
                  op("ReduceProd", [f"{p}/rest{j}"], f"stride{j}", keepdims=1),  # 1 where rest is empty
                  op("Mul", [f"{p}/part{j}", f"{p}/stride{j}"], f"term{j}")]
        terms.append(f"{p}/term{j}")
    linear = terms[0]
    for j, term in enumerate(terms[1:], 1):  # Add: onnx's Sum takes no int64
        nodes.append(op("Add", [linear, term], f"upto{j}"))
        linear = f"{p}/upto{j}"
    nodes += [
        # the updates as one row per index tuple, the index broadcast over each row's elements
        op("Concat", [f"{p}/minus1", f"{p}/tail"], "updshape", axis=0),
        op("Reshape", [updates, f"{p}/updshape"], "flatupdates"),
        op("Shape", [f"{p}/tail"], "tailrank"),
        helper.make_node("ConstantOfShape", [f"{p}/tailrank"], [f"{p}/ones"],
                         value=helper.make_tensor(f"{p}/one", TensorProto.INT64, [1], [1])),
        op("Concat", [f"{p}/minus1", f"{p}/ones"], "idxshape", axis=0),
        op("Reshape", [linear, f"{p}/idxshape"], "column"),
        op("Shape", [f"{p}/flatupdates"], "fullshape"),
        op("Expand", [f"{p}/column", f"{p}/fullshape"], "elements"),
        op("ScatterElements", [f"{p}/flatdata", f"{p}/elements", f"{p}/flatupdates"], "scattered",
           axis=0, reduction="add"),
        helper.make_node("Reshape", [f"{p}/scattered", f"{p}/dshape"], [output]),
    ]
    return nodes
