"""Training BatchNorm on the GPU: ``graph_transpiler.batchnorm::BatchNormTraining`` and
``BatchNormTrainingGrad`` nodes (transpiler/batchnorm_ops.py, docs/contracts.md) run as cuDNN's
``cudnnBatchNormalizationForwardTraining`` and ``cudnnBatchNormalizationBackward`` (spatial mode,
NCHW: the kernels PyTorch runs for BatchNorm2d).

Why: the nodes' functions in standard ops make onnxruntime pass over each activation about 23 times
per step (nothing fused), cuDNN about 8 (ResNet-18, batch 256, one H100: ~7.6 against ~3.8 ms).

Each node is one cuDNN call. The forward updates the running statistics in place, so its running
outputs start as copies of the running inputs; the program makes them the same buffers where it can
(``in_place_pairs``, as for the fused optimizer update), and the copy is then skipped. The transpiler
writes the node only for an epsilon of at least 1e-5 in float32 (cuDNN 7's CUDNN_BN_MIN_EPSILON),
which in double can be a hair below (float32(1e-5) = 9.9999997e-6); it is raised to 1e-5, as
onnxruntime's own cuDNN BatchNorm clamps it.

Interface: OrtCudaSegment's (``run`` allocates the outputs on the first call; then ``prepare`` and
``run_bound``); descriptors are made on the first call, whose shapes every bound call keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from contract.ops import BATCHNORM_TRAINING, BATCHNORM_TRAINING_GRAD
from runtime.errors import RunError
from runtime.executor import LaunchRunner
from runtime.gpu import cudnn
from runtime.segments import place

_ARITY = {BATCHNORM_TRAINING: (5, 5), BATCHNORM_TRAINING_GRAD: (5, 3)}  # op -> (inputs, outputs)


@dataclass
class _Node:
    name: str
    op_type: str
    inputs: list[str]
    outputs: list[str]
    epsilon: float
    factor: float  # cuDNN's exponentialAverageFactor: 1 - ONNX momentum (forward only)
    shape: tuple = ()  # X's, of the call that made the descriptors
    descriptors: tuple = field(default=())  # (x, per-channel statistics)

    @classmethod
    def from_node(cls, node, where: str) -> _Node:
        arity = _ARITY.get(node.op_type)
        if arity is None or (len(node.input), len(node.output)) != arity or not all(node.input):
            raise RunError(f"{where}: node '{node.name}' ({node.domain}::{node.op_type}) is not a "
                           f"{BATCHNORM_TRAINING} (5 inputs, 5 outputs) or {BATCHNORM_TRAINING_GRAD} (5 inputs, 3 outputs) node")
        attrs = {a.name: a.f for a in node.attribute}
        epsilon = max(float(attrs.get("epsilon", 1e-5)), cudnn.BATCHNORM_MIN_EPSILON)
        return cls(node.name, node.op_type, list(node.input), list(node.output), epsilon,
                   1.0 - float(attrs.get("momentum", 0.9)))


class BatchNormRunner(LaunchRunner):
    """A NativeGroup of BatchNormTraining/BatchNormTrainingGrad nodes, run by cuDNN on the device's
    compute stream (the module docstring)."""

    def __init__(self, group, where: str, device):
        super().__init__(group.outputs)
        self.cp = device.cp
        self.stream = device.compute
        self.device = device
        self.where = f"{where}: BatchNorms in {place(group)}"
        self.ops = [_Node.from_node(node, self.where) for node in group.nodes]

    def in_place_pairs(self) -> dict[str, str]:
        """Running-statistic outputs that may share their input's buffer (cuDNN updates in place)."""
        return {out: src for op in self.ops if op.op_type == BATCHNORM_TRAINING
                for out, src in zip(op.outputs[1:3], op.inputs[3:5])}

    def _check(self, op: _Node, x, values) -> None:
        """Every input contiguous float32: X (N, C, H, W), dY X's shape, the rest (C,). cuDNN would
        read past a smaller buffer without an error."""
        if x.dtype != np.float32 or x.ndim != 4:
            raise RunError(f"{self.where}: '{op.name}': X must be a float32 (N, C, H, W) tensor, "
                           f"got {x.dtype} {tuple(x.shape)}")
        full = 1 if op.op_type == BATCHNORM_TRAINING else 2  # leading inputs shaped like X: X, or dY and X
        for index, name in enumerate(op.inputs):
            value = values[name]
            shape = tuple(x.shape) if index < full else (x.shape[1],)
            if value.dtype != np.float32 or not value.flags.c_contiguous or tuple(value.shape) != shape:
                raise RunError(f"{self.where}: '{op.name}': input '{name}' must be a contiguous float32 tensor of "
                               f"shape {shape}, got {value.dtype} {tuple(value.shape)}")

    def _configure(self, op: _Node, x) -> None:
        cudnn.destroy_tensors(*op.descriptors)
        op.descriptors = (cudnn.tensor_descriptor(x.shape), cudnn.tensor_descriptor((1, x.shape[1], 1, 1)))
        op.shape = tuple(x.shape)

    def launch(self, values, allocate: bool) -> None:
        cp = self.cp
        handle = self.device.cudnn().handle
        with self.stream:
            for op in self.ops:
                forward = op.op_type == BATCHNORM_TRAINING
                x = values[op.inputs[0] if forward else op.inputs[1]]
                if allocate:  # a first call: its shapes are every bound call's
                    self._check(op, x, values)
                    if op.shape != tuple(x.shape):
                        self._configure(op, x)
                    channels = (x.shape[1],)
                    for name, shape in zip(op.outputs, [x.shape, channels, channels, channels, channels]):
                        if name not in values:  # given where the node runs inside a session (in_session.py)
                            values[name] = cp.empty(shape, dtype=np.float32)
                x_desc, stat_desc = op.descriptors
                ptr = [values[name].data.ptr for name in op.inputs]
                out = [values[name] for name in op.outputs]
                try:
                    if forward:
                        for running, src in zip(out[1:3], op.inputs[3:5]):
                            if running.data.ptr != values[src].data.ptr:
                                running[...] = values[src]
                        cudnn.batchnorm_forward_training(handle, x_desc, ptr[0], out[0].data.ptr, stat_desc, ptr[1],
                                                         ptr[2], op.factor, out[1].data.ptr, out[2].data.ptr,
                                                         op.epsilon, out[3].data.ptr, out[4].data.ptr)
                    else:
                        cudnn.batchnorm_backward(handle, x_desc, ptr[1], ptr[0], out[0].data.ptr, stat_desc, ptr[2],
                                                 out[1].data.ptr, out[2].data.ptr, op.epsilon, ptr[3], ptr[4])
                except RunError as exc:
                    raise RunError(f"{self.where}: '{op.name}': {exc}") from None
