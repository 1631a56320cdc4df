"""Python kernels inside onnxruntime sessions: custom ops whose compute is a Python callable.

Why: a node the runtime runs itself (a cuDNN BatchNorm, a CuPy kernel) used to cut the step into one
more onnxruntime session before and after it. Each session costs a cuBLAS workspace and handles
(~21 MiB to 81 MiB on an H200), a host round trip between sessions, and its own CUDA graph. As a
custom op, the node runs inside the session that holds its neighbours, on that session's stream,
and is captured into the session's CUDA graph with the rest.

How: onnxruntime's Python API registers custom ops only from a shared library
(``SessionOptions.register_custom_ops_library``), which it opens and whose ``RegisterCustomOps``
it calls with the session options and its API table. That library (runtime/ort_custom_ops_build.py)
forwards the call to a Python function (a ctypes callback). Everything else is here, through ctypes
on onnxruntime's C API: the op domain, one ``OrtCustomOp`` per op, and the callbacks onnxruntime
makes into them. ``readiness(ort)`` decides once per process whether they may be used (a known C API
layout, the library, a self-test through the same table the CUDA EP uses); where it says no,
callers keep their nodes between onnxruntime sessions and say why, once.

Each op here is one node of one session: its ``name`` (the node's op_type, unique in the session's
domain), its input and output element types (ONNX's TensorProto codes, which are onnxruntime's),
and ``compute(ctx)``, called on onnxruntime's thread with a ``KernelContext``. An exception in
``compute`` fails the run with its message and the op's ``label`` (onnxruntime raises it from
``run``). No exception may leave a callback: ctypes would hand onnxruntime an undefined return value
(a garbage status pointer, which it frees), so every callback catches all of them.

Invariant: every ctypes object onnxruntime holds a pointer to (ops, callbacks, names, the hook)
lives as long as the process (``_KEEP``, module globals): a session may run until the process ends,
and onnxruntime never says when it is done with an op.
"""

from __future__ import annotations

import ctypes
import re
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from runtime.ort_c_api import (
    API_VERSION,
    FIELDS,
    FIELDS_18,
    INPLACE_OP_VERSION,
    INPUT_OUTPUT_REQUIRED,
    INT_MAX,
    KNOWN_VERSIONS,
    MEM_TYPE_DEFAULT,
    OP_VERSION,
    ORT_FAIL,
    OrtCApi,
    OrtCustomOp,
    OrtCustomOp18,
)
from runtime.ort_custom_ops_build import BuildError, load

_KEEP: list = []  # every ctypes object onnxruntime may still point to (the module docstring)
_OPS: dict[int, PythonOp] = {}  # address of an _OrtCustomOp -> its op
_PENDING: list[tuple[str, list]] = []  # (domain, ops) for the next RegisterCustomOps call


class KernelContext:
    """One compute call's inputs, outputs and stream (onnxruntime's OrtKernelContext)."""

    __slots__ = ("api", "context")

    def __init__(self, api: OrtCApi, context: int):
        self.api = api
        self.context = context

    def input_ptr(self, index: int) -> int:
        """The data pointer of input ``index`` (0 for an empty tensor)."""
        api, value, data = self.api, ctypes.c_void_p(), ctypes.c_void_p()
        api.check(api.KernelContext_GetInput(self.context, index, ctypes.byref(value)), f"input {index}")
        api.check(api.GetTensorMutableData(value, ctypes.byref(data)), f"input {index} data")
        return data.value or 0

    def input_shape(self, index: int) -> tuple[tuple[int, ...], int]:
        """(shape, element type) of input ``index``."""
        api, value, info = self.api, ctypes.c_void_p(), ctypes.c_void_p()
        api.check(api.KernelContext_GetInput(self.context, index, ctypes.byref(value)), f"input {index}")
        api.check(api.GetTensorTypeAndShape(value, ctypes.byref(info)), f"input {index} shape")
        try:
            rank, elem = ctypes.c_size_t(), ctypes.c_int()
            api.check(api.GetTensorElementType(info, ctypes.byref(elem)), f"input {index} type")
            api.check(api.GetDimensionsCount(info, ctypes.byref(rank)), f"input {index} rank")
            dims = (ctypes.c_int64 * max(rank.value, 1))()
            api.check(api.GetDimensions(info, dims, rank.value), f"input {index} dims")
            return tuple(dims[i] for i in range(rank.value)), elem.value
        finally:
            api.ReleaseTensorTypeAndShapeInfo(info)

    def output_ptr(self, index: int, shape: Sequence[int]) -> int:
        """Output ``index`` allocated by onnxruntime with ``shape``: its data pointer."""
        api, value, data = self.api, ctypes.c_void_p(), ctypes.c_void_p()
        dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        api.check(api.KernelContext_GetOutput(self.context, index, dims, len(shape), ctypes.byref(value)), f"output {index}")
        api.check(api.GetTensorMutableData(value, ctypes.byref(data)), f"output {index} data")
        return data.value or 0

    def gpu_stream(self) -> int:
        """The stream onnxruntime runs this node on (its compute stream; the user's, where set)."""
        api, stream = self.api, ctypes.c_void_p()
        api.check(api.KernelContext_GetGPUComputeStream(self.context, ctypes.byref(stream)), "compute stream")
        return stream.value or 0


@dataclass(eq=False)
class PythonOp:
    """One custom op: ``name`` (a node's op_type in the domain), its element types, the execution
    provider whose memory its inputs and outputs are in, and ``compute(ctx: KernelContext)``."""

    name: str
    input_types: list[int]
    output_types: list[int]
    compute: Callable[[KernelContext], None]
    provider: str = "CPUExecutionProvider"
    label: str = ""  # what an error names (the node, where it is); the op's name if empty
    # (input index, output index) pairs whose buffers onnxruntime may share, where the input is
    # dead after this node (OrtCustomOp's GetMayInplace): a hint, so compute must handle both.
    may_inplace: tuple[tuple[int, int], ...] = ()
    # The C strings GetName and GetExecutionProviderType hand onnxruntime (alive as long as the op).
    _c_name: ctypes.Array = field(init=False, repr=False)
    _c_provider: ctypes.Array = field(init=False, repr=False)

    def __post_init__(self):
        self._c_name = ctypes.create_string_buffer(self.name.encode())
        self._c_provider = ctypes.create_string_buffer(self.provider.encode())


def _guarded(default, function):
    """``function`` as a callback body that never raises (the module docstring): on an exception,
    its traceback goes to stderr and onnxruntime gets ``default``."""
    def body(*args):
        try:
            return function(*args)
        except BaseException:  # noqa: BLE001 - nothing may cross into onnxruntime
            traceback.print_exc()
            return default
    return body


def _string(field_name: str):
    """A getter of an op's C string (its address; the buffer lives as long as the op)."""
    return lambda op: ctypes.addressof(getattr(_OPS[op], field_name))


class _Callbacks:
    """The C functions every op's struct points to; each finds its op by the struct's address."""

    def __init__(self):
        self.api: OrtCApi | None = None
        self.inplace_api = False  # whether onnxruntime reads version-18 ops (C API 18)
        f = dict(FIELDS)
        bodies = {  # callback -> (its body, what onnxruntime gets if the body raises)
            "CreateKernel": (lambda op, api, info: op, None),
            "GetName": (_string("_c_name"), None),
            "GetExecutionProviderType": (_string("_c_provider"), None),
            "GetInputType": (lambda op, i: _OPS[op].input_types[i], 0),
            "GetInputTypeCount": (lambda op: len(_OPS[op].input_types), 0),
            "GetOutputType": (lambda op, i: _OPS[op].output_types[i], 0),
            "GetOutputTypeCount": (lambda op: len(_OPS[op].output_types), 0),
            "KernelDestroy": (lambda kernel: None, None),
            "GetInputCharacteristic": (lambda op, i: INPUT_OUTPUT_REQUIRED, INPUT_OUTPUT_REQUIRED),
            "GetOutputCharacteristic": (lambda op, i: INPUT_OUTPUT_REQUIRED, INPUT_OUTPUT_REQUIRED),
            "GetInputMemoryType": (lambda op, i: MEM_TYPE_DEFAULT, MEM_TYPE_DEFAULT),
            "GetVariadicInputMinArity": (lambda op: 1, 1),
            "GetVariadicInputHomogeneity": (lambda op: 1, 1),
            "GetVariadicOutputMinArity": (lambda op: 1, 1),
            "GetVariadicOutputHomogeneity": (lambda op: 1, 1),
            "CreateKernelV2": (self._create_kernel, None),
            "KernelComputeV2": (self._compute, None),
        }
        self.functions = {name: f[name](_guarded(default, body)) for name, (body, default) in bodies.items()}

    def _create_kernel(self, op, api, info, kernel):
        kernel[0] = op  # the kernel is its op: one node per op (the module docstring)
        return None

    def _compute(self, kernel, context):
        op = _OPS.get(kernel)
        try:
            op.compute(KernelContext(self.api, context))
        except BaseException as exc:  # onnxruntime's thread: the error goes back as its status
            label = (op.label or op.name) if op is not None else f"custom op {kernel:#x}"
            try:
                message = f"{label}: {type(exc).__name__}: {exc}".splitlines()[0]
            except BaseException:  # noqa: BLE001 - an exception whose str() fails
                message = f"{label}: {type(exc).__name__}"
            return self.api.CreateStatus(ORT_FAIL, message.encode(errors="replace"))
        return None


_CALLBACKS = _Callbacks()
_LOCK = threading.Lock()  # one registration at a time: _PENDING is the hook's only argument
_ERRORS: list[BaseException] = []  # what the hook could not hand back as a status (register raises it)


def _register(options, api_base) -> int | None:
    """RegisterCustomOps, forwarded from the shim: one domain per pending (domain, ops)."""
    callbacks = _CALLBACKS
    try:
        if callbacks.api is None:
            base = ctypes.cast(api_base, ctypes.POINTER(ctypes.c_void_p))
            get_api = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32)(base[0])
            table = get_api(API_VERSION)
            if not table:
                raise RuntimeError(f"onnxruntime has no C API version {API_VERSION}")
            callbacks.api = OrtCApi(table)
            callbacks.inplace_api = bool(get_api(INPLACE_OP_VERSION))
        api = callbacks.api
        while _PENDING:
            domain_name, ops = _PENDING.pop(0)
            name = domain_name.encode()
            domain = ctypes.c_void_p()
            api.check(api.CreateCustomOpDomain(name, ctypes.byref(domain)), f"CreateCustomOpDomain({domain_name})")
            _KEEP.append(name)
            for op in ops:
                struct = _struct(op, callbacks)
                address = ctypes.addressof(struct)
                _OPS[address] = op
                _KEEP.append(struct)
                api.check(api.CustomOpDomain_Add(domain, address), f"CustomOpDomain_Add({op.name})")
            api.check(api.AddCustomOpDomain(options, domain), f"AddCustomOpDomain({domain_name})")
    except BaseException as exc:  # noqa: BLE001 - nothing may cross into onnxruntime
        _PENDING.clear()
        if callbacks.api is None:
            _ERRORS.append(exc)  # no API to make a status with: ``register`` raises it instead
            return None
        return callbacks.api.CreateStatus(ORT_FAIL, f"graph-transpiler custom ops: {exc}".encode(errors="replace"))
    return None


def _struct(op: PythonOp, callbacks: _Callbacks) -> ctypes.Structure:
    """The OrtCustomOp of ``op``: version 16, or 18 with its in-place hints where it has some and
    onnxruntime reads them (C API 18)."""
    if not op.may_inplace or not callbacks.inplace_api:
        return OrtCustomOp(version=OP_VERSION, **callbacks.functions)
    pairs = list(op.may_inplace)
    inputs = (ctypes.c_int * len(pairs))(*(i for i, _ in pairs))
    outputs = (ctypes.c_int * len(pairs))(*(o for _, o in pairs))
    fields = dict(FIELDS_18)

    def get(input_index, output_index):  # onnxruntime reads the arrays, then hands them to release
        input_index[0] = ctypes.cast(inputs, ctypes.POINTER(ctypes.c_int))
        output_index[0] = ctypes.cast(outputs, ctypes.POINTER(ctypes.c_int))
        return len(pairs)

    extra = {
        "GetStartVersion": fields["GetStartVersion"](_guarded(1, lambda _: 1)),
        "GetEndVersion": fields["GetEndVersion"](_guarded(INT_MAX, lambda _: INT_MAX)),
        "GetMayInplace": fields["GetMayInplace"](_guarded(0, get)),
        "ReleaseMayInplace": fields["ReleaseMayInplace"](lambda a, b: None),  # the arrays live in _KEEP
    }
    _KEEP.extend([inputs, outputs, *extra.values()])
    return OrtCustomOp18(version=INPLACE_OP_VERSION, **callbacks.functions, **extra)


# The hook every loaded library gets: one object for the process (``reset`` may load another library).
_HOOK = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(_register)
_UNSET = object()
_LIBRARY: tuple[str, ctypes.CDLL] | str | None = None  # loaded (path, handle), why not, or not tried
_READINESS: object = _UNSET  # readiness's answer, once computed
_READY_LOCK = threading.RLock()  # one build and self-test per process, whichever thread asks first


def version_reason(version: str) -> str | None:
    """None where onnxruntime ``version`` has the C API layout this module knows (KNOWN_VERSIONS),
    else why not."""
    match = re.match(r"(\d+)\.(\d+)", str(version).strip())
    first, end = KNOWN_VERSIONS
    if match and first <= (int(match[1]), int(match[2])) < end:
        return None
    return (f"onnxruntime {version} is outside the C API layout this runtime knows "
            f"({first[0]}.{first[1]} to {end[0] - 1}.x)")


def _library() -> tuple[str, ctypes.CDLL]:
    """The library, built and loaded once per process, its hook set. Raises BuildError."""
    global _LIBRARY
    with _READY_LOCK:
        if _LIBRARY is None:
            try:
                path, handle = load()
            except BuildError as exc:
                _LIBRARY = str(exc)
            except Exception as exc:  # noqa: BLE001 - an unforeseen failure costs custom ops, not the run
                _LIBRARY = f"the custom-op library could not be made: {_first_line(exc)}"
            else:
                handle.gt_set_register_hook.argtypes = [ctypes.c_void_p]
                handle.gt_set_register_hook(ctypes.cast(_HOOK, ctypes.c_void_p))
                _LIBRARY = (str(path), handle)
        if isinstance(_LIBRARY, str):
            raise BuildError(_LIBRARY)
        return _LIBRARY


def library_reason() -> str | None:
    """None where the library is built and loaded (on first use), else why not."""
    try:
        _library()
    except BuildError as exc:
        return str(exc)
    return None


def library() -> str | None:
    """The library's path, built on first use; None where it cannot be (``readiness`` says why)."""
    return None if library_reason() else _library()[0]


_FLOAT = 1  # TensorProto.FLOAT


def _add_one(ctx: KernelContext) -> None:
    """The self-test's kernel: y = x + 1 on the host pointers onnxruntime hands it."""
    import numpy as np

    shape, elem = ctx.input_shape(0)
    if elem != _FLOAT:
        raise TypeError(f"input element type {elem}, not float ({_FLOAT})")
    ctx.gpu_stream()  # the table's last function used: its slot must hold the right one
    count = int(np.prod(shape, dtype=np.int64))
    x = np.ctypeslib.as_array((ctypes.c_float * count).from_address(ctx.input_ptr(0)))
    y = np.ctypeslib.as_array((ctypes.c_float * count).from_address(ctx.output_ptr(0, shape)))
    y[...] = x + 1


def _self_test(ort) -> None:
    """Neg -> a Python op (``_add_one``) -> Relu in one CPU session, its result checked: the
    registration, the callbacks and the kernel context, through the same C API table the GPU uses.
    Raises on any failure."""
    import numpy as np
    from onnx import TensorProto, helper

    x_info, y_info = (helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 3]) for name in "xy")
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("AddOne", ["n"], ["a"], domain="gt.self_test"),
             helper.make_node("Relu", ["a"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "self_test", [x_info], [y_info]),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("gt.self_test", 1)])
    model.ir_version = 8  # what every onnxruntime from 1.16 on reads
    options = ort.SessionOptions()
    options.log_severity_level = 3
    _register_library(options, "gt.self_test", [PythonOp("AddOne", [_FLOAT], [_FLOAT], _add_one, label="self-test")])
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.array([[-3.0, -1.0, 0.5], [2.0, 0.0, 4.25]], np.float32)
    for _ in range(2):  # the second run is the kernel's second compute
        (y,) = session.run(None, {"x": x})
        expected = np.maximum(-x + 1, 0)
        if not np.array_equal(y, expected):
            raise AssertionError(f"Neg, AddOne, Relu of {x.tolist()} gave {np.asarray(y).tolist()}, not {expected.tolist()}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def readiness(ort) -> str | None:
    """None where this process may run Python kernels inside onnxruntime ``ort``'s sessions, else
    one line saying why not. Decided once per process (the first call's ``ort``)."""
    global _READINESS
    with _READY_LOCK:
        if _READINESS is _UNSET:
            reason = version_reason(getattr(ort, "__version__", "(no __version__)"))
            if reason is None and (reason := library_reason()) is None:
                try:
                    _self_test(ort)
                except Exception as exc:  # noqa: BLE001 - any failure is the answer, never a crash
                    reason = f"self-test failed: {_first_line(exc)}"
            _READINESS = reason
        return _READINESS


def reset() -> None:
    """Forget the decision and the library (tests: another environment). Sessions already made keep theirs."""
    global _READINESS, _LIBRARY
    with _READY_LOCK:
        _READINESS, _LIBRARY = _UNSET, None


def available(ort=None) -> bool:
    if ort is None:
        import onnxruntime as ort
    return readiness(ort) is None


def register(options, domain: str, ops: Sequence[PythonOp]) -> None:
    """Add ``ops`` as the custom op domain ``domain`` to onnxruntime SessionOptions ``options``.
    Raises RuntimeError with ``readiness``'s line where this process may not use custom ops."""
    import onnxruntime

    reason = readiness(onnxruntime)
    if reason is not None:
        raise RuntimeError(f"custom op domain {domain}: no custom ops in this process: {reason}")
    _register_library(options, domain, ops)


def _register_library(options, domain: str, ops: Sequence[PythonOp]) -> None:
    path = _library()[0]
    with _LOCK:
        _PENDING.append((domain, list(ops)))
        try:
            options.register_custom_ops_library(path)
            called = not _PENDING
        finally:
            _PENDING.clear()
        if _ERRORS:
            error = _ERRORS[-1]
            _ERRORS.clear()
            raise RuntimeError(f"custom op domain {domain}: {error}")
    if not called:
        raise RuntimeError(f"custom op domain {domain}: onnxruntime did not call the library's RegisterCustomOps")
