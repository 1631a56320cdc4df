"""Rewrites of a specialized segment into forms the CUDA EP runs fast; same values up to the order
of float32 sums.

- **Channel reductions in two steps.** onnxruntime runs a ReduceSum/ReduceMean with cuDNN's
  reduce-tensor kernel, which is slow when the reduced axes are not contiguous: the per-channel
  sums of an NCHW tensor (axes 0, 2, 3: BatchNorm's statistics and their gradients, the gradients
  of per-channel biases). Reducing the trailing axes first, then the batch axis, takes 0.04-0.05 ms
  where one reduction over (0, 2, 3) takes 0.09-0.32 ms (ResNet-18 shapes at batch 256, one H200,
  benchmarks/formulations_gpu.py, `channel_sum` rows). A mean of equal-sized means is the mean, so
  both ops split the same way.
- **Reductions over no axis** (``noop_with_empty_axes=1`` with an empty axes input): an Identity,
  which onnxruntime then removes. The backward of a batched MatMul writes them where both operands
  have the same batch dims, which the symbolic batch hid until specialization; run as reductions
  they copy the tensor (twice per attention layer).
- **Masked softmax** (attention's causal mask: ``Softmax(Where(mask, -inf, scores))``). Forward:
  onnxruntime's ``com.microsoft.BiasSoftmax(scores, Where(mask, -inf, 0))``, one kernel instead of
  a Where and a Softmax over the [batch, heads, T, T] scores (the additive mask is [T, T]);
  ``x + (-inf) = -inf`` and ``x + 0 = x``, so its input equals the Where's. Backward: the gradient
  of that Where, ``Where(mask, 0, S * g)`` where S is the softmax's output, is dropped: S is exactly 0
  wherever the mask filled (exp of a fill at or below -1e30 underflows to 0 in float32), so S * g
  already is 0 there (for finite g). Two passes over the scores per layer fewer (0.07 ms each for
  GPT-2-small at batch 8).
- **Wide Concats as a tree.** onnxruntime's CUDA Concat refuses more than 32 inputs while a CUDA
  graph is captured ("supports at most 32 inputs during CUDA Graph capture"): ZeRO's packing of a
  bucket's slices wrote 49-69 (2 H100s, run `h100x2-s4`). A Concat of more inputs becomes Concats of
  at most CONCAT_MAX_INPUTS consecutive inputs each, then one of their results (concatenation along
  one axis is associative: the same values; one extra copy of the data).
- **bfloat16 nodes onnxruntime has no CUDA kernel for** (``widen_bfloat16``): --precision bf16
  makes a CNN's pools bfloat16 at opset 22, where the standard allows it, and its backward has
  bfloat16 ConvTranspose and Pad nodes; onnxruntime-gpu 1.31's CUDA EP has no bfloat16 kernel for
  them, and the session would not load ("Provider type for GlobalAveragePool ... is not set"). Such
  a node reads its bfloat16 inputs cast to float32 and its float32 outputs are cast back: what a
  bfloat16 kernel computes (float arithmetic, one rounding). ``NO_BF16_KERNEL`` lists the ops, as
  found by loading a one-node bf16 model of each on the CUDA EP alone (one H200, 2026-11-28: Conv,
  AveragePool, Gemm, Relu, Sum, Flatten load; these do not; Greater, the ReLU gradient's mask,
  failed in a ResNet-18 step). onnxruntime's own kernel listing (``get_all_opkernel_def``) cannot
  say it: on the GPU build it loads every provider library, TensorRT's included, and crashed the
  process. An op missing from the list is widened when a session refuses it (session.py) and said.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from runtime.gpu.elementwise_steps import DOMAIN as ELEMENTWISE_DOMAIN
from runtime.gpu.elementwise_steps import final_factors
from runtime.specialize import static_values

_SPLIT_REDUCTIONS = ("ReduceSum", "ReduceMean")
CONCAT_MAX_INPUTS = 32  # onnxruntime's CUDA Concat under CUDA-graph capture (concat.cc)
# A mask fill at or below this makes exp(fill - row max) exactly 0 in float32 (exp underflows below
# about -104), for any row max a real score reaches.
_MASK_FILL_AT_MOST = -1e30


def lower_for_cuda(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (already specialized: static shapes inferred) with the rewrites above applied."""
    graph = model.graph
    ranks = _ranks(graph)
    constants = {t.name: t for t in graph.initializer}
    constants.update({n.output[0]: n.attribute[0].t for n in graph.node
                      if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"})
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 18)
    nodes: list[onnx.NodeProto] = []
    changed = False
    for index, node in enumerate(graph.node):
        split = (_empty_reduction(node, constants) or _split_reduction(node, ranks, constants, opset, index, graph)
                 or _concat_tree(node))
        if split is None:
            nodes.append(node)
        else:
            nodes.extend(split)
            changed = True
    if changed:
        del graph.node[:]
        graph.node.extend(nodes)
    if _masked_softmax(graph, constants, opset) and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def _ranks(graph: onnx.GraphProto) -> dict[str, int]:
    ranks = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        t = value.type.tensor_type if value.type.HasField("tensor_type") else None
        if t is not None and t.HasField("shape"):
            ranks[value.name] = len(t.shape.dim)
    return ranks


def _empty_reduction(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto]) -> list[onnx.NodeProto] | None:
    """[Identity] for a reduction over no axis that is a no-op; None otherwise."""
    if node.domain not in ("", "ai.onnx") or not node.op_type.startswith("Reduce") or len(node.input) < 2:
        return None
    noop = next((a.i for a in node.attribute if a.name == "noop_with_empty_axes"), 0)
    axes = constants.get(node.input[1])
    if not noop or axes is None or int(np.prod(axes.dims, dtype=np.int64)) != 0:
        return None
    return [helper.make_node("Identity", [node.input[0]], list(node.output), name=node.name or None)]


def _split_reduction(node: onnx.NodeProto, ranks: dict[str, int], constants: dict[str, onnx.TensorProto],
                     opset: int, index: int, graph: onnx.GraphProto) -> list[onnx.NodeProto] | None:
    """Two reductions for one over the batch axis and trailing axes with axis 1 kept; None if the
    node is not such a reduction."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in _SPLIT_REDUCTIONS or not node.input:
        return None
    rank = ranks.get(node.input[0])
    if rank is None or rank < 3:
        return None
    attrs = {a.name: a for a in node.attribute}
    axes_as_input = (node.op_type == "ReduceSum" and opset >= 13) or (node.op_type == "ReduceMean" and opset >= 18)
    if axes_as_input:
        if len(node.input) < 2 or node.input[1] not in constants:
            return None
        axes = numpy_helper.to_array(constants[node.input[1]]).reshape(-1).tolist()
    else:
        if "axes" not in attrs:
            return None
        axes = list(attrs["axes"].ints)
    axes = sorted({int(a) % rank for a in axes})
    trailing = [a for a in axes if a >= 2]
    if not axes or axes[0] != 0 or 1 in axes or not trailing:
        return None
    keepdims = attrs["keepdims"].i if "keepdims" in attrs else 1
    base = node.name or f"{node.op_type}_{index}"
    inner = f"{node.output[0]}.lowered.trailing"

    def reduce(source: str, over: list[int], keep: int, output: str, suffix: str) -> onnx.NodeProto:
        if axes_as_input:
            name = f"{output}.axes"
            graph.initializer.append(numpy_helper.from_array(np.array(over, dtype=np.int64), name))
            return helper.make_node(node.op_type, [source, name], [output], name=f"{base}/{suffix}", keepdims=keep)
        return helper.make_node(node.op_type, [source], [output], name=f"{base}/{suffix}", axes=over, keepdims=keep)

    # The first step keeps its dims, so the batch axis is still axis 0; the second reduces it and
    # the (now size-1) trailing axes, keeping dims as the original did. Its input is tiny (N, C, 1...).
    return [reduce(node.input[0], trailing, 1, inner, "trailing"),
            reduce(inner, [0, *trailing], keepdims, node.output[0], "batch")]


def _concat_tree(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """A Concat of more than CONCAT_MAX_INPUTS inputs as a tree of Concats of at most that many."""
    if node.domain not in ("", "ai.onnx") or node.op_type != "Concat" or len(node.input) <= CONCAT_MAX_INPUTS:
        return None
    axis = next(a.i for a in node.attribute if a.name == "axis")
    nodes: list[onnx.NodeProto] = []
    inputs, level = list(node.input), 0
    while len(inputs) > CONCAT_MAX_INPUTS:
        groups = [inputs[i:i + CONCAT_MAX_INPUTS] for i in range(0, len(inputs), CONCAT_MAX_INPUTS)]
        inputs = []
        for k, group in enumerate(groups):
            name = f"{node.output[0]}.lowered.concat{level}_{k}"
            nodes.append(helper.make_node("Concat", group, [name], name=name, axis=axis))  # output names are unique
            inputs.append(name)
        level += 1
    nodes.append(helper.make_node("Concat", inputs, list(node.output), name=node.name, axis=axis))
    return nodes


def _scalar(constants: dict[str, onnx.TensorProto], name: str) -> float | None:
    tensor = constants.get(name)
    if tensor is None or int(np.prod(tensor.dims, dtype=np.int64)) != 1:
        return None
    return float(numpy_helper.to_array(tensor).reshape(-1)[0])


def _masked_softmax(graph: onnx.GraphProto, constants: dict[str, onnx.TensorProto], opset: int) -> bool:
    """The masked-softmax rewrites of the module docstring, in place. A Where qualifies when its
    fill is a scalar at or below _MASK_FILL_AT_MOST, its only readers are Softmax over the last axis
    and its mask has the scores' trailing shape (one mask row per score row, repeated over the
    leading dims: BiasSoftmax's outer broadcast). Returns whether anything changed."""
    producer = {out: node for node in graph.node for out in node.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    shapes = _shapes(graph)
    graph_outputs = {o.name for o in graph.output}
    masked: dict[str, str] = {}  # softmax output -> its mask
    replace: dict[int, list[onnx.NodeProto]] = {}
    for where in graph.node:
        if where.op_type != "Where" or where.domain not in ("", "ai.onnx") or where.output[0] in graph_outputs:
            continue
        mask, fill_name, scores = where.input
        fill = _scalar(constants, fill_name)
        softmaxes = readers.get(where.output[0], [])
        score_shape, mask_shape = shapes.get(scores), shapes.get(mask)
        if fill is None or fill > _MASK_FILL_AT_MOST or not softmaxes or score_shape is None or mask_shape is None:
            continue
        if not all(s.op_type == "Softmax" and _softmax_axis(s, opset) in (-1, len(score_shape) - 1) for s in softmaxes):
            continue
        trailing = list(mask_shape)
        while len(trailing) > 2 and trailing[0] == 1:
            trailing = trailing[1:]
        if len(trailing) < 2 or list(score_shape[-len(trailing):]) != trailing or shapes.get(where.output[0]) != score_shape:
            continue
        base = where.name or where.output[0]
        zero = f"{base}.lowered.zero"
        bias = f"{base}.lowered.bias"
        if mask in constants:  # the additive mask computed here, once (onnxruntime's folding may be off)
            additive = np.where(numpy_helper.to_array(constants[mask]), np.float32(fill), np.float32(0))
            graph.initializer.append(numpy_helper.from_array(additive.astype(np.float32), bias))
            new = []
        else:
            graph.initializer.append(numpy_helper.from_array(np.zeros((), np.float32), zero))
            new = [helper.make_node("Where", [mask, fill_name, zero], [bias], name=f"{base}/bias")]
        for softmax in softmaxes:
            new.append(helper.make_node("BiasSoftmax", [scores, bias], list(softmax.output), name=f"{softmax.name or base}/bias_softmax",
                                        domain="com.microsoft", axis=len(score_shape) - 1, is_inner_broadcast=0))
            replace[id(softmax)] = []
            masked[softmax.output[0]] = mask
        replace[id(where)] = new
    if not masked:
        return False
    for where in graph.node:
        if where.op_type != "Where" or where.domain not in ("", "ai.onnx") or id(where) in replace:
            continue
        mask, zero_name, grad = where.input
        product = producer.get(grad)
        if _scalar(constants, zero_name) != 0.0 or product is None:
            continue
        if not any(masked.get(name) == mask for name in _factors(product, grad)):
            continue
        replace[id(where)] = [helper.make_node("Identity", [grad], list(where.output), name=f"{where.name or grad}/dropped")]
    nodes = [new for node in graph.node for new in replace.get(id(node), [node])]
    del graph.node[:]
    graph.node.extend(nodes)
    return True


def _factors(node: onnx.NodeProto, output: str) -> list[str]:
    """The values ``node`` multiplies to compute ``output``, if its last step is a product: a Mul's
    inputs, or those of a fused elementwise node's final Mul (the softmax backward's ``S * (g - s)``
    is one once fused); else none."""
    if node.op_type == "Mul" and node.domain in ("", "ai.onnx"):
        return list(node.input)
    if node.domain == ELEMENTWISE_DOMAIN:
        return final_factors(node, output)
    return []


def _softmax_axis(node: onnx.NodeProto, opset: int) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), -1 if opset >= 13 else 1)


def _shapes(graph: onnx.GraphProto) -> dict[str, list[int]]:
    shapes = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        t = value.type.tensor_type if value.type.HasField("tensor_type") else None
        if t is not None and t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
            shapes[value.name] = [d.dim_value for d in t.shape.dim]
    for tensor in graph.initializer:
        shapes[tensor.name] = list(tensor.dims)
    return shapes


# Ops onnxruntime-gpu 1.31's CUDA EP has no bfloat16 kernel for (the module docstring).
NO_BF16_KERNEL = frozenset({"MaxPool", "GlobalAveragePool", "GlobalMaxPool", "LpPool", "GlobalLpPool", "MaxUnpool",
                            "ConvTranspose", "Pad", "Greater"})


def widen_bfloat16(model: onnx.ModelProto, no_kernel: frozenset[str] = NO_BF16_KERNEL) -> onnx.ModelProto:
    """``model`` (specialized) with every default-domain node of an op in ``no_kernel`` that reads or
    writes bfloat16 computed in float32 between casts (the module docstring)."""
    graph = model.graph
    types = {name: elem for name, (_, elem) in static_values(graph).items()}
    low, wide = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        default = node.domain in ("", "ai.onnx")
        if (not default or node.op_type not in no_kernel
                or not any(types.get(n) == low for n in (*node.input, *node.output) if n)):
            nodes.append(node)
            continue
        for i, name in enumerate(node.input):
            if name and types.get(name) == low:
                nodes.append(helper.make_node("Cast", [name], [f"{name}/{node.name}.float32"], to=wide,
                                              name=f"{node.name}/widen_{i}"))
                node.input[i] = f"{name}/{node.name}.float32"
        narrow = []
        for j, name in enumerate(node.output):
            if name and types.get(name) == low:
                node.output[j] = f"{name}.float32"
                narrow.append(helper.make_node("Cast", [f"{name}.float32"], [name], to=low, name=f"{node.name}/narrow_{j}"))
        nodes += [node, *narrow]
    del graph.node[:]
    graph.node.extend(nodes)
    return model
