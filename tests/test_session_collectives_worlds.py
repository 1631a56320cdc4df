"""The collectives inside the sessions (runtime/gpu/session_collectives.py) for other world sizes than
tests/test_session_collectives.py's two: 3 (not a power of two: zero's shards pad, sharded's roots
are uneven) and 8 (the next GPU kind's). For each strategy, every rank's rewritten step (starts and
finishes as Python custom ops on onnxruntime's CPU EP, the ranks as threads) computes what the cut
program computes, within float32 rounding."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import test_session_collectives as base
from conftest import load_data, max_rel_error

from commands.main import main
from runtime.collectives import LocalGroup
from runtime.executor import CpuBackend
from runtime.gpu.session_collectives import Registry
from runtime.plan import load_plan
from runtime.simulate import run_threads
from runtime.trainer import Trainer

pytestmark = base.pytestmark
ROWS = 2  # per rank (SGD, as tests/test_session_collectives.py: AdamW makes rounding noise of the
# attention key bias, whose gradient is zero in exact arithmetic, a unit-sized step)


@pytest.mark.parametrize("world", [3, 8])
@pytest.mark.parametrize("strategy", ["allreduce", "sharded", "zero"])
def test_the_rewritten_step_computes_what_the_cut_program_does(strategy, world, model_dir, tmp_path):
    src = model_dir("gpt")
    path = tmp_path / "out"
    assert main(["compile", str(src / "model.onnx"), "--gpus", str(world), "--strategy", strategy,
                 "--optimizer", "sgd", "--bucket-mb", "4", "-o", str(path)]) == 0
    data = load_data(src / "data.npz")
    plan = load_plan(path)
    group = LocalGroup(world)
    expected, got = [None] * world, [None] * world

    def rank(r: int) -> None:
        comm = group.communicator(r)
        trainer = Trainer(plan, comm, rank=r, backend=CpuBackend())
        trainer.initialize()
        shard = {k: v[r * ROWS:(r + 1) * ROWS] for k, v in data.items()}
        feeds = {**shard, plan.lr_input: np.array(1e-3, np.float32), **trainer.state}
        expected[r] = trainer.step_program.run({k: np.array(v, copy=True) for k, v in feeds.items()})
        registry = Registry()
        registry.comm = comm
        segment, compiled = base._rewritten(path, r, feeds, registry)
        session = base._session(compiled, registry, comm)
        names = [o.name for o in session.get_outputs()]
        got[r] = dict(zip(names, session.run(names, {k: np.array(feeds[k], copy=True) for k in segment.inputs})))

    run_threads(group, rank)
    for r in range(world):
        assert set(got[r]) == set(expected[r])
        errors = {k: max_rel_error({k: got[r][k]}, {k: np.asarray(expected[r][k])}) for k in got[r]}
        bad = {k: e for k, e in errors.items() if e >= 2e-5}
        assert not bad, (r, sorted(bad.items(), key=lambda kv: -kv[1])[:6])
    assert len({tuple(sorted(n.name for n in onnx.load(str(path / plan.graphs(r).step.name)).graph.node
                             if n.domain == "graph_transpiler")) for r in range(world)}) == 1  # one order of calls
