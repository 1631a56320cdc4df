"""Peak resident memory per rank of ``transpile run`` on a large dataset, by --data format.

    python -m benchmarks.data_rss --gib 2 --ranks 4 --work /tmp/data-rss --json benchmarks/results/data_rss.json

Builds the built-in GPT (``models.generate("gpt")``) for ``--ranks`` CPU ranks, a dataset of about
``--gib`` GiB of token ids (the generated rows repeated, so every id is valid) written as a .npz, a
directory of .npy files and Parquet, and trains ``--steps`` shuffled steps from each. While a run
goes, every process under it is sampled for VmHWM (/proc/PID/status: the kernel's peak resident
set, file pages it mapped included); the JSON holds each process's peak, the ranks' largest, and
the run's wall time. The launcher ('transpile run' itself) also opens the data and checks every id.
Then, without training, rank 0's data path alone reads every step of one epoch at ``--scan-batch``
(``epoch_scan``: its peak RSS before opening the data and after the epoch).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

CHUNK_ROWS = 65536


def _status(pid: int) -> dict[str, int]:
    values = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "PPid"):
                values[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return {}
    return values


def _descendants(root: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            status = _status(int(entry.name))
            if "PPid" in status:
                parents[int(entry.name)] = status["PPid"]
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid]
        found += children
        frontier += children
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def run_and_sample(command: list[str], cwd: Path) -> dict:
    """Run ``command``, sampling VmHWM of it and every descendant every 0.1 s."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, tuple[int, str]] = {}
    while process.poll() is None:
        for pid in [process.pid, *_descendants(process.pid)]:
            hwm = _status(pid).get("VmHWM")
            if hwm:
                peaks[pid] = (max(hwm, peaks.get(pid, (0, ""))[0]), peaks.get(pid, (0, ""))[1] or _cmdline(pid))
        time.sleep(0.1)
    output = process.stdout.read()
    if process.returncode != 0:
        raise SystemExit(f"data_rss: {' '.join(command)} failed:\n{output[-2000:]}")
    python = {pid: v for pid, v in peaks.items() if "python" in v[1].split(" ")[0]}
    ranks = {pid: v for pid, v in python.items() if pid != process.pid and "runtime.worker" in v[1]}
    launcher = peaks.get(process.pid, (0, ""))[0]
    return {"seconds": round(time.perf_counter() - start, 1),
            "launcher_peak_mib": round(launcher / 1024, 1),
            "rank_peak_mib": sorted(round(kib / 1024, 1) for kib, _ in ranks.values()),
            "max_rank_peak_mib": round(max((kib for kib, _ in ranks.values()), default=0) / 1024, 1)}


def build_data(work: Path, gib: float, small: dict[str, np.ndarray], formats: set[str]) -> None:
    """npy/ (always: the others are made from it), and data.parquet and data.npz where ``formats``
    asks, holding the same ``gib`` GiB, written a chunk at a time; a format already there is kept
    (a set larger than memory is written once: 26 GiB of .npy, and the .npz of it, took 52 GiB)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from runtime.data_convert import parquet_column

    row_bytes = sum(a[0].nbytes for a in small.values())
    rows = int(gib * (1 << 30) // row_bytes)
    npy = work / "npy"
    write_npy = not all((npy / f"{name}.npy").is_file() for name in small)
    write_parquet = "parquet" in formats and not (work / "data.parquet").is_file()
    if write_npy or write_parquet:
        npy.mkdir(parents=True, exist_ok=True)
        maps = {name: np.lib.format.open_memmap(npy / f"{name}.npy", mode="w+" if write_npy else "r", dtype=a.dtype,
                                                shape=(rows, *a.shape[1:]) if write_npy else None)
                for name, a in small.items()}
        writer = None
        for start in range(0, rows, CHUNK_ROWS):
            stop = min(rows, start + CHUNK_ROWS)
            index = np.arange(start, stop) % len(next(iter(small.values())))
            chunk = {name: a[index] for name, a in small.items()}
            if write_npy:
                for name, array in chunk.items():
                    maps[name][start:stop] = array
            if write_parquet:
                table = pa.table({name: parquet_column(array) for name, array in chunk.items()})
                writer = writer or pq.ParquetWriter(work / "data.parquet", table.schema)
                writer.write_table(table, row_group_size=1024)
        if writer is not None:
            writer.close()
        if write_npy:
            for array in maps.values():
                array.flush()
        del maps
    if "npz" in formats and not (work / "data.npz").is_file():
        np.savez(work / "data.npz", **{name: np.load(npy / f"{name}.npy", mmap_mode="r") for name in small})


def scan(path: Path, out: Path, rank: int, world: int, batch: int, shuffle: bool) -> dict:
    """One rank's data path alone: every step of one epoch (no training), its peak RSS before and after."""
    from runtime.data import Dataset
    from runtime.plan import load_plan

    inputs = load_plan(out).data_inputs
    before = _status(os.getpid())["VmHWM"]
    start = time.perf_counter()
    dataset = Dataset.load(path, inputs)
    steps = dataset.rows // batch
    read = 0
    for step in range(steps):
        read += sum(a.nbytes for a in dataset.shard(step, batch=batch, rank=rank, world_size=world,
                                                     shuffle=shuffle, seed=0).values())
    after = _status(os.getpid())["VmHWM"]
    return {"steps": steps, "read_mib": round(read / (1 << 20), 1), "seconds": round(time.perf_counter() - start, 1),
            "peak_before_mib": round(before / 1024, 1), "peak_after_mib": round(after / 1024, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--formats", default="npy,parquet,npz")
    parser.add_argument("--work", type=Path, default=Path("/tmp/data-rss"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--scan-batch", type=int, default=4096, help="global batch of the data-only epoch scan (0: none)")
    parser.add_argument("--scan-one", nargs=4, metavar=("KIND", "RANK", "SHUFFLE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.scan_one:
        kind, rank, shuffle, path = args.scan_one
        print(json.dumps(scan(Path(path), args.work / "out", int(rank), args.ranks, args.scan_batch, shuffle == "1")))
        return 0
    import models

    work = args.work.resolve()
    if not (work / "gpt" / "model.onnx").is_file():
        models.generate("gpt", work / "gpt", seed=0, rows=256)
    with np.load(work / "gpt" / "data.npz") as npz:
        small = {name: npz[name] for name in npz.files}
    cli = [sys.executable, "-m", "transpiler.cli"]
    subprocess.run([*cli, str(work / "gpt" / "model.onnx"), "--gpus", str(args.ranks), "--optimizer", "adamw",
                    "-o", str(work / "out")], check=True, capture_output=True)
    formats = args.formats.split(",")
    build_data(work, args.gib, small, set(formats))
    paths = {"npz": work / "data.npz", "npy": work / "npy", "parquet": work / "data.parquet"}
    sizes = {kind: sum(p.stat().st_size for p in ([path] if path.is_file() else path.iterdir()))
             for kind, path in paths.items() if kind in formats or kind == "npy"}
    results = {"dataset_gib": round(sizes["npy"] / (1 << 30), 3), "ranks": args.ranks, "steps": args.steps,
               "batch": args.batch, "model": "gpt (models.generate)", "formats": {}}
    for kind in args.formats.split(","):
        measured = run_and_sample([*cli, "run", str(work / "out"), "--data", str(paths[kind]), "--batch",
                                   str(args.batch), "--steps", str(args.steps), "--shuffle", "--log-every", "1"], work)
        results["formats"][kind] = {"file_gib": round(sizes[kind] / (1 << 30), 3), **measured}
        print(kind, json.dumps(results["formats"][kind]), flush=True)
    for kind in args.formats.split(",") if args.scan_batch else []:
        shuffle = "0" if kind == "parquet" else "1"  # shuffled Parquet decodes a row group per row: see docs/data.md
        command = [sys.executable, "-m", "benchmarks.data_rss", "--work", str(work), "--ranks", str(args.ranks),
                   "--scan-batch", str(args.scan_batch), "--scan-one", kind, "0", shuffle, str(paths[kind])]
        done = subprocess.run(command, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, check=True)
        results["formats"][kind]["epoch_scan"] = {"batch": args.scan_batch, "shuffle": shuffle == "1",
                                                  **json.loads(done.stdout.splitlines()[-1])}
        print(kind, "scan", json.dumps(results["formats"][kind]["epoch_scan"]), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
