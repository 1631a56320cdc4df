"""A hand-built transpiler output directory (OUT) for the runtime tests, written per docs/contracts.md.

The model is linear regression, loss = mean((x @ w + b - y)^2), with SGD momentum written out as
ONNX ops. Gradients are means over the rank's rows, so N equal shards + AllReduce(mean) (or
Reduce(mean) to the root + Broadcast) compute what one device computes on the full batch.
Parameter b is rooted on rank 0 (bucket 0, order 0); w on rank 1 % N (bucket 1, order 1).

Other runtime test modules import ``write_out`` from here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
OPSET = [helper.make_opsetid("", 18), helper.make_opsetid("graph_transpiler", 1)]
MOMENTUM = 0.9
LR = 0.05
INIT = {"b": np.array([0.1], np.float32), "w": np.array([[0.5], [-0.3], [0.2]], np.float32)}
PARAMS = [("b", [1], 0), ("w", [3, 1], 1)]  # name, shape, bucket (== its collective order)


def _root(bucket: int, world: int) -> int:
    return bucket % world


def _collective(op, inputs, outputs, order, **attrs):
    return helper.make_node(op, inputs, outputs, name=f"{op.lower()}{order}", domain="graph_transpiler",
                            order=order, bucket=attrs.pop("bucket", order), **attrs)


def _forward_backward():
    """Nodes computing loss, grad.b [1] and grad.w [3, 1] from x [n, 3], y [n, 1]."""
    n = helper.make_node
    return [
        n("MatMul", ["x", "w"], ["xw"], name="matmul"),
        n("Add", ["xw", "b"], ["pred"], name="add_b"),
        n("Sub", ["pred", "y"], ["diff"], name="diff"),
        n("Mul", ["diff", "diff"], ["sq"], name="square"),
        n("ReduceMean", ["sq"], ["loss"], name="loss", keepdims=0),
        n("Mul", ["diff", "two"], ["dpred"], name="dpred"),
        n("ReduceMean", ["dpred", "axis0"], ["grad.b"], name="grad_b", keepdims=0),
        n("Mul", ["x", "dpred"], ["xd"], name="xd"),
        n("ReduceMean", ["xd", "axis0"], ["grad.w.flat"], name="grad_w_mean", keepdims=0),
        n("Reshape", ["grad.w.flat", "shape31"], ["grad.w"], name="grad_w"),
    ]


def _constants():
    return [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
            numpy_helper.from_array(np.array([0], np.int64), "axis0"),
            numpy_helper.from_array(np.array([3, 1], np.int64), "shape31"),
            numpy_helper.from_array(np.array(MOMENTUM, np.float32), "momentum")]


def _update(p: str, grad: str, out: str):
    """SGD momentum: v' = mu v + g; p' = p - lr v'."""
    n = helper.make_node
    return [n("Mul", ["momentum", f"{p}.v"], [f"{p}.mv"], name=f"{p}_mv"),
            n("Add", [f"{p}.mv", grad], [f"{p}.v.next"], name=f"{p}_v"),
            n("Mul", ["lr", f"{p}.v.next"], [f"{p}.step"], name=f"{p}_lrv"),
            n("Sub", [p, f"{p}.step"], [out], name=f"{p}_update")]


def step_graph(rank: int | None, world: int, strategy: str) -> tuple[onnx.ModelProto, list[dict]]:
    """Step graph and its plan "state" list; ``rank=None`` is the single-device graph."""
    nodes = _forward_backward()
    value_info = []
    owned = [p for p, _, bucket in PARAMS if rank is None or strategy == "allreduce" or _root(bucket, world) == rank]
    grads = {p: f"grad.{p}" for p, _, _ in PARAMS}
    if rank is not None:
        for p, shape, bucket in PARAMS:
            root = _root(bucket, world)
            if strategy == "allreduce":
                nodes.append(_collective("AllReduce", [f"grad.{p}"], [f"grad.{p}.avg"], bucket, reduction="mean", phase="step"))
            else:
                outs = [f"grad.{p}.avg"] if rank == root else []
                nodes.append(_collective("Reduce", [f"grad.{p}"], outs, bucket, root=root, reduction="mean", phase="step"))
            if p in owned:
                value_info.append(helper.make_tensor_value_info(f"grad.{p}.avg", FLOAT, shape))
                grads[p] = f"grad.{p}.avg"
    for p, _, bucket in PARAMS:
        if p in owned:
            out = f"{p}.next" if rank is None or strategy == "allreduce" else f"{p}.upd"
            nodes += _update(p, grads[p], out)
        if rank is not None and strategy == "sharded":
            root = _root(bucket, world)
            nodes.append(_collective("Broadcast", [f"{p}.upd"] if rank == root else [], [f"{p}.next"],
                                     2 + bucket, bucket=bucket, root=root, phase="step"))
    nodes.append(helper.make_node("Add", ["optimizer.step", "one"], ["optimizer.step.next"], name="count"))

    shapes = {p: shape for p, shape, _ in PARAMS}
    state = [{"input": p, "output": f"{p}.next", "kind": "param", "param": p} for p, _, _ in PARAMS]
    state += [{"input": f"{p}.v", "output": f"{p}.v.next", "kind": "optimizer", "param": p} for p in owned]
    state.append({"input": "optimizer.step", "output": "optimizer.step.next", "kind": "step", "param": None})

    def typed(name):
        if name == "optimizer.step" or name == "optimizer.step.next":
            return helper.make_tensor_value_info(name, INT64, [])
        base = name.split(".")[0]
        return helper.make_tensor_value_info(name, FLOAT, shapes[base])

    inputs = [helper.make_tensor_value_info("x", FLOAT, ["batch", 3]), helper.make_tensor_value_info("y", FLOAT, ["batch", 1]),
              helper.make_tensor_value_info("lr", FLOAT, [])] + [typed(s["input"]) for s in state]
    outputs = [helper.make_tensor_value_info("loss", FLOAT, [])] + [typed(s["output"]) for s in state]
    init = _constants() + [numpy_helper.from_array(np.array(1, np.int64), "one")]
    graph = helper.make_graph(nodes, "step", inputs, outputs, initializer=init, value_info=value_info)
    return helper.make_model(graph, opset_imports=OPSET), state


def init_graph(rank: int | None, world: int, state: list[dict]) -> onnx.ModelProto:
    """Outputs every state input: parameters via Broadcast from their root (Identity on one device)."""
    nodes, initializers, outputs = [], [], []
    for p, shape, bucket in PARAMS:
        root = _root(bucket, world)
        outputs.append(helper.make_tensor_value_info(p, FLOAT, shape))
        if rank is None:
            initializers.append(numpy_helper.from_array(INIT[p], f"{p}.init"))
            nodes.append(helper.make_node("Identity", [f"{p}.init"], [p], name=f"init_{p}"))
        else:
            if rank == root:  # the initial value lives only in the root's init graph
                initializers.append(numpy_helper.from_array(INIT[p], f"{p}.init"))
            nodes.append(_collective("Broadcast", [f"{p}.init"] if rank == root else [], [p], bucket, root=root, phase="init"))
    names = {s["input"] for s in state}
    if "b.v" in names:  # computed by a node: exercises a compute segment in an init graph
        initializers.append(numpy_helper.from_array(np.array([1], np.int64), "b.v.shape"))
        nodes.append(helper.make_node("ConstantOfShape", ["b.v.shape"], ["b.v"], name="zeros_b_v",
                                      value=numpy_helper.from_array(np.array([0.0], np.float32))))
        outputs.append(helper.make_tensor_value_info("b.v", FLOAT, [1]))
    if "w.v" in names:  # an initializer that is directly a graph output
        initializers.append(numpy_helper.from_array(np.zeros((3, 1), np.float32), "w.v"))
        outputs.append(helper.make_tensor_value_info("w.v", FLOAT, [3, 1]))
    initializers.append(numpy_helper.from_array(np.array(0, np.int64), "optimizer.step"))
    outputs.append(helper.make_tensor_value_info("optimizer.step", INT64, []))
    graph = helper.make_graph(nodes, "init", [], outputs, initializer=initializers)
    return helper.make_model(graph, opset_imports=OPSET)


def user_model() -> onnx.ModelProto:
    n = helper.make_node
    nodes = [n("MatMul", ["x", "w"], ["xw"]), n("Add", ["xw", "b"], ["pred"]), n("Sub", ["pred", "y"], ["diff"]),
             n("Mul", ["diff", "diff"], ["sq"]), n("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "user", [helper.make_tensor_value_info("x", FLOAT, ["N", 3]),
                                              helper.make_tensor_value_info("y", FLOAT, ["N", 1])],
                              [helper.make_tensor_value_info("loss", FLOAT, [])],
                              initializer=[numpy_helper.from_array(v, k) for k, v in INIT.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def write_out(path: Path, world: int = 2, strategy: str = "allreduce") -> Path:
    """Write a complete OUT directory at ``path`` and return it."""
    path.mkdir(parents=True, exist_ok=True)
    onnx.save(user_model(), path / "model.onnx")
    graphs = {}
    step, state = step_graph(None, world, strategy)
    onnx.save(step, path / "train.onnx")
    onnx.save(init_graph(None, world, state), path / "train_init.onnx")
    graphs["single"] = {"step": "train.onnx", "init": "train_init.onnx", "state": state}
    graphs["ranks"] = []
    for r in range(world):
        step, state = step_graph(r, world, strategy)
        onnx.save(step, path / f"rank{r}.onnx")
        onnx.save(init_graph(r, world, state), path / f"rank{r}_init.onnx")
        graphs["ranks"].append({"rank": r, "step": f"rank{r}.onnx", "init": f"rank{r}_init.onnx", "state": state})
    params = [{"name": p, "shape": shape, "dtype": "float32", "bytes": 4 * int(np.prod(shape)),
               "root": _root(bucket, world), "bucket": bucket} for p, shape, bucket in PARAMS]
    plan = {
        "format": "graph-transpiler/plan", "format_version": 1, "world_size": world, "strategy": strategy,
        "source_model": {"file": "model.onnx", "sha256": "0" * 64, "path": "/tmp/model.onnx"},
        "opset": 18,
        "data_inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 3], "batch_axis": 0},
                        {"name": "y", "dtype": "float32", "shape": ["batch", 1], "batch_axis": 0}],
        "loss": "loss", "lr_input": "lr",
        "optimizer": {"name": "sgd", "lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                      "momentum": MOMENTUM, "nesterov": False},
        "parameters": params, "frozen": [],
        "buckets": [{"id": p["bucket"], "root": p["root"], "params": [p["name"]], "bytes": p["bytes"]} for p in params],
        "graphs": graphs,
        "collectives": {},
        "versions": {"graph_transpiler": "test", "onnx": onnx.__version__, "onnx_ir": "test"},
    }
    (path / "plan.json").write_text(json.dumps(plan, indent=1))
    return path


def make_data(rows: int = 12, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [2.0], [-1.0]], np.float32) + 0.5).astype(np.float32)
    return {"x": x, "y": y}


def test_written_graphs_pass_the_onnx_checker(tmp_path):
    for strategy in ("allreduce", "sharded"):
        out = write_out(tmp_path / strategy, 2, strategy)
        for f in sorted(out.glob("*.onnx")):
            onnx.checker.check_model(onnx.load(str(f)))
