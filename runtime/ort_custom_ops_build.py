"""The custom-op library of runtime/ort_custom_ops.py: its C source, compiled once per machine and
compiler into a cache folder, and loaded.

Every way this can fail becomes a ``BuildError`` whose message is one line saying what and where:
the caller decides once per process whether custom ops are used and says why not; nothing here
prints, and nothing here may crash a run (a run without custom ops is slower, not wrong).

The file name is a digest of everything the binary depends on (the source, the compiler command and
its version, the machine and the system), so a home folder shared by hosts of other architectures,
or by users of other compilers, never hands one of them another's library. A file at that name that
does not load (truncated, another ELF class, garbage) or is not ours is built again over it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from runtime.variables import CACHE

# The C part: RegisterCustomOps as onnxruntime calls it, forwarded to the hook Python sets.
SHIM_SOURCE = r"""
typedef void *(*gt_register_hook)(void *options, const void *api_base);
static gt_register_hook hook;
void gt_set_register_hook(gt_register_hook h) { hook = h; }
void *RegisterCustomOps(void *options, const void *api_base) { return hook ? hook(options, api_base) : 0; }
"""
SYMBOL = "gt_set_register_hook"  # what makes a loaded file our library
COMPILE_TIMEOUT_S = 120


class BuildError(Exception):
    """Why this process has no custom-op library: one line, for the caller's decision line."""


def compiler() -> list[str]:
    """The C compiler command: ``CC`` split as a shell would (``ccache gcc``, ``gcc -m64``), else
    ``cc``; its program resolved on PATH, so the digest names the very binary."""
    text = os.environ.get("CC", "").strip()
    try:
        command = shlex.split(text) if text else ["cc"]
    except ValueError as exc:
        raise BuildError(f"no C compiler (CC={text!r} does not parse: {exc})") from None
    program = shutil.which(command[0]) if command else None
    if program is None:
        where = f"{command[0]} from CC={text!r}" if text else "cc"
        raise BuildError(f"no C compiler ({where} not found; set CC)")
    return [program, *command[1:]]


def _identity(command: list[str]) -> str:
    """The compiler's ``--version`` first line ("" where it has none: the command still keys)."""
    try:
        done = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return next(iter((done.stdout or done.stderr).splitlines()), "").strip()


def file_name(command: list[str]) -> str:
    """The library's file name for ``command`` on this machine (the module docstring: what it keys)."""
    parts = [SHIM_SOURCE, shlex.join(command), _identity(command), platform.machine(), platform.system()]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return f"gt_ort_custom_ops_{digest}.so"


def folders() -> list[Path]:
    """Where the library may live, in order: the cache folder, then a folder of this user's in the
    temporary folder (a host whose home is read-only still gets custom ops)."""
    cache = os.environ.get(CACHE) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "graph-transpiler")
    return [Path(cache), Path(tempfile.gettempdir()) / f"graph-transpiler-{os.getuid()}"]


def _ours(path: Path) -> bool:
    """Whether ``path`` is this user's and nobody else may write it (a library another user could
    have put in a shared temporary folder is never loaded)."""
    info = path.stat()
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _usable(folder: Path) -> str | None:
    """None where ``folder`` can hold the library, else why not (a few words)."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        return "not a folder"
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    if not _ours(folder):
        return "not this user's alone"
    if not os.access(folder, os.W_OK | os.X_OK):
        return "not writable"
    return None


def _open(path: Path) -> tuple[ctypes.CDLL | None, str]:
    """``path`` loaded, or None and why it is no library of ours."""
    try:
        handle = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, (str(exc).splitlines() or [type(exc).__name__])[0]
    if not hasattr(handle, SYMBOL):
        return None, f"no {SYMBOL} in it"
    return handle, ""


def _compile(command: list[str], library: Path) -> None:
    """The shim compiled to ``library``, through a temporary name in its folder and a rename: ranks
    building at once, and a process loading meanwhile, each see a whole file."""
    shown = shlex.join(command)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        source, target = Path(tmp) / "shim.c", Path(tmp) / library.name
        source.write_text(SHIM_SOURCE)
        try:
            done = subprocess.run([*command, "-shared", "-fPIC", "-O2", "-o", str(target), str(source)],
                                  capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise BuildError(f"{shown} did not build the custom-op library in {COMPILE_TIMEOUT_S} s") from None
        except OSError as exc:
            raise BuildError(f"{shown} could not run: {exc}") from None
        if done.returncode != 0 or not target.is_file():
            last = ((done.stderr or done.stdout).strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise BuildError(f"{shown} could not build the custom-op library: {last.strip()}")
        os.chmod(target, 0o755)  # whatever the umask: a group-writable file would never count as ours
        os.replace(target, library)


def load() -> tuple[Path, ctypes.CDLL]:
    """The library, loaded: the cached one where it loads and is ours, else built (again) in the
    first usable folder. Raises BuildError."""
    command = compiler()
    name = file_name(command)
    tried = []
    for folder in folders():
        why = _usable(folder)
        if why is not None:
            tried.append(f"{folder}: {why}")
            continue
        library = folder / name
        if library.is_file() and _ours(library) and (handle := _open(library)[0]) is not None:
            return library, handle
        try:
            _compile(command, library)
        except OSError as exc:  # the folder took the check but not the files (full, read-only mount)
            tried.append(f"{folder}: {exc.strerror or exc}")
            continue
        handle, why = _open(library)
        if handle is None:
            raise BuildError(f"the custom-op library {library} that {shlex.join(command)} built does not load: {why}")
        return library, handle
    raise BuildError(f"no writable folder for the custom-op library (tried {'; '.join(tried)})")
