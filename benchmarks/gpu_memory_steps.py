"""Device memory after each of the first steps of one GPU run: where the runtime's footprint comes
from (the init graph, the first uncaptured steps, the CUDA-graph captures). docs/benchmarks.md.

    python benchmarks/gpu_memory_steps.py OUT DATA.npz ROWS [--steps 8]

Prints one JSON line: device memory in use (cudaMemGetInfo, GiB, the whole device) before the
runtime starts, after the init graph, after each step (synchronized), and CuPy's pool at the end.
GRAPH_TRANSPILER_NATIVE_OFF applies (docs/cli.md); compare code changes with another source tree.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from mpi4py import MPI

from runtime.collectives.mpi import MpiCommunicator
from runtime.gpu import GpuBackend, NcclCommunicator
from runtime.plan import load_plan
from runtime.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("data")
    parser.add_argument("rows", type=int, help="per-step batch (rows of DATA)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args()
    backend = GpuBackend(0, tf32=True)
    cp = backend.device.cp

    def used() -> float:
        free, total = cp.cuda.runtime.memGetInfo()
        return round((total - free) / 2**30, 2)

    result = {"before": used()}
    comm = NcclCommunicator(MpiCommunicator(MPI.COMM_WORLD), 0)
    trainer = Trainer(load_plan(args.out), comm, rank=None, backend=backend)
    comm.connect()
    trainer.initialize()
    backend.device.compute.synchronize()
    result["after_init"] = used()
    data = {k: v[:args.rows] for k, v in np.load(args.data).items()}
    result["steps"] = []
    for _ in range(args.steps):
        trainer.step_async(data, args.lr)
        backend.device.compute.synchronize()
        result["steps"].append(used())
    result["cupy_pool"] = round(cp.get_default_memory_pool().total_bytes() / 2**30, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
