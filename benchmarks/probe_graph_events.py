"""Can one captured CUDA graph wait, inside itself, for an event another captured graph records,
while the host runs steps ahead? The gate of the publish overlap for `sharded`/`zero` (docs/gpu.md,
"On two H200s, per strategy"): the next step's first session would wait, per bucket, for the
previous step's Broadcast, recorded in another session's graph.

Two graphs, replayed alternately without a host wait for STEPS steps:
- the publisher (on a "communication" stream): waits (external) for the consumer's ``read`` event
  of the previous step, spins, writes the step number into a buffer, records ``written``
  (CU_EVENT_RECORD_EXTERNAL, as the deleted early update recorded its event: docs/gpu.md);
- the consumer (on the compute stream): spins, waits (CU_EVENT_WAIT_EXTERNAL) for ``written``,
  copies the buffer into ``seen[step]``, records ``read``.
Right: ``seen`` is 0, 1, 2, ... (each read saw its own step's write, none the next one's, and no
write came before the read it must wait for). The spins make every wrong binding of a wait show.

    python benchmarks/probe_graph_events.py OUT.json [--steps 200] [--spin-us 50]

Writes {"ok", "seen_wrong", "first_wrong", "error", ...}; exits 0 when ok, 1 otherwise.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

RECORD_EXTERNAL = 1  # CU_EVENT_RECORD_EXTERNAL
WAIT_EXTERNAL = 1  # CU_EVENT_WAIT_EXTERNAL

SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}
extern "C" __global__ void publish(int* step, int* buffer) {  // the Broadcast: this step's values
    buffer[0] = *step;
    *step += 1;
}
extern "C" __global__ void consume(int* step, const int* buffer, int* seen, int capacity) {  // the forward
    if (*step < capacity) seen[*step] = buffer[0];
    *step += 1;
}
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--spin-us", type=float, default=50.0)
    args = p.parse_args(argv)
    result: dict = {"steps": args.steps, "spin_us": args.spin_us}
    try:
        result.update(_probe(args.steps, args.spin_us))
    except Exception as exc:  # noqa: BLE001 - the probe's answer is the failure itself
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}".splitlines()[0])
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0 if result.get("ok") else 1


def _probe(steps: int, spin_us: float) -> dict:
    import cupy as cp

    driver = ctypes.CDLL("libcuda.so.1")
    record = driver.cuEventRecordWithFlags
    record.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
    wait = driver.cuStreamWaitEvent
    wait.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)

    def check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what}: CUresult {code}")

    module = cp.RawModule(code=SOURCE)
    spin, publish, consume = (module.get_function(n) for n in ("spin", "publish", "consume"))
    clock_khz = cp.cuda.Device().attributes["ClockRate"]
    cycles = cp.int64(int(spin_us * clock_khz / 1000))
    compute, comm = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True, priority=-(2**31))
    written, read = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)
    pub_step, con_step = cp.zeros(1, cp.int32), cp.zeros(1, cp.int32)
    buffer, seen = cp.full(1, -1, cp.int32), cp.full(steps, -1, cp.int32)
    read.record(compute)  # the first publish waits for nothing
    compute.synchronize()

    comm.begin_capture()
    check(wait(comm.ptr, read.ptr, WAIT_EXTERNAL), "publisher: external wait")
    spin((1,), (1,), (cycles,), stream=comm)
    publish((1,), (1,), (pub_step, buffer), stream=comm)
    check(record(written.ptr, comm.ptr, RECORD_EXTERNAL), "publisher: external record")
    publisher = comm.end_capture()

    compute.begin_capture()
    spin((1,), (1,), (cycles,), stream=compute)
    check(wait(compute.ptr, written.ptr, WAIT_EXTERNAL), "consumer: external wait")
    consume((1,), (1,), (con_step, buffer, seen, cp.int32(steps)), stream=compute)
    check(record(read.ptr, compute.ptr, RECORD_EXTERNAL), "consumer: external record")
    consumer = compute.end_capture()

    for _ in range(steps):  # no host wait: the host runs as far ahead as the launch queues allow
        publisher.launch(comm)
        consumer.launch(compute)
    compute.synchronize()
    comm.synchronize()
    got = cp.asnumpy(seen).tolist()
    wrong = [i for i, v in enumerate(got) if v != i]
    return {"ok": not wrong, "seen_wrong": len(wrong), "first_wrong": (wrong[0], got[wrong[0]]) if wrong else None,
            "device": cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()}


if __name__ == "__main__":
    sys.exit(main())
