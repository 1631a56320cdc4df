"""Issue 28's zoo cases through the command line, as a user runs them: ``transpile MODEL.onnx --gpus 2
-o OUT`` and ``transpile run OUT --data D.npz --batch 4 --steps 3 --backend cpu --export FILE`` as
subprocesses (2 MPI ranks through mpiexec), the trained parameters read back from the exported model
and the losses from --metrics, compared with PyTorch's own 3 SGD steps by test_zoo.py's comparison.

tests/test_zoo.py runs every case in process (``runtime.simulate``, threads); this file runs the
cases of issue 28 (recurrent networks, boolean-mask indexing and GatherND, ReduceL2, the activation
set, DepthToSpace, BART, MobileNetV2), each from dynamo and two of them from TorchScript too, with
the same exports (cached per session), the same settings (sharded, SGD lr 0.1, --sync-bn, --freeze
and --train as the zoo entry says) and the same tolerance. transformers' own CLIP loss, refused at
``transpile`` in one line with exit status 2, is test_zoo.py's test_clip_own_loss_is_refused_at_transpile.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")
from conftest import child_env  # noqa: E402
from test_zoo import BATCH, LR, STEPS, WORLD, compare_with_torch, export_zoo_model, zoo_freeze  # noqa: E402
from zoo_models import ZOO  # noqa: E402

from contract.plan import EXPORTED_KINDS  # noqa: E402
from runtime.metrics import read_metrics  # noqa: E402
from runtime.plan import load_plan  # noqa: E402

pytestmark = pytest.mark.mpi

CASES = [
    ("lstm_lm", "dynamo", 18), ("lstm_lm", "torchscript", 17), ("gru_classifier", "dynamo", 18),
    ("masked_tokens", "dynamo", 18), ("electra", "dynamo", 18), ("clip", "dynamo", 18), ("clip", "torchscript", 17),
    ("swin", "dynamo", 18), ("whisper", "dynamo", 18), ("weight_norm_conv", "dynamo", 18),
    ("activations_mlp", "dynamo", 18), ("pixel_shuffle", "dynamo", 18), ("bart", "dynamo", 18),
    ("mobilenet_v2", "dynamo", 18),
]
RESULTS: dict[tuple[str, str, int], dict] = {}


def transpile(*args, cwd: Path) -> subprocess.CompletedProcess:
    """The ``transpile`` command (commands/, the console script's entry point) on this checkout."""
    return subprocess.run([sys.executable, "-m", "commands", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300, env=child_env())


@pytest.mark.parametrize("model,exporter,opset", CASES, ids=[f"{m}-{e}{o}" for m, e, o in CASES])
def test_two_cpu_ranks_through_the_cli_train_like_pytorch(model, exporter, opset, tmp_path_factory, tmp_path):
    entry = ZOO[model]
    path, module, data, _ = export_zoo_model(model, exporter, opset, tmp_path_factory)
    np.savez(tmp_path / "data.npz", **data)
    options = ["--strategy", "sharded", "--optimizer", "sgd", "--lr", LR]
    if entry.sync_bn:
        options.append("--sync-bn")
    if (freeze := zoo_freeze(model, path)) is not None:
        options += ["--freeze", freeze]
    if entry.train is not None:
        options += ["--train", entry.train]

    start = time.perf_counter()
    done = transpile(path, "--gpus", WORLD, "-o", "out", *options, cwd=tmp_path)
    transpile_s = time.perf_counter() - start
    assert done.returncode == 0, done.stderr
    start = time.perf_counter()
    done = transpile("run", "out", "--data", "data.npz", "--batch", BATCH, "--steps", STEPS, "--backend", "cpu",
                     "--log-every", 1, "--metrics", "metrics.jsonl", "--export", "trained.onnx", cwd=tmp_path)
    run_s = time.perf_counter() - start
    assert done.returncode == 0, done.stderr

    # What --export wrote back: the plan's parameters and buffers, by the user's initializer names.
    names = {s.param or s.input for s in load_plan(tmp_path / "out").single.state if s.kind in EXPORTED_KINDS}
    exported = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "trained.onnx")).graph.initializer}
    assert names <= exported.keys(), sorted(names - exported.keys())[:5]
    records, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)) and summary["steps"] == STEPS
    measured: dict = {}
    try:
        compare_with_torch(module, data, {n: exported[n] for n in names}, [r["loss"] for r in records], measured,
                           transpile_s=transpile_s, run_s=run_s)
    finally:
        if measured:
            RESULTS[model, exporter, opset] = measured


def test_report():
    """Print each case's errors and times (visible with -s); runs last in this file."""
    if not RESULTS:
        pytest.skip("no case ran")
    for (model, exporter, opset), r in RESULTS.items():
        print(f"{model} {exporter} {opset}: max rel error {r['error']:.1e}, loss {r['loss']:.1e}; "
              f"transpile {r['transpile_s']:.1f} s, run {r['run_s']:.1f} s")
