"""Every gradient rule against central finite differences, from one spec table.

The check is JAX's cheap VJP check: for a random cotangent c and a random direction t, the
backward's <t, J^T c> must equal the directional derivative of <f(x), c> along t, measured by central
differences in float64. Each spec runs twice: with static input shapes, and with every input dim
symbolic, which drives the rules' dynamic paths (run-time unbroadcast, Shape-based sizes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from transpiler.autodiff import build_gradients, check_supported
from transpiler.autodiff._registry import non_differentiable_ops, registered_ops
from transpiler.errors import UnsupportedOpsError
from transpiler.native_ops import add_op_functions

Shape = tuple[int, ...]


@dataclass
class Spec:
    op: str
    # A shape makes a random float64 graph input; an array makes a constant (shapes, axes, masks,
    # labels); None omits an optional input.
    inputs: list[Shape | np.ndarray | None]
    attrs: dict[str, Any] = field(default_factory=dict)
    # Input indices to differentiate; default: every random input.
    wrt: tuple[int, ...] | None = None
    # Sampling range per input index; default (-2, 2). Log, Sqrt and Pow's base need positives.
    ranges: dict[int, tuple[float, float]] = field(default_factory=dict)
    # Float32 outputs (Cast) need a wider step and a looser tolerance.
    eps: float = 1e-6
    rtol: float = 1e-6
    name: str = ""
    # Number of node outputs, and which of them enter the loss (default: every float output).
    outputs: int = 1
    loss_outputs: tuple[int, ...] | None = None
    # Input dtype: float32 for ops onnxruntime's CPU provider has no float64 kernel for (Conv,
    # ConvTranspose, AveragePool, GlobalAveragePool, Erf, Gelu); those specs set eps/rtol too.
    dtype: type = np.float64
    opset: int = 18
    # Ops that only occur in a pattern (SequenceAt reads a sequence SplitToSequence made): these
    # nodes replace the single op node; they read in0, in1, ... and `pattern_outputs` enter the loss.
    pattern: list[onnx.NodeProto] | None = None
    pattern_outputs: tuple[str, ...] = ()
    # Declare the outputs' types (rank known, dims not) for ops onnx's shape inference cannot type
    # (GroupNormalization, a function op).
    declare_outputs: bool = False

    @property
    def id(self) -> str:
        shapes = ",".join(
            "x".join(map(str, s)) or "scalar" if isinstance(s, tuple) else "c" if s is not None else "-"
            for s in self.inputs
        )
        return f"{self.op}[{shapes}]{self.name}"


POSITIVE = (0.5, 2.0)
AWAY_FROM_ZERO = (0.5, 2.0)
# Recurrent ops: inputs and weights in (-1, 1), so the gates stay off saturation.
RNN_RANGES = {i: (-1.0, 1.0) for i in range(8)}

SPECS = [
    # Binary elementwise, with broadcast pairs and scalars.
    Spec("Add", [(3, 4), (3, 4)]),
    Spec("Add", [(3, 4), (4,)]),
    Spec("Add", [(3, 1), (1, 4)]),
    Spec("Add", [(2, 3, 4), (3, 1)]),
    Spec("Add", [(), (3, 4)]),
    Spec("Add", [(3, 4), ()]),
    Spec("Sub", [(3, 4), (4,)]),
    Spec("Sub", [(3, 1), (1, 4)]),
    Spec("Sub", [(), ()]),
    Spec("Mul", [(3, 4), (3, 4)]),
    Spec("Mul", [(2, 3, 4), (3, 1)]),
    Spec("Mul", [(), (2, 3)]),
    Spec("Mul", [(3, 4), (4,)], wrt=(1,), name="wrt-right-only"),
    Spec("Div", [(3, 4), (4,)], ranges={1: AWAY_FROM_ZERO}),
    Spec("Div", [(3, 1), (1, 4)], ranges={1: AWAY_FROM_ZERO}),
    Spec("Pow", [(3, 4), (4,)], ranges={0: POSITIVE}),
    Spec("Pow", [(3, 1), ()], ranges={0: POSITIVE}),
    Spec("Pow", [(3, 4), np.array(3, dtype=np.int64)], name="int-exponent"),
    Spec("Pow", [(3, 4), (3, 4)], wrt=(0,), name="wrt-base-only"),
    Spec("Where", [np.array([[True, False, True, False]] * 3), (3, 4), (4,)]),
    Spec("Where", [np.array([True, False, True]).reshape(3, 1), (), (1, 4)]),
    # Unary elementwise.
    Spec("Neg", [(3, 4)]),
    Spec("Identity", [(3, 4)]),
    Spec("Relu", [(3, 4)]),
    Spec("Tanh", [(3, 4)]),
    Spec("Sigmoid", [(3, 4)]),
    Spec("Exp", [(3, 4)]),
    Spec("Sqrt", [(3, 4)], ranges={0: POSITIVE}),
    Spec("Log", [(3, 4)], ranges={0: POSITIVE}),
    Spec("Log", [()], ranges={0: POSITIVE}),
    Spec("Cast", [(3, 4)], {"to": onnx.TensorProto.FLOAT}, eps=1e-2, rtol=1e-4, name="to-float32"),
    Spec("Cast", [(3, 4)], {"to": onnx.TensorProto.DOUBLE}, name="to-double"),
    # Matrix products.
    Spec("MatMul", [(3, 4), (4, 5)]),
    Spec("MatMul", [(2, 3, 4), (4, 5)]),
    Spec("MatMul", [(2, 1, 3, 4), (5, 4, 2)]),
    Spec("MatMul", [(4,), (4, 5)]),
    Spec("MatMul", [(3, 4), (4,)]),
    Spec("MatMul", [(4,), (4,)]),
    Spec("MatMul", [(4,), (2, 4, 5)]),
    Spec("Gemm", [(3, 4), (4, 5), (5,)]),
    Spec("Gemm", [(4, 3), (4, 5), (3, 1)], {"transA": 1, "alpha": 0.5, "beta": 2.0}),
    Spec("Gemm", [(3, 4), (5, 4), ()], {"transB": 1}),
    Spec("Gemm", [(4, 3), (5, 4), (3, 5)], {"transA": 1, "transB": 1, "alpha": 1.5}),
    Spec("Gemm", [(3, 4), (4, 5)], name="no-C"),
    # Reductions.
    Spec("ReduceSum", [(3, 4), np.array([1])]),
    Spec("ReduceSum", [(2, 3, 4), np.array([0, -1])], {"keepdims": 0}),
    Spec("ReduceSum", [(3, 4)], {"keepdims": 0}, name="all-axes"),
    Spec("ReduceSum", [(3, 4)], {"noop_with_empty_axes": 1}, name="noop"),
    Spec("ReduceSum", [(3, 4), np.array([], dtype=np.int64)], {"keepdims": 0}, name="empty-axes"),
    Spec("ReduceMean", [(3, 4), np.array([1])]),
    Spec("ReduceMean", [(2, 3, 4), np.array([0, 2])], {"keepdims": 0}),
    Spec("ReduceMean", [(3, 4)], {"keepdims": 0}, name="all-axes"),
    Spec("ReduceMean", [(3, 4)], name="all-axes-keepdims"),
    Spec("ReduceMean", [(3, 4)], {"noop_with_empty_axes": 1}, name="noop"),
    # Shape ops.
    Spec("Reshape", [(2, 6), np.array([3, 4])]),
    Spec("Reshape", [(2, 3, 4), np.array([0, -1])]),
    Spec("Flatten", [(2, 3, 4)], {"axis": 2}),
    Spec("Transpose", [(2, 3, 4)], {"perm": [2, 0, 1]}),
    Spec("Transpose", [(2, 3, 4)], name="default-perm"),
    Spec("Squeeze", [(3, 1, 4), np.array([1])]),
    Spec("Squeeze", [(1, 3, 1)], name="all-ones"),
    Spec("Unsqueeze", [(3, 4), np.array([0, -1])]),
    Spec("Expand", [(3, 1), np.array([2, 3, 4])]),
    Spec("Expand", [(4,), np.array([3, 1])]),
    Spec("Concat", [(2, 3), (2, 5)], {"axis": 1}),
    Spec("Concat", [(1, 3), (2, 3), (3, 3)], {"axis": -2}),
    # Convolutions and pools: onnxruntime's CPU provider has Conv, ConvTranspose, AveragePool and
    # GlobalAveragePool in float32 only, so those run in float32. They are linear (bilinear for
    # Conv), so central differences are exact and a large step keeps rounding small.
    *(
        Spec(op, inputs, attrs, dtype=np.float32, eps=0.5, rtol=2e-4, name=name)
        for op, inputs, attrs, name in [
            ("Conv", [(2, 3, 7, 6), (4, 3, 3, 3), (4,)], {}, ""),
            (
                "Conv",
                [(2, 3, 7, 6), (4, 3, 3, 2)],
                {"strides": [2, 2], "pads": [1, 0, 2, 1]},
                "-strides-pads",
            ),
            (
                "Conv",
                [(2, 4, 9, 8), (6, 2, 3, 3), (6,)],
                {"group": 2, "dilations": [2, 1]},
                "-groups-dilation",
            ),
            (
                "Conv",
                [(1, 4, 8, 9), (4, 1, 3, 3)],
                {"group": 4, "strides": [3, 2], "pads": [1, 1, 1, 1]},
                "-depthwise",
            ),
            (
                "Conv",
                [(2, 3, 10), (2, 3, 4), (2,)],
                {"strides": [3], "dilations": [2], "pads": [2, 1]},
                "-1d",
            ),
            (
                "Conv",
                [(2, 2, 7, 8), (3, 2, 3, 2)],
                {"auto_pad": "SAME_UPPER", "strides": [2, 3]},
                "-same-upper",
            ),
            ("Conv", [(2, 2, 7, 8), (3, 2, 2, 3)], {"auto_pad": "SAME_LOWER"}, "-same-lower"),
            ("Conv", [(2, 2, 7, 8), (3, 2, 3, 3)], {"auto_pad": "VALID", "strides": [2, 2]}, "-valid"),
            (
                "Conv",
                [(1, 2, 4, 5, 6), (2, 2, 2, 3, 2)],
                {"strides": [1, 2, 2], "pads": [1, 0, 1, 0, 1, 1]},
                "-3d",
            ),
            ("ConvTranspose", [(2, 3, 4, 5), (3, 2, 3, 3), (2,)], {}, ""),
            (
                "ConvTranspose",
                [(2, 4, 4, 3), (4, 3, 3, 2)],
                {"strides": [2, 3], "pads": [1, 0, 0, 1], "output_padding": [1, 2], "group": 2},
                "-strides-groups",
            ),
            (
                "ConvTranspose",
                [(1, 2, 5), (2, 3, 3)],
                {"dilations": [2], "strides": [2], "pads": [1, 2]},
                "-1d-dilation",
            ),
            ("AveragePool", [(2, 3, 7, 6)], {"kernel_shape": [3, 2]}, ""),
            (
                "AveragePool",
                [(2, 3, 7, 6)],
                {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
                "-pads",
            ),
            (
                "AveragePool",
                [(2, 3, 7, 6)],
                {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1},
                "-count-pad",
            ),
            (
                "AveragePool",
                [(2, 3, 8, 7)],
                {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 0, 1], "ceil_mode": 1},
                "-ceil",
            ),
            (
                "AveragePool",
                [(2, 3, 8, 7)],
                {"kernel_shape": [3, 2], "strides": [2, 2], "ceil_mode": 1, "count_include_pad": 1},
                "-ceil-count-pad",
            ),
            (
                "AveragePool",
                [(2, 3, 9)],
                {"kernel_shape": [4], "strides": [3], "auto_pad": "SAME_UPPER"},
                "-same",
            ),
            ("GlobalAveragePool", [(2, 3, 4, 5)], {}, ""),
        ]
    ),
    Spec("MaxPool", [(2, 3, 7, 6)], {"kernel_shape": [2, 2]}),
    Spec(
        "MaxPool",
        [(2, 3, 7, 6)],
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
        name="-pads",
    ),
    Spec(
        "MaxPool",
        [(2, 3, 7, 6)],
        {"kernel_shape": [3, 2], "strides": [2, 1], "dilations": [2, 2]},
        name="-dilation",
    ),
    Spec(
        "MaxPool", [(2, 3, 8, 7)], {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, name="-ceil"
    ),
    Spec("MaxPool", [(2, 3, 9)], {"kernel_shape": [3], "strides": [2]}, outputs=2, name="-1d-indices-given"),
    # Normalization and dropout. float64 LayerNormalization stashes float32 statistics, so the rule
    # recomputes them in float64 there; the float32 spec uses the (added) Mean/InvStdDev outputs.
    Spec("LayerNormalization", [(3, 5), (5,), (5,)]),
    Spec("LayerNormalization", [(2, 3, 4), (3, 4)], {"axis": 1, "epsilon": 0.1}, name="-axis1-no-bias"),
    Spec("LayerNormalization", [(2, 3, 4), (4,), (1,)], outputs=3, loss_outputs=(0,), name="-stats-given"),
    Spec("LayerNormalization", [(4, 6), (6,), (6,)], dtype=np.float32, eps=1e-2, rtol=2e-3, name="-float32"),
    # RMSNormalization-23 (dynamo's form of torch.nn.RMSNorm).
    Spec("RMSNormalization", [(3, 5), (5,)], opset=23),
    Spec("RMSNormalization", [(2, 3, 4), (3, 4)], {"axis": 1, "epsilon": 0.1}, opset=23, name="-axis1"),
    # BatchNormalization in inference mode (transpiler/batchnorm.py feeds it the batch statistics;
    # that pattern's training-mode gradient is checked in tests/test_batchnorm_formulation.py).
    Spec("BatchNormalization", [(2, 3, 4, 5), (3,), (3,), (3,), (3,)], ranges={4: POSITIVE}),
    Spec("BatchNormalization", [(4, 3), (3,), (3,), (3,), (3,)], {"epsilon": 0.1}, ranges={4: POSITIVE}),
    Spec("Dropout", [(3, 4)], name="-inference"),
    Spec("Dropout", [(3, 4), np.array(0.0), np.array(True)], outputs=2, name="-ratio0-training"),
    Spec("Dropout", [(3, 4), np.array(0.5), np.array(False)], name="-training-off"),
    # Softmax family and activations.
    Spec("Softmax", [(3, 5)]),
    Spec("Softmax", [(2, 3, 4)], {"axis": 1}),
    Spec("LogSoftmax", [(3, 5)]),
    Spec("LogSoftmax", [(2, 3, 4)], {"axis": 0}),
    Spec("Erf", [(3, 4)], dtype=np.float32, eps=1e-2, rtol=1e-3),
    Spec("Gelu", [(3, 4)], opset=20, dtype=np.float32, eps=1e-2, rtol=1e-3),
    Spec(
        "Gelu",
        [(3, 4)],
        {"approximate": "tanh"},
        opset=20,
        dtype=np.float32,
        eps=1e-2,
        rtol=1e-3,
        name="-tanh",
    ),
    Spec("Abs", [(3, 4)]),
    Spec("Clip", [(3, 4), np.array(-0.5), np.array(1.0)]),
    Spec("Clip", [(3, 4), np.array(-0.5)], name="-min-only"),
    Spec("Clip", [(3, 4), None, np.array(0.5)], name="-max-only"),
    Spec("Clip", [(3, 4)], name="-no-bounds"),
    # Bounds from Constant nodes (TorchScript's hardtanh: the gradient strictly inside).
    Spec(
        "Clip",
        [(3, 4)],
        pattern=[
            onnx.helper.make_node("Constant", [], ["lo"], value=onnx.helper.make_tensor("v", 11, [], [-0.5])),
            onnx.helper.make_node("Constant", [], ["hi"], value=onnx.helper.make_tensor("v", 11, [], [1.0])),
            onnx.helper.make_node("Clip", ["in0", "lo", "hi"], ["y"]),
        ],
        pattern_outputs=("y",),
        name="-constant-bounds-hardtanh",
    ),
    Spec("LeakyRelu", [(3, 4)]),
    Spec("LeakyRelu", [(3, 4)], {"alpha": 0.2}),
    Spec("Max", [(3, 4), (3, 4)]),
    Spec("Max", [(3, 4), (4,)]),
    Spec("Max", [(3, 1), (1, 4), ()]),
    Spec("Max", [(2, 3)], name="-single"),
    Spec("Min", [(3, 4), (4,)]),
    Spec("Min", [(2, 3, 4), (3, 1), (4,)]),
    Spec("Sum", [(3, 4), (4,), (3, 1)]),
    Spec("Mean", [(3, 4), (4,)], dtype=np.float32, eps=0.5, rtol=1e-4),  # float32 kernel only
    Spec("CastLike", [(3, 4), np.array(0.0, dtype=np.float32)], eps=1e-2, rtol=1e-4, name="-to-float32"),
    # Losses: gradient w.r.t. the scores only; labels are fixed int64 arrays.
    *(
        Spec(op, [shape, labels, *weight], {"reduction": reduction, **extra}, outputs=outputs, name=name)
        for op, outputs in [
            ("SoftmaxCrossEntropyLoss", 1),
            ("SoftmaxCrossEntropyLoss", 2),
            ("NegativeLogLikelihoodLoss", 1),
        ]
        for reduction in ["mean", "sum", "none"]
        for shape, labels, weight, extra, name in [
            ((5, 4), np.array([0, 3, 1, 1, 2]), [], {}, f"-{reduction}"),
            (
                (5, 4),
                np.array([0, 3, -1, 1, 2]),
                [np.array([0.5, 1.0, 2.0, 1.5])],
                {"ignore_index": -1},
                f"-{reduction}-weight-ignore",
            ),
            (
                (2, 3, 4),
                np.array([[0, 2, 1, 2], [1, 1, 0, 7]]),
                [],
                {"ignore_index": 7},
                f"-{reduction}-spatial-ignore",
            ),
            (
                (2, 3, 2),
                np.array([[0, 2], [1, 1]]),
                [np.array([0.2, 1.0, 3.0])],
                {},
                f"-{reduction}-weight-spatial",
            ),
        ]
        if not (op == "SoftmaxCrossEntropyLoss" and outputs == 2 and "weight" not in name)
    ),
    Spec(
        "SoftmaxCrossEntropyLoss",
        [(5, 4), np.array([0, 3, 1, 1, 2])],
        outputs=2,
        loss_outputs=(1,),
        name="-log-prob-only",
    ),
    # Indexing.
    Spec("Gather", [(5, 3), np.array([[0, 4], [4, -1]])], name="-embedding-repeats-negative"),
    Spec("Gather", [(2, 5, 3), np.array([1, -2, 1])], {"axis": 1}),
    Spec("Gather", [(2, 3, 5), np.array(2)], {"axis": -1}, name="-scalar-index"),
    Spec("Gather", [(2, 3, 5), np.array([[0, 1], [2, 2]])], {"axis": 2}, name="-2d-index-last-axis"),
    Spec("GatherElements", [(3, 4), np.array([[0, 1, 2, 0], [2, 2, -1, 0]])]),
    Spec("GatherElements", [(3, 4), np.array([[0, 3], [3, -4], [1, 1]])], {"axis": 1}),
    Spec("Slice", [(5, 6), np.array([1, 0]), np.array([4, 5])]),
    Spec("Slice", [(5, 6), np.array([-4]), np.array([100]), np.array([1])], name="-clamped"),
    Spec(
        "Slice",
        [(5, 6, 4), np.array([4, 0]), np.array([-10, 6]), np.array([0, 1]), np.array([-2, 2])],
        name="-negative-step",
    ),
    Spec("Slice", [(5, 6), np.array([1]), np.array([6]), np.array([-1]), np.array([2])], name="-step2"),
    Spec("Split", [(6, 3)], {"axis": 0, "num_outputs": 3}, outputs=3),
    Spec("Split", [(2, 7), np.array([2, 5])], {"axis": 1}, outputs=2),
    Spec("Split", [(6, 3)], {"num_outputs": 2}, outputs=2, loss_outputs=(1,), name="-one-output-used"),
    Spec("Trilu", [(4, 5)]),
    Spec("Trilu", [(2, 4, 5), np.array(1)], {"upper": 0}, name="-lower-k1"),
    Spec("Trilu", [(4, 5), np.array(-1)], name="-k-1"),
    Spec("Tile", [(2, 3), np.array([2, 3])]),
    Spec("Tile", [(2, 1, 3), np.array([1, 4, 1])]),
    Spec("Pad", [(3, 4), np.array([1, 0, 2, 3])]),
    Spec("Pad", [(3, 4), np.array([1, -1, -1, 2]), np.array(0.5)], name="-negative-value"),
    Spec("Pad", [(2, 3, 4), np.array([1, 2]), None, np.array([-1])], name="-axes"),
    Spec("ReduceMax", [(3, 4), np.array([1])]),
    Spec("ReduceMax", [(2, 3, 4), np.array([0, 2])], {"keepdims": 0}),
    Spec("ReduceMax", [(3, 4)], {"keepdims": 0}, name="all-axes"),
    Spec("ReduceMin", [(2, 3, 4), np.array([-1])]),
    Spec("Einsum", [(3, 4), (4, 5)], {"equation": "ij,jk->ik"}),
    Spec("Einsum", [(2, 3, 4, 5), (2, 3, 6, 5)], {"equation": "bhqd,bhkd->bhqk"}, name="-attention"),
    Spec("Einsum", [(3, 4), (4,)], {"equation": "ij,j"}, name="-implicit"),
    Spec("Einsum", [(3, 4, 2), (5,)], {"equation": "ijk,l->il"}, name="-summed-away"),
    Spec(
        "Einsum", [(2, 1, 3, 4), (1, 3, 4, 5)], {"equation": "...ij,...jk->...ik"}, name="-ellipsis-broadcast"
    ),
    Spec("Einsum", [(3, 4)], {"equation": "ij->ji"}, name="-transpose"),
    # Activations added for MobileNetV3 (HardSigmoid, HardSwish) and rotary embeddings (Sin, Cos).
    # The range (-4, 4) covers both kinks of the hard functions; random points miss them.
    Spec("HardSigmoid", [(3, 4)], ranges={0: (-4.0, 4.0)}),
    Spec("HardSigmoid", [(3, 4)], {"alpha": 1 / 6, "beta": 0.5}, ranges={0: (-4.0, 4.0)}, name="-torch"),
    Spec("HardSwish", [(4, 5)], ranges={0: (-4.0, 4.0)}),
    Spec("Reciprocal", [(3, 4)], ranges={0: AWAY_FROM_ZERO}),
    Spec("Sin", [(3, 4)]),
    Spec("Cos", [(3, 4)]),
    # Normalizations the exporters write for torch's GroupNorm, and nearest upsampling.
    Spec("InstanceNormalization", [(2, 3, 4, 5), (3,), (3,)], {"epsilon": 0.1}, dtype=np.float32, eps=1e-2, rtol=2e-3),
    Spec("InstanceNormalization", [(2, 3, 6), (3,), (3,)], dtype=np.float32, eps=1e-2, rtol=2e-3, name="-1d"),
    # GroupNormalization-21 (18's per-group scale is deprecated: onnx.checker rejects it).
    # stash_type=11 makes onnxruntime compute the statistics in float64.
    Spec("GroupNormalization", [(2, 6, 3, 2), (6,), (6,)], {"num_groups": 3, "stash_type": 11}, opset=21,
         declare_outputs=True),
    Spec("GroupNormalization", [(2, 4, 5), (4,), (4,)], {"num_groups": 2, "epsilon": 0.1}, opset=21,
         declare_outputs=True, dtype=np.float32, eps=1e-2, rtol=2e-3, name="-float32"),
    *(
        Spec("Resize", [(2, 3, 4, 5), None, scales, sizes], attrs, dtype=np.float32, eps=0.5, rtol=1e-4, name=name)
        for scales, sizes, attrs, name in [
            (
                np.array([1, 1, 2, 3], dtype=np.float32),
                None,
                {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
                "-torch-nearest",
            ),
            (None, np.array([2, 3, 8, 10]), {"mode": "nearest"}, "-half-pixel-sizes"),
        ]
    ),
    # Opset 23's Attention (4-D Q, K, V): masks, causal, grouped-query heads.
    Spec("Attention", [(2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 6)], opset=23),
    Spec("Attention", [(2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 4), (3, 5)], {"scale": 0.7}, opset=23,
         name="-float-mask"),
    Spec("Attention", [(1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4), np.array([[True, False, True]] * 3)], opset=23,
         name="-bool-mask"),
    Spec("Attention", [(2, 2, 4, 3), (2, 2, 4, 3), (2, 2, 4, 3)], {"is_causal": 1}, opset=23, name="-causal"),
    Spec("Attention", [(2, 4, 3, 4), (2, 2, 5, 4), (2, 2, 5, 4)], opset=23, name="-grouped-query"),
    # Sequences: SplitToSequence, then SequenceAt at constant positions (dynamo's `split`/`chunk`).
    *(
        Spec(
            op,
            [shape, split],
            pattern=[
                onnx.helper.make_node(
                    "SplitToSequence", ["in0", "in1"] if split is not None else ["in0"], ["seq"], **attrs
                ),
                *(
                    node
                    for j, position in enumerate(positions)
                    for node in (
                        onnx.helper.make_node(
                            "Constant", [], [f"at{j}"], value=onnx.helper.make_tensor("v", 7, [], [position])
                        ),
                        onnx.helper.make_node("SequenceAt", ["seq", f"at{j}"], [f"y{j}"]),
                    )
                ),
            ],
            pattern_outputs=tuple(f"y{j}" for j in range(len(positions))),
            wrt=(0,),
            name=name,
        )
        for op, shape, split, attrs, positions, name in [
            ("SplitToSequence", (2, 12), np.array([3, 5, 4]), {"axis": 1}, [0, -1, 0], "-sizes-repeat"),
            ("SplitToSequence", (2, 12), np.array(5), {"axis": -1}, [2, 0], "-chunks-short-last"),
            ("SequenceAt", (3, 4), None, {"axis": 0, "keepdims": 0}, [1, 2], "-unbind"),
            ("SequenceAt", (4, 3), None, {"axis": 0}, [3], "-keepdims"),
        ]
    ),
    # The rest of the activation set (rules/activation_set.py). onnxruntime has Celu in float32 only.
    # Points within a step of a kink (ThresholdedRelu's alpha, Shrink's +-lambd) would fail: seed 0's
    # inputs are not.
    Spec("Elu", [(3, 4)]),
    Spec("Elu", [(3, 4)], {"alpha": 0.5}, name="-alpha"),
    Spec("Selu", [(3, 4)]),
    Spec("Selu", [(3, 4)], {"alpha": 1.5, "gamma": 0.8}, name="-alpha-gamma"),
    Spec("Celu", [(3, 4)], {"alpha": 0.7}, dtype=np.float32, eps=1e-2, rtol=1e-3),
    Spec("PRelu", [(3, 4), (4,)]),
    Spec("PRelu", [(2, 3, 4, 5), (3, 1, 1)], name="-per-channel"),
    Spec("PRelu", [(2, 3), (1,)], name="-shared-slope"),
    Spec("PRelu", [(3, 4), (3, 4)], wrt=(1,), name="-slope-only"),
    Spec("Softplus", [(3, 4)]),
    Spec("Softsign", [(3, 4)]),
    Spec("Mish", [(3, 4)]),
    Spec("Swish", [(3, 4)], {"alpha": 0.8}, opset=24),
    Spec("ThresholdedRelu", [(3, 4)], {"alpha": 0.5}),
    Spec("ThresholdedRelu", [(3, 4)], ranges={0: (-3.0, 3.0)}, name="-default-alpha"),
    # onnxruntime computes Shrink in float32 even for float64 (x - bias is off by 4e-9): a float32
    # spec with a step that crosses no kink (piecewise linear: central differences are exact).
    Spec("Shrink", [(3, 4)], dtype=np.float32, eps=1e-2, rtol=1e-4),
    Spec("Shrink", [(3, 4)], {"lambd": 0.7, "bias": 0.3}, dtype=np.float32, eps=1e-2, rtol=1e-4, name="-soft"),
    # The rest of the Reduce family (rules/reduce.py).
    Spec("ReduceSumSquare", [(3, 4), np.array([1])]),
    Spec("ReduceSumSquare", [(2, 3, 4)], {"keepdims": 0}, name="all-axes"),
    Spec("ReduceL1", [(3, 4), np.array([0])], {"keepdims": 0}),
    Spec("ReduceL1", [(3, 4)], {"noop_with_empty_axes": 1}, name="noop"),
    Spec("ReduceL2", [(2, 3, 4), np.array([0, 1])]),
    Spec("ReduceL2", [(3, 4), np.array([-1])], {"keepdims": 0}),
    Spec("ReduceL2", [(3, 4)], {"keepdims": 0}, name="all-axes"),
    Spec("ReduceLogSum", [(3, 4), np.array([1])], ranges={0: POSITIVE}),
    Spec("ReduceLogSum", [(2, 3, 4), np.array([0, 2])], {"keepdims": 0}, ranges={0: POSITIVE}),
    Spec("ReduceLogSumExp", [(3, 4), np.array([1])]),
    Spec("ReduceLogSumExp", [(2, 3, 4)], {"keepdims": 0}, name="all-axes"),
    Spec("ReduceProd", [(3, 4), np.array([1])]),
    Spec("ReduceProd", [(2, 3, 4), np.array([0, 2])], {"keepdims": 0}),
    Spec("ReduceProd", [(2, 3)], {"noop_with_empty_axes": 1}, name="noop"),
    # PixelShuffle / PixelUnshuffle (rules/shape_ops.py).
    Spec("DepthToSpace", [(2, 8, 3, 2)], {"blocksize": 2}, name="-dcr"),
    Spec("DepthToSpace", [(2, 18, 2, 3)], {"blocksize": 3, "mode": "CRD"}, name="-crd"),
    Spec("SpaceToDepth", [(2, 3, 4, 6)], {"blocksize": 2}),
    # GatherND (rules/indexing.py): repeated and negative tuples, batch_dims, and the exporters'
    # boolean-mask indexing x[mask] (NonZero -> Transpose -> GatherND; the mask gets no gradient).
    Spec("GatherND", [(3, 4, 5), np.array([[0, 1], [2, -1], [0, 1]])], name="-repeats-negative"),
    Spec("GatherND", [(3, 4), np.array([[[2, 3]], [[0, 0]]])], name="-full-tuples"),
    Spec("GatherND", [(2, 3, 4), np.array([[[1], [-1]], [[0], [1]]])], {"batch_dims": 1}, name="-batch-dims-1"),
    Spec("GatherND", [(2, 3, 4, 5), np.array([[[1], [3]], [[0], [0]], [[2], [-4]]]).reshape(2, 3, 1)],
         {"batch_dims": 2}, name="-batch-dims-2"),
    Spec(
        "GatherND",
        [(3, 4, 5), np.array([[True, False, True, True], [False, False, True, False], [True, True, False, True]])],
        pattern=[
            onnx.helper.make_node("NonZero", ["in1"], ["nonzero"]),
            onnx.helper.make_node("Transpose", ["nonzero"], ["positions"], perm=[1, 0]),
            onnx.helper.make_node("GatherND", ["in0", "positions"], ["y"]),
        ],
        pattern_outputs=("y",),
        wrt=(0,),
        name="-boolean-mask",
    ),
    # LSTM and GRU (rules/lstm_gru.py): onnxruntime runs them in float32 only. Inputs are X, W, R, B,
    # sequence_lens, initial_h (, initial_c); hidden size 2, T=3, B=2. Every direction, sequence
    # lengths, the initial states, and a subset of the outputs read. onnxruntime refuses layout=1
    # (batch-major) LSTM/GRU nodes: tests/test_autodiff_recurrent.py checks that layout on onnx's
    # reference evaluator.
    *(
        Spec(op, inputs, {"hidden_size": 2, **attrs}, outputs=outputs, loss_outputs=loss, ranges=RNN_RANGES,
             dtype=np.float32, eps=1e-2, rtol=2e-3, name=name)
        for op, inputs, attrs, outputs, loss, name in [
            ("LSTM", [(3, 2, 3), (1, 8, 3), (1, 8, 2), (1, 16), None, (1, 2, 2), (1, 2, 2)], {}, 3, None,
             "-forward-states"),
            ("LSTM", [(3, 2, 3), (2, 8, 3), (2, 8, 2)], {"direction": "bidirectional"}, 3, None,
             "-bidirectional-no-bias"),
            ("LSTM", [(3, 2, 3), (1, 8, 3), (1, 8, 2), (1, 16), np.array([3, 2], np.int32), (1, 2, 2), (1, 2, 2)],
             {"direction": "reverse"}, 3, None, "-reverse-lens"),
            ("LSTM", [(3, 2, 3), (2, 8, 3), (2, 8, 2), (2, 16), np.array([1, 3], np.int32), (2, 2, 2), (2, 2, 2)],
             {"direction": "bidirectional"}, 3, None, "-bidirectional-lens"),
            ("LSTM", [(3, 2, 3), (1, 8, 3), (1, 8, 2), (1, 16)], {}, 3, (0,), "-y-only"),
            ("LSTM", [(3, 2, 3), (2, 8, 3), (2, 8, 2), (2, 16), None, (2, 2, 2), (2, 2, 2)],
             {"direction": "bidirectional"}, 3, (1, 2), "-final-states-only"),
            ("GRU", [(3, 2, 3), (2, 6, 3), (2, 6, 2), (2, 12), None, (2, 2, 2)],
             {"direction": "bidirectional", "linear_before_reset": 1}, 2, None, "-bidirectional-torch"),
            ("GRU", [(3, 2, 3), (1, 6, 3), (1, 6, 2), (1, 12), None, (1, 2, 2)], {}, 2, None, "-reset-after"),
            ("GRU", [(3, 2, 3), (1, 6, 3), (1, 6, 2)], {"direction": "reverse"}, 2, None, "-reverse-no-bias"),
            ("GRU", [(3, 2, 3), (2, 6, 3), (2, 6, 2), (2, 12), np.array([3, 1], np.int32), (2, 2, 2)],
             {"direction": "bidirectional"}, 2, None, "-bidirectional-lens"),
            ("GRU", [(3, 2, 3), (1, 6, 3), (1, 6, 2), (1, 12), np.array([2, 3], np.int32)],
             {"direction": "reverse", "linear_before_reset": 1}, 2, None, "-reverse-lens-torch"),
        ]
    ),
    # dynamo's GRU without its Y output (only the final state is read): the rule switches Y on.
    Spec(
        "GRU",
        [(3, 2, 3), (2, 6, 3), (2, 6, 2), (2, 12)],
        pattern=[onnx.helper.make_node("GRU", ["in0", "in1", "in2", "in3"], ["", "y"], hidden_size=2,
                                       direction="bidirectional", linear_before_reset=1)],
        pattern_outputs=("y",),
        ranges=RNN_RANGES,
        dtype=np.float32,
        eps=1e-2,
        rtol=2e-3,
        name="-no-y-output",
    ),
]


def _input_name(index: int) -> str:
    return f"in{index}"


def _graph_input(name: str, array: np.ndarray, symbolic: bool) -> onnx.ValueInfoProto:
    dims = [f"{name}_d{j}" for j in range(array.ndim)] if symbolic else list(array.shape)
    return onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(array.dtype), dims)


def _output_names(spec: Spec) -> list[str]:
    return ["y"] + [f"y{j}" for j in range(1, spec.outputs)]


def _forward_model(
    spec: Spec, feeds: dict[str, np.ndarray], cotangents: dict[int, np.ndarray] | None, symbolic: bool
):
    """The one-node model; with cotangents c_j, also loss = sum_j ReduceSum(y_j * c_j)."""
    inputs, initializers, names = [], [], []
    for i, entry in enumerate(spec.inputs):
        name = _input_name(i)
        if entry is None:  # an omitted optional input
            names.append("")
            continue
        names.append(name)
        if isinstance(entry, np.ndarray):
            initializers.append(onnx.numpy_helper.from_array(entry, name))
        else:
            inputs.append(_graph_input(name, feeds[name], symbolic))
    if spec.pattern is not None:
        out_names = list(spec.pattern_outputs)
        nodes = list(spec.pattern)
    else:
        out_names = _output_names(spec)
        nodes = [onnx.helper.make_node(spec.op, names, out_names, name="op", **spec.attrs)]
    if cotangents is None:
        outputs = [onnx.helper.make_value_info(n, onnx.TypeProto()) for n in out_names]
    else:
        terms = []
        for j, cotangent in cotangents.items():
            initializers.append(onnx.numpy_helper.from_array(cotangent, f"c{j}"))
            nodes += [
                onnx.helper.make_node("Mul", [out_names[j], f"c{j}"], [f"yc{j}"], name=f"weigh{j}"),
                onnx.helper.make_node("ReduceSum", [f"yc{j}"], [f"term{j}"], name=f"sum{j}", keepdims=0),
            ]
            terms.append(f"term{j}")
        nodes.append(onnx.helper.make_node("Sum", terms, ["loss"], name="loss"))
        dtype = next(iter(cotangents.values())).dtype
        if spec.declare_outputs:
            value_info = [
                onnx.helper.make_tensor_value_info(
                    out_names[j], onnx.helper.np_dtype_to_tensor_dtype(c.dtype), [None] * c.ndim
                )
                for j, c in cotangents.items()
            ]
        outputs = [
            onnx.helper.make_tensor_value_info("loss", onnx.helper.np_dtype_to_tensor_dtype(dtype), [])
        ]
    graph = onnx.helper.make_graph(nodes, "spec", inputs, outputs, initializers)
    if cotangents is not None and spec.declare_outputs:
        graph.value_info.extend(value_info)
    opsets = [onnx.helper.make_opsetid("", spec.opset)]
    return onnx.helper.make_model(graph, ir_version=10, opset_imports=opsets)


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_vjp_matches_finite_differences(spec: Spec, symbolic: bool):
    rng = np.random.default_rng(0)
    feeds = {
        _input_name(i): np.asarray(rng.uniform(*spec.ranges.get(i, (-2.0, 2.0)), size=entry)).astype(
            spec.dtype
        )
        for i, entry in enumerate(spec.inputs)
        if isinstance(entry, tuple)
    }
    wrt_names = [_input_name(i) for i in spec.wrt] if spec.wrt is not None else list(feeds)
    ys = _session(_forward_model(spec, feeds, None, symbolic)).run(None, feeds)
    loss_outputs = spec.loss_outputs
    if loss_outputs is None:
        loss_outputs = tuple(j for j, y in enumerate(ys) if np.issubdtype(y.dtype, np.floating))
    cotangents = {j: rng.standard_normal(ys[j].shape).astype(ys[j].dtype) for j in loss_outputs}

    model = onnx.shape_inference.infer_shapes(
        _forward_model(spec, feeds, cotangents, symbolic), strict_mode=True
    )
    ir_model = ir.serde.deserialize_model(model)
    graph = ir_model.graph
    values = {v.name: v for v in graph.inputs}
    loss = graph.outputs[0]
    result = build_gradients(graph, loss, [values[n] for n in wrt_names])
    graph.outputs.extend(result.grads[values[n]] for n in wrt_names)
    add_op_functions(ir_model)
    grad_model = ir.serde.serialize_model(ir_model)
    onnx.checker.check_model(grad_model, full_check=True)
    session = _session(grad_model)

    loss_value, *grads = session.run(None, feeds)
    for name, grad in zip(wrt_names, grads):
        assert grad.shape == feeds[name].shape, f"gradient of {name} has the wrong shape"
        assert grad.dtype == feeds[name].dtype

    direction = {n: rng.standard_normal(feeds[n].shape) for n in wrt_names}

    def moved(step: float) -> dict[str, np.ndarray]:
        return {
            n: np.asarray(v + step * direction[n]).astype(v.dtype) if n in direction else v
            for n, v in feeds.items()
        }

    plus, minus = moved(spec.eps), moved(-spec.eps)
    # The step actually taken (float32 inputs round it), so the comparison stays exact for
    # linear and quadratic functions.
    taken = {
        n: (plus[n].astype(np.float64) - minus[n].astype(np.float64)) / (2 * spec.eps) for n in wrt_names
    }
    vjp = sum(float(np.sum(taken[n] * g.astype(np.float64))) for n, g in zip(wrt_names, grads))

    def loss_at(feed: dict[str, np.ndarray]) -> float:
        return float(session.run([loss.name], feed)[0])

    finite_difference = (loss_at(plus) - loss_at(minus)) / (2 * spec.eps)
    np.testing.assert_allclose(vjp, finite_difference, rtol=spec.rtol, atol=spec.rtol * 1e-3)


def test_every_rule_has_a_spec():
    missing = registered_ops() - {s.op for s in SPECS}
    assert not missing, f"gradient rules without a finite-difference spec: {sorted(missing)}"


def test_docs_list_every_rule_and_non_differentiable_op():
    documented = set(re.findall(r"`(\w+)`", (Path(__file__).parents[1] / "docs" / "ops.md").read_text()))
    missing = (registered_ops() | non_differentiable_ops()) - documented
    assert not missing, f"ops missing from docs/ops.md: {sorted(missing)}"


def test_rules_and_non_differentiable_ops_are_disjoint():
    assert not registered_ops() & non_differentiable_ops()


def test_check_supported_lists_every_unsupported_node_at_once():
    # x -> Foo -> Bar -> Foo -> loss, plus a Bar off the path (from a non-parameter input): the
    # error names all three nodes on the path, both op types, and not the off-path node.
    model = onnx.parser.parse_model(
        """
        <ir_version: 10, opset_import: ["" : 18, "test.custom" : 1]>
        g (float[3] x, float[3] other) => (float loss, float[3] side) {
            a = test.custom.Foo (x)
            b = test.custom.Bar (a)
            c = test.custom.Foo (b)
            s = Shape (c)
            r = Reshape (c, s)
            loss = ReduceSum <keepdims = 0> (r)
            side = test.custom.Bar (other)
        }
        """
    )
    graph = ir.serde.deserialize_model(model).graph
    for node, name in zip(graph, ["foo1", "bar1", "foo2", "shape", "reshape", "loss", "bar_off_path"]):
        node.name = name
    x = graph.inputs[0]
    with pytest.raises(UnsupportedOpsError) as caught:
        check_supported(graph, graph.outputs[0], [x])
    assert sorted(caught.value.nodes) == [
        ("test.custom::Bar", "bar1"),
        ("test.custom::Foo", "foo1"),
        ("test.custom::Foo", "foo2"),
    ]
    message = str(caught.value)
    for text in ("test.custom::Foo", "test.custom::Bar", "'foo1'", "'foo2'", "'bar1'", "docs/ops.md"):
        assert text in message
    assert "bar_off_path" not in message
    # Nothing differentiable reaches the loss from `other`, so nothing is unsupported there.
    check_supported(graph, graph.outputs[0], [graph.inputs[1]])
