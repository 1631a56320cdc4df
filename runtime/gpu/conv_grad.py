"""The Conv weight gradient on the GPU: ``graph_transpiler.conv::ConvWeightGrad`` nodes
(transpiler/conv_grad.py, docs/contracts.md) run as cuDNN's ``cudnnConvolutionBackwardFilter``.

Why: onnxruntime has no weight-gradient op; the node's function (a Conv whose kernel is the whole
output gradient) or the per-tap GEMMs cost several times what cuDNN's backward-filter costs (ResNet-18,
batch 256, one H100: ~8.7 against ~1.9 ms per step), which is what PyTorch runs.

Algorithm: chosen once per node on its first call by ``cudnnFindConvolutionBackwardFilterAlgorithmEx``
(cuDNN times every algorithm on the real buffers, as onnxruntime's default EXHAUSTIVE search and
``torch.backends.cudnn.benchmark`` do; each algorithm's median over cudnn.FIND_RUNS such timings
decides), among those needing at most cudnn.WORKSPACE_LIMIT bytes. Every
runner of a device shares one cuDNN handle and one workspace (``CudnnContext``): they all run in
turn on the device's compute stream. The workspace only grows, and each launch reads its current
pointer, so a node's chosen algorithm always fits it. TF32 follows the device (tensor-core
math allowed with ``tf32``, FMA-only math without it, as onnxruntime's ``use_tf32`` does for its
Convs), so the equality tests (TF32 off) compare exact float32 products; the summation order is
cuDNN's, within the tests' 1e-5 of the CPU backend.

Element types (--precision): X, dY and dW share one, float32, bfloat16 or float16
(``CUDNN_TYPES``; bfloat16 arrives as its raw bits, uint16, as in_session.VIEWS has CuPy hold it).
Half and bfloat16 run cuDNN's "pseudo" configurations: bf16/fp16 products summed in float32 on
tensor cores, dW rounded once, which is what the node's function computes on the CPU backend
(runtime/low_precision.py: its Conv in float32, rounded once), up to the summation order. Between
sessions a bfloat16 value crosses as float32 (compile.py ``WidenBfloat16``), so there the node runs
in float32 on the exactly widened values.

Interface: OrtCudaSegment's (``run`` on the first call, allocating dW; then ``prepare`` per parity
and ``run_bound``), so GpuProgram binds its outputs into buffers and collective slots like any
segment's. Descriptors and algorithms are made in ``run`` (again only if its shapes changed), whose
shapes the program keeps for every bound call (its buffers are allocated from them), so a step only
enqueues the cuDNN calls.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import numpy as np

from contract.ops import CONV_GRAD_DOMAIN, CONV_WEIGHT_GRAD, CONV_WEIGHT_GRAD_ATTRIBUTES
from runtime.errors import RunError
from runtime.executor import LaunchRunner
from runtime.gpu import cudnn
from runtime.segments import place

# How each element type arrives (CuPy has no bfloat16: its raw bits, uint16) -> cuDNN's data type.
CUDNN_TYPES = {np.dtype(np.float32): cudnn.DATA_FLOAT, np.dtype(np.float16): cudnn.DATA_HALF,
               np.dtype(np.uint16): cudnn.DATA_BFLOAT16}
_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.uint16): "bfloat16"}


@dataclass
class _WeightGrad:
    """One node: names, attributes, and (once shapes are known) its descriptors and algorithm."""

    name: str
    x: str
    dy: str
    dw: str
    kernel: list[int]
    strides: list[int]
    dilations: list[int]
    pads: list[int]  # begin pads; the transpiler emits the node only where cuDNN's symmetric ones fit
    shapes: tuple = ()  # (X's shape, dY's shape, their dtype) of the call that made the descriptors
    descriptors: tuple = ()  # (x, dy, conv, dw)
    algo: int = 0
    workspace_bytes: int = 0

    @classmethod
    def from_node(cls, node, where: str) -> _WeightGrad:
        if node.op_type != CONV_WEIGHT_GRAD or len(node.input) != 2 or len(node.output) != 1:
            raise RunError(f"{where}: node '{node.name}' ({node.domain}::{node.op_type}) is not a "
                           f"{CONV_GRAD_DOMAIN}::{CONV_WEIGHT_GRAD}(X, dY) -> dW node")
        attrs = {a.name: list(a.ints) for a in node.attribute}
        missing = [key for key in CONV_WEIGHT_GRAD_ATTRIBUTES if key not in attrs]
        if missing:
            raise RunError(f"{where}: node '{node.name}' ({CONV_WEIGHT_GRAD}) lacks attribute(s) {', '.join(missing)}")
        k = len(attrs["kernel_shape"])
        if not (len(attrs["strides"]) == len(attrs["dilations"]) == k and len(attrs["pads"]) == 2 * k):
            raise RunError(f"{where}: node '{node.name}' ({CONV_WEIGHT_GRAD}): kernel_shape, strides, dilations and pads "
                           "disagree on the number of spatial axes")
        return cls(node.name, node.input[0], node.input[1], node.output[0], attrs["kernel_shape"],
                   attrs["strides"], attrs["dilations"], attrs["pads"][:k])


class CudnnConvRunner(LaunchRunner):
    """What the cuDNN Conv-gradient runners share (this one, conv_data_grad.py's): the device's compute
    stream and TF32 choice, the group's nodes parsed, and the device's cuDNN context from the first
    call on (one handle and workspace for all of them)."""

    WHAT: str  # the nodes, in errors

    def __init__(self, group, where: str, device):
        super().__init__(group.outputs)
        self.cp = device.cp
        self.tf32 = device.tf32
        self.stream = device.compute
        self.device = device
        self.where = f"{where}: {self.WHAT} in {place(group)}"
        self.ops = [self.parse(node) for node in group.nodes]
        self.context: cudnn.CudnnContext | None = None

    @abstractmethod
    def parse(self, node):
        """The node as the runner keeps it; a RunError naming it where it is not the runner's op."""

    def handle(self) -> cudnn.Handle:
        if self.context is None:
            self.context = self.device.cudnn()
        return self.context.handle

    def choose(self, op, conv, workspace_of, algorithms: int, find, what: str) -> None:
        """``op``'s algorithm: the fastest by its median over cudnn.FIND_RUNS of cuDNN's Finds on
        these buffers within cudnn.WORKSPACE_LIMIT (``cudnn.fastest``), kept with its workspace
        need and the math type it was timed with (for float32, tensor-op math only where tf32
        allowed it); a RunError naming the node where none fits (``what``: the call and the shapes)."""
        best = cudnn.fastest(self.cp, workspace_of, algorithms, find)
        if best is None:
            raise RunError(f"{self.where}: '{op.name}': cuDNN has no {what} within "
                           f"{cudnn.WORKSPACE_LIMIT >> 20} MiB of workspace")
        cudnn.call("cudnnSetConvolutionMathType", conv, best.mathType)
        op.algo, op.workspace_bytes = int(best.algo), int(best.memory)
        self.context.reserve(op.workspace_bytes)


class ConvGradRunner(CudnnConvRunner):
    """A NativeGroup of ConvWeightGrad nodes, run by cuDNN on the device's compute stream."""

    WHAT = "Conv weight gradients"

    def parse(self, node) -> _WeightGrad:
        return _WeightGrad.from_node(node, self.where)

    def _check(self, op: _WeightGrad, x, dy, dw=None) -> None:
        for label, value in (("X", x), ("dY", dy)):
            if value.dtype not in CUDNN_TYPES or value.ndim != 2 + len(op.kernel) or not value.flags.c_contiguous:
                raise RunError(f"{self.where}: '{op.name}': {label} must be a contiguous float32, bfloat16 or float16 "
                               f"tensor of rank {2 + len(op.kernel)}, got {value.dtype} {tuple(value.shape)}")
        for label, value in (("dY", dy), ("dW", dw)):
            if value is not None and value.dtype != x.dtype:
                raise RunError(f"{self.where}: '{op.name}': X is {_NAMES[x.dtype]} but {label} is "
                               f"{_NAMES.get(value.dtype, value.dtype)}: X, dY and dW must share one element type")

    def _configure(self, op: _WeightGrad, x, dy, dw) -> None:
        """Descriptors for these shapes, and the fastest algorithm on these buffers."""
        handle = self.handle()
        if op.descriptors:
            cudnn.destroy(*op.descriptors)
        data_type = CUDNN_TYPES[x.dtype]
        x_desc, dy_desc = cudnn.tensor_descriptor(x.shape, data_type), cudnn.tensor_descriptor(dy.shape, data_type)
        dw_desc = cudnn.filter_descriptor(dw.shape, data_type)
        conv = cudnn.convolution_descriptor(op.pads, op.strides, op.dilations, tf32=self.tf32, data_type=data_type)
        expected = cudnn.forward_output_dims(conv, x_desc, dw_desc, x.ndim)
        if expected != list(dy.shape):
            raise RunError(f"{self.where}: '{op.name}': dY is {tuple(dy.shape)}, but a Conv of X {tuple(x.shape)} "
                           f"with these attributes gives {tuple(expected)}")
        op.shapes, op.descriptors = (x.shape, dy.shape, x.dtype), (x_desc, dy_desc, conv, dw_desc)
        self.choose(op, conv, lambda algo: cudnn.backward_filter_workspace(handle, x_desc, dy_desc, conv, dw_desc, algo),
                    cudnn.BWD_FILTER_ALGOS, lambda scratch, size: cudnn.find_backward_filter(
                        handle, x_desc, x.data.ptr, dy_desc, dy.data.ptr, conv, dw_desc, dw.data.ptr, scratch, size),
                    f"backward-filter algorithm for {_NAMES[x.dtype]} X {tuple(x.shape)}, dY {tuple(dy.shape)}")

    def launch(self, values, allocate: bool) -> None:
        cp = self.cp
        with self.stream:
            for op in self.ops:
                x, dy = values[op.x], values[op.dy]
                if allocate:  # a first call: its shapes are every bound call's (the module docstring)
                    self._check(op, x, dy, values.get(op.dw))
                    if op.dw not in values:  # given where the node runs inside a session (in_session.py)
                        values[op.dw] = cp.empty((dy.shape[1], x.shape[1], *op.kernel), dtype=x.dtype)
                    if op.shapes != (x.shape, dy.shape, x.dtype):
                        self._configure(op, x, dy, values[op.dw])
                dw = values[op.dw]
                x_desc, dy_desc, conv, dw_desc = op.descriptors
                context = self.context
                cudnn.backward_filter(context.handle, x_desc, x.data.ptr, dy_desc, dy.data.ptr, conv, op.algo,
                                      context.pointer(), op.workspace_bytes, dw_desc, dw.data.ptr)

