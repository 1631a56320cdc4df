"""Training BatchNorm on the GPU: ``graph_transpiler.batchnorm::BatchNormTraining`` and
``BatchNormTrainingGrad`` nodes (transpiler/batchnorm_ops.py, docs/contracts.md), and the same nodes
with their bfloat16 casts folded in (batchnorm_casts.py), as CuPy RawKernels: two launches a node.

Why not cuDNN (``cudnnBatchNormalizationForwardTraining``/``Backward``, which this ran before):
its spatial-mode NCHW kernels give each channel one block, 64 blocks for ResNet-18's first stage on
132 SMs: 20 nodes cost 3.8 ms of a 12.2 ms float32 step on an H200 (run h200-s42), about eight
times the bytes they move. Here each channel's N x H x W values are cut into parts over about 512
blocks, and the activations take 16-byte accesses. And cuDNN reads and writes float32 only, so
under ``--precision bf16`` every BatchNorm sat between two casts and kept a float32 copy of its
input for the backward; these kernels read and write bfloat16 where the fused nodes have it, with
float32 statistics and arithmetic (what torch.autocast runs).

Kernels (two launches a node, batchnorm_kernels.py): the statistics (or the gradient's two sums)
over parts of each channel, then one elementwise pass.

Interface: OrtCudaSegment's (``run`` allocates the outputs on the first call; then ``prepare`` and
``run_bound``); inside a session (in_session.py) the outputs are onnxruntime's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from contract.ops import BATCHNORM_TRAINING, BATCHNORM_TRAINING_GRAD
from runtime.errors import RunError
from runtime.gpu.batchnorm_kernels import SOURCE, THREADS, WIDTHS, parts
from runtime.gpu.kernel_runner import RawKernelRunner, aligned

_ARITY = {BATCHNORM_TRAINING: (5, 5), BATCHNORM_TRAINING_GRAD: (5, 3)}  # op -> (inputs, outputs)
_FLOAT, _BF16 = np.dtype(np.float32), np.dtype(np.uint16)  # bfloat16 is viewed as its raw bits


@dataclass
class _Node:
    name: str
    forward: bool
    inputs: list[str]
    outputs: list[str]
    epsilon: float
    momentum: float  # ONNX's: running = momentum * running + (1 - momentum) * batch (forward only)
    relu: bool = False  # Y = max(BatchNorm, 0) (a forward of batchnorm_casts.py that took its Relu in)

    @classmethod
    def from_node(cls, node, where: str) -> _Node:
        # A fused node of batchnorm_casts.py is named like the node it replaced, with a suffix.
        op = BATCHNORM_TRAINING_GRAD if node.op_type.startswith(BATCHNORM_TRAINING_GRAD) else BATCHNORM_TRAINING
        arity = _ARITY[op] if node.op_type.startswith(BATCHNORM_TRAINING) else None
        if arity is None or (len(node.input), len(node.output)) != arity or not all(node.input):
            raise RunError(f"{where}: node '{node.name}' ({node.domain}::{node.op_type}) is not a "
                           f"{BATCHNORM_TRAINING} (5 inputs, 5 outputs) or {BATCHNORM_TRAINING_GRAD} (5 inputs, 3 outputs) node")
        attrs = {a.name: a.f for a in node.attribute}
        relu = any(a.name == "relu" and a.i for a in node.attribute)
        return cls(node.name, op == BATCHNORM_TRAINING, list(node.input), list(node.output),
                   float(attrs.get("epsilon", 1e-5)), float(attrs.get("momentum", 0.9)), relu)


class BatchNormRunner(RawKernelRunner):
    """A NativeGroup of BatchNorm nodes (the module docstring). The partial sums, the channels'
    counters and the gradient coefficients live in buffers the runner keeps (a captured graph
    replays with their pointers); its nodes run one after another on one stream, so they share them."""

    SOURCE = SOURCE
    KERNELS = tuple(f"{name}{width}" for width in WIDTHS for name in ("bn_stats", "bn_apply", "bn_grad_sums", "bn_grad_apply"))
    WHAT = "BatchNorms"

    def __init__(self, group, where: str, device):
        super().__init__(group, where, device)
        self.blocks = 0
        self.partial = self.counters = self.coef = None

    def parse(self, node) -> _Node:
        return _Node.from_node(node, self.where)

    def in_place_pairs(self) -> dict[str, str]:
        """Running-statistic outputs that may share their input's buffer (each channel's is read
        before it is written, by one thread)."""
        return {out: src for op in self.ops if op.forward for out, src in zip(op.outputs[1:3], op.inputs[3:5])}

    def _check(self, op: _Node, values) -> tuple:
        """(N, C, HW) of X; every tensor contiguous, X-shaped ones float32 or bfloat16, the
        per-channel ones float32 (C,). The kernels would read past a smaller buffer without an error."""
        x = values[op.inputs[0] if op.forward else op.inputs[1]]
        if x.ndim != 4 or x.dtype not in (_FLOAT, _BF16) or x.size >= 2**31:
            raise RunError(f"{self.where}: '{op.name}': X must be a float32 or bfloat16 (N, C, H, W) tensor of "
                           f"fewer than 2**31 values, got {x.dtype} {tuple(x.shape)}")
        full = 1 if op.forward else 2  # leading inputs shaped like X: X, or dY and X
        for index, name in enumerate(op.inputs):
            value = values[name]
            shape, kinds = (tuple(x.shape), (_FLOAT, _BF16)) if index < full else ((x.shape[1],), (_FLOAT,))
            if value.dtype not in kinds or not value.flags.c_contiguous or tuple(value.shape) != shape:
                raise RunError(f"{self.where}: '{op.name}': input '{name}' must be a contiguous "
                               f"{' or '.join('bfloat16' if k == _BF16 else 'float32' for k in kinds)} tensor of "
                               f"shape {shape}, got {value.dtype} {tuple(value.shape)}")
        return x.shape[0], x.shape[1], x.shape[2] * x.shape[3]

    def _reserve(self, n: int, c: int, hw: int) -> None:
        count, _ = parts(c, n * hw)
        if self.partial is None or self.partial.size < 2 * count * c:
            self.partial = self.cp.empty(2 * count * c, dtype=np.float32)
        if self.counters is None or self.counters.size < c:
            self.counters = self.cp.zeros(c, dtype=np.uint32)
        if self.coef is None or self.coef.size < 3 * c:
            self.coef = self.cp.empty(3 * c, dtype=np.float32)
        if not self.blocks:
            self.blocks = 8 * self.cp.cuda.Device().attributes["MultiProcessorCount"]

    def launch(self, values, allocate: bool) -> None:
        cp = self.cp
        kernels = self.functions()
        with self.stream:
            for op in self.ops:
                x = values[op.inputs[0] if op.forward else op.inputs[1]]
                if allocate:  # a first call: its shapes are every bound call's
                    n, c, hw = self._check(op, values)
                    self._reserve(n, c, hw)
                    channels = (c,)
                    for name, shape in zip(op.outputs, [x.shape, channels, channels, channels, channels]):
                        if name not in values:  # given where the node runs inside a session (in_session.py)
                            values[name] = cp.empty(shape, dtype=np.float32)
                n, c, h, w = x.shape
                hw, total = h * w, x.size
                count, per_part = parts(c, n * hw)
                big = [values[op.outputs[0]], *(values[name] for name in op.inputs[:1 if op.forward else 2])]
                flags = [np.int32(a.dtype == _BF16) for a in big]  # (out, in...) as bfloat16
                # 8 only where every X-shaped tensor is bf16 and the rows hold whole accesses of 8;
                # else 4 (bf16 at 8 bytes an access: 14 x 14 planes stay vectorized)
                width = WIDTHS[-1] if all(flags) and hw % WIDTHS[-1] == 0 else WIDTHS[0]
                vec = hw % width == 0 and aligned(*big)
                stats, apply, grad_sums, grad_apply = kernels[4 * WIDTHS.index(width):][:4]
                values_an_access = width if vec else 1
                inp, out = [values[k] for k in op.inputs], [values[k] for k in op.outputs]
                sizes = (np.int32(vec), np.int32(c), np.int32(hw))
                # A statistics thread's stride, and an elementwise grid's, as (rows, remainder) of HW.
                parts_step = [np.uint32(v) for v in divmod(THREADS * values_an_access, hw)]
                grid = min(self.blocks, -(-total // (THREADS * values_an_access)))
                rows, rem = divmod(grid * THREADS * values_an_access, hw)
                walk_step = (np.uint32(rows % c), np.uint32(rem))
                try:
                    if op.forward:
                        stats((c, count), (THREADS,), (inp[0], flags[1], *sizes, np.uint32(n * hw),
                                                       np.uint32(per_part), *parts_step, self.partial, self.counters,
                                                       inp[3], inp[4], out[1], out[2], out[3], out[4],
                                                       np.float32(op.momentum), np.float32(op.epsilon)))
                        apply((grid,), (THREADS,), (inp[0], flags[1], out[0], flags[0], *sizes, np.uint32(total),
                                                    *walk_step, out[3], out[4], inp[1], inp[2], np.int32(op.relu)))
                    else:
                        grad_sums((c, count), (THREADS,), (inp[0], flags[1], inp[1], flags[2], *sizes,
                                                           np.uint32(n * hw), np.uint32(per_part), *parts_step,
                                                           inp[3], inp[4], inp[2], self.partial, self.counters,
                                                           out[1], out[2], self.coef))
                        grad_apply((grid,), (THREADS,), (inp[0], flags[1], inp[1], flags[2], out[0], flags[0],
                                                         *sizes, np.uint32(total), *walk_step, inp[3], self.coef))
                except Exception as exc:
                    raise self.launch_error(op.name, exc) from None
