"""A GPT-2-layout decoder written directly in basic ONNX ops, for the GPU tests and benchmark.

Only ops whose gradient rules are in the committed transpiler are used (MatMul, Add, Mul, Div, Sub,
Exp, Log, Sqrt, Tanh, ReduceSum/ReduceMean, Reshape, Transpose; Equal/Range/Cast/Unsqueeze off the
gradient path), so the model transpiles whatever else the transpiler grows. Differences from
GPT-2, all for that reason: the token embedding is a MatMul with a one-hot built in the graph (no
Gather), softmax and log-softmax are written out without the max shift (activations stay small at
GPT-2's init), the causal mask is an added constant (-1e4 above the diagonal, exp underflows to 0),
GELU is the tanh form. Embedding and LM head are tied, as in GPT-2 (124M parameters at 12x768).

    model = build(layers=12, width=768, heads=12, vocab=50304, seq=512)
    forward(tokens int64 [batch, seq], targets int64 [batch, seq]) -> loss (float32 scalar)
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

GPT2_SMALL = dict(layers=12, width=768, heads=12, vocab=50304, seq=512)
TINY = dict(layers=2, width=64, heads=4, vocab=128, seq=16)


def build(layers: int, width: int, heads: int, vocab: int, seq: int, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    head = width // heads
    nodes: list[onnx.NodeProto] = []
    inits: dict[str, np.ndarray] = {}
    counter = [0]

    def const(value, dtype=np.float32) -> str:
        # A Constant node, not an initializer: float initializers are the trainable parameters.
        counter[0] += 1
        name = f"const{counter[0]}"
        nodes.append(helper.make_node("Constant", [], [name], name=f"/Constant_{counter[0]}",
                                      value=numpy_helper.from_array(np.array(value, dtype=dtype))))
        return name

    def op(kind: str, inputs: list[str], **attrs) -> str:
        counter[0] += 1
        out = f"{kind.lower()}{counter[0]}"
        nodes.append(helper.make_node(kind, inputs, [out], name=f"/{kind}_{counter[0]}", **attrs))
        return out

    def param(name: str, shape, kind: str) -> str:
        if kind == "weight":
            inits[name] = rng.normal(0.0, 0.02, size=shape).astype(np.float32)
        elif kind == "gain":
            inits[name] = (1.0 + rng.uniform(-0.02, 0.02, size=shape)).astype(np.float32)
        else:
            inits[name] = rng.uniform(-0.02, 0.02, size=shape).astype(np.float32)
        return name

    def linear(x: str, prefix: str, fan_in: int, fan_out: int) -> str:
        return op("Add", [op("MatMul", [x, param(f"{prefix}.weight", (fan_in, fan_out), "weight")]),
                          param(f"{prefix}.bias", (fan_out,), "bias")])

    last = const([-1], np.int64)

    def layer_norm(x: str, prefix: str) -> str:
        mean = op("ReduceMean", [x, last], keepdims=1)
        centered = op("Sub", [x, mean])
        var = op("ReduceMean", [op("Mul", [centered, centered]), last], keepdims=1)
        normed = op("Div", [centered, op("Sqrt", [op("Add", [var, const(1e-5)])])])
        return op("Add", [op("Mul", [normed, param(f"{prefix}.weight", (width,), "gain")]),
                          param(f"{prefix}.bias", (width,), "bias")])

    def one_hot(ids: str) -> str:
        classes = op("Range", [const(0, np.int64), const(vocab, np.int64), const(1, np.int64)])
        return op("Cast", [op("Equal", [op("Unsqueeze", [ids, last]), classes])], to=TensorProto.FLOAT)

    wte = param("wte", (vocab, width), "weight")
    x = op("Add", [op("MatMul", [one_hot("tokens"), wte]), param("wpe", (seq, width), "weight")])
    mask = const(np.triu(np.full((seq, seq), -1e4, np.float32), 1))
    split_heads = const([0, seq, heads, head], np.int64)
    merge_heads = const([0, seq, width], np.int64)
    for i in range(layers):
        h = layer_norm(x, f"h{i}.ln_1")
        q, k, v = (op("Transpose", [op("Reshape", [linear(h, f"h{i}.attn.{n}", width, width), split_heads])], perm=perm)
                   for n, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])))
        scores = op("Add", [op("Mul", [op("MatMul", [q, k]), const(1.0 / np.sqrt(head))]), mask])
        e = op("Exp", [scores])
        probs = op("Div", [e, op("ReduceSum", [e, last], keepdims=1)])
        attn = op("Reshape", [op("Transpose", [op("MatMul", [probs, v])], perm=[0, 2, 1, 3]), merge_heads])
        x = op("Add", [x, linear(attn, f"h{i}.attn.proj", width, width)])
        h = layer_norm(x, f"h{i}.ln_2")
        u = linear(h, f"h{i}.mlp.fc", width, 4 * width)
        inner = op("Mul", [op("Add", [u, op("Mul", [op("Mul", [op("Mul", [u, u]), u]), const(0.044715)])]),
                           const(np.sqrt(2.0 / np.pi))])
        gelu = op("Mul", [op("Mul", [u, const(0.5)]), op("Add", [op("Tanh", [inner]), const(1.0)])])
        x = op("Add", [x, linear(gelu, f"h{i}.mlp.proj", 4 * width, width)])
    h = layer_norm(x, "ln_f")
    logits = op("MatMul", [h, op("Transpose", [wte], perm=[1, 0])])
    log_probs = op("Sub", [logits, op("Log", [op("ReduceSum", [op("Exp", [logits]), last], keepdims=1)])])
    picked = op("ReduceSum", [op("Mul", [one_hot("targets"), log_probs]), last], keepdims=0)
    nodes.append(helper.make_node("Neg", [op("ReduceMean", [picked], keepdims=0)], ["loss"], name="/loss"))

    graph = helper.make_graph(
        nodes, "gpt",
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, ["batch", seq]),
         helper.make_tensor_value_info("targets", TensorProto.INT64, ["batch", seq])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def make_data(vocab: int, seq: int, rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random token streams; targets are the tokens shifted by one (next-token prediction)."""
    stream = np.random.default_rng(seed + 1).integers(0, vocab, size=(rows, seq + 1), dtype=np.int64)
    return {"tokens": stream[:, :-1].copy(), "targets": stream[:, 1:].copy()}
