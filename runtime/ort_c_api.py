"""onnxruntime's C API as runtime/ort_custom_ops.py uses it through ctypes: the OrtApi functions it
calls (by their index in the table), the OrtCustomOp struct it fills (versions 16 and 18), and the
versions for which that layout holds. Layout only; what the ops do is ort_custom_ops.py's."""

from __future__ import annotations

import ctypes

# onnxruntime's C API as used here (include/onnxruntime/core/session/onnxruntime_c_api.h).
# Why 1.16 <= version < 2: the indices below are OrtApi version 16's table, and OrtCustomOp is filled
# up to its version-16 fields. Within major version 1 that C API only grows: OrtApi gains functions
# at its end and never moves one (onnxruntime_c_api.cc static_asserts each version's slots), and an
# OrtCustomOp is read only up to the version it states, so every 1.x from 1.16 on serves this layout.
# Before 1.16 functions are missing; a major 2 may break the ABI (semantic versioning): refused.
KNOWN_VERSIONS = ((1, 16), (2, 0))  # [first, past the last) (major, minor) of onnxruntime
API_VERSION = 16  # the OrtApi asked for: every function below exists from 1.16 on
OP_VERSION = 16  # OrtCustomOp.version: fields up to KernelComputeV2 are read (below)
# An op with in-place hints (PythonOp.may_inplace) states version 18 and fills the fields up to
# ReleaseAliasMap, where onnxruntime has C API 18 (1.18 on); elsewhere it goes in as version 16,
# without the hints (its outputs then get buffers of their own: slower, the same results).
INPLACE_OP_VERSION = 18
INT_MAX = 2**31 - 1
ORT_FAIL = 1  # OrtErrorCode
INPUT_OUTPUT_REQUIRED = 0  # OrtCustomOpInputOutputCharacteristic
MEM_TYPE_DEFAULT = 0  # OrtMemType: the provider's own memory (the device, for the CUDA EP)

_status = ctypes.c_void_p  # OrtStatus*: NULL is success
_vp, _sz = ctypes.c_void_p, ctypes.c_size_t
# OrtApi member -> (index in the table of function pointers, return type, argument types).
_API = {
    "CreateStatus": (0, _status, [ctypes.c_int, ctypes.c_char_p]),
    "GetErrorMessage": (2, ctypes.c_char_p, [_status]),
    "CreateCustomOpDomain": (26, _status, [ctypes.c_char_p, ctypes.POINTER(_vp)]),
    "CustomOpDomain_Add": (27, _status, [_vp, _vp]),
    "AddCustomOpDomain": (28, _status, [_vp, _vp]),
    "GetTensorMutableData": (51, _status, [_vp, ctypes.POINTER(_vp)]),
    "GetTensorTypeAndShape": (65, _status, [_vp, ctypes.POINTER(_vp)]),
    "GetTensorElementType": (60, _status, [_vp, ctypes.POINTER(ctypes.c_int)]),
    "GetDimensionsCount": (61, _status, [_vp, ctypes.POINTER(_sz)]),
    "GetDimensions": (62, _status, [_vp, ctypes.POINTER(ctypes.c_int64), _sz]),
    "ReleaseTensorTypeAndShapeInfo": (99, None, [_vp]),
    "KernelContext_GetInput": (90, _status, [_vp, _sz, ctypes.POINTER(_vp)]),
    "KernelContext_GetOutput": (91, _status, [_vp, _sz, ctypes.POINTER(ctypes.c_int64), _sz, ctypes.POINTER(_vp)]),
    "ReleaseStatus": (93, None, [_status]),
    "KernelContext_GetGPUComputeStream": (193, _status, [_vp, ctypes.POINTER(_vp)]),
}

_OpP = ctypes.c_void_p  # const OrtCustomOp*, as the callbacks receive it
FIELDS = [  # OrtCustomOp, in order, up to OP_VERSION's last field
    ("CreateKernel", ctypes.CFUNCTYPE(_vp, _OpP, _vp, _vp)),
    ("GetName", ctypes.CFUNCTYPE(_vp, _OpP)),
    ("GetExecutionProviderType", ctypes.CFUNCTYPE(_vp, _OpP)),
    ("GetInputType", ctypes.CFUNCTYPE(ctypes.c_int, _OpP, _sz)),
    ("GetInputTypeCount", ctypes.CFUNCTYPE(_sz, _OpP)),
    ("GetOutputType", ctypes.CFUNCTYPE(ctypes.c_int, _OpP, _sz)),
    ("GetOutputTypeCount", ctypes.CFUNCTYPE(_sz, _OpP)),
    ("KernelCompute", ctypes.CFUNCTYPE(None, _vp, _vp)),
    ("KernelDestroy", ctypes.CFUNCTYPE(None, _vp)),
    ("GetInputCharacteristic", ctypes.CFUNCTYPE(ctypes.c_int, _OpP, _sz)),
    ("GetOutputCharacteristic", ctypes.CFUNCTYPE(ctypes.c_int, _OpP, _sz)),
    ("GetInputMemoryType", ctypes.CFUNCTYPE(ctypes.c_int, _OpP, _sz)),
    ("GetVariadicInputMinArity", ctypes.CFUNCTYPE(ctypes.c_int, _OpP)),
    ("GetVariadicInputHomogeneity", ctypes.CFUNCTYPE(ctypes.c_int, _OpP)),
    ("GetVariadicOutputMinArity", ctypes.CFUNCTYPE(ctypes.c_int, _OpP)),
    ("GetVariadicOutputHomogeneity", ctypes.CFUNCTYPE(ctypes.c_int, _OpP)),
    ("CreateKernelV2", ctypes.CFUNCTYPE(_status, _OpP, _vp, _vp, ctypes.POINTER(_vp))),
    ("KernelComputeV2", ctypes.CFUNCTYPE(_status, _vp, _vp)),
]


FIELDS_18 = [  # OrtCustomOp's fields after KernelComputeV2, to INPLACE_OP_VERSION's last
    ("InferOutputShapeFn", ctypes.c_void_p),  # NULL: the shapes come from the graph's value_info
    ("GetStartVersion", ctypes.CFUNCTYPE(ctypes.c_int, _OpP)),
    ("GetEndVersion", ctypes.CFUNCTYPE(ctypes.c_int, _OpP)),
    # size_t (*)(int** input_index, int** output_index): no op argument, so one function per op.
    ("GetMayInplace", ctypes.CFUNCTYPE(_sz, ctypes.POINTER(ctypes.POINTER(ctypes.c_int)),
                                       ctypes.POINTER(ctypes.POINTER(ctypes.c_int)))),
    ("ReleaseMayInplace", ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))),
    ("GetAliasMap", ctypes.c_void_p),  # NULL: no output is always an alias
    ("ReleaseAliasMap", ctypes.c_void_p),
]


class OrtCustomOp(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), *FIELDS]


class OrtCustomOp18(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), *FIELDS, *FIELDS_18]


class OrtCApi:
    """The OrtApi functions of ``_API``, as ctypes functions, from the table ``api`` points to."""

    def __init__(self, api: int):
        table = ctypes.cast(api, ctypes.POINTER(ctypes.c_void_p))
        for name, (index, restype, argtypes) in _API.items():
            setattr(self, name, ctypes.CFUNCTYPE(restype, *argtypes)(table[index]))

    def check(self, status, what: str) -> None:
        """Raise for a failed call (a non-NULL OrtStatus), with onnxruntime's message."""
        if status:
            message = self.GetErrorMessage(status).decode(errors="replace")
            self.ReleaseStatus(status)
            raise RuntimeError(f"onnxruntime {what}: {message}")
