"""BatchNormalization for training: decomposed into primitive ops with batch statistics.

Why decompose rather than differentiate the BatchNormalization op:
- onnxruntime's CUDA EP rejects BatchNormalization in training mode for opset >= 14, so the GPU
  needs primitives anyway;
- with ``--sync-bn`` the statistics are all-reduced across ranks *inside* the forward, which is a
  collective node between primitives; autodiff then differentiates through it (the transpose of an
  all-reduce-mean is an all-reduce-mean of the cotangents);
- the gradient comes from the primitive rules, each finite-difference checked.

The default ("node") form is ONE node, ``graph_transpiler.batchnorm::BatchNormTraining``, for the
common case (rank-4 float32 input, running statistics present, statistics not synchronized, epsilon
at least cuDNN's minimum); its rule emits one ``BatchNormTrainingGrad``. The GPU backend runs both
as its own kernels (runtime/gpu/batchnorm.py); their functions (transpiler/batchnorm_ops.py) compute the "fused" form
below everywhere else. Other BatchNorms fall back to the "fused" form.

The "fused" form keeps the statistics as primitives (ReduceMean of x; ReduceMean of the
squared centered x: the exact two-pass variance) and normalizes with ONE BatchNormalization node in
inference mode fed those statistics, which onnxruntime runs as one kernel on CPU and CUDA (cuDNN)
at any opset. Its gradient rule (autodiff/rules/batchnorm.py) recognizes that pattern and
writes PyTorch's training-mode backward: two reductions (sum dy, sum dy * (x - mean)) and
elementwise ops, all-reducing the two per-channel means with ``--sync-bn``. The "primitive" form
(normalization as Sub/Mul/Add too; its backward has about four reductions and two Expands per BN)
is kept for epsilon below cuDNN's minimum, which onnxruntime's CUDA kernel would clamp, and for
benchmarks/formulations_gpu.py.

Semantics are PyTorch's ``model.train()`` whatever mode the exporter used: normalize with the batch
mean and biased variance; update the running statistics as
``running = momentum_onnx * running + (1 - momentum_onnx) * batch_stat`` where the running variance
takes the *unbiased* batch variance (PyTorch; onnxruntime's kernel would use the biased one).
The running statistics are state of kind ``buffer``: updated every step, never trained, exported.

Without ``--sync-bn`` each rank normalizes with its own shard's statistics, as PyTorch DDP does, so N
ranks differ slightly from one device on BN models and each rank's running statistics differ (rank
0's are exported, as DDP's broadcast_buffers would make every rank use). With ``--sync-bn`` the
mean and the variance are all-reduced (two collectives per BN layer, each [C] floats), so N ranks
equal one device (SyncBatchNorm).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx.shape_inference
import onnx_ir as ir

from contract.ops import BATCHNORM_DOMAIN, BATCHNORM_TRAINING
from transpiler.collectives import DOMAIN, VERSION
from transpiler.errors import TranspileError
from transpiler.native_ops import add_op_functions


@dataclass
class Buffer:
    """Running statistic: the initializer ``name`` is replaced each step by the value ``update``."""

    name: str
    update: ir.Value


_FUSED_SUFFIX = "/batch_statistics"


class _Emitter:
    def __init__(self, node: ir.Node):
        self.node = node
        self.nodes: list[ir.Node] = []
        self.prefix = f"{node.name or 'BatchNormalization'}/decomposed"

    def op(self, op_type: str, inputs, attributes=None, *, domain: str = "", num_outputs: int = 1) -> ir.Value:
        suffix = _FUSED_SUFFIX if op_type == "BatchNormalization" else ""
        node = ir.node(op_type, inputs, attributes, domain=domain, num_outputs=num_outputs,
                       name=f"{self.prefix}/{op_type}_{len(self.nodes)}{suffix}")
        self.nodes.append(node)
        return node.outputs[0]

    def const(self, array: np.ndarray) -> ir.Value:
        # A Constant node, never an initializer: a float initializer on the path to the loss would be
        # taken for a trainable parameter.
        return self.op("Constant", [], {"value": ir.tensor(array)})


def _attr(node: ir.Node, name: str, default):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


# onnxruntime's CUDA BatchNormalization clamps epsilon up to cuDNN's minimum (CUDNN_BN_MIN_EPSILON,
# 1e-5 in cuDNN 7's headers; later headers may define it lower, not checked on a device): a smaller
# epsilon keeps the primitive normalization, which computes it as given, and so does the node form
# (the GPU's cuDNN call). A conservative bound: models with epsilon 1e-5 or more are unaffected.
CUDNN_MIN_EPSILON = 1e-5
FORMULATIONS = ("node", "fused", "primitive")


def decompose_batchnorm(
    model: ir.Model, *, world_size: int = 1, formulation: str = "node"
) -> tuple[ir.Model, list[Buffer]]:
    """Replace every BatchNormalization node by its training form; ``world_size > 1`` all-reduces the statistics.

    ``formulation``: "node" (default) writes one BatchNormTraining node where it applies (see the
    module docstring) and the "fused" form elsewhere; "fused" computes the batch statistics with primitives and
    normalizes with an inference-mode BatchNormalization node fed those statistics (one kernel;
    its gradient rule needs two reductions); "primitive" (the former form, kept for comparison
    and benchmarks/formulations_gpu.py) normalizes with primitives too.

    Returns the model (re-typed by shape inference when anything changed: autodiff needs the types
    of the new values) and the running-statistics updates, for the caller to wire as state.
    """
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {formulation!r}")
    graph = model.graph
    # (Nodes this function wrote, on a model it already decomposed, are not training BNs again.)
    nodes = [n for n in graph if n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx")
             and not (n.name or "").endswith(_FUSED_SUFFIX)]
    if not nodes:
        return model, []
    names = []
    if world_size > 1:
        graph.opset_imports[DOMAIN] = VERSION
    for node in nodes:
        names.extend((b.name, b.update.name) for b in _decompose(graph, node, world_size, formulation))
    add_op_functions(model)
    # Shape inference through a proto round trip; the collectives' outputs carry explicit types.
    proto = onnx.shape_inference.infer_shapes(ir.serde.serialize_model(model), data_prop=True)
    model = ir.serde.deserialize_model(proto)
    values = {v.name: v for node in model.graph for v in node.outputs}
    return model, [Buffer(name, values[update]) for name, update in names]


def _decompose(graph: ir.Graph, node: ir.Node, world_size: int, formulation: str) -> list[Buffer]:
    x, scale, bias, running_mean, running_var = node.inputs[:5]
    if node.outputs[0].is_graph_output():
        raise TranspileError(f"node '{node.name}' (BatchNormalization): its output is a graph output; not supported")
    if x.shape is None or x.dtype is None:
        raise TranspileError(f"node '{node.name}' (BatchNormalization): the input's shape is unknown after shape inference")
    rank = x.shape.rank()
    if rank < 2 or not isinstance(x.shape[1], int):
        raise TranspileError(f"node '{node.name}' (BatchNormalization): needs a static channel axis 1, input shape is {x.shape}")
    channels = x.shape[1]
    dtype = x.dtype.numpy()
    eps = float(_attr(node, "epsilon", 1e-5))
    momentum = float(_attr(node, "momentum", 0.9))
    e = _Emitter(node)
    if formulation == "node" and _node_applies(node, world_size, eps):
        return _training_node(graph, node, e, eps, momentum)

    axes = e.const(np.array([0, *range(2, rank)], dtype=np.int64))
    stat_shape = [1, channels] + [1] * (rank - 2)

    def synced(value: ir.Value) -> ir.Value:
        if world_size == 1:
            return value
        # order and bucket are assigned by SplitRanksPass, once the whole rank graph exists.
        out = e.op("AllReduce", [value], {"reduction": "mean", "bucket": -1, "order": -1, "phase": "step"}, domain=DOMAIN)
        out.dtype, out.shape = x.dtype, ir.Shape(stat_shape)
        return out

    # Equal shards: the mean of the ranks' means is the global mean, and so for the variance
    # around the (already global) mean: two passes, as one device computes it.
    mean = synced(e.op("ReduceMean", [x, axes], {"keepdims": 1}))
    centered = e.op("Sub", [x, mean])
    var = synced(e.op("ReduceMean", [e.op("Mul", [centered, centered]), axes], {"keepdims": 1}))
    # (Compared in float32: the attribute is a float32, and float32(1e-5) < 1e-5.)
    if formulation in ("node", "fused") and np.float32(eps) >= np.float32(CUDNN_MIN_EPSILON):
        # Normalize and scale in one kernel: BatchNormalization in inference mode, fed the batch
        # statistics. Its gradient rule (autodiff/rules/batchnorm.py) recognizes this pattern
        # and differentiates through the statistics with two reductions (sum dy, sum dy*(x-mean)).
        flat = e.const(np.array([channels], dtype=np.int64))
        y = e.op("BatchNormalization", [x, scale, bias, e.op("Reshape", [mean, flat]), e.op("Reshape", [var, flat])],
                 {"epsilon": eps})
    else:
        # Primitives only; the primitives' rules give the gradient (more reductions and kernels).
        inv_std = e.op("Div", [e.const(np.array(1, dtype)),
                               e.op("Sqrt", [e.op("Add", [var, e.const(np.array(eps, dtype))])])])
        shape = e.const(np.array(stat_shape, dtype=np.int64))
        y = e.op("Add", [e.op("Mul", [e.op("Mul", [centered, inv_std]), e.op("Reshape", [scale, shape])]),
                         e.op("Reshape", [bias, shape])])

    buffers = []
    if running_mean is not None and running_var is not None:
        flat = e.const(np.array([channels], dtype=np.int64))
        # Elements per channel over the batch the statistics were taken on (global with --sync-bn).
        count = e.op("Div", [e.op("Cast", [e.op("Size", [x])], {"to": x.dtype}), e.const(np.array(channels / world_size, dtype))])
        unbiased = e.op("Div", [count, e.op("Sub", [count, e.const(np.array(1, dtype))])])
        keep, take = e.const(np.array(momentum, dtype)), e.const(np.array(1 - momentum, dtype))
        new_mean = e.op("Add", [e.op("Mul", [running_mean, keep]), e.op("Mul", [e.op("Reshape", [mean, flat]), take])])
        batch_var = e.op("Mul", [e.op("Reshape", [var, flat]), unbiased])
        new_var = e.op("Add", [e.op("Mul", [running_var, keep]), e.op("Mul", [batch_var, take])])
        buffers = _running_updates(node, e, new_mean, new_var)
    _replace(graph, node, e.nodes, y)
    return buffers


def _running_updates(node: ir.Node, e: _Emitter, new_mean: ir.Value, new_var: ir.Value) -> list[Buffer]:
    """The running statistics' next values typed and named, read where the node's own
    running-statistics outputs were (rare); the buffers they update where both are initializers."""
    running_mean, running_var = node.inputs[3], node.inputs[4]
    for value, stat, suffix in ((new_mean, running_mean, "mean"), (new_var, running_var, "var")):
        value.dtype, value.shape = stat.dtype, ir.Shape(stat.shape)
        value.name = f"{e.prefix}/running_{suffix}"
    for old, new in zip(node.outputs[1:3], (new_mean, new_var)):
        old.replace_all_uses_with(new)
    if running_mean.is_initializer() and running_var.is_initializer():
        return [Buffer(running_mean.name, new_mean), Buffer(running_var.name, new_var)]
    return []


def _replace(graph: ir.Graph, node: ir.Node, nodes: list[ir.Node], y: ir.Value) -> None:
    """``nodes`` in place of ``node``, whose output ``y`` (typed like its input) now is."""
    x = node.inputs[0]
    graph.insert_before(node, nodes)
    y.dtype, y.shape = x.dtype, ir.Shape(x.shape)
    node.outputs[0].replace_all_uses_with(y)
    graph.remove(node, safe=True)


def _node_applies(node: ir.Node, world_size: int, eps: float) -> bool:
    """Whether BatchNormTraining can stand for ``node``: statistics not synchronized (the node holds
    no collective), a rank-4 float32 input (cuDNN's 2-D spatial kernels, float32 descriptors), both
    running statistics given (cuDNN updates them) and epsilon at least cuDNN's minimum."""
    x, running_mean, running_var = node.inputs[0], node.inputs[3], node.inputs[4]
    return (world_size == 1 and x.dtype == ir.DataType.FLOAT and x.shape.rank() == 4
            and running_mean is not None and running_var is not None
            and np.float32(eps) >= np.float32(CUDNN_MIN_EPSILON))


def _training_node(graph: ir.Graph, node: ir.Node, e: _Emitter, eps: float, momentum: float) -> list[Buffer]:
    x = node.inputs[0]
    bn = ir.node(BATCHNORM_TRAINING, list(node.inputs[:5]), {"epsilon": eps, "momentum": momentum},
                 domain=BATCHNORM_DOMAIN, num_outputs=5, name=f"{e.prefix}/{BATCHNORM_TRAINING}")
    y, new_mean, new_var, saved_mean, saved_inv_std = bn.outputs
    for value, suffix in ((saved_mean, "saved_mean"), (saved_inv_std, "saved_inv_std")):
        value.dtype, value.shape = x.dtype, ir.Shape([x.shape[1]])
        value.name = f"{e.prefix}/{suffix}"
    buffers = _running_updates(node, e, new_mean, new_var)
    _replace(graph, node, [bn], y)
    return buffers
