"""--hostfile / --hosts: parsing both hostfile formats, the slot check, and the mpiexec command
line each MPI needs (tests/test_two_hosts.py runs one for real)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from test_runtime_launcher import _clean_env
from test_runtime_outdir import make_data, write_out

from runtime import RunError, variables
from runtime.cli import main
from runtime.launcher import Host, check_slots, hostfile_text, mpiexec_command, parse_hostfile, parse_hosts


def test_hostfile_formats_and_comments(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# the cluster\nnode1 slots=4   # Open MPI's form\n\nnode2:4\nnode3\n  node4 slots=2\n")
    assert parse_hostfile(path) == [Host("node1", 4), Host("node2", 4), Host("node3", 1), Host("node4", 2)]
    assert parse_hosts("h1:4,h2:4,h3") == [Host("h1", 4), Host("h2", 4), Host("h3", 1)]


@pytest.mark.parametrize("text, message", [
    ("node1 slots=4 max_slots=8\n", r"line 1: expected 'host slots=N' or 'host:N', got 'node1 slots=4 max_slots=8'"),
    ("node1\nnode2 slots=two\n", r"line 2: slots of node2 must be a whole number >= 1, got 'two'"),
    ("node1:0\n", r"line 1: slots of node1 must be a whole number >= 1, got '0'"),
    ("# nothing\n\n", r"names no host"),
])
def test_bad_hostfiles_are_one_line_errors(tmp_path, text, message):
    (tmp_path / "hosts").write_text(text)
    with pytest.raises(RunError, match=f"^--hostfile {tmp_path / 'hosts'}(, |: ){message}$"):
        parse_hostfile(tmp_path / "hosts")


def test_slots_must_add_up_to_the_world_size():
    check_slots([Host("a", 4), Host("b", 4)], 8, "--hosts a:4,b:4")
    with pytest.raises(RunError, match=r"^--hosts a:4,b:2: 6 slot\(s\) in all \(a:4, b:2\), but the plan was transpiled "
                                       r"for world_size 8; the slots must add up to it \(one rank per slot\)$"):
        check_slots([Host("a", 4), Host("b", 2)], 8, "--hosts a:4,b:2")


def test_each_mpi_gets_its_own_hostfile_and_environment(tmp_path):
    hosts = [Host("n1", 2), Host("n2", 2)]
    assert hostfile_text(hosts, "openmpi") == "n1 slots=2\nn2 slots=2\n"
    assert hostfile_text(hosts, "mpich") == "n1:2\nn2:2\n"
    env = {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_NVLS_ENABLE": "0", "UCX_TLS": "rc", "HOME": "/root",
           "PYTHONPATH": "/src", variables.DEBUG_SYNC: "1", variables.NATIVE_OFF: "all",
           "GRAPH_TRANSPILER_UNKNOWN": "1"}
    openmpi = mpiexec_command("mpirun", "openmpi", 4, ["--config-json", "{}"], tmp_path / "h", env)
    assert openmpi[openmpi.index("--hostfile") + 1] == str(tmp_path / "h")
    # Open MPI passes only what -x names to remote hosts: NCCL_*, UCX_*, PYTHONPATH and the runtime's
    # debugging aids (runtime/variables.py), unchanged; no other variable of ours is read by a rank.
    passed = [openmpi[i + 1] for i, word in enumerate(openmpi) if word == "-x"]
    assert passed == sorted(["NCCL_NVLS_ENABLE", "NCCL_SOCKET_IFNAME", "PYTHONPATH", "UCX_TLS", variables.DEBUG_SYNC,
                             variables.NATIVE_OFF])
    mpich = mpiexec_command("mpiexec", "mpich", 4, ["--config-json", "{}"], tmp_path / "h", env)
    assert mpich[:5] == ["mpiexec", "-f", str(tmp_path / "h"), "-genvall", "-n"]  # Hydra: the whole environment
    assert mpich[-5:] == [sys.executable, "-m", "runtime.worker", "--config-json", "{}"]
    with pytest.raises(RunError, match="neither Open MPI nor MPICH/Hydra"):
        mpiexec_command("mpiexec", "unknown", 4, [], tmp_path / "h", env)


def test_cli_checks_hosts_before_starting_anything(tmp_path, capsys, monkeypatch):
    _clean_env(monkeypatch)
    out = write_out(tmp_path / "out", 2, "allreduce")
    np.savez(tmp_path / "d.npz", **make_data())
    run = ["run", str(out), "--data", str(tmp_path / "d.npz"), "--batch", "4", "--steps", "1"]
    assert main([*run, "--hosts", "a:1,b:2"]) == 2
    assert capsys.readouterr().err == ("transpile: error: --hosts a:1,b:2: 3 slot(s) in all (a:1, b:2), but the plan "
                                       "was transpiled for world_size 2; the slots must add up to it (one rank per "
                                       "slot)\n")
    assert main([*run, "--hostfile", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == f"transpile: error: --hostfile {tmp_path / 'missing'}: No such file or directory\n"
    with pytest.raises(SystemExit):
        main([*run, "--hosts", "a:2", "--hostfile", "x"])  # one or the other
    assert "not allowed with argument" in capsys.readouterr().err
    # Under an outside launcher the hosts are its business: nothing is started.
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "2")
    assert main([*run, "--hosts", "a:1,b:1"]) == 2
    assert capsys.readouterr().err.startswith("transpile: error: --hostfile/--hosts: this process is already a rank "
                                              "started by MPICH/Hydra, which chose the hosts")


def test_the_plan_ranks_agree_on_holds_nothing_of_the_host(model_dir, tmp_path):
    """One model transpiled on two hosts from different directories is one plan: the ranks'
    agreement and --resume ignore where the model was (plan.json records its absolute path, for provenance).
    Nothing else in plan.json names a host, a path outside OUT, or GPUs per host."""
    import json
    import shutil
    import socket

    from runtime.checkpoint import plan_hash
    from runtime.plan import load_plan
    from transpiler import Options, transpile

    hashes = {}
    for where, strategy in (("host-a/models", "sharded"), ("host-b/home/me", "sharded"), ("host-b/other", "allreduce")):
        (tmp_path / where).mkdir(parents=True)
        shutil.copy(model_dir("perceptron") / "model.onnx", tmp_path / where / "model.onnx")
        transpile(tmp_path / where / "model.onnx", tmp_path / where / "out", Options(world_size=2, strategy=strategy))
        plan = load_plan(tmp_path / where / "out")
        hashes[where] = plan_hash(plan)
        text = plan.path.read_text()
        assert socket.gethostname() not in text
        paths = [v for v in _strings(json.loads(text)) if "/" in v and v != "graph-transpiler/plan"]
        assert paths == [str(tmp_path / where / "model.onnx")]  # source_model.path, and nothing else
    assert hashes["host-a/models"] == hashes["host-b/home/me"]
    assert hashes["host-b/other"] != hashes["host-a/models"]  # a real difference still counts


def _strings(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value
