"""Fused attention on the GPU: ``graph_transpiler.attention::Attention`` and ``AttentionGrad`` nodes
(transpiler/attention_ops.py, docs/contracts.md) run as cuDNN's fused scaled dot-product attention,
forward and backward, through NVIDIA's cuDNN frontend (the ``nvidia-cudnn-frontend`` package).

Why: the nodes' functions materialize the (batch, heads, queries, keys) scores and probabilities,
forward and backward; cuDNN's flash-attention kernels keep them on chip and save only each row's
log-sum-exp (LSE) for the backward, which recomputes the probabilities. cuDNN's SDPA takes bf16 and
fp16 only; float32 nodes are not written (the rewrite fuses attention for --precision bf16|fp16).

Each node's cuDNN graph is built on its first call (validate, heuristics, plan build: host work and
runtime compilation, never inside a CUDA-graph capture), once per shape and attribute set in the
process, and executed on the device's compute stream with the buffers' device addresses: onnxruntime
captures the launches in its CUDA graph. Tensors are described by strides over the (B, S, H, D)
buffers the nodes take, so no layout copy is made. The backward is cuDNN's deterministic one (the
same bits on every run, as every native kernel here), its workspace the shared cuDNN workspace.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import numpy as np

from contract.ops import ATTENTION, ATTENTION_GRAD
from runtime.errors import RunError
from runtime.executor import LaunchRunner
from runtime.segments import place

MODULE = "cudnn"  # nvidia-cudnn-frontend's import name


def unavailable() -> str | None:
    """Why the kernel cannot run in this process, or None."""
    if importlib.util.find_spec(MODULE) is None:
        return "nvidia-cudnn-frontend is not installed (pip install nvidia-cudnn-frontend)"
    return None


@dataclass(frozen=True)
class _Key:
    """What a cuDNN graph is built for: nodes with equal keys share it."""

    grad: bool
    dtype: str  # "bfloat16" | "float16"
    batch: int
    queries: int
    keys: int
    heads: int
    size: int
    scale: float
    causal: int


class _Plan:
    """One built cuDNN graph and its tensors in the node's input/output order."""

    def __init__(self, cudnn, handle, key: _Key):
        b, s, t, h, d = key.batch, key.queries, key.keys, key.heads, key.size
        io = cudnn.data_type.BFLOAT16 if key.dtype == "bfloat16" else cudnn.data_type.HALF
        f32 = cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

        def heads(name: str, length: int):  # (B, S, H, D) memory seen as (B, H, S, D)
            return graph.tensor(name=name, dim=[b, h, length, d], stride=[length * h * d, d, h * d, 1], data_type=io)

        band = {} if not key.causal else {"diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT,
                                          "diagonal_band_right_bound": 0}
        lse_stride = [h * s, s, 1, 1]
        if not key.grad:
            q, k, v = heads("Q", s), heads("K", t), heads("V", t)
            y, lse = graph.sdpa(q, k, v, generate_stats=True, attn_scale=key.scale, **band)
            y.set_output(True).set_dim([b, h, s, d]).set_stride([s * h * d, d, h * d, 1]).set_data_type(io)
            lse.set_output(True).set_dim([b, h, s, 1]).set_stride(lse_stride).set_data_type(f32)
            self.tensors = [q, k, v, y, lse]
        else:
            dy, q, k, v, y = heads("dY", s), heads("Q", s), heads("K", t), heads("V", t), heads("Y", s)
            lse = graph.tensor(name="LSE", dim=[b, h, s, 1], stride=lse_stride, data_type=f32)
            grads = graph.sdpa_backward(q, k, v, y, dy, lse, attn_scale=key.scale, use_deterministic_algorithm=True,
                                        **band)
            for grad, length in zip(grads, (s, t, t)):
                grad.set_output(True).set_dim([b, h, length, d]).set_stride([length * h * d, d, h * d, 1])
                grad.set_data_type(io)
            self.tensors = [dy, q, k, v, y, lse, *grads]
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph = graph
        self.workspace = int(graph.get_workspace_size())


class _Frontend:
    """The cuDNN frontend module, its handle on the compute stream, and the plans built, per device."""

    def __init__(self, device):
        import cudnn  # noqa: PLC0415  (optional, the gpu extra: ``unavailable`` said why where missing)

        self.cudnn = cudnn
        self.handle = cudnn.create_handle()
        cudnn.set_stream(self.handle, device.compute.ptr)
        self.plans: dict[_Key, _Plan] = {}

    def plan(self, key: _Key) -> _Plan:
        if key not in self.plans:
            self.plans[key] = _Plan(self.cudnn, self.handle, key)
        return self.plans[key]


_FRONTENDS: dict[tuple[int, int], _Frontend] = {}  # by (device, compute stream): a handle is bound to its stream
_DTYPES = {np.dtype(np.uint16): "bfloat16", np.dtype(np.float16): "float16"}  # bf16 arrives as its raw bits


@dataclass
class _Node:
    name: str
    grad: bool
    inputs: list[str]
    outputs: list[str]
    scale: float
    causal: int

    @classmethod
    def from_node(cls, node, where: str) -> _Node:
        counts = {ATTENTION: (3, 2), ATTENTION_GRAD: (6, 3)}.get(node.op_type)
        if counts is None or (len(node.input), len(node.output)) != counts or not all(node.input):
            raise RunError(f"{where}: node '{node.name}' ({node.domain}::{node.op_type}) is not an {ATTENTION} "
                           f"(3 inputs, 2 outputs) or {ATTENTION_GRAD} (6 inputs, 3 outputs) node")
        attrs = {a.name: a for a in node.attribute}
        return cls(node.name or node.op_type, node.op_type == ATTENTION_GRAD, list(node.input), list(node.output),
                   float(attrs["scale"].f) if "scale" in attrs else 1.0, int(attrs["causal"].i) if "causal" in attrs else 0)


class AttentionRunner(LaunchRunner):
    """A NativeGroup of Attention / AttentionGrad nodes on the device's compute stream (the module docstring)."""

    def __init__(self, group, where: str, device):
        super().__init__(group.outputs)
        self.device = device
        self.where = f"{where}: fused attention in {place(group)}"
        self.ops = [_Node.from_node(node, self.where) for node in group.nodes]
        self.plans: dict[str, _Plan] = {}
        self.frontend: _Frontend | None = None  # the device's, taken on the first call

    def _key(self, op: _Node, values) -> _Key:
        q, k = values[op.inputs[1 if op.grad else 0]], values[op.inputs[2 if op.grad else 1]]
        dtype = _DTYPES.get(np.dtype(q.dtype))
        if dtype is None or q.ndim != 4 or k.ndim != 4:
            raise RunError(f"{self.where}: '{op.name}': cuDNN's fused attention takes 4-D bfloat16 or float16 heads, "
                           f"got {q.dtype} {tuple(q.shape)}")
        (b, s, h, d), (_, t, _, _) = q.shape, k.shape
        if d % 8 or d > 128:
            raise RunError(f"{self.where}: '{op.name}': head size {d} is not a multiple of 8 up to 128, which "
                           "cuDNN's fused attention needs")
        for name in op.inputs:
            value = values[name]
            if not value.flags.c_contiguous or value.data.ptr % 16:
                raise RunError(f"{self.where}: '{op.name}': input '{name}' is not contiguous and 16-byte aligned")
        return _Key(op.grad, dtype, int(b), int(s), int(t), int(h), int(d), op.scale, op.causal)

    def launch(self, values, allocate: bool) -> None:
        cp = self.device.cp
        if allocate:  # a first call: build (or reuse) each node's plan, give outputs it lacks
            where = (self.device.device_id, self.device.compute.ptr)
            if where not in _FRONTENDS:
                _FRONTENDS[where] = _Frontend(self.device)
            self.frontend = _FRONTENDS[where]
            for op in self.ops:
                key = self._key(op, values)
                try:
                    self.plans[op.name] = plan = self.frontend.plan(key)
                except Exception as exc:  # the frontend's errors name no node
                    raise RunError(f"{self.where}: '{op.name}': cuDNN could not build its fused attention for "
                                   f"{key}: {str(exc).splitlines()[0]}") from None
                self.device.cudnn().reserve(plan.workspace)
                q = values[op.inputs[1 if op.grad else 0]]
                b, s, h, _ = q.shape
                shapes = ([values[n].shape for n in op.inputs[1:4]] if op.grad
                          else [q.shape, (b, h, s, 1)])
                dtypes = [q.dtype] * 3 if op.grad else [q.dtype, np.float32]
                for name, shape, dtype in zip(op.outputs, shapes, dtypes):
                    if name not in values:  # given where the node runs inside a session (in_session.py)
                        values[name] = cp.empty(shape, dtype=dtype)
        workspace = self.device.cudnn().pointer()
        for op in self.ops:
            plan = self.plans[op.name]
            pointers = {tensor: values[name].data.ptr for tensor, name in zip(plan.tensors, op.inputs + op.outputs)}
            try:
                plan.graph.execute(pointers, workspace, handle=self.frontend.handle)
            except Exception as exc:
                raise RunError(f"{self.where}: '{op.name}': {str(exc).splitlines()[0]}") from None
