"""What one more onnxruntime CUDA session costs in device memory: the fixed cost of a program cut
into many sessions (docs/gpu-log.md, "programs of many sessions").

    python benchmarks/gpu_session_memory.py relu|conv [--sessions 8] [--shared-arena]
                                                     [--provider-option KEY=VALUE ...]

Makes N sessions of one small model each (two Relus, or one 3x3 Conv, over a 256x64x32x32 float32
tensor bound to the same device buffers), runs each twice, and prints one JSON line: device memory
in use per session (MiB, cudaMemGetInfo) after the first and after the last. Run it once per
setting, e.g. with CUBLAS_WORKSPACE_CONFIG=:0:0 or :4096:1 in the environment, since cuBLAS reads
that when a handle is made.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from runtime.gpu.cuda import import_cupy, load_onnxruntime


def _model(kind: str) -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 64, 32, 32])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    if kind == "conv":
        w = numpy_helper.from_array(np.random.default_rng(0).random((64, 64, 3, 3), dtype=np.float32), "w")
        graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "g", [x], [y], [w])
    else:  # the intermediate is the session's own (its arena's)
        graph = helper.make_graph([helper.make_node("Relu", ["x"], ["t"]), helper.make_node("Relu", ["t"], ["y"])],
                                  "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10).SerializeToString()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("relu", "conv"))
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--shared-arena", action="store_true", help="one arena for all (session.use_env_allocators)")
    parser.add_argument("--provider-option", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    cp, ort = import_cupy(), load_onnxruntime()
    cp.cuda.Device(0).use()
    stream = cp.cuda.Stream(non_blocking=False)

    def used_mib() -> float:
        free, total = cp.cuda.runtime.memGetInfo()
        return (total - free) / 2**20

    if args.shared_arena:
        info = ort.OrtMemoryInfo("Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator_v2("CUDAExecutionProvider", info, {"device_id": "0"},
                                             ort.OrtArenaCfg({"arena_extend_strategy": 1}))
    model = _model(args.kind)
    x = cp.random.rand(256, 64, 32, 32, dtype=cp.float32)
    y = cp.empty_like(x)
    cuda = {"device_id": "0", "user_compute_stream": str(stream.ptr), "has_user_compute_stream": "1",
            "arena_extend_strategy": "kSameAsRequested", **dict(o.split("=", 1) for o in args.provider_option)}
    start, sessions, per_session = used_mib(), [], {}
    for i in range(args.sessions):
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if args.shared_arena:
            options.add_session_config_entry("session.use_env_allocators", "1")
        session = ort.InferenceSession(model, options, providers=[("CUDAExecutionProvider", cuda)])
        io = session.io_binding()
        io.bind_input("x", "cuda", 0, np.float32, list(x.shape), x.data.ptr)
        io.bind_output("y", "cuda", 0, np.float32, list(y.shape), y.data.ptr)
        session.run_with_iobinding(io)
        session.run_with_iobinding(io)
        sessions.append(session)
        if i in (0, args.sessions - 1):
            per_session[i + 1] = round((used_mib() - start) / (i + 1), 1)
    print(json.dumps({"kind": args.kind, "sessions": args.sessions, "shared_arena": args.shared_arena,
                      "provider_options": args.provider_option,
                      "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                      "mib_per_session": per_session}))


if __name__ == "__main__":
    main()
