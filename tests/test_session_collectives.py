"""runtime/gpu/session_collectives.py: the rewrite of a rank's step segment whose
collectives stay inside, checked on CPU. Each rank's segment, rewritten into start and finish nodes,
runs in onnxruntime's CPU EP with the starts and finishes as Python custom ops that run the
collective synchronously (the list form, on in-process ranks), and must compute what the cut
program computes on the CPU backend up to float32 rounding (SGD: AdamW's first step turns the
rounding of near-zero gradients into large relative differences); and the node order puts each start right after
its bucket's inputs and each finish right before the first reader of its outputs."""

from __future__ import annotations

import ctypes

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import load_data, max_rel_error
from onnx import helper

from commands.main import main
from runtime import ort_custom_ops
from runtime.collectives import COLLECTIVE_DOMAIN, LocalGroup
from runtime.executor import CpuBackend
from runtime.gpu.compile import SessionCollectives, Specialize, compile_segment
from runtime.gpu.session_collectives import DIRECT, DOMAIN, FINISH, FLAT, STAGED_FLAT, START, Registry
from runtime.plan import load_plan
from runtime.segments import cut_graph
from runtime.simulate import run_threads
from runtime.specialize import static_values
from runtime.trainer import Trainer

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(ort_custom_ops.readiness(ort) is not None, reason="no custom ops in this process")]

WORLD = 2


@pytest.fixture(scope="module", params=["allreduce", "sharded", "zero"])
def out(request, model_dir, tmp_path_factory):
    src = model_dir("gpt")
    path = tmp_path_factory.mktemp(request.param) / "out"
    assert main(["compile", str(src / "model.onnx"), "--gpus", str(WORLD), "--strategy", request.param,
                 "--optimizer", "sgd", "-o", str(path)]) == 0
    return path, load_data(src / "data.npz")


def _array(ptr: int, shape, dtype) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return np.empty(shape, dtype)
    raw = (ctypes.c_byte * (n * np.dtype(dtype).itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _rewritten(out, rank: int, feeds: dict, registry: Registry):
    plan = load_plan(out)
    model = onnx.load(str(out / plan.graphs(rank).step.name))
    cut = cut_graph(model, rank, "step", collectives_inside=True)
    (segment,) = cut.segments  # nothing else cuts a CPU rank's step
    shapes = {name: tuple(np.shape(feeds[name])) for name in segment.inputs}
    return segment, compile_segment(segment, shapes, "step", [Specialize(), SessionCollectives(registry)], frozenset())


def _session(compiled, registry: Registry, comm, shared: list | None = None):
    """The rewritten segment in onnxruntime's CPU EP, each start and finish a Python custom op (a
    direct one's finish with its in-place hints, as on the GPU); ``shared`` collects, per direct
    output, whether onnxruntime gave it its staged input's buffer."""
    known = static_values(compiled.model.graph)
    results: dict[int, list[np.ndarray]] = {}
    shared = [] if shared is None else shared
    ops = []
    for node in compiled.model.graph.node:
        if node.domain != DOMAIN:
            continue
        original = onnx.NodeProto()
        original.CopyFrom(node)
        ins = [(n, known[n][0], helper.tensor_dtype_to_np_dtype(known[n][1])) for n in node.input]
        outs = [(n, known[n][0], helper.tensor_dtype_to_np_dtype(known[n][1])) for n in node.output]
        k = next(a.i for a in node.attribute if a.name == "bucket")
        direct = next(a.i for a in node.attribute if a.name == "direct")

        def compute(ctx, original=original, ins=ins, outs=outs, k=k, direct=direct):
            if original.op_type == START:
                bucket = registry.bucket(k, "step")
                chained = next(a.i for a in original.attribute if a.name == "chained")
                values = [_array(ctx.input_ptr(i), s, d).copy() for i, (_, s, d) in enumerate(ins)][chained:]
                results[k] = bucket.op.run(comm, values) or []
                ctx.output_ptr(0, outs[0][1])  # the token exists once asked for (as _NodeKernel asks for every output)
                for j, (_, s, d) in enumerate(outs[1:]):  # direct: the staged outputs, which NCCL writes on a GPU
                    out = _array(ctx.output_ptr(1 + j, s), s, d)
                    if direct:  # else the staged bucket (STAGED_FLAT), scratch of the GPU's copies
                        out[...] = results[k][j]
            elif direct:
                for j, (_, s, d) in enumerate(outs):
                    staged, out = ctx.input_ptr(1 + j), ctx.output_ptr(j, s)
                    shared.append(staged == out)
                    if staged != out:
                        _array(out, s, d)[...] = _array(staged, s, d)
            else:
                for j, (_, s, d) in enumerate(outs):
                    _array(ctx.output_ptr(j, s), s, d)[...] = results[k][j]

        op_type = f"{node.op_type}_{len(ops)}"
        inplace = tuple((1 + j, j) for j in range(len(outs))) if direct and node.op_type == FINISH else ()
        ops.append(ort_custom_ops.PythonOp(op_type, [known[n][1] for n in node.input],
                                           [known[n][1] for n in node.output], compute, label=node.name,
                                           may_inplace=inplace))
        node.op_type = op_type
        del node.attribute[:]
    options = ort.SessionOptions()
    options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    ort_custom_ops.register(options, DOMAIN, ops)
    return ort.InferenceSession(compiled.model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_the_rewritten_step_computes_what_the_cut_program_does(out):
    path, data = out
    plan = load_plan(path)
    group = LocalGroup(WORLD)
    expected, got = [None] * WORLD, [None] * WORLD
    shared: list[bool] = []

    def rank(r: int) -> None:
        comm = group.communicator(r)
        trainer = Trainer(plan, comm, rank=r, backend=CpuBackend())
        trainer.initialize()
        shard = {k: v[r * 4:(r + 1) * 4] for k, v in data.items()}
        feeds = {**shard, plan.lr_input: np.array(1e-3, np.float32), **trainer.state}
        expected[r] = trainer.step_program.run({k: np.array(v, copy=True) for k, v in feeds.items()})
        registry = Registry()
        registry.comm = comm
        segment, compiled = _rewritten(path, r, feeds, registry)
        session = _session(compiled, registry, comm, shared)
        names = [o.name for o in session.get_outputs()]
        got[r] = dict(zip(names, session.run(names, {k: np.array(feeds[k], copy=True) for k in segment.inputs})))

    run_threads(group, rank)  # a failing rank aborts the group and raises here
    # One session where the cut made several: onnxruntime fuses and orders the float32 arithmetic
    # of the update differently, so equal up to rounding (relative to each tensor's scale), not bits.
    # AllReduce runs direct: onnxruntime hands the finish's outputs the staged buffers, no copy.
    direct = any(n.domain == COLLECTIVE_DOMAIN and n.op_type in DIRECT
                 for n in onnx.load(str(path / plan.graphs(0).step.name)).graph.node)
    assert (len(shared) > 0) == direct and all(shared), shared
    for r in range(WORLD):
        assert set(got[r]) == set(expected[r])
        errors_by_name = {k: max_rel_error({k: got[r][k]}, {k: np.asarray(expected[r][k])}) for k in got[r]}
        bad = {k: e for k, e in errors_by_name.items() if e >= 2e-5}
        assert not bad, (r, sorted(bad.items(), key=lambda kv: -kv[1])[:6])


def test_starts_come_after_their_inputs_and_finishes_before_their_readers(out):
    path, data = out
    plan = load_plan(path)
    feeds = {**{k: v[:4] for k, v in data.items()}, plan.lr_input: np.array(1e-3, np.float32)}
    model = onnx.load(str(path / plan.graphs(0).step.name))
    feeds.update({i.name: np.zeros([d.dim_value for d in i.type.tensor_type.shape.dim], np.float32)
                  for i in model.graph.input if i.name not in feeds})
    registry = Registry()
    registry.comm = LocalGroup(WORLD).communicator(0)
    _, compiled = _rewritten(path, 0, feeds, registry)
    nodes = list(compiled.model.graph.node)
    assert not any(n.domain == COLLECTIVE_DOMAIN for n in nodes)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output}
    starts = [i for i, n in enumerate(nodes) if n.domain == DOMAIN and n.op_type == START]
    finishes = [i for i, n in enumerate(nodes) if n.domain == DOMAIN and n.op_type == FINISH]
    collectives = [n for n in model.graph.node if n.domain == COLLECTIVE_DOMAIN]
    assert starts and len(starts) == len(finishes) == len(collectives)
    for i in starts:  # right after the last producer of its inputs (only other starts or finishes between)
        made = [producer[n] for n in nodes[i].input if n in producer]
        assert all(nodes[j].domain == DOMAIN for j in range(max(made, default=-1) + 1, i)), nodes[i].name
    readers: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for name in n.input:
            readers.setdefault(name, i)
    for i in finishes:  # right before the first reader of its outputs
        first = [readers[o] for o in nodes[i].output if o in readers]
        if first:
            assert all(nodes[j].domain == DOMAIN for j in range(i + 1, min(first)))
    known = static_values(compiled.model.graph)
    bucket_of = {i: next(a.i for a in nodes[i].attribute if a.name == "bucket") for i in starts + finishes}
    finish_of = {bucket_of[j]: nodes[j] for j in finishes}
    for i in starts:  # a ReduceScatter's bucket is its start's output, read by its finish, N times its slice
        original = registry.nodes[bucket_of[i]]
        flat = [o for o in nodes[i].output if o.endswith(FLAT)]
        assert (original.op_type in STAGED_FLAT) == bool(flat), nodes[i].name
        if flat:
            (slice_,) = original.output
            assert flat[0] in finish_of[bucket_of[i]].input
            assert np.prod(known[flat[0]][0]) == WORLD * np.prod(known[slice_][0])
    tokens = [nodes[i].output[0] for i in starts]
    for previous, i in zip(tokens, starts[1:]):
        assert nodes[i].input[0] == previous  # every rank's NCCL calls in one order
