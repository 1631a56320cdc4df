"""What NCCL is told about a buffer's element type (runtime/gpu/nccl.py), and the one arithmetic the
runtime does itself on a type CuPy lacks: the mean of a bfloat16 bucket after its sum."""

from __future__ import annotations

import functools

import numpy as np

from runtime.errors import RunError

# ncclBfloat16 (nccl.h, NCCL >= 2.10), where CuPy's module does not name it.
NCCL_BFLOAT16 = 9


def nccl_dtype(nccl, dtype: np.dtype) -> int:
    """NCCL's data type of a buffer of ``dtype``. A uint16 buffer is bfloat16's raw bits: CuPy has
    no bfloat16, and the runtime views a bfloat16 tensor as uint16 (--grad-dtype bf16's buckets;
    elementwise_steps.CUPY_DTYPES). A real UINT16 tensor never gets here for a reduction: the
    collectives inside the sessions take only float, bfloat16 and float16 tensors (in_session.TAKES),
    the cut's collectives reduce gradients, and a Broadcast or AllGather moves bits, whatever the type."""
    bf16 = getattr(nccl, "NCCL_BFLOAT16", NCCL_BFLOAT16)
    table = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
             np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.int64): nccl.NCCL_INT64,
             np.dtype(np.int32): nccl.NCCL_INT32, np.dtype(np.int8): nccl.NCCL_INT8,
             np.dtype(np.uint8): nccl.NCCL_UINT8, np.dtype(np.uint16): bf16}
    if np.dtype(dtype).name == "bfloat16":  # ml_dtypes' (onnx's numpy type for BFLOAT16)
        return bf16
    if np.dtype(dtype) not in table:
        raise RunError(f"NCCL cannot move dtype {np.dtype(dtype)}")
    return table[np.dtype(dtype)]


@functools.cache
def bf16_divide(cp):
    """``y = bf16(float(x) / n)`` on bfloat16 raw bits: what a bfloat16 division computes (the
    quotient of the widened values, rounded to nearest even once), as the CPU communicators' mean of
    a bfloat16 tensor (ml_dtypes) does. One kernel object: CuPy compiles it for each device it runs on."""
    from runtime.gpu.elementwise_steps import PREAMBLE

    return cp.ElementwiseKernel("uint16 x, float32 n", "uint16 y",
                                "y = gt_bf16_bits(gt_round_bf16(__fdiv_rn(gt_widen_bf16(x), n)))",
                                "graph_transpiler_bf16_mean", preamble=PREAMBLE)
