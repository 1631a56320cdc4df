"""Two hosts on one machine: two network namespaces joined by a veth pair (10.200.0.1/24 and
10.200.0.2/24, inside the namespaces only), one CPU rank in each, MPI over TCP between them,
started by `transpile run --hostfile`.

MPICH's Hydra starts the remote rank through its ssh launcher; HYDRA_LAUNCHER_EXEC points it at a
small script that runs the command inside the namespace of the host named (where a cluster has
ssh). UCX_TLS=tcp,self keeps MPI off shared memory, which two namespaces of one machine would
otherwise still share: the ranks talk over the veth pair as two hosts would over a network.

Needs root (or CAP_NET_ADMIN) and iproute2; skips with the reason printed otherwise.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import load_data, max_rel_error
from onnx import numpy_helper

from runtime import simulate

REPO = Path(__file__).resolve().parent.parent
ADDRESSES = ("10.200.0.1", "10.200.0.2")
BATCH, STEPS = 8, 3

pytestmark = pytest.mark.mpi


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _skip(reason: str):
    print(f"test_two_hosts skipped: {reason}", file=sys.stderr)
    pytest.skip(reason)


class TwoHosts:
    """The namespaces, their veth ends, and the launcher script that enters them by address."""

    def __init__(self, tmp: Path):
        token = f"{os.getpid() % 100000}{secrets.token_hex(2)}"  # unique per run: other jobs may do the same
        self.namespaces = (f"gt{token}a", f"gt{token}b")
        self.links = (f"gt{token}x", f"gt{token}y")  # interface names: at most 15 characters
        self.launcher = tmp / "netns-launcher"
        cases = "\n".join(f"  {a}) ns={ns};;" for a, ns in zip(ADDRESSES, self.namespaces))
        # Hydra runs `LAUNCHER [-x] HOST "COMMAND"` as it would run ssh.
        self.launcher.write_text(f'#!/bin/sh\nwhile [ "${{1#-}}" != "$1" ]; do shift; done\nhost=$1; shift\n'
                                 f'case $host in\n{cases}\n  *) echo "no namespace for host $host" >&2; exit 1;;\nesac\n'
                                 'exec ip netns exec "$ns" sh -c "$*"\n')
        self.launcher.chmod(0o755)

    def create(self) -> str | None:
        """None, or why the namespaces cannot be made here."""
        a, b = self.namespaces
        x, y = self.links
        steps = [("netns", "add", a), ("netns", "add", b), ("link", "add", x, "type", "veth", "peer", "name", y),
                 ("link", "set", x, "netns", a), ("link", "set", y, "netns", b),
                 ("-n", a, "addr", "add", f"{ADDRESSES[0]}/24", "dev", x),
                 ("-n", b, "addr", "add", f"{ADDRESSES[1]}/24", "dev", y),
                 ("-n", a, "link", "set", x, "up"), ("-n", b, "link", "set", y, "up"),
                 ("-n", a, "link", "set", "lo", "up"), ("-n", b, "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                return f"`ip {' '.join(step)}` failed: {done.stderr.strip() or done.returncode}"
        return None

    def pids(self, namespace: str) -> list[int]:
        return [int(p) for p in _ip("netns", "pids", namespace).stdout.split()]

    def destroy(self) -> None:
        for namespace in self.namespaces:
            for pid in self.pids(namespace):  # only processes of this test live in its namespaces
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "del", namespace)  # also removes its end of the veth pair, and so the pair

    def run(self, *args: str, hostfile: Path, **popen):
        """``transpile run ARGS --hostfile FILE``, started inside the first namespace."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_", "SLURM_", "HYDRA_"))}
        env.update(PYTHONPATH=str(REPO), UCX_TLS="tcp,self", UCX_LOG_LEVEL="info",
                   HYDRA_LAUNCHER="ssh", HYDRA_LAUNCHER_EXEC=str(self.launcher))
        command = ["ip", "netns", "exec", self.namespaces[0], sys.executable, "-m", "commands", "run", *args,
                   "--hostfile", str(hostfile)]
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


@pytest.fixture
def two_hosts(tmp_path):
    if os.geteuid() != 0:
        _skip("not root: network namespaces need CAP_NET_ADMIN")
    if shutil.which("ip") is None:
        _skip("no `ip` (iproute2): apt-get install -y iproute2")
    if shutil.which("mpiexec") is None:
        _skip("no mpiexec")
    if "HYDRA" not in subprocess.run(["mpiexec", "--version"], capture_output=True, text=True).stdout:
        _skip("the test drives MPICH's Hydra launcher (HYDRA_LAUNCHER_EXEC); this mpiexec is another")
    hosts = TwoHosts(tmp_path)
    try:
        problem = hosts.create()
        if problem is not None:
            _skip(f"cannot make network namespaces here: {problem}")
        yield hosts
    finally:
        hosts.destroy()
        assert not any(ns in _ip("netns", "list").stdout for ns in hosts.namespaces)


@pytest.fixture
def out_and_data(model_dir, tmp_path):
    from transpiler import Options, transpile

    transpile(model_dir("perceptron") / "model.onnx", tmp_path / "transpiled", Options(world_size=2, strategy="sharded"))
    # OUT moved after transpiling: nothing in it may depend on where it was written.
    moved = tmp_path / "elsewhere" / "out"
    moved.parent.mkdir()
    shutil.move(tmp_path / "transpiled", moved)
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# two hosts, one rank each (Open MPI's form, then MPICH's)\n{ADDRESSES[0]} slots=1\n"
                        f"{ADDRESSES[1]}:1\n")
    return moved, model_dir("perceptron") / "data.npz", hostfile


def _trained(path: Path) -> dict[str, np.ndarray]:
    arrays = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    return {k: v for k, v in arrays.items() if v.dtype.kind == "f"}


def test_two_hosts_train_like_one_device(two_hosts, out_and_data, tmp_path):
    out, data, hostfile = out_and_data
    job = two_hosts.run(str(out), "--data", str(data), "--batch", str(BATCH), "--steps", str(STEPS), "--log-every", "1",
                        "--export", str(tmp_path / "two-hosts.onnx"), hostfile=hostfile)
    stdout, stderr = job.communicate(timeout=180)
    assert job.returncode == 0, stderr[-3000:]
    steps = [line.split()[1] for line in stdout.splitlines() if line.startswith("step ")]
    assert steps == [f"{s}/{STEPS}" for s in range(1, STEPS + 1)]
    # Each rank ran in its own namespace and reached the other over TCP on its end of the veth pair
    # (UCX's log, on stdout; its variables reached the remote rank unchanged).
    for link in two_hosts.links:
        assert f"inter-node cfg#1 tag(tcp/{link})" in stdout, f"no MPI traffic over TCP on {link}"

    trained = _trained(tmp_path / "two-hosts.onnx")
    arrays = load_data(data)
    ranks = simulate(out, arrays, batch=BATCH, steps=STEPS)
    for name, value in ranks.parameters[0].items():
        np.testing.assert_array_equal(trained[name], value, err_msg=name)  # MPI over TCP == local collectives
    one_device = simulate(out, arrays, batch=BATCH, steps=STEPS, single_device=True)
    assert max_rel_error(trained, one_device.parameters[0]) < 1e-5
    assert max_rel_error(trained, _trained(out / "model.onnx")) > 1e-3  # training moved them

    # The same OUT on one host with two local ranks: the plan holds nothing of the machine's shape.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_", "SLURM_"))}
    env["PYTHONPATH"] = str(REPO)
    local = subprocess.run([sys.executable, "-m", "commands", "run", str(out), "--data", str(data), "--batch", str(BATCH),
                            "--steps", str(STEPS), "--log-every", "0", "--export", str(tmp_path / "one-host.onnx")],
                           env=env, capture_output=True, text=True, timeout=180)
    assert local.returncode == 0, local.stderr
    for name, value in _trained(tmp_path / "one-host.onnx").items():
        np.testing.assert_array_equal(trained[name], value, err_msg=name)


def test_killing_the_rank_on_one_host_stops_the_other(two_hosts, out_and_data):
    out, data, hostfile = out_and_data
    timeout = 20
    job = two_hosts.run(str(out), "--data", str(data), "--batch", str(BATCH), "--steps", "10000000", "--log-every",
                        "10000000", "--timeout", str(timeout), hostfile=hostfile)
    try:
        for first in job.stdout:  # step 1 is always logged: both ranks are training (UCX logs here too)
            if first.startswith("step "):
                break
        assert first.startswith("step 1/"), job.stderr.read()[-3000:]
        remote = [pid for pid in two_hosts.pids(two_hosts.namespaces[1])
                  if b"runtime.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(remote) == 1
        os.kill(remote[0], signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = job.communicate(timeout=timeout + 30)
        took = time.monotonic() - killed
    finally:
        if job.poll() is None:
            job.kill()
    assert took < timeout, f"the job took {took:.0f} s to stop"
    assert job.returncode != 0
    ours = [line for line in stderr.splitlines() if line.startswith("transpile:")]
    assert ours == [f"transpile: error: a rank (pid {remote[0]} on {ADDRESSES[1]}) was killed by signal 9 (SIGKILL); "
                    "the other ranks were stopped"], stderr[-3000:]
    deadline = time.monotonic() + 10
    while any(b"runtime.worker" in Path(f"/proc/{p}/cmdline").read_bytes() for p in two_hosts.pids(two_hosts.namespaces[0])
              if Path(f"/proc/{p}").exists()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in two_hosts.pids(two_hosts.namespaces[0]) if Path(f"/proc/{p}").exists()
                and b"runtime.worker" in Path(f"/proc/{p}/cmdline").read_bytes()], "the rank on the first host survived"
