"""Old vs new backward formulations, timed one by one on onnxruntime; JSON lines to stdout and --out.

    # on a GPU host (onnxruntime-gpu; TF32 on unless --no-tf32):
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/formulations_gpu.py --out benchmarks/results/formulations_gpu.jsonl
    # anywhere, as a smoke test (CPU provider, tiny shapes):
    python3 benchmarks/formulations_gpu.py --cpu --tiny --out /tmp/formulations.jsonl

Cases (each graph holds only the formulation measured; inputs random, bound on the device):
- ``conv_wgrad``: dW of a Conv (ResNet-18 for 32x32 at batch 256: 3x3 pad 1 at every stage, the
  stride-2 3x3 and 1x1 convs that open stages 2-4). "conv": the Conv over transposed tensors
  whose kernel is the whole output gradient (the former rule, still the fallback for groups and
  dynamic shapes); "gemm": one Gemm per kernel tap (the current rule). Both are built by the
  transpiler's own Conv rule (``transpiler.autodiff.rules.conv.WEIGHT_GRAD``).
- ``bn_train``: BatchNormalization forward + backward (dx, dscale, dbias) at the same shapes, from
  ``decompose_batchnorm(formulation=...)`` and the autodiff: "primitive" (former) vs "fused"
  (inference-mode BatchNormalization fed the batch statistics, two-reduction backward). The loss
  is sum(y * dY); "loss_only" times that scaffolding alone (y = x) to subtract.
- ``channel_sum``: the per-channel reduction BN needs, three ways: ReduceSum over axes [0, 2, 3]
  (cuDNN reduce), ReduceSum over [2, 3] then [0] (two row/column reductions), Reshape to
  (N, C, H*W) and ReduceSum over [0, 2]. Not used by the transpiler yet: for choosing.
- ``linear_wgrad``: dW of x @ W, x (8, 512, 768), W (768, 3072) ("plain"), and of x @ W^T with
  W (3072, 768) as exporters write nn.Linear ("transposed"): "batched_reduce" (former: transpose
  x, batched MatMul, ReduceSum over the batch) vs "gemm" (the current MatMul rule: one Gemm over
  the flattened rows, transA=1).
- ``bias_grad``: dB of x + B, x (8, 512, 3072): ReduceSum over [0, 1] vs Reshape (-1, C) +
  ReduceSum over 0.

Each line: case, shape, formulation, provider, tf32, nodes (all), kernel_nodes (nodes that launch
work: not Constant/Reshape/Unsqueeze/Squeeze/Shape/Size/Flatten/Identity), op counts, median /
p10 / p90 milliseconds over --runs runs after --warmup runs (host clock around
run_with_iobinding, which waits for the device), and max_rel_diff against the first formulation
of the case (the same math: expect ~1e-6 in float32, ~1e-3 with TF32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import onnx_ir as ir  # noqa: E402

from transpiler.autodiff import build_gradients  # noqa: E402
from transpiler.autodiff._context import Emitter, RuleContext  # noqa: E402
from transpiler.autodiff._registry import rule_for  # noqa: E402
from transpiler.autodiff.rules import conv as conv_rules  # noqa: E402
from transpiler.batchnorm import decompose_batchnorm  # noqa: E402

OPSET = 18
FREE = {"Constant", "Reshape", "Unsqueeze", "Squeeze", "Shape", "Size", "Flatten", "Identity"}

# (N, C, O, H=W, kernel, stride): ResNet-18 for 32x32 at batch 256.
CONV_SHAPES = [
    (256, 64, 64, 32, 3, 1),
    (256, 64, 128, 32, 3, 2),
    (256, 64, 128, 32, 1, 2),
    (256, 128, 128, 16, 3, 1),
    (256, 128, 256, 16, 3, 2),
    (256, 256, 256, 8, 3, 1),
    (256, 256, 512, 8, 3, 2),
    (256, 512, 512, 4, 3, 1),
]
TINY_CONV_SHAPES = [(2, 4, 4, 8, 3, 1), (2, 4, 8, 8, 3, 2), (2, 4, 8, 8, 1, 2), (2, 8, 8, 4, 3, 1)]
BN_SHAPES = [(256, 64, 32), (256, 128, 16), (256, 256, 8), (256, 512, 4)]
TINY_BN_SHAPES = [(2, 4, 8), (2, 8, 4)]
LINEAR = (8, 512, 768, 3072)
TINY_LINEAR = (2, 16, 32, 64)


# ---------------------------------------------------------------------------------------------
# Graph building


def _value_info(name: str, shape) -> onnx.ValueInfoProto:
    return onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, list(shape))


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = onnx.helper.make_graph(nodes, "formulation", inputs, outputs, list(initializers))
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", OPSET)])
    model.ir_version = 10
    return model


def _prune(graph: ir.Graph) -> None:
    """Drop nodes and graph inputs nothing needed for the outputs reads."""
    live = set(graph.outputs)
    for node in reversed(list(graph)):
        if any(out in live for out in node.outputs):
            live.update(v for v in node.inputs if v is not None)
        else:
            graph.remove(node, safe=False)
    kept = [v for v in graph.inputs if v in live]
    graph.inputs.clear()
    graph.inputs.extend(kept)


def _finish(model: ir.Model) -> onnx.ModelProto:
    _prune(model.graph)
    proto = ir.serde.serialize_model(model)
    proto = onnx.shape_inference.infer_shapes(proto)
    onnx.checker.check_model(proto)
    return proto


def conv_wgrad(shape, formulation: str) -> onnx.ModelProto:
    n, c, o, h, k, s = shape
    pad = k // 2
    ho = (h + 2 * pad - k) // s + 1
    proto = _model(
        [onnx.helper.make_node("Conv", ["x", "w"], ["y"], name="conv", strides=[s, s], pads=[pad] * 4)],
        [_value_info("x", [n, c, h, h]), _value_info("w", [o, c, k, k]), _value_info("dy", [n, o, ho, ho])],
        [_value_info("y", [n, o, ho, ho])],
    )
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto))
    graph = model.graph
    node = next(iter(graph))
    dy = next(v for v in graph.inputs if v.name == "dy")
    previous = conv_rules.WEIGHT_GRAD
    conv_rules.WEIGHT_GRAD = formulation
    try:
        ctx = RuleContext(Emitter(graph), node, [dy], [1])
        dw = rule_for(node).compute(ctx)[1]
    finally:
        conv_rules.WEIGHT_GRAD = previous
    dw.name = "dw"
    graph.outputs.clear()
    graph.outputs.append(dw)
    return _finish(model)


def bn_train(shape, formulation: str) -> onnx.ModelProto:
    n, c, h = shape
    inits = [
        onnx.numpy_helper.from_array(np.zeros(c, np.float32), "running_mean"),
        onnx.numpy_helper.from_array(np.ones(c, np.float32), "running_var"),
    ]
    if formulation == "loss_only":
        nodes = [onnx.helper.make_node("Identity", ["x"], ["y"])]
    else:
        nodes = [onnx.helper.make_node("BatchNormalization", ["x", "scale", "bias", "running_mean", "running_var"],
                                       ["y"], name="bn", epsilon=1e-5, momentum=0.9)]
    nodes += [
        onnx.helper.make_node("Mul", ["y", "dy"], ["ydy"]),
        onnx.helper.make_node("ReduceSum", ["ydy"], ["loss"], keepdims=0),
    ]
    proto = _model(
        nodes,
        [_value_info("x", [n, c, h, h]), _value_info("scale", [c]), _value_info("bias", [c]),
         _value_info("dy", [n, c, h, h])],
        [_value_info("loss", [])],
        inits,
    )
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto))
    if formulation != "loss_only":
        model, _ = decompose_batchnorm(model, formulation=formulation)
    graph = model.graph
    values = {v.name: v for v in graph.inputs}
    wrt = [values["x"]] if formulation == "loss_only" else [values["x"], values["scale"], values["bias"]]
    grads = build_gradients(graph, graph.outputs[0], wrt)
    graph.outputs.extend(grads.grads[v] for v in wrt)
    return _finish(model)


def channel_sum(shape, formulation: str) -> onnx.ModelProto:
    n, c, h = shape
    const = lambda name, values: onnx.numpy_helper.from_array(np.array(values, np.int64), name)  # noqa: E731
    if formulation == "axes_0_2_3":
        nodes, inits = [onnx.helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=1)], [const("axes", [0, 2, 3])]
    elif formulation == "spatial_then_batch":
        nodes = [onnx.helper.make_node("ReduceSum", ["x", "inner"], ["t"], keepdims=1),
                 onnx.helper.make_node("ReduceSum", ["t", "outer"], ["s"], keepdims=1)]
        inits = [const("inner", [2, 3]), const("outer", [0])]
    else:  # reshape_0_2
        nodes = [onnx.helper.make_node("Reshape", ["x", "shape"], ["r"]),
                 onnx.helper.make_node("ReduceSum", ["r", "axes"], ["s"], keepdims=1)]
        inits = [const("shape", [0, c, -1]), const("axes", [0, 2])]
    out_shape = [1, c, 1] if formulation == "reshape_0_2" else [1, c, 1, 1]
    return _model(nodes, [_value_info("x", [n, c, h, h])], [_value_info("s", out_shape)], inits)


def linear_wgrad(shape, formulation: str, transposed: bool) -> onnx.ModelProto:
    b, t, k, m = shape
    w_shape = [m, k] if transposed else [k, m]
    inputs = [_value_info("x", [b, t, k]), _value_info("w", w_shape), _value_info("dy", [b, t, m])]
    if formulation == "batched_reduce":
        # The former MatMul rule (and Transpose rule after it, for x @ W^T).
        nodes = [
            onnx.helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
            onnx.helper.make_node("MatMul", ["xt", "dy"], ["per_batch"]),
            onnx.helper.make_node("ReduceSum", ["per_batch", "zero"], ["dwt" if transposed else "dw"], keepdims=0),
        ]
        if transposed:
            nodes.append(onnx.helper.make_node("Transpose", ["dwt"], ["dw"], perm=[1, 0]))
        proto = _model(nodes, inputs, [_value_info("dw", w_shape)],
                       [onnx.numpy_helper.from_array(np.array([0], np.int64), "zero")])
        return proto
    # The current rules, on the forward node(s) as exporters write them, fed dy directly.
    nodes = []
    if transposed:
        nodes.append(onnx.helper.make_node("Transpose", ["w"], ["wt"], name="wT", perm=[1, 0]))
    nodes.append(onnx.helper.make_node("MatMul", ["x", "wt" if transposed else "w"], ["y"], name="mm"))
    proto = _model(nodes, inputs, [_value_info("y", [b, t, m])])
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto))
    graph = model.graph
    emitter = Emitter(graph)
    forward = {node.name: node for node in graph}
    dy = next(v for v in graph.inputs if v.name == "dy")
    matmul = forward["mm"]
    grad = rule_for(matmul).compute(RuleContext(emitter, matmul, [dy], [1]))[1]
    if transposed:
        transpose = forward["wT"]
        grad = rule_for(transpose).compute(RuleContext(emitter, transpose, [grad], [0]))[0]
    grad.name = "dw"
    graph.outputs.clear()
    graph.outputs.append(grad)
    return _finish(model)


def bias_grad(shape, formulation: str) -> onnx.ModelProto:
    b, t, _, m = shape
    if formulation == "reducesum_0_1":
        nodes = [onnx.helper.make_node("ReduceSum", ["dy", "axes"], ["db"], keepdims=0)]
        inits = [onnx.numpy_helper.from_array(np.array([0, 1], np.int64), "axes")]
    else:
        nodes = [onnx.helper.make_node("Reshape", ["dy", "rows"], ["r"]),
                 onnx.helper.make_node("ReduceSum", ["r", "axes"], ["db"], keepdims=0)]
        inits = [onnx.numpy_helper.from_array(np.array([-1, m], np.int64), "rows"),
                 onnx.numpy_helper.from_array(np.array([0], np.int64), "axes")]
    return _model(nodes, [_value_info("dy", [b, t, m])], [_value_info("db", [m])], inits)


# ---------------------------------------------------------------------------------------------
# Timing


def _session(proto: onnx.ModelProto, args):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if args.cpu:
        providers = ["CPUExecutionProvider"]
    else:
        providers = [("CUDAExecutionProvider", {"use_tf32": "0" if args.no_tf32 else "1"}), "CPUExecutionProvider"]
    return ort.InferenceSession(proto.SerializeToString(), options, providers=providers)


def _time(proto: onnx.ModelProto, feeds: dict[str, np.ndarray], args) -> tuple[dict, list[np.ndarray]]:
    import onnxruntime as ort

    session = _session(proto, args)
    device = "cpu" if args.cpu else "cuda"
    binding = session.io_binding()
    names = {i.name for i in session.get_inputs()}
    for name, array in feeds.items():
        if name in names:
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array, device, 0))
    for out in session.get_outputs():
        binding.bind_output(out.name, device)
    for _ in range(args.warmup):
        session.run_with_iobinding(binding)
    times = []
    for _ in range(args.runs):
        started = time.perf_counter()
        session.run_with_iobinding(binding)  # returns when the device is done
        times.append((time.perf_counter() - started) * 1e3)
    outputs = binding.copy_outputs_to_cpu()
    times.sort()
    stats = {
        "median_ms": round(statistics.median(times), 4),
        "p10_ms": round(times[len(times) // 10], 4),
        "p90_ms": round(times[(len(times) * 9) // 10], 4),
        "runs": args.runs,
    }
    return stats, outputs


def _ops(proto: onnx.ModelProto) -> dict:
    ops = Counter(n.op_type for n in proto.graph.node)
    return {
        "nodes": sum(ops.values()),
        "kernel_nodes": sum(v for k, v in ops.items() if k not in FREE),
        "ops": dict(sorted(ops.items())),
    }


def _feeds(proto: onnx.ModelProto, rng: np.random.Generator) -> dict[str, np.ndarray]:
    feeds = {}
    for value in proto.graph.input:
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.standard_normal(dims, dtype=np.float32)
    return feeds


def _cases(args):
    tiny = args.tiny
    for shape in TINY_CONV_SHAPES if tiny else CONV_SHAPES:
        yield "conv_wgrad", shape, [(f, lambda f=f, s=shape: conv_wgrad(s, f)) for f in ("conv", "gemm")]
    for shape in TINY_BN_SHAPES if tiny else BN_SHAPES:
        yield "bn_train", shape, [(f, lambda f=f, s=shape: bn_train(s, f)) for f in ("primitive", "fused", "loss_only")]
        yield "channel_sum", shape, [(f, lambda f=f, s=shape: channel_sum(s, f))
                                     for f in ("axes_0_2_3", "spatial_then_batch", "reshape_0_2")]
    shape = TINY_LINEAR if tiny else LINEAR
    for transposed in (False, True):
        case = "linear_wgrad_" + ("transposed" if transposed else "plain")
        yield case, shape, [(f, lambda f=f, t=transposed: linear_wgrad(shape, f, t)) for f in ("batched_reduce", "gemm")]
    yield "bias_grad", shape, [(f, lambda f=f: bias_grad(shape, f)) for f in ("reducesum_0_1", "rows_reducesum_0")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the JSON lines to this file")
    parser.add_argument("--cpu", action="store_true", help="CPU provider (default: CUDA)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke test)")
    parser.add_argument("--no-tf32", action="store_true", help="CUDA: fp32 GEMMs and convolutions")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--only", default="", help="comma-separated case-name prefixes to run")
    args = parser.parse_args(argv)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    sink = args.out.open("w") if args.out else None
    import onnxruntime as ort

    provider = "CPUExecutionProvider" if args.cpu else "CUDAExecutionProvider"
    if provider not in ort.get_available_providers():
        sys.exit(f"formulations_gpu: {provider} is not available (onnxruntime {ort.__version__}); use --cpu")
    only = [p for p in args.only.split(",") if p]
    rng = np.random.default_rng(0)
    try:
        for case, shape, variants in _cases(args):
            if only and not any(case.startswith(p) for p in only):
                continue
            reference = None
            feeds = None
            for formulation, make in variants:
                proto = make()
                if feeds is None:
                    feeds = _feeds(proto, rng)
                else:  # same inputs for every formulation of a case (new names get new arrays)
                    for value in proto.graph.input:
                        if value.name not in feeds:
                            feeds.update(_feeds(onnx.helper.make_model(onnx.helper.make_graph([], "g", [value], [])), rng))
                stats, outputs = _time(proto, feeds, args)
                diff = None
                if reference is None:
                    reference = outputs
                elif len(outputs) == len(reference) and all(a.size == b.size for a, b in zip(outputs, reference)):
                    diff = max(float(np.max(np.abs(a.reshape(-1) - b.reshape(-1))) / max(float(np.max(np.abs(b))), 1e-30))
                               for a, b in zip(outputs, reference))
                row = {
                    "case": case, "shape": list(shape), "formulation": formulation,
                    "provider": provider, "tf32": not args.cpu and not args.no_tf32,
                    **stats, **_ops(proto),
                    "max_rel_diff_vs_first": None if diff is None else float(f"{diff:.3g}"),
                    "onnxruntime": ort.__version__,
                }
                line = json.dumps(row)
                print(line, flush=True)
                if sink:
                    sink.write(line + "\n")
                    sink.flush()
    finally:
        if sink:
            sink.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
