"""runtime/ort_custom_ops.py and ort_custom_ops_build.py: whether a process may use custom ops
(``readiness``), and the library's build: the compiler command, the cache key, the folders, a bad
cached file. Each test starts from an undecided process, with its own cache and temporary folders."""

from __future__ import annotations

import ctypes
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import types

import numpy as np
import onnxruntime as ort
import pytest
from conftest import child_env

from runtime import ort_custom_ops
from runtime import ort_custom_ops_build as build
from runtime.variables import CACHE

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the custom-op library")


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """An undecided process (restored afterwards), cache in tmp_path/cache, temp folder tmp_path/tmp."""
    monkeypatch.setattr(ort_custom_ops, "_LIBRARY", None)
    monkeypatch.setattr(ort_custom_ops, "_READINESS", ort_custom_ops._UNSET)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv(CACHE, str(tmp_path / "cache"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    return tmp_path


def _temp_folder(tmp_path):
    return tmp_path / "tmp" / f"graph-transpiler-{os.getuid()}"


def _fake_compiler(tmp_path, body: str, name="fake-cc"):
    """A compiler script: ``--version`` prints "fake-cc 1.0"; a build runs ``body`` (``$out``: its -o)."""
    script = tmp_path / name
    script.write_text("#!/bin/sh\n"
                      'case "$1" in --version) echo "fake-cc ${FAKE_VERSION:-1.0}"; exit 0;; esac\n'
                      'out=; while [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done\n' + body + "\n")
    script.chmod(0o755)
    return script


def _is_our_library(path) -> bool:
    return hasattr(ctypes.CDLL(str(path)), build.SYMBOL) and not os.stat(path).st_mode & 0o022


# The onnxruntime version.

@pytest.mark.parametrize("version", ["1.16.0", "1.31.1", "1.32.0", "1.20.0.dev20240101", "1.18.1+cu118"])
def test_onnxruntime_versions_of_the_known_layout_are_accepted(version):
    assert ort_custom_ops.version_reason(version) is None


@pytest.mark.parametrize("version", ["1.15.0", "1.15.1", "2.0.0", "2.0.1", "0.9.9", "garbage", "", "1"])
def test_other_onnxruntime_versions_are_refused_with_a_line_naming_them(version):
    assert ort_custom_ops.version_reason(version) == (
        f"onnxruntime {version} is outside the C API layout this runtime knows (1.16 to 1.x)")


def test_the_installed_onnxruntime_is_of_the_known_layout():
    assert ort_custom_ops.version_reason(ort.__version__) is None


def test_an_unknown_onnxruntime_is_refused_before_anything_is_built(tmp_path):
    reason = ort_custom_ops.readiness(types.SimpleNamespace(__version__="2.0.1"))
    assert reason == "onnxruntime 2.0.1 is outside the C API layout this runtime knows (1.16 to 1.x)"
    assert not (tmp_path / "cache").exists() and not _temp_folder(tmp_path).exists()


# The compiler.

def test_without_a_compiler_readiness_names_it_and_register_raises_it(monkeypatch, tmp_path):
    missing = tmp_path / "no-such-compiler"
    monkeypatch.setenv("CC", str(missing))
    reason = ort_custom_ops.readiness(ort)
    assert reason == f"no C compiler ({missing} from CC='{missing}' not found; set CC)"
    assert not ort_custom_ops.available(ort) and ort_custom_ops.library() is None
    with pytest.raises(RuntimeError, match=re.escape(reason)):
        ort_custom_ops.register(ort.SessionOptions(), "test.python", [])


def test_without_cc_on_the_path_readiness_says_to_set_cc(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert ort_custom_ops.readiness(ort) == "no C compiler (cc not found; set CC)"


def test_the_decision_is_made_once_per_process_until_reset(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    first = ort_custom_ops.readiness(ort)
    monkeypatch.setenv("CC", str(_fake_compiler(tmp_path, "exit 1")))
    assert ort_custom_ops.readiness(ort) == first  # no second build in one process
    ort_custom_ops.reset()
    assert ort_custom_ops.readiness(ort).endswith("could not build the custom-op library: exit status 1")


def test_a_compiler_that_fails_gives_its_last_error_line(monkeypatch, tmp_path):
    script = _fake_compiler(tmp_path, 'echo "shim.c: note: first" >&2; echo "fake-cc: error: no headers" >&2; exit 1')
    monkeypatch.setenv("CC", str(script))
    assert ort_custom_ops.readiness(ort) == f"{script} could not build the custom-op library: fake-cc: error: no headers"


def test_a_compiler_that_hangs_is_stopped_and_named(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "COMPILE_TIMEOUT_S", 0.5)
    monkeypatch.setenv("CC", str(_fake_compiler(tmp_path, "exec sleep 30")))
    assert ort_custom_ops.readiness(ort) == f"{tmp_path / 'fake-cc'} did not build the custom-op library in 0.5 s"


def test_a_built_file_that_does_not_load_is_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(_fake_compiler(tmp_path, 'printf "not a library" > "$out"')))
    reason = ort_custom_ops.readiness(ort)
    library = tmp_path / "cache" / build.file_name(build.compiler())
    assert reason.startswith(f"the custom-op library {library} that {tmp_path / 'fake-cc'} built does not load: ")


@needs_cc
@pytest.mark.parametrize("cc", ["env cc", "cc -O1"])
def test_a_compiler_command_with_words_builds_and_passes_the_self_test(monkeypatch, tmp_path, cc):
    plain = build.file_name([shutil.which("cc")])
    monkeypatch.setenv("CC", cc)
    assert ort_custom_ops.readiness(ort) is None and ort_custom_ops.available(ort)
    path = ort_custom_ops.library()
    assert os.path.dirname(path) == str(tmp_path / "cache") and os.path.basename(path) != plain
    assert _is_our_library(path)


# The cache key and the cached file.

def test_the_file_name_keys_the_compiler_its_version_the_machine_and_the_system(monkeypatch, tmp_path):
    command = [str(_fake_compiler(tmp_path, "exit 1"))]
    names = {build.file_name(command), build.file_name([*command, "-m64"])}
    monkeypatch.setenv("FAKE_VERSION", "2.0")
    names.add(build.file_name(command))
    monkeypatch.setattr(platform, "machine", lambda: "riscv128")
    names.add(build.file_name(command))
    monkeypatch.setattr(platform, "system", lambda: "Plan9")
    names.add(build.file_name(command))
    assert len(names) == 5
    assert build.file_name(command) == build.file_name(command)  # and nothing else varies


@needs_cc
@pytest.mark.parametrize("garbage", [b"not a library at all", b"\x7fELF\x02\x01\x01" + bytes(9), b""])
def test_a_corrupt_cached_library_is_built_again(tmp_path, garbage):
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    path = folder / build.file_name(build.compiler())
    path.write_bytes(garbage)
    path.chmod(0o600)
    assert ort_custom_ops.readiness(ort) is None
    assert ort_custom_ops.library() == str(path)
    assert path.read_bytes() != garbage and _is_our_library(path)


@needs_cc
def test_a_cached_library_others_may_write_is_built_again(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    path = folder / build.file_name(build.compiler())
    (tmp_path / "shim.c").write_text(build.SHIM_SOURCE)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(path), str(tmp_path / "shim.c")], check=True)
    path.chmod(0o666)  # a library that loads, but that anyone could have written
    planted = path.stat().st_ino
    assert ort_custom_ops.readiness(ort) is None
    assert path.stat().st_ino != planted and _is_our_library(path)


@needs_cc
def test_under_a_group_writing_umask_the_library_is_built_once_and_reused(tmp_path):
    old = os.umask(0o002)
    try:
        assert ort_custom_ops.readiness(ort) is None
        path = ort_custom_ops.library()
        built = os.stat(path).st_ino
        ort_custom_ops.reset()
        assert ort_custom_ops.readiness(ort) is None and ort_custom_ops.library() == path
    finally:
        os.umask(old)
    assert os.stat(path).st_ino == built and _is_our_library(path)


@needs_cc
def test_a_library_keyed_for_another_machine_is_not_used(monkeypatch, tmp_path):
    command = build.compiler()
    with monkeypatch.context() as m:
        m.setattr(platform, "machine", lambda: "other-arch")
        theirs = tmp_path / "cache" / build.file_name(command)
    theirs.parent.mkdir(mode=0o700)
    theirs.write_bytes(b"another machine's library")
    theirs.chmod(0o600)
    assert ort_custom_ops.readiness(ort) is None
    ours = ort_custom_ops.library()
    assert ours == str(tmp_path / "cache" / build.file_name(command)) and ours != str(theirs)
    assert theirs.read_bytes() == b"another machine's library" and _is_our_library(ours)


# The folders.

@needs_cc
def test_a_cache_path_that_is_no_folder_falls_back_to_the_temp_folder(monkeypatch, tmp_path):
    (tmp_path / "cache-file").write_text("")
    monkeypatch.setenv(CACHE, str(tmp_path / "cache-file"))
    assert ort_custom_ops.readiness(ort) is None
    assert os.path.dirname(ort_custom_ops.library()) == str(_temp_folder(tmp_path))


@needs_cc
def test_a_cache_folder_others_may_write_falls_back_to_the_temp_folder(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache").chmod(0o777)
    assert ort_custom_ops.readiness(ort) is None
    assert os.path.dirname(ort_custom_ops.library()) == str(_temp_folder(tmp_path))
    assert not list((tmp_path / "cache").iterdir())


@needs_cc
@pytest.mark.skipif(os.getuid() == 0, reason="root writes any folder: a read-only mode proves nothing")
def test_a_read_only_cache_folder_falls_back_to_the_temp_folder(tmp_path):
    (tmp_path / "cache").mkdir(mode=0o500)
    try:
        assert ort_custom_ops.readiness(ort) is None
        assert os.path.dirname(ort_custom_ops.library()) == str(_temp_folder(tmp_path))
    finally:
        (tmp_path / "cache").chmod(0o700)


def test_no_writable_folder_is_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(_fake_compiler(tmp_path, "exit 1")))
    (tmp_path / "cache-file").write_text("")
    monkeypatch.setenv(CACHE, str(tmp_path / "cache-file"))
    _temp_folder(tmp_path).write_text("")
    reason = ort_custom_ops.readiness(ort)
    assert reason.startswith("no writable folder for the custom-op library (tried ")
    assert f"{tmp_path / 'cache-file'}: not a folder" in reason and f"{_temp_folder(tmp_path)}: not a folder" in reason
    with pytest.raises(RuntimeError, match=re.escape(reason)):
        ort_custom_ops.register(ort.SessionOptions(), "test.python", [])


# The self-test.

@needs_cc
def test_a_self_test_that_computes_a_wrong_value_is_the_reason(monkeypatch):
    real = ort_custom_ops._add_one

    def add_two(ctx):
        real(ctx)
        shape, _ = ctx.input_shape(0)
        count = int(np.prod(shape))
        out = np.ctypeslib.as_array((ctypes.c_float * count).from_address(ctx.output_ptr(0, shape)))
        out += 1

    monkeypatch.setattr(ort_custom_ops, "_add_one", add_two)
    reason = ort_custom_ops.readiness(ort)
    assert reason.startswith("self-test failed: AssertionError: Neg, AddOne, Relu of ")
    assert not ort_custom_ops.available(ort)
    with pytest.raises(RuntimeError, match=re.escape(reason)):
        ort_custom_ops.register(ort.SessionOptions(), "test.python", [])


@needs_cc
def test_a_self_test_whose_kernel_raises_is_the_reason(monkeypatch):
    def broken(ctx):
        raise ValueError("no such slot")

    monkeypatch.setattr(ort_custom_ops, "_add_one", broken)
    reason = ort_custom_ops.readiness(ort)
    assert reason.startswith("self-test failed: ") and "self-test: ValueError: no such slot" in reason
    assert "\n" not in reason


@needs_cc
def test_the_library_built_here_runs_in_a_fresh_process(tmp_path):
    """What a rank does: another process finds the cached file and decides on its own."""
    env = child_env(**{CACHE: str(tmp_path / "cache")})
    env.pop("CC", None)
    code = ("import onnxruntime as ort; from runtime import ort_custom_ops as m; "
            "print(m.readiness(ort)); print(m.library())")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
            for _ in range(2)]
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.startswith(f"None\n{tmp_path / 'cache'}/")
