"""Fused attention on the GPU (runtime/gpu/attention.py): cuDNN's SDPA forward and backward, run by
the runner of Attention and AttentionGrad nodes, equal a float64 reference of the nodes' functions
(the probabilities rounded as the functions round them) to the heads' dtype's rounding, give the
same bits on every run, and train the bf16 GPT as the CPU backend does. Skips without a GPU or
without nvidia-cudnn-frontend."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import cpu_and_gpu_losses
from onnx import helper

from contract.ops import ATTENTION, ATTENTION_DOMAIN, ATTENTION_GRAD
from runtime.gpu import cuda_available, gpu_count
from runtime.gpu.attention import unavailable

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(gpu_count() < 1 or not cuda_available(), reason="needs a CUDA GPU, CuPy and onnxruntime-gpu"),
              pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]

B, S, H, D = 2, 128, 4, 64
NAMES = ["q", "k", "v", "dy"]


def _nodes(causal: int, scale: float):
    attrs = {"scale": scale, "causal": causal}
    return (helper.make_node(ATTENTION, ["q", "k", "v"], ["y", "lse"], name="attn", domain=ATTENTION_DOMAIN, **attrs),
            helper.make_node(ATTENTION_GRAD, ["dy", "q", "k", "v", "y", "lse"], ["dq", "dk", "dv"], name="attn_grad",
                             domain=ATTENTION_DOMAIN, **attrs))


def _reference(arrays: dict[str, np.ndarray], y: np.ndarray, causal: int, scale: float, low) -> dict[str, np.ndarray]:
    """The functions' arithmetic in float64 (transpiler/attention_ops.py), P and dS rounded to ``low``."""
    q, k, v, dy = (torch.tensor(arrays[n], dtype=torch.float64).transpose(1, 2) for n in NAMES)
    yh = torch.tensor(y, dtype=torch.float64).transpose(1, 2)
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.exp(s - lse)
    rounded = lambda x: x.to(low).to(torch.float64)  # noqa: E731
    out = (rounded(p) @ v).transpose(1, 2)
    dp = dy @ v.transpose(-1, -2)
    ds = rounded(p * (dp - (dy * yh).sum(-1, keepdim=True)) * scale)
    grads = {"dq": ds @ k, "dk": ds.transpose(-1, -2) @ q, "dv": rounded(p).transpose(-1, -2) @ dy}
    return {"y": out.numpy(), "lse": lse.numpy(), **{n: g.transpose(1, 2).numpy() for n, g in grads.items()}}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [1, 0])
def test_cudnn_equals_the_functions_arithmetic_and_repeats_its_bits(dtype, causal):
    import cupy as cp

    from runtime.gpu.attention import AttentionRunner
    from runtime.gpu.device import GpuDevice
    from runtime.segments import NativeGroup

    low = getattr(torch, dtype)
    rng = np.random.default_rng(causal)
    arrays = {n: torch.tensor(rng.normal(size=(B, S, H, D)) * (0.1 if n == "dy" else 1)).to(low) for n in NAMES}
    device = GpuDevice(0, tf32=False)
    view = np.uint16 if dtype == "bfloat16" else np.float16
    env = {n: cp.asarray(a.view(torch.int16).numpy().view(view) if dtype == "bfloat16" else a.numpy()) for n, a in arrays.items()}
    outputs = ("y", "lse", "dq", "dk", "dv")
    runner = AttentionRunner(NativeGroup(0, 0, 1, _nodes(causal, 0.125), tuple(NAMES), outputs), "test", device)
    first = dict(zip(runner.outputs, runner.run(env)))
    device.compute.synchronize()

    def host(x):
        x = cp.asnumpy(x)
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).double().numpy() if x.dtype == np.uint16 else x.astype(np.float64)

    got = {n: host(first[n]) for n in outputs}
    expected = _reference({n: a.double().numpy() for n, a in arrays.items()}, got["y"], causal, 0.125, low)
    ulp = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -11
    for name in outputs:
        tolerance = (1e-5 if name == "lse" else 4 * ulp) * float(np.max(np.abs(expected[name])))
        error = float(np.max(np.abs(got[name] - expected[name])))
        assert error <= tolerance, f"{dtype} causal={causal} {name}: {error:.3g} > {tolerance:.3g}"
    # Bound runs into fresh buffers, twice: the same bits as the first call (deterministic backward).
    for parity in (0, 1):
        outs = {n: cp.full_like(first[n], 0) for n in outputs}
        runner.prepare(parity, outs)
        runner.run_bound(parity, env)
        device.compute.synchronize()
        for name in outputs:
            assert cp.array_equal(outs[name], first[name]), f"{name}, bound run {parity}"


def test_the_bf16_gpt_trains_on_the_gpu_as_on_the_cpu_backend(model_dir, tmp_path):
    from graph_transpiler import transpile

    out = transpile(model_dir("gpt") / "model.onnx", tmp_path / "out", gpus=1, optimizer="adamw", lr=1e-3,
                    precision="bf16", verbose=False)
    losses = cpu_and_gpu_losses(out, model_dir("gpt") / "data.npz", batch=8, steps=6)
    # The GPU runs cuDNN's fused attention and onnxruntime's bf16 kernels, the CPU backend the functions
    # in float32 with the same roundings: summation order apart, the same step.
    assert np.max(np.abs(losses["nccl"] - losses["cpu"])) <= 2e-3 * float(losses["cpu"][0]), losses
