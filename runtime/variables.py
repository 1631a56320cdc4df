"""Every environment variable the runtime reads, in one table (docs/cli.md, "Environment").

None of them changes what a run computes. They are debugging aids in the manner of
CUDA_LAUNCH_BLOCKING, and one place to build a helper library; everything a user sets to train
is a flag of ``transpile run`` (runtime/cli.py), and what ``transpile run`` tells the ranks it
starts travels in their RunConfig (runtime/config.py), never in variables. The launcher passes
exactly these on to ranks on other hosts (runtime/launcher.py), besides NCCL's and UCX's own.
"""

from __future__ import annotations

import os

# "1": synchronize the device after every segment and collective of a GPU step (rules out any
# stream-ordering race; slow).
DEBUG_SYNC = "GRAPH_TRANSPILER_DEBUG_SYNC"
# A folder: every onnxruntime session of a GPU run writes the graph onnxruntime optimized for it
# there (its fusions, the nodes it kept), to diagnose kernel counts.
DUMP = "GRAPH_TRANSPILER_DUMP"
# Native GPU kernels to leave to onnxruntime, for bisecting a wrong result or a crash: a comma list
# of names from runtime/gpu/native.py's table ("update", "conv_grad", "batchnorm", "layernorm",
# "elementwise", "relu_mask"), "in_session" (run them between sessions instead of inside), or "all".
NATIVE_OFF = "GRAPH_TRANSPILER_NATIVE_OFF"
# The folder the custom-op library is built in (default: $XDG_CACHE_HOME/graph-transpiler, else
# ~/.cache/graph-transpiler; runtime/ort_custom_ops.py).
CACHE = "GRAPH_TRANSPILER_CACHE"

ALL = (DEBUG_SYNC, DUMP, NATIVE_OFF, CACHE)


def flag(name: str) -> bool:
    """Whether a "1"-style variable is set (anything but empty and "0")."""
    return os.environ.get(name, "0") not in ("", "0")


def text(name: str) -> str:
    return os.environ.get(name, "").strip()
