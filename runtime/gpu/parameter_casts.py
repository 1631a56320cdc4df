"""The casts of the parameters to bfloat16, in one launch: under ``--precision bf16`` the forward
casts every float32 weight the low-precision products read (docs/precision.md, "Master weights"),
one onnxruntime Cast kernel each. ``batch_parameter_casts`` makes every Cast to bfloat16 of a
graph input (a parameter: the step's float32 master weights) one node of ``DOMAIN``, run inside
the session by one CuPy RawKernel.

Why: GPT-2-small's bf16 step ran 171 Cast kernels float32 -> bfloat16 (0.79 ms of 13.2 on an
H200), a launch per weight and bias, most of them too small to fill the GPU. All of them read
values present at the step's start, so one launch covers them all: its blocks take chunks of
CHUNK elements of one tensor each.

The node takes the first replaced Cast's place; every replaced Cast's output is its output, with
the same bits (round to nearest even, as onnxruntime's Cast and the fused elementwise kernels
round, elementwise_steps.PREAMBLE; a NaN stays a NaN, its payload not necessarily onnxruntime's). The bfloat16 copies then all live from the
step's start, where each lived from its first reader: in a transformer every one is read again by
the backward, so the step's peak (between forward and backward) holds them all either way. The
node carries a function of the Casts, so a session that cannot take it computes what it did.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from runtime.errors import RunError
from runtime.gpu.elementwise_steps import PREAMBLE
from runtime.gpu.kernel_runner import RawKernelRunner
from runtime.gpu.rewrite_nodes import add_function, attribute

DOMAIN = "graph_transpiler.gpu.parameter_casts"  # the runtime's own: the fused node of this rewrite
OP = "CastParameters"  # (p0, ..., pn-1) -> (c0, ..., cn-1), each ci = Cast(pi, to=BFLOAT16)
CHUNK = 16384  # elements per block
THREADS = 256
MOST = 200  # tensors per node: two pointers each, within CUDA's 4 KiB of kernel arguments


def batch_parameter_casts(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its Casts to bfloat16 of graph inputs made nodes of up to MOST each (the
    module docstring), in place, where there are at least two; returned."""
    graph = model.graph
    inputs = {i.name for i in graph.input} - {i.name for i in graph.initializer}
    casts = [k for k, n in enumerate(graph.node) if n.op_type == "Cast" and n.domain in ("", "ai.onnx")
             and n.input[0] in inputs and attribute(n, "to") == onnx.TensorProto.BFLOAT16]
    if len(casts) < 2:
        return model
    nodes = list(graph.node)
    fused = {}  # position of a group's first Cast -> the group's node
    for g, first in enumerate(range(0, len(casts), MOST)):
        group = casts[first:first + MOST]
        formal_in, formal_out = [f"p{i}" for i in range(len(group))], [f"c{i}" for i in range(len(group))]
        body = [helper.make_node("Cast", [p], [c], to=onnx.TensorProto.BFLOAT16) for p, c in zip(formal_in, formal_out)]
        add_function(model, DOMAIN, f"{OP}_{g}", formal_in, formal_out, body)
        fused[group[0]] = helper.make_node(f"{OP}_{g}", [nodes[k].input[0] for k in group],
                                           [nodes[k].output[0] for k in group], name=f"parameter_casts/{g}", domain=DOMAIN)
    taken = set(casts)
    kept = [fused.get(k, n) for k, n in enumerate(nodes) if k not in taken or k in fused]
    del graph.node[:]
    graph.node.extend(kept)
    return model


def kernel_source(sizes: list[int], name: str) -> str:
    """The kernel casting ``len(sizes)`` float32 tensors of those element counts, its arguments
    (s0.., d0..): block b takes chunk b - first[t] of the tensor t whose chunks hold it (the sizes
    are static: the specialized session's). 16-byte loads where both pointers are aligned."""
    firsts, total = [], 0
    for size in sizes:
        firsts.append(total)
        total += -(-size // CHUNK)
    params = [f"const float* __restrict__ s{t}" for t in range(len(sizes))]
    params += [f"unsigned short* __restrict__ d{t}" for t in range(len(sizes))]
    pick = "\n    ".join(
        f"{'if' if t == 0 else 'else if'} (b < {firsts[t] + -(-sizes[t] // CHUNK)}LL) "
        f"{{ s = s{t}; d = d{t}; n = {sizes[t]}LL; start = (b - {firsts[t]}LL) * {CHUNK}LL; }}"
        for t in range(len(sizes)))
    return PREAMBLE + f"""
extern "C" __global__ void {name}({", ".join(params)}) {{
    const long long b = blockIdx.x;
    const float* s = 0; unsigned short* d = 0; long long n = 0, start = 0;
    {pick}
    const long long end = start + {CHUNK}LL < n ? start + {CHUNK}LL : n;
    long long i = start;  // a multiple of CHUNK, so of 4
    if ((((unsigned long long)s) & 15) == 0 && (((unsigned long long)d) & 7) == 0) {{
        for (long long q = start / 4 + threadIdx.x; q < end / 4; q += blockDim.x) {{
            const float4 v = reinterpret_cast<const float4*>(s)[q];
            ushort4 o;
            o.x = gt_bf16_bits(gt_round_bf16(v.x)); o.y = gt_bf16_bits(gt_round_bf16(v.y));
            o.z = gt_bf16_bits(gt_round_bf16(v.z)); o.w = gt_bf16_bits(gt_round_bf16(v.w));
            reinterpret_cast<ushort4*>(d)[q] = o;
        }}
        i = end - end % 4;  // start is a multiple of 4: the vector loop covered [start, i)
    }}
    for (i += threadIdx.x; i < end; i += blockDim.x) d[i] = gt_bf16_bits(gt_round_bf16(s[i]));
}}
""", total


@dataclass
class _Node:
    name: str
    inputs: list[str]
    outputs: list[str]

    @classmethod
    def from_node(cls, node, where: str) -> _Node:
        if not node.op_type.startswith(OP) or len(node.input) != len(node.output) or not node.input:
            raise RunError(f"{where}: node '{node.name}' ({node.domain}::{node.op_type}) is not a fused "
                           f"{OP} node (as many outputs as inputs)")
        return cls(node.name, list(node.input), list(node.output))


class ParameterCastRunner(RawKernelRunner):
    """One fused node's launch (the module docstring); its kernel is made for the node's sizes at
    the first call, the pointers are its arguments (a captured graph replays them)."""

    KERNELS = ("cast_parameters",)
    WHAT = "parameter casts"

    def __init__(self, group, where: str, device):
        super().__init__(group, where, device)
        self.grid = 0

    def parse(self, node) -> _Node:
        return _Node.from_node(node, self.where)

    def launch(self, values, allocate: bool) -> None:
        cp = self.cp
        with self.stream:
            for op in self.ops:
                sources = [values[name] for name in op.inputs]
                if allocate:
                    for name, source in zip(op.outputs, sources):
                        if name not in values:  # given where the node runs inside a session (in_session.py)
                            values[name] = cp.empty(source.shape, np.uint16)
                    self._check(op, values)
                    self.SOURCE, self.grid = kernel_source([int(s.size) for s in sources], self.KERNELS[0])
                    self._functions = None
                if self.grid == 0:
                    continue
                (kernel,) = self.functions()
                try:
                    kernel((self.grid,), (THREADS,), (*sources, *(values[name] for name in op.outputs)))
                except Exception as exc:
                    raise self.launch_error(op.name, exc) from None

    def _check(self, op: _Node, values) -> None:
        if len(self.ops) != 1:
            raise RunError(f"{self.where}: one {OP} node per runner, got {len(self.ops)}")
        for source, result in zip(op.inputs, op.outputs):
            s, d = values[source], values[result]
            if s.dtype != np.float32 or d.dtype != np.uint16 or s.shape != d.shape or not (
                    s.flags.c_contiguous and d.flags.c_contiguous):
                raise RunError(f"{self.where}: '{op.name}': '{source}' -> '{result}' must be contiguous float32 -> "
                               f"bfloat16 of one shape, got {s.dtype} {tuple(s.shape)} -> {d.dtype} {tuple(d.shape)}")
