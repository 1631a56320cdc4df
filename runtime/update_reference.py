"""The fused optimizer update ops (domain ``graph_transpiler.optimizer``): their attributes as the
runtime reads them, and a NumPy reference of the arithmetic of the GPU kernel that runs them.

The transpiler emits one node per parameter (or zero slice), ``SGD``, ``Momentum``, ``Adam`` or
``AdamW``, with inputs ``(param, grad, lr, [step], *slots)`` and outputs ``(param', *slots')``
(docs/contracts.md). Each node carries a model-local function of standard ops, so onnxruntime runs it
as is (the CPU backend does). A backend that lists the domain in ``Backend.native_domains`` gets the
nodes as ``NativeGroup`` items of the cut graph instead (runtime/segments.py) and runs them itself:
the GPU backend with one multi-tensor kernel per group (runtime/gpu/update_kernel.py).

The reference (``reference_update``) is written step for step like that kernel: float32 arithmetic,
torch's fused multiply-adds as ``fma``, the per-step scalars (bias corrections, step size, AdamW's
decay factor) in float64 from ``lr`` and ``step`` and rounded to float32 once, as torch's Python
scalars are. ``fma`` here is emulated as the float64 sum of the exact float32 product, rounded to
float32, which is also what the nodes' function bodies compute; the GPU's ``fmaf`` rounds once, so
the two can differ by one float32 ulp in rare cases (double rounding of the sum).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from contract.ops import FUSED_UPDATE_DOMAIN
from runtime.errors import RunError

# op type -> (state slots in input/output order, whether it reads the step counter)
OPS: dict[str, tuple[tuple[str, ...], bool]] = {
    "SGD": ((), False),
    "Momentum": (("momentum_buffer",), False),
    "Adam": (("exp_avg", "exp_avg_sq"), True),
    "AdamW": (("exp_avg", "exp_avg_sq"), True),
}
_ATTRIBUTES = {
    "SGD": ("weight_decay",),
    "Momentum": ("momentum", "weight_decay", "nesterov"),
    "Adam": ("beta1", "beta2", "eps", "weight_decay"),
    "AdamW": ("beta1", "beta2", "eps", "weight_decay"),
}

f32 = np.float32


@dataclass(frozen=True)
class UpdateOp:
    """One fused update node: what it computes and where its values are."""

    op_type: str
    hyper: tuple[tuple[str, float], ...]  # the attributes, in _ATTRIBUTES order
    param: str
    grad: str
    lr: str
    step: str | None
    slots: tuple[str, ...]  # input names of the state slots
    outputs: tuple[str, ...]  # param', then the slots'

    @classmethod
    def from_node(cls, node: onnx.NodeProto, where: str) -> UpdateOp:
        label = f"{where}: node '{node.name or node.op_type}'"
        if node.domain != FUSED_UPDATE_DOMAIN or node.op_type not in OPS:
            raise RunError(f"{label}: not a fused update op ({node.domain}::{node.op_type}; known: {', '.join(OPS)})")
        slots, uses_step = OPS[node.op_type]
        arity = 3 + uses_step + len(slots)
        if len(node.input) != arity or len(node.output) != 1 + len(slots) or not all(node.input) or not all(node.output):
            raise RunError(f"{label}: {node.op_type} takes {arity} inputs and gives {1 + len(slots)} outputs, "
                           f"got {len(node.input)} and {len(node.output)}")
        attrs = {}
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                attrs[attr.name] = float(numpy_helper.to_array(attr.t))
            elif attr.type == onnx.AttributeProto.INT:
                attrs[attr.name] = attr.i
            elif attr.type == onnx.AttributeProto.FLOAT:
                attrs[attr.name] = attr.f
        missing = [name for name in _ATTRIBUTES[node.op_type] if name not in attrs]
        if missing:
            raise RunError(f"{label}: attribute(s) {', '.join(missing)} missing")
        inputs = list(node.input)
        return cls(node.op_type, tuple((name, attrs[name]) for name in _ATTRIBUTES[node.op_type]),
                   inputs[0], inputs[1], inputs[2], inputs[3] if uses_step else None,
                   tuple(inputs[3 + uses_step:]), tuple(node.output))

    @property
    def h(self) -> dict[str, float]:
        return dict(self.hyper)

    @property
    def tensors_in(self) -> tuple[str, ...]:
        """The elementwise inputs, in the kernel's pointer-table order: param, grad, slots."""
        return (self.param, self.grad, *self.slots)

    def launch_key(self) -> tuple:
        """Nodes with equal keys can share one multi-tensor launch."""
        return (self.op_type, self.hyper, self.lr, self.step)

    def constants(self) -> dict[str, np.float32]:
        """The hyper-parameters as the elementwise arithmetic takes them: Python floats rounded to
        float32 (``1 - beta1`` and ``1 - beta2`` computed in float64 first, as Python does)."""
        h = self.h
        out = {"weight_decay": f32(h["weight_decay"])}
        if self.op_type == "Momentum":
            out["momentum"] = f32(h["momentum"])
        if self.op_type in ("Adam", "AdamW"):
            weight = f32(1.0 - h["beta1"])
            out.update(one_minus_beta1=weight, one_minus_beta1_minus_one=f32(weight - f32(1.0)),
                       one_minus_beta2=f32(1.0 - h["beta2"]), beta2=f32(h["beta2"]), eps=f32(h["eps"]))
        return out

    def step_scalars(self, lr: np.float32, step: np.float32 | None) -> dict[str, np.float32]:
        """The per-step scalars, from this step's ``lr`` and (already incremented) ``step``, in float64
        like torch's Python scalars, each rounded to float32 once."""
        out = {"neg_lr": f32(-f32(lr))}
        if self.op_type in ("Adam", "AdamW"):
            h = self.h
            lr64, step64 = float(f32(lr)), float(f32(step))
            correction1 = 1.0 - math.pow(h["beta1"], step64)
            correction2 = 1.0 - math.pow(h["beta2"], step64)
            out["neg_step_size"] = f32(-(lr64 / correction1))
            out["bias_correction2_sqrt"] = f32(math.sqrt(correction2))
            out["decay"] = f32(1.0 - lr64 * h["weight_decay"])
        return out


def fma(a, b, c) -> np.ndarray:
    """float32 ``a*b + c``: the float32 product is exact in float64, the sum is rounded twice
    (float64, then float32), which the function bodies compute too (see the module docstring)."""
    return np.asarray(np.float64(a) * np.float64(b) + np.float64(c)).astype(np.float32)


def reference_update(op: UpdateOp, lr, step, param: np.ndarray, grad: np.ndarray,
                     slots: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The new parameter and slots of one fused update node, in the GPU kernel's arithmetic."""
    c, s = op.constants(), op.step_scalars(f32(lr), None if step is None else f32(step))
    p, g = np.asarray(param, np.float32), np.asarray(grad, np.float32)
    wd = op.h["weight_decay"]
    if op.op_type in ("SGD", "Momentum"):
        if wd != 0:
            g = fma(p, c["weight_decay"], g)
        new_slots = []
        if op.op_type == "Momentum":
            buf = np.asarray(slots[0], np.float32) * c["momentum"] + g  # mul_ then add_: two roundings
            new_slots.append(buf)
            g = fma(buf, c["momentum"], g) if op.h["nesterov"] else buf
        return [fma(g, s["neg_lr"], p), *new_slots]
    m, v = (np.asarray(x, np.float32) for x in slots)
    if wd != 0 and op.op_type == "AdamW":
        p = p * s["decay"]
    elif wd != 0:
        g = fma(p, c["weight_decay"], g)
    diff = g - m
    if abs(c["one_minus_beta1"]) < 0.5:  # torch's lerp: which form depends on the weight
        m = fma(c["one_minus_beta1"], diff, m)
    else:
        m = fma(c["one_minus_beta1_minus_one"], diff, g)
    v = fma(c["one_minus_beta2"] * g, g, v * c["beta2"])
    denom = np.sqrt(v) / s["bias_correction2_sqrt"] + c["eps"]
    return [p + (s["neg_step_size"] * m) / denom, m, v]


class ReferenceUpdateRunner:
    """A NativeGroup of fused update nodes run with ``reference_update`` (NumPy, host arrays): the CPU
    stand-in for the GPU kernel, so the native-item path of the runtime is testable without a GPU."""

    def __init__(self, group, where: str):
        self.ops = [UpdateOp.from_node(node, where) for node in group.nodes]
        self.inputs, self.outputs = list(group.inputs), list(group.outputs)

    def run(self, feeds: dict) -> list[np.ndarray]:
        env = dict(feeds)
        for name, result in self._results(env):
            env[name] = result
        return [env[name] for name in self.outputs]

    def launch(self, values: dict, allocate: bool) -> None:
        """Inside a session (runtime/gpu/in_session.py; a CPU session in the tests): into the output
        buffers onnxruntime gives."""
        for name, result in self._results(values):
            values[name][...] = result

    def _results(self, env: dict):
        """Each output and its value, node by node (the caller stores a node's before the next reads ``env``)."""
        for op in self.ops:
            lr = np.asarray(env[op.lr]).reshape(())
            step = None if op.step is None else np.asarray(env[op.step]).reshape(())
            yield from zip(op.outputs, reference_update(op, lr, step, env[op.param], env[op.grad],
                                                        [env[s] for s in op.slots]))
