"""The `zero` strategy's collectives (ReduceScatter, AllGather) on the CPU communicators, and a
hand-built zero OUT (the transpiler does not emit them yet) that N ranks run like one device.

``write_zero_out`` is also what the GPU tests run on NCCL. The model is test_runtime_outdir's linear
regression with SGD momentum; its two parameters form one flat bucket of T = 4 elements: each rank
ReduceScatters the gradients, updates its slice S = ceil(4 / N) of the flattened parameters with
its slice of the momentum, and AllGathers the new parameters (docs/contracts.md).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from test_runtime_outdir import (
    FLOAT,
    INIT,
    INT64,
    OPSET,
    _collective,
    _constants,
    _forward_backward,
    make_data,
)
from test_runtime_outdir import write_out as write_reference_out

from runtime import LocalGroup, simulate
from runtime.collectives import TensorSpec
from runtime.collectives.base import flat_size

TOTAL = 4  # b [1] + w [3, 1]


def _zero_step(rank: int, world: int) -> tuple[onnx.ModelProto, list[dict]]:
    _, shard = flat_size([TOTAL], world)
    pad = world * shard - TOTAL
    n = helper.make_node
    nodes = _forward_backward()
    nodes.append(_collective("ReduceScatter", ["grad.b", "grad.w"], ["grad.shard"], 0, reduction="mean", phase="step"))
    # This rank's slice of the flattened, zero-padded parameters.
    flat_inputs = ["b.flat", "w.flat"] + (["pad"] if pad else [])
    nodes += [n("Reshape", ["b", "minus1"], ["b.flat"]), n("Reshape", ["w", "minus1"], ["w.flat"]),
              n("Concat", flat_inputs, ["p.flat"], axis=0),
              n("Slice", ["p.flat", "start", "stop"], ["p.shard"])]
    nodes += [n("Mul", ["momentum", "bucket0.v"], ["mv"]), n("Add", ["mv", "grad.shard"], ["bucket0.v.next"]),
              n("Mul", ["lr", "bucket0.v.next"], ["lrv"]), n("Sub", ["p.shard", "lrv"], ["p.shard.next"])]
    nodes.append(_collective("AllGather", ["p.shard.next"], ["b.next", "w.next"], 1, bucket=0, phase="step"))
    nodes.append(n("Add", ["optimizer.step", "one"], ["optimizer.step.next"], name="count"))
    init = _constants() + [numpy_helper.from_array(np.array(1, np.int64), "one"),
                           numpy_helper.from_array(np.array([-1], np.int64), "minus1"),
                           numpy_helper.from_array(np.array([rank * shard], np.int64), "start"),
                           numpy_helper.from_array(np.array([(rank + 1) * shard], np.int64), "stop")]
    if pad:
        init.append(numpy_helper.from_array(np.zeros(pad, np.float32), "pad"))
    state = [{"input": "b", "output": "b.next", "kind": "param", "param": "b"},
             {"input": "w", "output": "w.next", "kind": "param", "param": "w"},
             {"input": "bucket0.v", "output": "bucket0.v.next", "kind": "optimizer", "param": None},
             {"input": "optimizer.step", "output": "optimizer.step.next", "kind": "step", "param": None}]
    types = {"b": [1], "w": [3, 1], "bucket0.v": [shard]}

    def typed(name):
        base = name.removesuffix(".next")
        if base == "optimizer.step":
            return helper.make_tensor_value_info(name, INT64, [])
        return helper.make_tensor_value_info(name, FLOAT, types[base])

    inputs = [helper.make_tensor_value_info("x", FLOAT, ["batch", 3]), helper.make_tensor_value_info("y", FLOAT, ["batch", 1]),
              helper.make_tensor_value_info("lr", FLOAT, [])] + [typed(s["input"]) for s in state]
    outputs = [helper.make_tensor_value_info("loss", FLOAT, [])] + [typed(s["output"]) for s in state]
    value_info = [helper.make_tensor_value_info("grad.shard", FLOAT, [shard])]
    graph = helper.make_graph(nodes, "step", inputs, outputs, initializer=init, value_info=value_info)
    return helper.make_model(graph, opset_imports=OPSET), state


def _zero_init(rank: int, world: int) -> onnx.ModelProto:
    _, shard = flat_size([TOTAL], world)
    nodes, inits = [], []
    if rank == 0:  # both parameters rooted on rank 0, broadcast as one bucket
        inits += [numpy_helper.from_array(INIT["b"], "b.init"), numpy_helper.from_array(INIT["w"], "w.init")]
    nodes.append(_collective("Broadcast", ["b.init", "w.init"] if rank == 0 else [], ["b", "w"], 0, bucket=-1,
                             root=0, phase="init"))
    inits += [numpy_helper.from_array(np.zeros(shard, np.float32), "bucket0.v"),
              numpy_helper.from_array(np.array(0, np.int64), "optimizer.step")]
    outputs = [helper.make_tensor_value_info("b", FLOAT, [1]), helper.make_tensor_value_info("w", FLOAT, [3, 1]),
               helper.make_tensor_value_info("bucket0.v", FLOAT, [shard]),
               helper.make_tensor_value_info("optimizer.step", INT64, [])]
    return helper.make_model(helper.make_graph(nodes, "init", [], outputs, initializer=inits), opset_imports=OPSET)


def write_zero_out(path: Path, world: int) -> Path:
    """A complete zero-strategy OUT for ``world`` ranks (single-device graphs as the reference's)."""
    write_reference_out(path, world, "allreduce")
    plan = json.loads((path / "plan.json").read_text())
    plan["strategy"] = "zero"
    ranks = []
    for r in range(world):
        step, state = _zero_step(r, world)
        onnx.save(step, path / f"rank{r}.onnx")
        onnx.save(_zero_init(r, world), path / f"rank{r}_init.onnx")
        ranks.append({"rank": r, "step": f"rank{r}.onnx", "init": f"rank{r}_init.onnx", "state": state})
    plan["graphs"]["ranks"] = ranks
    (path / "plan.json").write_text(json.dumps(plan, indent=1))
    return path


def _in_threads(world: int, fn):
    group = LocalGroup(world)
    results = [None] * world
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, fn(group.communicator(r)))) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_reduce_scatter_then_all_gather_is_a_padded_all_reduce(world):
    rng = np.random.default_rng(world)
    parts = [[rng.standard_normal(5).astype(np.float32), rng.standard_normal((2, 3)).astype(np.float32)]
             for _ in range(world)]
    specs = [TensorSpec((5,), np.dtype(np.float32)), TensorSpec((2, 3), np.dtype(np.float32))]
    _, shard = flat_size([5, 6], world)

    def run(comm):
        mine = comm.reduce_scatter(parts[comm.rank], "mean")
        return mine, comm.all_gather(mine, specs)

    results = _in_threads(world, run)
    expected = [sum(p[i] for p in parts) / np.float32(world) for i in range(2)]
    for mine, gathered in results:
        assert mine.shape == (shard,)
        for got, want in zip(gathered, expected):
            np.testing.assert_allclose(got, want, rtol=1e-6)
    padding = np.concatenate([m for m, _ in results])[11:]
    np.testing.assert_array_equal(padding, 0)  # the padded tail reduces to zeros


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zero_ranks_match_one_device(tmp_path, world):
    out = write_zero_out(tmp_path, world)
    data = make_data(rows=24)
    single = simulate(out, data, batch=12, steps=6, single_device=True)
    ranks = simulate(out, data, batch=12, steps=6)
    np.testing.assert_allclose(ranks.losses, single.losses, rtol=2e-6, atol=1e-6)
    for r in range(world):
        for name, value in single.parameters[0].items():
            np.testing.assert_allclose(ranks.parameters[r][name], value, rtol=2e-6, atol=1e-6)
            np.testing.assert_array_equal(ranks.parameters[r][name], ranks.parameters[0][name])
        assert ranks.states[r]["bucket0.v"].shape == (flat_size([TOTAL], world)[1],)  # 1/N of the state
