"""The fused optimizer update kernel (runtime/gpu/update_kernel.py) on a GPU.

- The CuPy kernel against the NumPy reference of its arithmetic (runtime/update_reference.py), for every
  optimizer configuration of tests/test_optimizer.py, on tensors that cover the chunking (smaller
  than a chunk, several chunks with a ragged end, empty): within 1e-6 relative, and bitwise but for
  rare elements (the kernel's fmaf rounds once where the reference rounds twice; CUDA's double pow
  may differ from glibc's in the last bit).
- The single-device GPT trained on the GPU with the kernel equals the same run with the updates left
  to onnxruntime (GRAPH_TRANSPILER_NATIVE_OFF=update), within 1e-6 of each parameter's scale.

Marked ``gpu``; skipped without CuPy and a CUDA GPU (the second test also needs onnxruntime-gpu).
"""

from __future__ import annotations

import types

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import load_data, max_rel_error
from test_optimizer import CASES

from contract.ops import FUSED_UPDATE_DOMAIN as DOMAIN
from runtime.gpu import cuda_available, gpu_count
from runtime.gpu.elementwise_steps import round_bf16_numpy, widen_bf16_numpy
from runtime.gpu.gradient_casts import GRADIENT_TYPE, bfloat16_gradients
from runtime.gpu.update_kernel import CHUNK
from runtime.segments import NativeGroup
from runtime.update_reference import UpdateOp, reference_update
from transpiler import OptimizerConfig, Options, transpile
from transpiler.optimizer import emit_step_increment
from transpiler.update_node import emit_fused_update

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 1, reason="needs a CUDA GPU and CuPy")]

SHAPES = [(7, 13), (3,), (CHUNK + 5,), (2, CHUNK), (0,), (129, 257)]
STEPS = 6


def _group(config: OptimizerConfig, bfloat16: bool = False) -> tuple[NativeGroup, list[UpdateOp]]:
    """The update nodes of SHAPES' parameters; ``bfloat16``: every other one's gradient marked
    bfloat16 (runtime/gpu/gradient_casts.py), so one launch mixes the kinds."""
    graph = ir.Graph(inputs=[], outputs=[], nodes=[], opset_imports={"": 18})
    model = ir.Model(graph, ir_version=10)

    def add_input(name, shape):
        value = ir.val(name, ir.DataType.FLOAT, ir.Shape(shape))
        graph.inputs.append(value)
        return value

    lr = add_input("lr", [])
    step = emit_step_increment(graph, add_input("optimizer.step", [])) if config.uses_step() else None
    for index, shape in enumerate(SHAPES):
        name = f"p{index}"
        emit_fused_update(model, config, param=add_input(name, shape), grad=add_input(f"{name}.grad", shape), lr=lr,
                          step=step, state={s: add_input(f"{name}.{s}", shape) for s in config.slots()}, name=name)
    nodes = [n for n in ir.to_proto(model).graph.node if n.domain == DOMAIN]
    for node in nodes[::2] if bfloat16 else ():
        node.attribute.append(onnx.helper.make_attribute(GRADIENT_TYPE, onnx.TensorProto.BFLOAT16))
    produced = {o for n in nodes for o in n.output}
    inputs = tuple(dict.fromkeys(i for n in nodes for i in n.input if i not in produced))
    outputs = tuple(o for n in nodes for o in n.output)
    return NativeGroup(0, 0, 1, tuple(nodes), inputs, outputs), [UpdateOp.from_node(n, "test") for n in nodes]


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_the_reference(case):
    import cupy

    compare_kernel_with_reference(cupy, case)


@pytest.mark.parametrize("grads", ["bfloat16", "bfloat16 as float32"])
def test_kernel_reads_bfloat16_gradients_as_their_float32_values(grads):
    import cupy

    compare_kernel_with_reference(cupy, "adamw", grads)
    compare_kernel_with_reference(cupy, "momentum_wd", grads)


@pytest.mark.parametrize("case", ["adamw", "momentum_wd", "sgd_wd"])
def test_kernel_inside_a_session_matches_the_reference(case):
    import cupy

    compare_kernel_with_reference(cupy, case, "bfloat16", inside=True)


def compare_kernel_with_reference(cp, case: str, grads: str = "float32", *, inside: bool = False) -> None:
    """Run ``case``'s updates of SHAPES through FusedUpdateRunner on ``cp`` (CuPy, or the host
    emulation of tests/test_fused_update_host.py) for STEPS steps, first call then bound by parity,
    and compare every output with the reference given the same inputs. ``grads`` (update_kernel's
    GRAD_KINDS): every other gradient is bfloat16, fed as its raw bits or as float32 the kernel
    rounds; the reference gets it rounded to bfloat16 and widened. ``inside``: from the second
    step on, called as inside a session (``launch``), each step on new buffers (onnxruntime's
    pointers may change between uncaptured runs), every other tensor's state updated in place
    (its outputs bound over its inputs)."""
    from runtime.gpu.update_kernel import FusedUpdateRunner

    config = CASES[case].validate()
    group, ops = _group(config, bfloat16=grads != "float32")
    low = bfloat16_gradients(group.nodes)
    runner = FusedUpdateRunner(group, "test", types.SimpleNamespace(cp=cp))
    rng = np.random.default_rng(0)
    host = {}
    for op, shape in zip(ops, SHAPES):
        host[op.param] = rng.standard_normal(shape).astype(np.float32)
        for slot in op.slots:
            host[slot] = np.zeros(shape, np.float32)
    differing = total = 0
    for t in range(1, STEPS + 1):
        lr, step = np.float32(config.lr * (1 - 0.05 * t)), np.float32(t)
        fed = {}
        for op, shape in zip(ops, SHAPES):
            fed[op.grad] = host[op.grad] = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 1)).astype(np.float32)
            if op.grad in low:
                host[op.grad] = widen_bf16_numpy(round_bf16_numpy(fed[op.grad]))
                if grads == "bfloat16":
                    fed[op.grad] = round_bf16_numpy(fed[op.grad])  # the raw bits, as CuPy holds bfloat16
        host["lr"] = np.array(lr)
        if config.uses_step():
            host[ops[0].step] = np.array(step)
        # Copies: the host emulation's asarray shares the array's memory, which an in-place update writes.
        feeds = {name: cp.asarray(np.array(fed.get(name, host.get(name)))) for name in group.inputs}
        if t == 1:  # the first-call path: the runner allocates its outputs
            results = dict(zip(group.outputs, runner.run(feeds)))
        elif inside:  # this call's buffers, half of them in place
            results = {name: feeds[src] if k % 2 == 0 else cp.empty_like(feeds[src])
                       for k, op in enumerate(ops) for src, name in zip((op.param, *op.slots), op.outputs)}
            runner.launch({**feeds, **results}, allocate=t == 2)
        else:  # the bound path, by parity, as GpuProgram runs it
            parity = t % 2
            outs = {name: cp.empty_like(feeds[src]) for op in ops for src, name in zip((op.param, *op.slots), op.outputs)}
            runner.prepare(parity, outs)
            runner.run_bound(parity, feeds)
            results = outs
        cp.cuda.get_current_stream().synchronize()
        for op in ops:
            expected = reference_update(op, lr, step if op.step else None, host[op.param], host[op.grad],
                                        [host[s] for s in op.slots])
            for name, want in zip(op.outputs, expected):
                got = cp.asnumpy(results[name])
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=f"{case}: {name} step {t}")
                differing += int(np.sum(got != want))
                total += got.size
            for source, value in zip((op.param, *op.slots), expected):
                host[source] = value  # next step starts from the reference's values
    print(f"{case}: {differing} of {total} elements differ from the reference")
    assert differing <= max(2, total // 10_000), f"{case}: {differing} of {total} elements differ in the last bit"


@pytest.mark.skipif(not cuda_available(), reason="needs onnxruntime-gpu")
@pytest.mark.parametrize("optimizer", ["momentum", "adamw"])
def test_gpt_trains_the_same_with_the_kernel_and_with_onnxruntime(optimizer, model_dir, tmp_path, monkeypatch):
    """Twelve steps of the small GPT with the kernel (inside the step's session, state in place; the
    steps include the CUDA-graph captures) and with onnxruntime running the function bodies. The two backward sessions differ (the updates are inside one of them), so the
    gradients agree to float32 rounding, not bit for bit. Momentum's update is linear in the
    gradient: the parameters agree to 1e-6. Adam divides by the gradient's own running scale, so a
    gradient that is rounding noise moves its parameter by up to about lr whatever its size (the
    attention key biases get no gradient in exact arithmetic; on one H200 every GPU path differs
    from the CPU backend there by 5e-4 after one step, and by 1.4e-4 elsewhere between these two
    paths): AdamW is held to that bound, 2 lr per step; its arithmetic is checked element by element
    against the reference above."""
    from runtime.collectives import LocalGroup
    from runtime.config import RunConfig
    from runtime.data import Dataset
    from runtime.gpu import GpuBackend
    from runtime.loop import train
    from runtime.plan import load_plan
    from runtime.trainer import Trainer
    from runtime.variables import NATIVE_OFF

    steps, lr = 12, 1e-3  # past both parities' CUDA-graph captures (the first replays)
    transpile(model_dir("gpt") / "model.onnx", tmp_path / "out", Options(optimizer=OptimizerConfig(optimizer, lr=lr)))
    plan = load_plan(tmp_path / "out")
    data = load_data(model_dir("gpt") / "data.npz")
    states = {}
    for fused in ("1", "0"):
        monkeypatch.setenv(NATIVE_OFF, "" if fused == "1" else "update")
        backend = GpuBackend(0, tf32=False)
        assert (DOMAIN in backend.plan.inside) == (fused == "1") and DOMAIN not in backend.native_domains
        trainer = Trainer(plan, LocalGroup(1).communicator(0), rank=None, backend=backend)
        assert not trainer.step_program.cut.native_groups  # inside the session (or its function), one session
        train(trainer, Dataset(data, plan.data_inputs, "<data>"), RunConfig(batch=4, steps=steps, lr=lr),
              log=lambda line: None)
        states[fused] = trainer.parameters()
        if fused == "1":  # both parities captured, the state updated in place: the capture calls ran
            (session,) = [r for _, r in trainer.step_program.steps if hasattr(r, "captured")]
            assert session.captured == [True, True] and session.in_place_pairs()
    if optimizer == "momentum":
        assert max_rel_error(states["1"], states["0"]) < 1e-6
    else:
        worst = max(float(np.max(np.abs(states["1"][k] - states["0"][k]))) for k in states["0"])
        assert worst <= 2 * lr * steps, worst
