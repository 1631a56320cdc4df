"""cuDNN through ctypes: the few calls of its (legacy, still shipped in cuDNN 9) convolution API
the native Conv gradients use, on the cuDNN library onnxruntime-gpu itself loads.

Why ctypes: CuPy no longer wraps cuDNN, and the library is already in the process (onnxruntime's CUDA
EP links it; ``onnxruntime.preload_dlls`` loads it from the nvidia-cudnn wheel), so binding the calls
we need costs no dependency. Every call's status is checked; a failure names the call and cuDNN's
message.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

from runtime.errors import RunError

# cudnnDataType_t, cudnnTensorFormat_t, cudnnConvolutionMode_t, cudnnMathType_t (cudnn_graph.h).
DATA_FLOAT = 0
DATA_HALF = 2
DATA_BFLOAT16 = 9
TENSOR_NCHW = 0
CROSS_CORRELATION = 1
DEFAULT_MATH = 0  # tensor cores allowed: TF32 for float32 data
TENSOR_OP_MATH = 1  # tensor cores allowed: what half and bfloat16 data run on (float accumulation)
FMA_MATH = 3  # no tensor cores: exact float32 FMAs
BWD_FILTER_ALGOS = 7  # cudnnConvolutionBwdFilterAlgo_t values 0..6
BWD_DATA_ALGOS = 6  # cudnnConvolutionBwdDataAlgo_t values 0..5
WORKSPACE_LIMIT = 256 << 20  # bytes an algorithm may need; cuDNN's fastest ResNet ones need far less
# cuDNN's Find times each algorithm once, and for the bf16 ResNet-18 convolutions the fastest few are
# within that one run's noise of each other: which one won moved from run to run, and with it the
# step and the workspace (one H200, 1.16 to 1.29 GiB over four runs, h200-s45 to h200-s48). Each
# algorithm's median over FIND_RUNS Finds picks the same ones every run: 5.96 and 5.98 ms, 0.198 GiB
# in CuPy's pool, against 6.25 to 6.28 ms and 0.28 to 0.32 GiB from one Find (runs h200-s59,
# h200-s60), for 2.2 s more in the first step.
FIND_RUNS = 5
STATUS_SUCCESS = 0


class BwdFilterAlgoPerf(ctypes.Structure):
    """cudnnConvolutionBwdFilterAlgoPerf_t, and cudnnConvolutionBwdDataAlgoPerf_t (the same fields)."""

    _fields_ = [("algo", ctypes.c_int), ("status", ctypes.c_int), ("time", ctypes.c_float),
                ("memory", ctypes.c_size_t), ("determinism", ctypes.c_int), ("mathType", ctypes.c_int),
                ("reserved", ctypes.c_int * 3)]


_LIBRARY: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """libcudnn.so.9: the copy already loaded (onnxruntime's), else one from an nvidia-cudnn wheel."""
    global _LIBRARY
    if _LIBRARY is None:
        candidates = ["libcudnn.so.9"]
        for base in sys.path:
            candidates += sorted(glob.glob(os.path.join(base, "nvidia", "cudnn*", "lib", "libcudnn.so.9")))
        errors = []
        for name in candidates:
            try:
                _LIBRARY = ctypes.CDLL(name)
                break
            except OSError as exc:
                errors.append(str(exc))
        else:
            raise RunError("the GPU backend's native Conv gradients need cuDNN 9 (libcudnn.so.9), which onnxruntime-gpu "
                           f"uses too; not found ({errors[0] if errors else 'no candidates'})")
    return _LIBRARY


def check(status: int, call: str) -> None:
    if status != STATUS_SUCCESS:
        lib = library()
        lib.cudnnGetErrorString.restype = ctypes.c_char_p
        raise RunError(f"cuDNN {call} failed: {lib.cudnnGetErrorString(status).decode()} (status {status})")


def call(name: str, *args) -> None:
    check(getattr(library(), name)(*args), name)


def _ints(values) -> ctypes.Array:
    return (ctypes.c_int * len(values))(*[int(v) for v in values])


class Handle:
    """A cuDNN handle bound to one CUDA stream (the backend's compute stream)."""

    def __init__(self, stream_ptr: int):
        self.ptr = ctypes.c_void_p()
        call("cudnnCreate", ctypes.byref(self.ptr))
        call("cudnnSetStream", self.ptr, ctypes.c_void_p(stream_ptr))


def tensor_descriptor(dims, data_type: int = DATA_FLOAT) -> ctypes.c_void_p:
    """A packed (C-contiguous) tensor of ``dims`` (4 or 5 of them) of ``data_type`` (float32 unless said)."""
    desc = ctypes.c_void_p()
    call("cudnnCreateTensorDescriptor", ctypes.byref(desc))
    strides, running = [], 1
    for dim in reversed(dims):
        strides.insert(0, running)
        running *= int(dim)
    call("cudnnSetTensorNdDescriptor", desc, data_type, len(dims), _ints(dims), _ints(strides))
    return desc


def filter_descriptor(dims, data_type: int = DATA_FLOAT) -> ctypes.c_void_p:
    desc = ctypes.c_void_p()
    call("cudnnCreateFilterDescriptor", ctypes.byref(desc))
    call("cudnnSetFilterNdDescriptor", desc, data_type, TENSOR_NCHW, len(dims), _ints(dims))
    return desc


def convolution_descriptor(pads, strides, dilations, *, tf32: bool, data_type: int = DATA_FLOAT) -> ctypes.c_void_p:
    """A cross-correlation over tensors of ``data_type``, its compute type float32 whatever that is:
    half and bfloat16 data in cuDNN's "pseudo" configurations (products accumulated in float32, the
    result rounded once; the compute type PyTorch's and onnxruntime's legacy-API Convs give half data)
    with tensor-core math (as both set for half); float32 data in TF32 on tensor cores with ``tf32``,
    else in exact float32 FMAs."""
    desc = ctypes.c_void_p()
    call("cudnnCreateConvolutionDescriptor", ctypes.byref(desc))
    call("cudnnSetConvolutionNdDescriptor", desc, len(pads), _ints(pads), _ints(strides), _ints(dilations),
         CROSS_CORRELATION, DATA_FLOAT)
    if data_type == DATA_FLOAT:
        math = DEFAULT_MATH if tf32 else FMA_MATH
    elif data_type in (DATA_HALF, DATA_BFLOAT16):
        math = TENSOR_OP_MATH
    else:
        raise RunError(f"cuDNN convolution descriptor: data type {data_type} is none of float32, half, bfloat16")
    call("cudnnSetConvolutionMathType", desc, math)
    return desc


def destroy_tensors(*descs) -> None:
    """Free descriptors ``tensor_descriptor`` made."""
    for desc in descs:
        call("cudnnDestroyTensorDescriptor", desc)


def destroy(x_desc, dy_desc, conv, dw_desc) -> None:
    """Free a Conv weight gradient's descriptors (``tensor_descriptor``, ``convolution_descriptor``,
    ``filter_descriptor``)."""
    destroy_tensors(x_desc, dy_desc)
    call("cudnnDestroyConvolutionDescriptor", conv)
    call("cudnnDestroyFilterDescriptor", dw_desc)


def forward_output_dims(conv, x_desc, w_desc, rank: int) -> list[int]:
    dims = (ctypes.c_int * rank)()
    call("cudnnGetConvolutionNdForwardOutputDim", conv, x_desc, w_desc, rank, dims)
    return list(dims)


def backward_filter_workspace(handle: Handle, x_desc, dy_desc, conv, dw_desc, algo: int) -> int | None:
    """Bytes of workspace ``algo`` needs here, or None where it does not support the case."""
    size = ctypes.c_size_t()
    status = library().cudnnGetConvolutionBackwardFilterWorkspaceSize(handle.ptr, x_desc, dy_desc, conv, dw_desc,
                                                                       algo, ctypes.byref(size))
    return int(size.value) if status == STATUS_SUCCESS else None


def _found(name: str, algorithms: int, handle: Handle, *args) -> list[BwdFilterAlgoPerf]:
    """cuDNN's ``name`` (a Find...AlgorithmEx over ``args`` then the workspace): every algorithm that
    ran, fastest first."""
    results = (BwdFilterAlgoPerf * algorithms)()
    returned = ctypes.c_int()
    *tensors, workspace, workspace_bytes = args
    call(name, handle.ptr, *tensors, algorithms, ctypes.byref(returned), results, ctypes.c_void_p(workspace),
         ctypes.c_size_t(workspace_bytes))
    return [results[i] for i in range(returned.value) if results[i].status == STATUS_SUCCESS]


def find_backward_filter(handle: Handle, x_desc, x: int, dy_desc, dy: int, conv, dw_desc, dw: int,
                         workspace: int, workspace_bytes: int) -> list[BwdFilterAlgoPerf]:
    """Every algorithm that ran within ``workspace_bytes``, fastest first (cuDNN times them on these
    buffers; ``dw`` is overwritten)."""
    return _found("cudnnFindConvolutionBackwardFilterAlgorithmEx", BWD_FILTER_ALGOS, handle, x_desc, ctypes.c_void_p(x),
                  dy_desc, ctypes.c_void_p(dy), conv, dw_desc, ctypes.c_void_p(dw), workspace, workspace_bytes)


# alpha and beta: float for every data type but double (float32, half and bfloat16 alike).
_ONE = ctypes.c_float(1.0)
_ZERO = ctypes.c_float(0.0)


def backward_filter(handle: Handle, x_desc, x: int, dy_desc, dy: int, conv, algo: int, workspace: int,
                    workspace_bytes: int, dw_desc, dw: int) -> None:
    """dw = the weight gradient (beta 0: overwritten), enqueued on the handle's stream."""
    call("cudnnConvolutionBackwardFilter", handle.ptr, ctypes.byref(_ONE), x_desc, ctypes.c_void_p(x), dy_desc,
         ctypes.c_void_p(dy), conv, algo, ctypes.c_void_p(workspace), ctypes.c_size_t(workspace_bytes),
         ctypes.byref(_ZERO), dw_desc, ctypes.c_void_p(dw))


def backward_data_workspace(handle: Handle, w_desc, dy_desc, conv, dx_desc, algo: int) -> int | None:
    """Bytes of workspace backward-data ``algo`` needs here, or None where it does not support the case."""
    size = ctypes.c_size_t()
    status = library().cudnnGetConvolutionBackwardDataWorkspaceSize(handle.ptr, w_desc, dy_desc, conv, dx_desc, algo,
                                                                     ctypes.byref(size))
    return int(size.value) if status == STATUS_SUCCESS else None


def find_backward_data(handle: Handle, w_desc, w: int, dy_desc, dy: int, conv, dx_desc, dx: int,
                       workspace: int, workspace_bytes: int) -> list[BwdFilterAlgoPerf]:
    """Every backward-data algorithm that ran within ``workspace_bytes``, fastest first (``dx`` is
    overwritten)."""
    return _found("cudnnFindConvolutionBackwardDataAlgorithmEx", BWD_DATA_ALGOS, handle, w_desc, ctypes.c_void_p(w),
                  dy_desc, ctypes.c_void_p(dy), conv, dx_desc, ctypes.c_void_p(dx), workspace, workspace_bytes)


def fastest(cp, workspace_of, algorithms: int, find) -> BwdFilterAlgoPerf | None:
    """The fastest of ``algorithms`` that cuDNN's Find times within WORKSPACE_LIMIT bytes, by its
    median time over FIND_RUNS Finds (its ``time`` set to that median; only those most Finds timed
    count), or None: ``workspace_of(algo)`` is an algorithm's need (None where it does not apply),
    ``find(scratch, bytes)`` the Find call on a scratch workspace as large as the largest need that
    fits."""
    sizes = [workspace_of(algo) for algo in range(algorithms)]
    trial = max([size for size in sizes if size is not None and size <= WORKSPACE_LIMIT], default=0)
    # Straight from cudaMalloc and freed after (a first call, never captured): a block of CuPy's pool
    # would be split by later allocations and pin its chunk for the run. Where the device is full,
    # the pool's free blocks go back first (as the pool itself would retry).
    try:
        scratch = cp.cuda.memory.Memory(max(trial, 1))
    except (cp.cuda.memory.OutOfMemoryError, cp.cuda.runtime.CUDARuntimeError):  # cudaMalloc's failure
        cp.get_default_memory_pool().free_all_blocks()
        scratch = cp.cuda.memory.Memory(max(trial, 1))
    # Each (algorithm, math type) a candidate where most Finds timed it (one that ran once, and
    # failed in the others, has only that one timing: the noise the median is there to remove).
    timed: dict[tuple[int, int], tuple[BwdFilterAlgoPerf, list[float]]] = {}
    for _ in range(FIND_RUNS):
        for perf in find(scratch.ptr, trial):
            timed.setdefault((perf.algo, perf.mathType), (perf, []))[1].append(perf.time)
    best = None
    for perf, times in timed.values():
        if len(times) > FIND_RUNS // 2:
            perf.time = sorted(times)[len(times) // 2]
            if best is None or perf.time < best.time:
                best = perf
    return best


def backward_data(handle: Handle, w_desc, w: int, dy_desc, dy: int, conv, algo: int, workspace: int,
                  workspace_bytes: int, dx_desc, dx: int) -> None:
    """dx = the data gradient of a Conv with weight w (a ConvTranspose of dy), overwritten, enqueued
    on the handle's stream."""
    call("cudnnConvolutionBackwardData", handle.ptr, ctypes.byref(_ONE), w_desc, ctypes.c_void_p(w), dy_desc,
         ctypes.c_void_p(dy), conv, algo, ctypes.c_void_p(workspace), ctypes.c_size_t(workspace_bytes),
         ctypes.byref(_ZERO), dx_desc, ctypes.c_void_p(dx))


class CudnnContext:
    """The cuDNN handle (bound to the device's compute stream) and the workspace that every
    cuDNN runner of one device shares (GpuDevice.cudnn)."""

    def __init__(self, cp, stream):
        self.cp = cp
        self.handle = Handle(stream.ptr)
        self.workspace = None
        self.workspace_bytes = 0

    def reserve(self, nbytes: int) -> None:
        """A workspace of at least ``nbytes``; the old one is freed in stream order (CuPy's pool
        reuses a block only on the stream that freed it)."""
        if nbytes > self.workspace_bytes:
            self.workspace = self.cp.empty(nbytes, dtype='uint8')
            self.workspace_bytes = nbytes

    def pointer(self) -> int:
        return self.workspace.data.ptr if self.workspace is not None else 0
