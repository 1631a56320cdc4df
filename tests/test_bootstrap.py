"""The TCP bootstrap (runtime/bootstrap.py) on loopback: the host exchanges of the GPU path without
MPI, NCCL's unique id reaching every rank (a fake NCCL records it), its failures as one line, and
CPU ranks under a torch-style environment refusing with one line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_runtime_outdir import make_data, write_out

from runtime import RunError
from runtime.bootstrap import MAGIC, TcpHost, torch_style_host
from runtime.gpu.nccl import join_nccl
from runtime.launcher import LAUNCHERS

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_ranks(size: int, body, *, port: int | None = None, timeout: float = 20.0, delay: dict | None = None) -> list:
    """``body(host)`` on ``size`` threads, each its own rank of one TCP bootstrap; their results
    (or the exception each raised) in rank order."""
    port = free_port() if port is None else port
    results: list = [None] * size

    def rank(r: int) -> None:
        time.sleep((delay or {}).get(r, 0.0))
        try:
            host = TcpHost(r, size, "127.0.0.1", port, timeout=timeout)
            try:
                results[r] = body(host)
            finally:
                host.close()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


def test_host_exchanges_over_tcp():
    def body(host):
        return (host.allgather({"rank": host.rank}), host.bcast(b"\x00\xffid" if host.rank == 0 else None),
                host.allreduce_scalars([host.rank + 1.0, 0.5], "sum"), host.allreduce_scalars([float(host.rank)]),
                host.barrier())

    results = on_ranks(3, body)
    for gathered, uid, sums, mean, _ in results:
        assert gathered == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
        assert uid == b"\x00\xffid"  # bytes survive the JSON wire
        assert sums == [6.0, 1.5] and mean == [1.0]


def test_ranks_may_start_before_rank_0():
    results = on_ranks(2, lambda host: host.allgather(host.rank), delay={0: 1.0})  # rank 1 retries until rank 0 listens
    assert results == [[0, 1], [0, 1]]


class FakeNccl:
    """cupy.cuda.nccl's two calls the bootstrap of the unique id makes; records what each rank got."""

    def __init__(self, uid):
        self.uid, self.made = uid, []

    def get_unique_id(self):
        return self.uid

    def NcclCommunicator(self, size, uid, rank):  # noqa: N802 - CuPy's name
        self.made.append((rank, size, uid))
        return ("communicator", rank)


@pytest.mark.parametrize("uid", [os.urandom(128), tuple(range(-3, 125))], ids=["cupy14-bytes", "older-cupy-tuple"])
def test_nccl_unique_id_reaches_every_rank_through_the_bootstrap(uid):
    nccl = FakeNccl(uid)
    results = on_ranks(3, lambda host: join_nccl(nccl, host, host.rank, host.size, device=host.rank))
    assert results == [("communicator", r) for r in range(3)]
    assert sorted(nccl.made) == [(r, 3, uid) for r in range(3)]  # every rank joined with rank 0's id, as made


def test_a_missing_rank_0_is_one_line_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(RunError, match=r"^rank 1: cannot reach rank 0's bootstrap at 127\.0\.0\.1:\d+ \(MASTER_ADDR:"
                                       r"MASTER_PORT\) within 1 s: .*refused"):
        TcpHost(1, 2, "127.0.0.1", free_port(), timeout=1.0)
    assert time.monotonic() - start < 5


def test_a_rank_that_leaves_stops_the_others():
    def body(host):
        if host.rank == 2:
            return "gone"  # closes its connection without taking part in the exchange
        return host.allgather(host.rank)

    results = on_ranks(3, body)
    assert isinstance(results[0], RunError) and str(results[0]) == "rank 2 left the job (its bootstrap connection closed)"
    assert isinstance(results[1], RunError) and "rank 0 (the bootstrap at 127.0.0.1:" in str(results[1])


def test_strangers_are_ignored_and_a_different_world_size_is_refused():
    port = free_port()

    def stranger():
        for _ in range(100):
            try:
                with socket.create_connection(("127.0.0.1", port)) as s:
                    s.sendall(b"GET / HTTP/1.0\r\n\r\n")  # a health check, a port scanner
                return
            except OSError:
                time.sleep(0.05)

    threading.Thread(target=stranger).start()
    assert on_ranks(2, lambda host: host.allgather(host.rank), port=port, delay={1: 0.5}) == [[0, 1], [0, 1]]

    port = free_port()
    done: list = []
    server = threading.Thread(target=lambda: done.append(_raises(lambda: TcpHost(0, 3, "127.0.0.1", port, timeout=10))))
    server.start()
    with pytest.raises(RunError, match=r"^rank 1: the bootstrap on rank 0 refused this rank: rank 1 was started with "
                                       r"world size 2, rank 0 with 3 \(WORLD_SIZE differs between the ranks\)$"):
        TcpHost(1, 2, "127.0.0.1", port, timeout=10)
    server.join(15)
    assert "WORLD_SIZE differs" in str(done[0])


def _raises(fn):
    try:
        fn()
    except RunError as exc:
        return exc
    return None


def test_magic_names_the_protocol():
    assert MAGIC.startswith("graph-transpiler/bootstrap/")
    with pytest.raises(RunError, match="MASTER_PORT='x' is not a port number"):
        torch_style_host({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "x"}, 0, 2, 1.0)


def _rank_env(rank: int, size: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in {var for launcher in LAUNCHERS for var in (launcher.rank, *launcher.requires)}}
    env.update(PYTHONPATH=str(REPO), RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


def test_cpu_ranks_under_a_torch_style_launcher_refuse_with_one_line(tmp_path):
    out = write_out(tmp_path / "out", 2, "allreduce")
    np.savez(tmp_path / "d.npz", **make_data())
    port = free_port()
    command = [sys.executable, "-m", "commands", "run", str(out), "--data", str(tmp_path / "d.npz"), "--batch", "4",
               "--steps", "2", "--checkpoint", str(tmp_path / "ckpt")]
    start = time.monotonic()
    ranks = [subprocess.Popen(command, env=_rank_env(r, 2, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=tmp_path) for r in range(2)]
    outputs = [rank.communicate(timeout=60) for rank in ranks]
    assert time.monotonic() - start < 60
    assert [rank.returncode for rank in ranks] == [2, 2]
    errors = "".join(err for _, err in outputs)
    assert errors.count("\n") == 1, errors  # the ranks agreed over the bootstrap: rank 0 says it once
    assert errors.startswith("transpile: error: the cpu backend moves tensors with MPI, and torchrun starts no MPI "
                             "processes: start the 2 ranks with `mpirun -n 2 transpile run ...`")
    assert "".join(out for out, _ in outputs) == ""  # nothing trained, no second job started
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


# A rank of `transpile run --backend nccl` under a torch-style environment, on a machine without a
# GPU: onnxruntime's CPU backend stands in for the GPU one, and a fake NCCL communicator moves the
# tensors through the TCP bootstrap itself. Everything else is the real GPU path of runtime/worker.py:
# the host group from MASTER_ADDR:MASTER_PORT, the setup agreement, the GPU picked by LOCAL_RANK, the
# unique id made on rank 0 and handed to every rank's NCCL constructor.
FAKE_GPU_RANK = r'''
import json, os, sys
import numpy as np
import runtime.gpu, runtime.worker
from runtime.collectives.base import Communicator, finish_mean
from runtime.executor import CpuBackend
from runtime.gpu.nccl import join_nccl

class FakeNccl:
    def get_unique_id(self):
        return b"uid-of-rank-0-" + os.urandom(8)
    def NcclCommunicator(self, size, uid, rank):
        print("nccl-init", json.dumps({"rank": rank, "size": size, "uid": uid.hex()}), file=sys.stderr, flush=True)
        return object()

class FakeNcclCommunicator(Communicator):
    def __init__(self, host, device, *, timeout):
        self.host, self.rank, self.size, self.device = host, host.rank, host.size, device
        print("nccl-timeout", json.dumps(timeout), file=sys.stderr, flush=True)
    def connect(self):
        join_nccl(FakeNccl(), self.host, self.rank, self.size, self.device)
    def allreduce(self, arrays, reduction):
        rows = self.host.allgather([a.ravel().tolist() for a in arrays])
        out = []
        for i, a in enumerate(arrays):
            total = np.zeros(a.size, a.dtype)
            for row in rows:
                total += np.asarray(row[i], a.dtype)
            out.append((finish_mean(total, self.size) if reduction == "mean" else total).reshape(a.shape))
        return out
    def broadcast(self, arrays, root, specs):
        sent = self.host.bcast(None if arrays is None else [a.ravel().tolist() for a in arrays], root)
        return [np.asarray(v, s.dtype).reshape(s.shape) for v, s in zip(sent, specs)]
    def reduce(self, arrays, root, reduction): raise NotImplementedError
    def reduce_scatter(self, arrays, reduction): raise NotImplementedError
    def all_gather(self, array, specs): raise NotImplementedError
    def barrier(self): self.host.barrier()
    def allreduce_scalars(self, values, reduction="mean"): return self.host.allreduce_scalars(values, reduction)
    def abort(self, code): self.host.abort(code)

def FakeGpuBackend(device, *, tf32, ep_options, per_item_timings):
    print("gpu-backend", json.dumps({"tf32": tf32, "ep_options": ep_options, "per_item_timings": per_item_timings}),
          file=sys.stderr, flush=True)
    return CpuBackend(threads=1)

runtime.gpu.GpuBackend = FakeGpuBackend
runtime.gpu.NcclCommunicator = FakeNcclCommunicator
runtime.worker.pick_gpu = lambda local_rank, local_size: local_rank
from runtime.cli import main
sys.exit(main(sys.argv[1:]))
'''


def test_gpu_path_under_a_torch_style_launcher_with_a_fake_nccl(tmp_path):
    from runtime import simulate

    out = write_out(tmp_path / "out", 2, "allreduce")
    data = make_data(rows=12)
    np.savez(tmp_path / "d.npz", **data)
    port = free_port()
    command = [sys.executable, "-c", FAKE_GPU_RANK, "run", str(out), "--data", str(tmp_path / "d.npz"), "--batch", "4",
               "--steps", "3", "--log-every", "1", "--backend", "nccl", "--timeout", "45", "--ep-option", "prefer_nhwc=1"]
    ranks = [subprocess.Popen(command, env=_rank_env(r, 2, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=tmp_path) for r in range(2)]
    outputs = [rank.communicate(timeout=90) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    import json

    inits = [json.loads(line.split(" ", 1)[1]) for _, err in outputs for line in err.splitlines()
             if line.startswith("nccl-init")]
    assert sorted((i["rank"], i["size"]) for i in inits) == [(0, 2), (1, 2)]
    assert inits[0]["uid"] == inits[1]["uid"] and bytes.fromhex(inits[0]["uid"]).startswith(b"uid-of-rank-0-")

    def said(word):
        return [json.loads(line.split(" ", 1)[1]) for _, err in outputs for line in err.splitlines()
                if line.startswith(word + " ")]

    # The one --timeout bounds the NCCL watchdog too; --ep-option reaches the backend.
    assert said("nccl-timeout") == [45.0, 45.0]
    assert said("gpu-backend") == [{"tf32": True, "ep_options": {"prefer_nhwc": "1"}, "per_item_timings": False}] * 2
    lines = outputs[0][0].splitlines()
    assert lines[0] == "launcher: torchrun (2 rank(s), backend nccl)"  # rank 0 says how it was started
    assert outputs[1][0] == ""  # the log is rank 0's
    expected = simulate(out, data, batch=4, steps=3)
    logged = [float(line.split("  loss ")[1].split()[0]) for line in lines[1:] if "  loss " in line]
    assert logged == pytest.approx(expected.losses, rel=1e-6)


@pytest.mark.skipif(subprocess.run(["which", "torchrun"], capture_output=True).returncode != 0, reason="no torchrun")
def test_torchrun_starts_no_second_job_on_cpu(tmp_path):
    """The issue's case: `torchrun --nproc-per-node 2 transpile run ...` started two 2-rank jobs
    writing one checkpoint. Now each process is a rank (torchrun's store carries the agreement), and
    CPU ranks refuse with one line."""
    out = write_out(tmp_path / "out", 2, "allreduce")
    np.savez(tmp_path / "d.npz", **make_data())
    env = {k: v for k, v in _rank_env(0, 2, 0).items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                      "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run(["torchrun", "--nproc-per-node", "2", "-m", "commands", "run", str(out), "--data",
                           str(tmp_path / "d.npz"), "--batch", "4", "--steps", "2", "--checkpoint", str(tmp_path / "ck")],
                          env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("transpile:")]
    assert ours == [ours[0]] and ours[0].startswith("transpile: error: the cpu backend moves tensors with MPI, and "
                                                     "torchrun starts no MPI processes")
    assert done.stdout == "" and not (tmp_path / "ck").exists()
