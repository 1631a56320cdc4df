"""A Conv's data gradient in bfloat16 or float16 on the GPU: each ``ConvTranspose`` of the step graph
that cuDNN's backward-data computes (group 1, two spatial axes, no bias, symmetric pads) becomes one
node of ``DOMAIN``, run inside its onnxruntime session as ``cudnnConvolutionBackwardData``.

Why: the autodiff writes a Conv's input gradient as ``ConvTranspose(dY, W)``, and onnxruntime-gpu
1.31's CUDA EP has no bfloat16 ConvTranspose, so under ``--precision bf16`` lowering.py computes it in
float32 between casts: ResNet-18's 19 data gradients cost ~1.4 ms of float32 (TF32) convolutions and
~0.4 ms of casts in a 7.6 ms step on an H200 (run h200-s43). cuDNN runs them in bfloat16 with
float32 accumulation, what PyTorch's autocast runs.

The node keeps ConvTranspose's inputs, output and ``strides``, ``dilations``, ``pads`` (the begin
pads: the rewrite takes only symmetric ones) and ``output_padding``, and carries the ConvTranspose
as its function, so a session that does not take it computes what the graph computed before. A
float32 ConvTranspose is left to onnxruntime (its own cuDNN kernel).
ConvTranspose(dY, W) with those attributes is the input gradient of Conv(X, W) with the same pads,
strides and dilations for an X of its output's shape: the runner checks that this Conv gives dY's
shape (cuDNN's ``GetConvolutionNdForwardOutputDim``) and refuses the node naming it otherwise.

Algorithm: chosen once per node on its first call by ``cudnnFindConvolutionBackwardDataAlgorithmEx``
among those within cudnn.WORKSPACE_LIMIT, as conv_grad.py chooses the weight gradient's; the
device's cuDNN handle and workspace are shared with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper

from runtime.errors import RunError
from runtime.gpu import cudnn
from runtime.gpu.conv_grad import CUDNN_TYPES, CudnnConvRunner
from runtime.gpu.rewrite_nodes import add_function, attribute, renamed

DOMAIN = "graph_transpiler.gpu.conv_data_grad"  # the runtime's own: the nodes of this rewrite
OP = "ConvDataGrad"  # (dY, W) -> dX: ConvTranspose(dY, W) as cuDNN's backward-data
LOW = (onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT16)  # the types rewritten (in_session.TAKES takes them)


def fuse_conv_data_grads(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each bfloat16 or float16 ConvTranspose (its dY's type known) that cuDNN's
    backward-data computes (the module docstring) made one ``DOMAIN`` node, in place; returned. A
    float32 one stays onnxruntime's (its own cuDNN kernel)."""
    graph = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.value_info, *graph.output]
             if v.type.HasField("tensor_type")}
    fused = 0
    for node in graph.node:
        if (node.op_type != "ConvTranspose" or node.domain not in ("", "ai.onnx") or not node.input
                or types.get(node.input[0]) not in LOW):
            continue
        strides, pads = attribute(node, "strides"), attribute(node, "pads", [0, 0, 0, 0])
        dilations, extra = attribute(node, "dilations", [1, 1]), attribute(node, "output_padding", [0, 0])
        if (len(node.input) != 2 or attribute(node, "group", 1) != 1 or attribute(node, "output_shape") is not None
                or attribute(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET") or strides is None
                or len(strides) != 2 or len(pads) != 4 or pads[:2] != pads[2:] or len(dilations) != 2 or len(extra) != 2):
            continue
        op_type = f"{OP}_{fused}"
        add_function(model, DOMAIN, op_type, ["dY", "W"], ["dX"], [renamed(node, ["dY", "W"], ["dX"])])
        del node.attribute[:]
        node.attribute.extend([helper.make_attribute("strides", list(strides)),
                               helper.make_attribute("dilations", list(dilations)),
                               helper.make_attribute("pads", list(pads[:2])),
                               helper.make_attribute("output_padding", list(extra))])
        node.domain, node.op_type = DOMAIN, op_type
        fused += 1
    return model


@dataclass
class _DataGrad:
    name: str
    dy: str
    w: str
    dx: str
    strides: list[int]
    dilations: list[int]
    pads: list[int]
    extra: list[int]  # output_padding
    key: tuple = ()  # (dY's shape, W's shape, dX's shape, dtype) of the call that made the descriptors
    descriptors: tuple = ()  # (w, dy, conv, dx)
    algo: int = 0
    workspace_bytes: int = 0

    @classmethod
    def from_node(cls, node, where: str) -> _DataGrad:
        if not node.op_type.startswith(OP) or len(node.input) != 2 or len(node.output) != 1:
            raise RunError(f"{where}: node '{node.name}' ({node.domain}::{node.op_type}) is not a {OP} (dY, W) -> dX node")
        get = {a.name: list(a.ints) for a in node.attribute}
        if any(len(get.get(key, ())) != 2 for key in ("strides", "dilations", "pads", "output_padding")):
            raise RunError(f"{where}: node '{node.name}' ({OP}) needs strides, dilations, pads and output_padding "
                           "of two spatial axes each")
        return cls(node.name, node.input[0], node.input[1], node.output[0], get["strides"], get["dilations"],
                   get["pads"], get["output_padding"])

    def output_shape(self, dy, w) -> tuple[int, ...]:
        """ConvTranspose's: s * (in - 1) + output_padding + d * (k - 1) + 1 - 2 * pad per spatial axis."""
        spatial = [s * (i - 1) + e + d * (k - 1) + 1 - 2 * p for i, k, s, d, p, e in
                   zip(dy.shape[2:], w.shape[2:], self.strides, self.dilations, self.pads, self.extra)]
        return (dy.shape[0], w.shape[1], *spatial)


class ConvDataGradRunner(CudnnConvRunner):
    """A NativeGroup of ConvDataGrad nodes, run by cuDNN on the device's compute stream."""

    WHAT = "Conv data gradients"

    def parse(self, node) -> _DataGrad:
        return _DataGrad.from_node(node, self.where)

    def _check(self, op: _DataGrad, dy, w, dx) -> None:
        for label, value in (("dY", dy), ("W", w), ("dX", dx)):
            if value.dtype not in CUDNN_TYPES or value.dtype != dy.dtype or value.ndim != 4 or not value.flags.c_contiguous:
                raise RunError(f"{self.where}: '{op.name}': dY, W and dX must be contiguous rank-4 tensors of one type "
                               f"(float32, bfloat16 or float16); {label} is {value.dtype} {tuple(value.shape)}")
        if w.shape[0] != dy.shape[1] or tuple(dx.shape) != op.output_shape(dy, w):
            raise RunError(f"{self.where}: '{op.name}': dY {tuple(dy.shape)}, W {tuple(w.shape)} and dX "
                           f"{tuple(dx.shape)} do not agree (dX should be {op.output_shape(dy, w)})")

    def _configure(self, op: _DataGrad, dy, w, dx) -> None:
        """Descriptors for these shapes, and the fastest algorithm on these buffers."""
        handle = self.handle()
        if op.descriptors:
            w_desc, dy_desc, conv, dx_desc = op.descriptors
            cudnn.destroy(dx_desc, dy_desc, conv, w_desc)
        data_type = CUDNN_TYPES[dy.dtype]
        dy_desc, dx_desc = cudnn.tensor_descriptor(dy.shape, data_type), cudnn.tensor_descriptor(dx.shape, data_type)
        w_desc = cudnn.filter_descriptor(w.shape, data_type)
        conv = cudnn.convolution_descriptor(op.pads, op.strides, op.dilations, tf32=self.tf32, data_type=data_type)
        expected = cudnn.forward_output_dims(conv, dx_desc, w_desc, 4)
        if expected != list(dy.shape):
            raise RunError(f"{self.where}: '{op.name}': a Conv of X {tuple(dx.shape)} and W {tuple(w.shape)} with these "
                           f"attributes gives {tuple(expected)}, not dY's {tuple(dy.shape)}: not its data gradient")
        op.key, op.descriptors = (dy.shape, w.shape, dx.shape, dy.dtype), (w_desc, dy_desc, conv, dx_desc)
        self.choose(op, conv, lambda algo: cudnn.backward_data_workspace(handle, w_desc, dy_desc, conv, dx_desc, algo),
                    cudnn.BWD_DATA_ALGOS, lambda scratch, size: cudnn.find_backward_data(
                        handle, w_desc, w.data.ptr, dy_desc, dy.data.ptr, conv, dx_desc, dx.data.ptr, scratch, size),
                    f"backward-data algorithm for dY {tuple(dy.shape)}, W {tuple(w.shape)} ({dy.dtype})")

    def launch(self, values, allocate: bool) -> None:
        with self.stream:
            for op in self.ops:
                dy, w = values[op.dy], values[op.w]
                if allocate:  # a first call: its shapes are every bound call's
                    if op.dx not in values:  # given where the node runs inside a session (in_session.py)
                        values[op.dx] = self.cp.empty(op.output_shape(dy, w), dtype=dy.dtype)
                    dx = values[op.dx]
                    self._check(op, dy, w, dx)
                    if op.key != (dy.shape, w.shape, dx.shape, dy.dtype):
                        self._configure(op, dy, w, dx)
                w_desc, dy_desc, conv, dx_desc = op.descriptors
                context = self.context
                cudnn.backward_data(context.handle, w_desc, w.data.ptr, dy_desc, dy.data.ptr, conv, op.algo,
                                    context.pointer(), op.workspace_bytes, dx_desc, values[op.dx].data.ptr)
