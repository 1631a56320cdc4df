"""Device memory NCCL takes per collective kind: what the communicator costs each rank before and
after the first call of each collective the strategies use (NCCL connects lazily, per algorithm
and protocol), and the time of a large AllReduce, under the NCCL_* settings of the environment.

    mpirun -n N python -m benchmarks.nccl_memory [--mib 25]

One process per GPU (rank r on device r). Prints rank 0's JSON line: GiB in use (cudaMemGetInfo,
minus right after the CUDA context) after the communicator's init and after the first AllReduce,
Reduce and Broadcast (every root), ReduceScatter and AllGather of a ``--mib`` buffer, and the mean
ms of 20 AllReduces of 100 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from mpi4py import MPI

GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=25.0)
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    import cupy as cp
    from cupy.cuda import nccl

    cp.cuda.Device(rank).use()
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.runtime.free(cp.cuda.runtime.malloc(1))  # the context exists

    def used() -> float:
        free, total = cp.cuda.runtime.memGetInfo()
        return (total - free) / GIB

    base = used()
    uid = world.bcast(nccl.get_unique_id() if rank == 0 else None, root=0)
    comm = nccl.NcclCommunicator(size, uid, rank)
    count = int(args.mib * 2**20) // 4
    count -= count % size
    buf = cp.zeros(count, dtype=cp.float32)
    f32, total = nccl.NCCL_FLOAT32, nccl.NCCL_SUM
    stream.synchronize()
    result = {"world": size, "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
              "buffer_gib": round(buf.nbytes / GIB, 3)}
    result["init"] = round(used() - base - buf.nbytes / GIB, 3)
    calls = {
        "allreduce": lambda: comm.allReduce(buf.data.ptr, buf.data.ptr, count, f32, total, stream.ptr),
        "reduce": lambda: [comm.reduce(buf.data.ptr, buf.data.ptr, count, f32, total, r, stream.ptr) for r in range(size)],
        "broadcast": lambda: [comm.broadcast(buf.data.ptr, buf.data.ptr, count, f32, r, stream.ptr) for r in range(size)],
        "reducescatter": lambda: comm.reduceScatter(buf.data.ptr, buf.data.ptr + rank * (count // size) * 4,
                                                    count // size, f32, total, stream.ptr),
        "allgather": lambda: comm.allGather(buf.data.ptr + rank * (count // size) * 4, buf.data.ptr,
                                            count // size, f32, stream.ptr),
    }
    for name, call in calls.items():
        call()
        stream.synchronize()
        world.Barrier()
        result[f"after_{name}"] = round(used() - base - buf.nbytes / GIB, 3)
    big = cp.zeros(100 * 2**20 // 4, dtype=cp.float32)
    for _ in range(3):
        comm.allReduce(big.data.ptr, big.data.ptr, big.size, f32, total, stream.ptr)
    stream.synchronize()
    world.Barrier()
    start = time.perf_counter()
    for _ in range(20):
        comm.allReduce(big.data.ptr, big.data.ptr, big.size, f32, total, stream.ptr)
    stream.synchronize()
    result["allreduce_100mib_ms"] = round((time.perf_counter() - start) * 1e3 / 20, 3)
    if rank == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
