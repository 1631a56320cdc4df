"""``transpile view OUT/rank0.onnx``: serve a graph in Netron on localhost and print its URL.

A browser is opened only where there is a display (and never with --no-browser); on a headless
machine, forward the port (``ssh -L PORT:localhost:PORT host``) and open the printed URL.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from inspection.errors import InspectError
from inspection.model import load_model
from inspection.outdir import check_ranks, load_plan


def has_display() -> bool:
    if sys.platform in ("darwin", "win32"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def resolve(path: Path, rank: int | None) -> Path:
    """The .onnx file to show: the file itself, or OUT's step graph of ``rank`` (default 0)."""
    if path.is_dir():
        plan = load_plan(path)
        r = check_ranks([rank or 0], plan["world_size"])[0]
        path = path / plan["graphs"]["ranks"][r]["step"]
    elif rank:
        raise InspectError(f"{path}: --rank needs an OUT directory written by 'transpile', not a model file")
    load_model(path)  # a clear error for a missing or non-ONNX file, before a server starts
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="an .onnx file, or OUT (then its rank graph, --rank, default 0)")
    p.add_argument("--rank", type=int, default=None, help="with OUT: which rank's step graph (default 0)")
    p.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback only)")
    p.add_argument("--no-browser", action="store_true", help="never open a browser")


def execute(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise InspectError(f"--port must be in [0, 65535] (0: a free one), got {args.port}")
    path = resolve(Path(args.path), args.rank)
    try:
        import netron
    except ImportError:
        raise InspectError("'transpile view' needs netron: pip install 'graph-transpiler[inspect]'") from None
    import logging

    logging.getLogger("netron").setLevel(logging.WARNING)  # we print the URL ourselves, once
    browse = has_display() and not args.no_browser
    try:
        address = netron.start(str(path), address=(args.host, args.port), browse=browse)
    except (OSError, OverflowError) as exc:
        raise InspectError(f"cannot serve on {args.host}:{args.port} ({getattr(exc, 'strerror', None) or exc})") from None
    url = f"http://{address[0]}:{address[1]}"
    # "press Ctrl-C to stop" holds even when a script started us in the background, where the shell
    # hands its jobs SIGINT ignored (Python then never raises KeyboardInterrupt); SIGTERM stops as
    # cleanly. Both are set before the address is printed: whoever reads it may signal at once.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    print(f"serving {path} at {url}" + ("" if browse else " (no display: open it in a browser, "
                                        "e.g. through 'ssh -L {0}:localhost:{0}')".format(address[1])), flush=True)
    print("press Ctrl-C to stop", flush=True)
    try:
        while netron.status(address):
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        netron.stop(address)
    print("stopped", flush=True)
    return 0
