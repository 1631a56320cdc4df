"""NCCL's symmetric-memory kernels against its ring kernels, alone and beside compute: does a
collective on buffers registered as symmetric windows slow the kernels beside it less?

The lead of docs/gpu.md ("NCCL's symmetric-memory kernels, against the contention"): what the
N-GPU step pays most is the backward's kernels (and the updates) running slower beside NCCL's ring
kernels, which take one CTA a channel. NCCL 2.27+ runs AllReduce, ReduceScatter and AllGather over
NVLink loads and stores, with fewer CTAs, where both buffers lie in windows registered with
``NCCL_WIN_COLL_SYMMETRIC`` (memory from ``ncclMemAlloc``). With ``NCCL_CTA_POLICY=2`` an AllGather
on such windows runs on the copy engines, with no CTA at all (NCCL 2.28, ``ncclCeImplemented``).

    NCCL_NVLS_ENABLE=0 mpirun -n N python -m mpi4py benchmarks/probe_nccl_symmetric.py OUT.json [--mib 147]

One process per GPU (rank r on device r). For each buffer kind (``plain``: CuPy's pool, i.e.
cudaMalloc, what the runtime's collectives read today; ``symmetric``: ncclMemAlloc, registered) and
each collective form (``allreduce`` sum and ``avg``, the runtime's mean, which the symmetric
kernels do not take; ``rs_ag``: ReduceScatter then AllGather in place), it times, on the GPU clock:
- the collective alone (``comm_ms``, per call, over ``--calls`` calls);
- each load alone: ``gemm`` (fp32 2048^3 products, tensor-core free: the compute-bound kernels)
  and ``stream`` (``y += a*x`` over 256 MiB arrays: the bandwidth-bound ones, as the updates),
  sized so that a load alone lasts about as long as the collectives;
- both at once on two streams: the collectives' time, the load's time (``load_slowdown``: beside
  over alone) and the span of both (``span_ms``; the ideal is the longer of the two alone).
It also checks each form's result once (``ok``). Rank 0 writes one JSON object; the NCCL_*
variables of the environment are recorded in it (every rank's rows), so runs under different settings compare
(``NCCL_CTA_POLICY=2``; ``NCCL_SYM_CTAS=K``; ``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING`` names the
kernel NCCL picked for each call).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
from pathlib import Path

NCCL_FLOAT32, NCCL_SUM, NCCL_AVG = 7, 0, 4
WIN_COLL_SYMMETRIC = 0x01


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def load_nccl() -> ctypes.CDLL:
    """The libnccl CuPy loaded (one NCCL in the process), else the first one found."""
    from cupy.cuda import nccl

    nccl.get_version()
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libnccl.so" in line:
                return ctypes.CDLL(line.split()[-1])
    return ctypes.CDLL("libnccl.so.2")


class Nccl:
    """The few NCCL calls the probe makes, on a communicator of its own (CuPy's hides its handle)."""

    def __init__(self, lib: ctypes.CDLL, uid: bytes, rank: int, size: int):
        self.lib = lib
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        version = ctypes.c_int()
        self.check(lib.ncclGetVersion(ctypes.byref(version)), "ncclGetVersion")
        self.version = version.value
        self.comm = ctypes.c_void_p()
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
        self.check(lib.ncclCommInitRank(ctypes.byref(self.comm), size, UniqueId.from_buffer_copy(uid), rank),
                   "ncclCommInitRank")
        self.rank, self.size = rank, size

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what}: {self.lib.ncclGetErrorString(code).decode()}")

    def mem_alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self.check(self.lib.ncclMemAlloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "ncclMemAlloc")
        return ptr.value

    def register(self, ptr: int, nbytes: int) -> ctypes.c_void_p:
        win = ctypes.c_void_p()
        self.check(self.lib.ncclCommWindowRegister(self.comm, ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes),
                                                   ctypes.byref(win), WIN_COLL_SYMMETRIC), "ncclCommWindowRegister")
        return win

    def all_reduce(self, ptr: int, count: int, op: int, stream: int) -> None:
        self.check(self.lib.ncclAllReduce(ctypes.c_void_p(ptr), ctypes.c_void_p(ptr), ctypes.c_size_t(count),
                                          NCCL_FLOAT32, op, self.comm, ctypes.c_void_p(stream)), "ncclAllReduce")

    def rs_ag(self, ptr: int, count: int, stream: int) -> None:
        shard = count // self.size
        mine = ptr + self.rank * shard * 4
        self.check(self.lib.ncclReduceScatter(ctypes.c_void_p(ptr), ctypes.c_void_p(mine), ctypes.c_size_t(shard),
                                              NCCL_FLOAT32, NCCL_SUM, self.comm, ctypes.c_void_p(stream)),
                   "ncclReduceScatter")
        self.check(self.lib.ncclAllGather(ctypes.c_void_p(mine), ctypes.c_void_p(ptr), ctypes.c_size_t(shard),
                                          NCCL_FLOAT32, self.comm, ctypes.c_void_p(stream)), "ncclAllGather")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--mib", type=float, default=147.0, help="collective size (GPT-2-small's token table: 147 MiB)")
    p.add_argument("--calls", type=int, default=10)
    args = p.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never multicast (cuMulticastCreate)
    import cupy as cp
    from cupy.cuda import nccl as cupy_nccl
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    cp.cuda.Device(rank).use()
    uid = world.bcast(bytes(b % 256 for b in cupy_nccl.get_unique_id()) if rank == 0 else None, root=0)
    nccl = Nccl(load_nccl(), uid, rank, size)
    count = int(args.mib * 2**20) // 4
    count -= count % (size * 1024)  # shards of whole 4 KiB pages
    nbytes = count * 4

    plain = cp.empty(count, dtype=cp.float32)
    sym_ptr = nccl.mem_alloc(nbytes)
    window = nccl.register(sym_ptr, nbytes)  # collective: every rank, the same size
    if not window.value:  # no symmetric support (CUDA P2P between every pair, NCCL_WIN_ENABLE, cuMem)
        raise SystemExit(f"rank {rank}: NCCL registered no window: its symmetric kernels are off here")
    symmetric = cp.ndarray(count, cp.float32, cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(sym_ptr, nbytes, None), 0))
    buffers = {"plain": plain, "symmetric": symmetric}

    compute, comm_stream = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    a = cp.random.rand(2048, 2048, dtype=cp.float32)
    b = cp.random.rand(2048, 2048, dtype=cp.float32)
    c = cp.empty_like(a)
    x = cp.random.rand(64 * 2**20, dtype=cp.float32)
    y = cp.zeros_like(x)
    axpy = cp.ElementwiseKernel("float32 x, float32 a", "float32 y", "y += a * x", "probe_axpy")
    spin = cp.RawKernel(r"""extern "C" __global__ void probe_spin(long long cycles) {
        long long start = clock64(); while (clock64() - start < cycles) {} }""", "probe_spin")
    loads = {"gemm": lambda: cp.matmul(a, b, out=c), "stream": lambda: axpy(x, cp.float32(1e-3), y)}
    forms = {"allreduce": lambda buf: nccl.all_reduce(buf.data.ptr, count, NCCL_SUM, comm_stream.ptr),
             "avg": lambda buf: nccl.all_reduce(buf.data.ptr, count, NCCL_AVG, comm_stream.ptr),
             "rs_ag": lambda buf: nccl.rs_ag(buf.data.ptr, count, comm_stream.ptr)}

    def timed(stream, body, times: int) -> tuple[cp.cuda.Event, cp.cuda.Event]:
        start, end = cp.cuda.Event(), cp.cuda.Event()
        with stream:
            start.record(stream)
            for _ in range(times):
                body()
            end.record(stream)
        return start, end

    def ms(events) -> float:
        events[1].synchronize()  # cudaEventElapsedTime refuses an event not yet reached
        return cp.cuda.get_elapsed_time(*events)

    def settle() -> None:
        cp.cuda.Device().synchronize()
        world.Barrier()

    result: dict = {"world": size, "nccl_version": nccl.version, "mib": round(nbytes / 2**20, 1), "calls": args.calls,
                    "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}, "rows": []}
    # What one launch of each load costs alone (warm), to size the loads against the collectives.
    unit = {}
    for name, load in loads.items():
        timed(compute, load, 3)
        settle()
        unit[name] = ms(timed(compute, load, 20)) / 20
    for kind, buf in buffers.items():
        for form, call in forms.items():
            buf.fill(rank + 1)
            settle()
            with comm_stream:
                call(buf)
            settle()
            want = size * (size + 1) / 2 / (size if form == "avg" else 1)
            ok = bool(cp.allclose(buf, want))
            buf.fill(0)  # timed sums of zeros stay finite
            collective = functools.partial(call, buf)
            timed(comm_stream, collective, 2)  # warm: NCCL connects per algorithm and protocol
            settle()
            comm = ms(timed(comm_stream, collective, args.calls))
            settle()
            for name, load in loads.items():
                launches = max(1, round(world.allreduce(comm, op=MPI.MAX) / unit[name]))
                alone = ms(timed(compute, load, launches))
                settle()
                # Both streams start from one point: the host enqueues everything behind a 2 ms spin.
                with compute:
                    spin((1,), (1,), (cp.int64(4_000_000),))
                begin = cp.cuda.Event()
                begin.record(compute)
                comm_stream.wait_event(begin)
                collectives = timed(comm_stream, collective, args.calls)
                beside = timed(compute, load, launches)
                settle()
                span = max(ms((begin, collectives[1])), ms((begin, beside[1])))
                result["rows"].append({
                    "buffer": kind, "form": form, "ok": ok, "load": name, "launches": launches,
                    "comm_ms": round(comm / args.calls, 4), "load_ms": round(alone, 3),
                    "comm_beside_ms": round(ms(collectives) / args.calls, 4), "load_beside_ms": round(ms(beside), 3),
                    "load_slowdown": round(ms(beside) / alone, 3), "span_ms": round(span, 3),
                    "ideal_ms": round(max(comm, alone), 3)})
    settle()
    nccl.check(nccl.lib.ncclCommWindowDeregister(nccl.comm, window), "ncclCommWindowDeregister")
    nccl.check(nccl.lib.ncclMemFree(ctypes.c_void_p(sym_ptr)), "ncclMemFree")
    nccl.check(nccl.lib.ncclCommDestroy(nccl.comm), "ncclCommDestroy")
    ranks = world.gather(result.pop("rows"), root=0)
    if rank == 0:
        result["rows"] = [{"rank": r, **row} for r, rows in enumerate(ranks) for row in rows]
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        for row in result["rows"]:
            print(json.dumps(row), flush=True)
        return 0 if all(row["ok"] for row in result["rows"]) else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
