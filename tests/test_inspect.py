"""``transpile inspect`` and ``transpile view``: facts checked against plan.json, pictures, Netron, errors.

The small GPT is built here from ops that have gradient rules today (attention softmax and
LayerNorm written out with Exp/ReduceSum/Div/Sqrt, one-hot tokens through MatMul), with the block
naming of a PyTorch export (``/blocks/blocks.0/attn/...``). Write it for the docs with
``python tests/test_inspect.py OUT_MODEL_DIR``.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from contract.plan import load_plan  # noqa: E402
from inspection.costs import traffic  # noqa: E402
from inspection.render import plain, render, sections_of  # noqa: E402
from inspection.report import build_report  # noqa: E402

# ---------------------------------------------------------------- models


def read_plan(out: Path) -> dict:
    """plan.json as readers see it (format 2 writes a rank that shares an earlier one's graphs as
    {"rank", "same_as"}; the contract's reader expands it)."""
    return load_plan(out, report_fields=True).raw


def tiny_gpt(layers: int = 2, width: int = 16, vocab: int = 24, seq: int = 8, seed: int = 0) -> onnx.ModelProto:
    """x one-hot [batch, seq, vocab] -> embed + pos -> pre-LN blocks (causal attention, ReLU MLP)
    -> LN -> head -> log-softmax cross-entropy against one-hot targets y."""
    rng = np.random.default_rng(seed)
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def param(name, shape, scale=0.2, offset=0.0):
        inits.append(numpy_helper.from_array((offset + scale * rng.standard_normal(shape)).astype(np.float32), name))
        return name

    def const(name, value):  # a Constant node, not an initializer: float initializers would be trained
        nodes.append(helper.make_node("Constant", [], [name], name=f"/const/{name}",
                                      value=numpy_helper.from_array(np.asarray(value), name)))
        return name

    def node(op, inputs, scope, **attrs):
        name = f"{scope}/{op}_{len(nodes)}"
        nodes.append(helper.make_node(op, inputs, [name + "_output_0"], name=name, **attrs))
        return name + "_output_0"

    def layernorm(x, scope, prefix):
        mean = node("ReduceMean", [x, "axes_last"], scope, keepdims=1)
        xc = node("Sub", [x, mean], scope)
        var = node("ReduceMean", [node("Mul", [xc, xc], scope), "axes_last"], scope, keepdims=1)
        std = node("Sqrt", [node("Add", [var, "eps"], scope)], scope)
        y = node("Div", [xc, std], scope)
        return node("Add", [node("Mul", [y, param(f"{prefix}.weight", [width], 0.02, 1.0)], scope),
                            param(f"{prefix}.bias", [width], 0.02)], scope)

    def softmax(x, scope):
        e = node("Exp", [x], scope)
        return node("Div", [e, node("ReduceSum", [e, "axes_last"], scope, keepdims=1)], scope)

    const("axes_last", np.array([-1], np.int64))
    const("eps", np.array(1e-5, np.float32))
    const("scale", np.array(1.0 / np.sqrt(width), np.float32))
    const("causal", np.triu(np.full((seq, seq), -1e4, np.float32), 1))
    h = node("MatMul", ["x", param("wte.weight", [vocab, width])], "/wte")
    h = node("Add", [h, param("wpe", [seq, width])], "/wpe")
    for i in range(layers):
        s, p = f"/blocks/blocks.{i}", f"blocks.{i}"
        a = layernorm(h, f"{s}/ln_1", f"{p}.ln_1")
        q = node("MatMul", [a, param(f"{p}.attn.q.weight", [width, width])], f"{s}/attn/q")
        k = node("MatMul", [a, param(f"{p}.attn.k.weight", [width, width])], f"{s}/attn/k")
        v = node("MatMul", [a, param(f"{p}.attn.v.weight", [width, width])], f"{s}/attn/v")
        kt = node("Transpose", [k], f"{s}/attn", perm=[0, 2, 1])
        att = node("Add", [node("Mul", [node("MatMul", [q, kt], f"{s}/attn"), "scale"], f"{s}/attn"), "causal"],
                   f"{s}/attn")
        y = node("MatMul", [softmax(att, f"{s}/attn"), v], f"{s}/attn")
        y = node("MatMul", [y, param(f"{p}.attn.proj.weight", [width, width])], f"{s}/attn/proj")
        h = node("Add", [h, y], s)
        m = layernorm(h, f"{s}/ln_2", f"{p}.ln_2")
        m = node("Add", [node("MatMul", [m, param(f"{p}.mlp.fc.weight", [width, 4 * width])], f"{s}/mlp/fc"),
                         param(f"{p}.mlp.fc.bias", [4 * width], 0.02)], f"{s}/mlp/fc")
        m = node("Relu", [m], f"{s}/mlp/act")
        m = node("Add", [node("MatMul", [m, param(f"{p}.mlp.proj.weight", [4 * width, width])], f"{s}/mlp/proj"),
                         param(f"{p}.mlp.proj.bias", [width], 0.02)], f"{s}/mlp/proj")
        h = node("Add", [h, m], s)
    h = layernorm(h, "/ln_f", "ln_f")
    logits = node("MatMul", [h, param("lm_head.weight", [width, vocab])], "/lm_head")
    e = node("Exp", [logits], "/loss")
    logp = node("Sub", [logits, node("Log", [node("ReduceSum", [e, "axes_last"], "/loss", keepdims=1)], "/loss")], "/loss")
    picked = node("ReduceSum", [node("Mul", [logp, "y"], "/loss"), "axes_last"], "/loss", keepdims=0)
    nodes.append(helper.make_node("ReduceMean", [picked], ["nll"], name="/loss/ReduceMean", keepdims=0))
    nodes.append(helper.make_node("Neg", ["nll"], ["loss"], name="/loss/Neg"))
    graph = helper.make_graph(
        nodes, "tiny_gpt",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", seq, vocab]) for n in ("x", "y")],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def transpile_cli(*args, check: bool = True, env=None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "transpiler.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=300, env=env)
    if check:
        assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done


@pytest.fixture(scope="module")
def outs(tmp_path_factory, model_dir):
    """Transpiled perceptron (1, 2, 4 ranks; sharded and allreduce) and tiny GPT (4 ranks)."""
    root = tmp_path_factory.mktemp("inspect")
    perceptron = model_dir("perceptron") / "model.onnx"
    gpt = root / "gpt.onnx"
    onnx.save(tiny_gpt(), gpt)
    from transpiler import transpile
    from transpiler.optimizer import OptimizerConfig
    from transpiler.passes import Options

    made = {}
    # gpt4 keeps --placement hash: under balanced each of its ranks' parameters fit one 10 KB bucket
    for key, model, n, strategy, opt, bucket_mb in [
        ("p1", perceptron, 1, "sharded", "sgd", 25.0),
        ("p2", perceptron, 2, "sharded", "momentum", 25.0),
        ("p4", perceptron, 4, "sharded", "adam", 25.0),
        ("p4ar", perceptron, 4, "allreduce", "sgd", 25.0),
        ("gpt4", gpt, 4, "sharded", "adamw", 0.01),
    ]:
        out = root / key
        transpile(str(model), str(out), Options(world_size=n, strategy=strategy, optimizer=OptimizerConfig(name=opt),
                                                bucket_mb=bucket_mb, placement="hash" if key == "gpt4" else "balanced"))
        made[key] = out
    return made


# ---------------------------------------------------------------- JSON facts against the plan


def test_traffic_model():
    # ring AllReduce: 2(N-1)/N of the bucket each way; chains for Reduce and Broadcast
    assert traffic("AllReduce", 400, None, 0, 4) == (600, 600)
    assert [traffic("Reduce", 100, 1, r, 4) for r in range(4)] == [(100, 100), (0, 100), (100, 0), (100, 100)]
    assert [traffic("Broadcast", 100, 1, r, 4) for r in range(4)] == [(0, 100), (100, 0), (100, 100), (100, 100)]
    assert traffic("Reduce", 100, 0, 0, 1) == (0, 0)
    # every byte sent is received: the model conserves volume
    for op in ("Reduce", "Broadcast"):
        sent = sum(traffic(op, 64, 2, r, 5)[0] for r in range(5))
        recv = sum(traffic(op, 64, 2, r, 5)[1] for r in range(5))
        assert sent == recv == 4 * 64


@pytest.mark.parametrize("key", ["p1", "p2", "p4", "p4ar", "gpt4"])
def test_json_matches_plan(outs, key):
    out = outs[key]
    plan = read_plan(out)
    done = transpile_cli("inspect", out, "--json")
    rep = json.loads(done.stdout)
    assert rep["format"] == "graph-transpiler/inspect" and rep["kind"] == "out"
    world = plan["world_size"]
    assert [rk["rank"] for rk in rep["ranks"]] == list(range(world))
    sizes = {p["name"]: p["bytes"] for p in plan["parameters"]}
    for rk in rep["ranks"]:
        r = rk["rank"]
        entry = plan["graphs"]["ranks"][r]
        assert len(rk["collectives"]) == len(plan["collectives"]["step"])
        for got, want in zip(rk["collectives"], plan["collectives"]["step"]):
            assert (got["order"], got["op"], got["root"], got["bucket"], got["reduction"]) == \
                (want["order"], want["op"], want["root"], want["bucket"], want["reduction"])
            assert got["bytes"] == want["bytes"] == sum(sizes[p] for p in want["params"])
            assert [t["param"] for t in got["tensors"]] == want["params"]
            assert got["is_root"] == (want["root"] == r if want["root"] is not None else None)
            assert (got["sent_bytes"], got["recv_bytes"]) == traffic(want["op"], want["bytes"], want["root"], r, world)
        assert rk["sent_bytes_per_step"] == sum(traffic(c["op"], c["bytes"], c["root"], r, world)[0]
                                                for c in plan["collectives"]["step"])
        assert rk["optimizer_state_bytes"] == entry["optimizer_state_bytes"]
        assert rk["updates"] == entry["updates"]
        # segments: K collectives cut the graph into at most K+1 segments, each followed by its collective
        k = len(rk["collectives"])
        assert all(0 <= s["index"] <= k for s in rk["segments"])
        assert [s["followed_by"] for s in rk["segments"]] == [s["index"] if s["index"] < k else None
                                                            for s in rk["segments"]]
    # the placement table is the plan's, for both methods
    for method, info in rep["placement"]["methods"].items():
        src = plan["placement"] if method == plan["placement"]["method"] else plan["placement"]["other_methods"][method]
        assert info["bytes_per_rank"] == src["bytes_per_rank"]
        assert info["imbalance"] == src["imbalance"]
    assert set(rep["placement"]["methods"]) == {"hash", "balanced"}
    assert rep["buckets"] == [{k: b[k] for k in ("id", "root", "bytes", "params")} for b in plan["buckets"]]
    if world > 1 and plan["strategy"] == "sharded":
        # sharded: each rank's optimizer state is exactly that of the parameters it is root of
        for rk in rep["ranks"]:
            roots = {p["name"] for p in plan["parameters"] if p["root"] == rk["rank"]}
            assert set(rk["updates"]) == roots


def test_sharded_reduce_and_broadcast_per_bucket(outs):
    plan = read_plan(outs["gpt4"])
    rep = build_report(outs["gpt4"], [1], segments=False)
    ops = [c["op"] for c in rep["ranks"][0]["collectives"]]
    n = len(plan["buckets"])
    assert n > 4, "a small bucket cap must give the tiny GPT several buckets"
    assert ops == ["Reduce"] * n + ["Broadcast"] * n
    assert [c["root"] for c in rep["ranks"][0]["collectives"][:n]] == [b["root"] for b in plan["buckets"]]


def test_model_file_summary(model_dir):
    path = model_dir("perceptron") / "model.onnx"
    rep = json.loads(transpile_cli("inspect", path, "--json").stdout)
    m = rep["model"]
    assert rep["kind"] == "model"
    assert [i["name"] for i in m["inputs"]] == ["X", "Y"] and m["inputs"][0]["shape"] == ["batch", 10]
    assert m["outputs"] == [{"name": "loss", "dtype": "float32", "shape": []}]
    assert m["initializers"] == {"count": 4, "elements": 100 * 10 + 100 + 100 + 1, "bytes": 4 * 1201}
    assert m["ops"] == {"Gemm": 2, "Mul": 1, "ReduceMean": 1, "Relu": 1, "Sub": 1}


# ---------------------------------------------------------------- text: plain when piped, rich on a terminal


def test_text_states_the_same_facts(outs):
    out = outs["p4"]
    plan = read_plan(out)
    text = transpile_cli("inspect", out).stdout
    assert "\x1b[" not in text and "┃" not in text, "piped output must be plain text"
    for c in plan["collectives"]["step"]:
        row = next(line for line in text.splitlines() if line.strip().startswith(f"{c['order']}  {c['op']}"))
        assert f"{c['bytes']:,}" in row and c["params"][0] in row.replace("grad.", "").replace(".next", "")
    for b in plan["buckets"]:
        assert any(line.split()[:3] == [str(b["id"]), str(b["root"]), f"{b['bytes']:,}"] for line in text.splitlines())
    rep = build_report(out)
    for rk in rep["ranks"]:
        assert f"sends {rk['sent_bytes_per_step']:,} bytes and receives {rk['recv_bytes_per_step']:,} bytes" in text
        assert f"optimizer state kept: {rk['optimizer_state_bytes']:,} bytes" in text
    assert f"{plan['placement']['method']} {plan['placement']['imbalance']:.3f} (used)" in text


def test_rich_on_a_terminal(outs):
    rich = pytest.importorskip("rich.console")
    rep = build_report(outs["p2"])
    buf = io.StringIO()
    render(rep, console=rich.Console(file=buf, force_terminal=True, width=200, color_system="standard"))
    text = buf.getvalue()
    assert "\x1b[" in text and "┃" in text  # styled tables
    buf2 = io.StringIO()
    render(rep, console=rich.Console(file=buf2, force_terminal=False, width=200))
    assert buf2.getvalue().strip() == plain(sections_of(rep)).strip()


def test_env_forces_rich(outs):
    pytest.importorskip("rich")
    env = {**os.environ, "FORCE_COLOR": "1", "COLUMNS": "200"}
    text = transpile_cli("inspect", outs["p2"], env=env).stdout
    assert "┃" in text


def test_diff(outs):
    rep = json.loads(transpile_cli("inspect", outs["p4"], "--diff", "--json").stdout)
    d = rep["diff"]
    assert d["user_nodes"] == 6
    plan = read_plan(outs["p4"])
    for rk in d["ranks"]:
        t = rk["totals"]
        assert t["forward"] == 6 and rk["forward_removed"] == 0
        assert t["collective"] == len(plan["collectives"]["step"])
        assert t["backward"] > 0
        assert sum(t.values()) == rk["nodes"]
        assert "lr" in rk["inputs_added"]
        assert sorted(rk["initializers_now_inputs"]) == sorted(p["name"] for p in plan["parameters"])
    # a rank that updates nothing adds only the step counter as optimizer nodes
    idle = [rk for rk in d["ranks"] if not plan["graphs"]["ranks"][rk["rank"]]["updates"]]
    busy = [rk for rk in d["ranks"] if plan["graphs"]["ranks"][rk["rank"]]["updates"]]
    assert all(i["totals"]["optimizer"] < b["totals"]["optimizer"] for i in idle for b in busy)
    text = transpile_cli("inspect", outs["p4"], "--diff", "--rank", "0").stdout
    assert "forward kept 6" in text and "graph_transpiler::Reduce" in text and "rank 1" not in text


# ---------------------------------------------------------------- pictures


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' is not installed (apt-get install graphviz)")
@pytest.mark.parametrize("key,rank", [("p4", 3), ("p4ar", 0), ("gpt4", 2), ("p1", 0)])
def test_svg_has_every_collective(outs, tmp_path, key, rank):
    svg = tmp_path / "g.svg"
    done = transpile_cli("inspect", outs[key], "--svg", svg, "--rank", rank)
    assert "wrote" in done.stdout
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    model = onnx.load(outs[key] / f"rank{rank}.onnx")
    colls = [n for n in model.graph.node if n.domain == "graph_transpiler"]
    for n in colls:
        assert n.name in text, n.name  # each collective is its own box, named in its tooltip
    if colls:
        assert "segment 0" in text
    if key == "gpt4":  # repeated blocks fold: far fewer boxes than nodes
        boxes = int(done.stdout.split("(")[-1].split()[0])
        assert boxes < len(model.graph.node) / 3, (boxes, len(model.graph.node))
        assert "blocks.1 backward" in text


def test_svg_without_dot_says_how_to_install(outs, tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no dot on this PATH
    done = transpile_cli("inspect", outs["p2"], "--svg", tmp_path / "g.svg", check=False, env=env)
    assert done.returncode == 2 and "apt-get install graphviz" in done.stderr and len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize("key", ["p1", "p2", "p4", "gpt4"])
def test_timeline_png(outs, tmp_path, key):
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    transpile_cli("inspect", outs[key], "--timeline", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_schedule_and_measured_timings(outs, tmp_path):
    from inspection.draw import load_timings, schedule

    rep = build_report(outs["p4"])
    est = schedule(rep)
    assert est["measured"] == 0 and est["step_seconds"] > 0
    # collectives end together on every rank and never overlap each other
    comm = sorted({(it["index"], it["start"], it["end"]) for it in est["items"] if it["lane"] == "comm"})
    assert len(comm) == len(rep["ranks"][0]["collectives"])
    assert all(a[2] <= b[1] + 1e-15 for a, b in zip(comm, comm[1:]))
    # a segment never starts before its rank's previous one ends
    for r in range(4):
        segs = [it for it in est["items"] if it["rank"] == r and it["lane"] == "compute"]
        assert all(a["end"] <= b["start"] + 1e-15 for a, b in zip(segs, segs[1:]))
    path = tmp_path / "timings.json"
    path.write_text(json.dumps({"ranks": [{"rank": 0, "segments": {"0": 1.0}, "collectives": {"0": 0.5}}]}))
    measured = schedule(rep, load_timings(path))
    assert measured["measured"] == 2 and measured["step_seconds"] > 1.5
    transpile_cli("inspect", outs["p4"], "--timeline", tmp_path / "m.png", "--timings", path)


# ---------------------------------------------------------------- Netron


def test_view_serves_on_loopback_and_stops(outs):
    pytest.importorskip("netron")
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    proc = subprocess.Popen([sys.executable, "-m", "transpiler.cli", "view", outs["p2"] / "rank1.onnx"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving ") and "http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() else "")
        assert "no display" in line
        url = line.split(" at ")[1].split()[0]
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert resp.status == 200 and b"<html" in resp.read().lower()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert "stopped" in out and "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
    port = int(url.rsplit(":", 1)[1].strip("/"))
    with socket.socket() as s:  # the port is free again
        s.settimeout(2)
        assert s.connect_ex(("127.0.0.1", port)) != 0


# ---------------------------------------------------------------- bad input


def _one_line_error(done: subprocess.CompletedProcess, *fragments: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("transpile: error: ") and "Traceback" not in done.stderr, done.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])


@pytest.mark.parametrize("sub", ["inspect", "view"])
def test_bad_input(outs, tmp_path, sub):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"this is not a protobuf \x00\xff\x07")
    _one_line_error(transpile_cli(sub, junk, check=False), "junk.onnx", "not an ONNX model")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(transpile_cli(sub, empty, check=False), "no plan.json")
    _one_line_error(transpile_cli(sub, outs["p2"], "--rank", "2", check=False), "--rank 2 is out of range", "0..1")
    _one_line_error(transpile_cli(sub, tmp_path / "missing.onnx", check=False), "missing.onnx")


def test_inspect_rank_out_of_range_for_pictures(outs, tmp_path):
    _one_line_error(transpile_cli("inspect", outs["p4"], "--timeline", tmp_path / "t.png", "--rank", "7", check=False),
                    "--rank 7 is out of range")
    _one_line_error(transpile_cli("inspect", outs["p4"] / "model.onnx", "--timeline", tmp_path / "t.png", check=False),
                    "needs an OUT directory")


def test_a_conv_weight_gradient_node_costs_what_its_forward_conv_costs():
    """Estimated FLOPs of ``ConvWeightGrad`` (the backward's weight gradients, one node each) equal
    the forward Conv's: the same products, summed over another index."""
    from inspection.costs import node_flops
    from inspection.model import Types

    f32 = TensorProto.FLOAT
    conv = helper.make_node("Conv", ["x", "w"], ["y"], strides=[2, 2], pads=[1, 1, 1, 1])
    wgrad = helper.make_node("ConvWeightGrad", ["x", "y"], ["dw"], domain="graph_transpiler.conv",
                             kernel_shape=[3, 3], strides=[2, 2], dilations=[1, 1], pads=[1, 1, 1, 1])
    graph = helper.make_graph(
        [conv, wgrad], "g",
        [helper.make_tensor_value_info("x", f32, [4, 6, 16, 16]), helper.make_tensor_value_info("w", f32, [8, 6, 3, 3])],
        [helper.make_tensor_value_info("dw", f32, [8, 6, 3, 3])],
        value_info=[helper.make_tensor_value_info("y", f32, [4, 8, 8, 8])])
    types = Types(graph)
    assert node_flops(wgrad, types) == node_flops(conv, types) == 2 * (4 * 8 * 8 * 8) * (6 * 3 * 3)


if __name__ == "__main__":  # python tests/test_inspect.py DIR: write DIR/model.onnx (the tiny GPT) for the docs
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    onnx.save(tiny_gpt(), target / "model.onnx")
    print(target / "model.onnx")

