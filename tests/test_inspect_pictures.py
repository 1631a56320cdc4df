"""``transpile inspect``'s tables and pictures read right (issue 29, "Pictures and tables"):

- on a terminal, every user string (shapes such as ``[batch, 10]``, names, paths) is shown as it is,
  not read as rich markup, and a table's title is a line of its own, not wrapped inside the table;
- the ``--svg`` labels have no literal backslash-n, constants are not drawn by default and the
  built-in GPT's rank graph stays small;
- the ``--timeline`` labels never overlap (checked on the text boxes matplotlib draws) and the file
  is the same for the same drawing.
"""

from __future__ import annotations

import io
import os
import pty
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from inspection.render import render  # noqa: E402
from inspection.report import build_report  # noqa: E402

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' is not installed")


@pytest.fixture(scope="module")
def outs(tmp_path_factory, model_dir):
    """The built-in GPT on 2 and 4 ranks (AdamW; the 4-rank one also with small buckets: 60
    collectives), and the perceptron on 2 ranks."""
    from transpiler import transpile
    from transpiler.optimizer import OptimizerConfig
    from transpiler.passes import Options

    root = tmp_path_factory.mktemp("pictures")
    made = {}
    for key, model, world, bucket_mb, opt in [("gpt2", "gpt", 2, 25.0, "adamw"), ("gpt4", "gpt", 4, 25.0, "adamw"),
                                              ("gpt4_small_buckets", "gpt", 4, 0.3, "adamw"),
                                              ("p2", "perceptron", 2, 25.0, "momentum")]:
        transpile(str(model_dir(model) / "model.onnx"), str(root / key),
                  Options(world_size=world, strategy="sharded", optimizer=OptimizerConfig(name=opt), bucket_mb=bucket_mb))
        made[key] = root / key
    made["gpt_model"] = model_dir("gpt") / "model.onnx"
    made["perceptron_model"] = model_dir("perceptron") / "model.onnx"
    return made


# ---------------------------------------------------------------- tables on a terminal


def _terminal(rep: dict, width: int = 120) -> str:
    from rich.console import Console

    buf = io.StringIO()
    render(rep, console=Console(file=buf, force_terminal=True, width=width, color_system="standard"))
    return ANSI.sub("", buf.getvalue())


def test_terminal_tables_show_shapes_and_names_as_they_are(outs):
    pytest.importorskip("rich")
    text = _terminal(build_report(outs["perceptron_model"]))
    assert "┃" in text  # the rich tables, not the plain text
    assert text.count("[batch, 10]") == 1 and text.count("[batch, 1]") == 1, text
    # what looks like markup in a name, a path or a note is printed, not interpreted
    rep = build_report(outs["perceptron_model"])
    rep["model"]["inputs"][0]["name"] = "[bold red]X[/bold red]"
    rep["model"]["file"] = "[link=x]model.onnx"
    rep["model"]["ops"] = {"[i]Gemm": 2}
    text = _terminal(rep)
    assert "[bold red]X[/bold red]" in text and "[link=x]model.onnx" in text and "[i]Gemm 2" in text, text
    # an OUT: shapes in the model and initializer tables, for every parameter
    text = _terminal(build_report(outs["gpt4"], [0]), width=200)
    assert text.count("[batch, 128]") == 2
    assert "[4096, 256]" in text and "[1, 128, 256]" in text


def test_terminal_titles_are_lines_of_their_own(outs):
    pytest.importorskip("rich")
    rep = build_report(outs["perceptron_model"])
    title = next(line for line in _terminal(rep, width=60).splitlines() if line.startswith("model: "))
    assert title.rstrip() == "model: model.onnx (opset 18, 6 nodes)"  # not cut to the table's width
    # a title longer than the terminal breaks between words only
    rep["model"]["file"] = "a_rather_long_model_file.onnx"
    lines = _terminal(rep, width=36).splitlines()
    head = lines[:lines.index(next(x for x in lines if x.startswith("┏")))]
    assert [line.rstrip() for line in head] == ["model: a_rather_long_model_file.onnx", "(opset 18, 6 nodes)"], head


def test_inspect_under_a_pty_shows_every_shape(outs):
    """The real command on a pseudo-terminal: rich draws its tables, every shape is in them."""
    pytest.importorskip("rich")
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "200", "TERM": "xterm", "PYTHONPATH": str(REPO)}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, "-m", "transpiler.cli", "inspect", str(outs["gpt4"]), "--rank", "0"],
                            stdin=slave, stdout=slave, stderr=slave, cwd=REPO, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=120) == 0
    text = ANSI.sub("", b"".join(chunks).decode(errors="replace"))
    assert "┃" in text
    assert text.count("[batch, 128]") == 2 and "[4096, 256]" in text, text[:2000]


# ---------------------------------------------------------------- --svg


def _title(source: str) -> str:
    """The DOT source's graph label, its lines joined."""
    return re.search(r'^  label="(.*)"; labelloc', source, re.M).group(1).replace("\\n", " ")


def _svg_texts(svg: str) -> list[str]:
    return re.findall(r"<text[^>]*>([^<]*)</text>", svg)


def _svg_size(svg: str) -> tuple[float, float]:
    m = re.search(r'<svg width="([\d.]+)pt" height="([\d.]+)pt"', svg)
    return float(m.group(1)), float(m.group(2))


@needs_dot
@pytest.mark.parametrize("key, collapse", [("gpt2", "auto"), ("gpt4", "auto"), ("gpt4", "blocks"), ("p2", "off")])
def test_gpt_svg_has_no_literal_backslash_n(outs, tmp_path, key, collapse):
    svg = tmp_path / "g.svg"
    done = subprocess.run([sys.executable, "-m", "transpiler.cli", "inspect", str(outs[key]), "--svg", str(svg),
                           "--collapse", collapse], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    texts = _svg_texts(svg.read_text())
    assert texts and not [t for t in texts if "\\" in t], [t for t in texts if "\\" in t][:5]
    # the multi-line labels are drawn as lines: the collectives' "bucket B root R" is a line of its own
    assert any(re.fullmatch(r"bucket \d+( root \d+)?", t) for t in texts)


@pytest.mark.parametrize("collapse", ["off", "blocks", "segments"])
def test_gpt_dot_labels_break_lines_with_dot_escapes(outs, collapse):
    """Every label of the GPT's rank graph, at every fold level (dot itself is too slow on the
    unfolded GPT for a quick test): line breaks are DOT's ``\\n``, never an escaped backslash."""
    from inspection.draw import graph_dot
    from inspection.outdir import load_plan

    source, _ = graph_dot(outs["gpt4"] / "rank0.onnx", 0, load_plan(outs["gpt4"]), collapse=collapse, constants=True)
    labels = re.findall(r'label="((?:[^"\\]|\\.)*)"', source)
    assert len(labels) > 10 and not [x for x in labels if "\\\\" in x], [x for x in labels if "\\\\" in x][:5]
    assert any("\\n" in x for x in labels)


@needs_dot
def test_svg_labels_keep_backslashes_and_quotes(tmp_path):
    """A name with a backslash or a quote is drawn as it is (escaped once, not twice)."""
    from inspection.draw import _label

    name = 'a\\n"q"'  # a backslash, then n, then quotes: in a name, not a line break
    source = "digraph g { a [label=" + _label(name, "second line") + "]; }"
    svg = subprocess.run(["dot", "-Tsvg"], input=source, text=True, capture_output=True, check=True).stdout
    assert _svg_texts(svg) == ["a\\n&quot;q&quot;", "second line"]


@needs_dot
def test_gpt_svg_is_small_and_draws_no_constant_by_default(outs, tmp_path):
    from inspection.draw import MAX_BOXES, graph_dot
    from inspection.outdir import load_plan

    for key in ("gpt4", "gpt4_small_buckets", "gpt2"):
        out = outs[key]
        plan = load_plan(out)
        path = out / plan["graphs"]["ranks"][0]["step"]
        model = onnx.load(str(path), load_external_data=False)
        n_colls = sum(n.domain == "graph_transpiler" for n in model.graph.node)
        source, boxes = graph_dot(path, 0, plan)
        assert boxes <= MAX_BOXES + n_colls, (key, boxes)
        assert "constants not drawn" in _title(source) and "label=\"Constant" not in source
        svg = tmp_path / f"{key}.svg"
        subprocess.run(["dot", "-Tsvg", "-o", str(svg)], input=source, text=True, check=True)
        texts = _svg_texts(svg.read_text())
        assert not [t for t in texts if t.startswith("Constant")], key
        if key == "gpt4":  # readable at page width: the picture of docs/inspect.md
            width, height = _svg_size(svg.read_text())
            assert width <= 1000 and height <= 1200, (width, height)
    # --constants draws every Constant node (a box each when nothing folds)
    out = outs["gpt2"]
    plan = load_plan(out)
    path = out / "rank0.onnx"
    n_const = sum(n.op_type == "Constant" for n in onnx.load(str(path), load_external_data=False).graph.node)
    source, _ = graph_dot(path, 0, plan, collapse="off", constants=True)
    assert n_const > 50 and len(re.findall(r'label="Constant\\n', source)) == n_const
    assert "constants not drawn" not in _title(source) and "constant (grey)" in _title(source)


def test_svg_fold_levels(outs):
    """auto picks the finest level that stays readable; each level draws every collective alone."""
    from inspection.draw import graph_dot
    from inspection.outdir import load_plan

    plan = load_plan(outs["gpt4"])
    path = outs["gpt4"] / "rank0.onnx"
    sizes = {level: graph_dot(path, 0, plan, collapse=level)[1] for level in ("off", "blocks", "segments", "auto")}
    assert sizes["off"] > sizes["blocks"] > sizes["segments"] == sizes["auto"], sizes
    assert "one box per segment and class" in _title(graph_dot(path, 0, plan)[0])
    title = _title(graph_dot(outs["p2"] / "rank0.onnx", 0, load_plan(outs["p2"]))[0])
    assert "folded" not in title and "one box per" not in title  # a small graph: a box per node


# ---------------------------------------------------------------- --timeline


def test_spread_keeps_order_and_gaps():
    from inspection.draw import _spread

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 30)
        centers = sorted(rng.uniform(0, 500) for _ in range(n))
        widths = [rng.uniform(5, 30) for _ in range(n)]
        lefts = _spread(centers, widths, 0.0, 1000.0, 4.0)
        for i in range(n - 1):
            assert lefts[i] + widths[i] + 4.0 <= lefts[i + 1] + 1e-9
        assert lefts[0] >= -1e-9 and lefts[-1] + widths[-1] <= 1000.0 + 1e-9
    # labels far apart stay centred on their targets
    assert _spread([100.0, 300.0], [20.0, 20.0], 0, 1000, 4) == [90.0, 290.0]


def _text_boxes(fig):
    """Every non-empty visible text of the figure with its box in pixels (annotations: the text
    only, without the leader line)."""
    from matplotlib.text import Text

    renderer = fig.canvas.get_renderer()
    undrawn = set()  # labels of ticks outside the axis' view: matplotlib does not draw them
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not lo - 1e-9 <= tick.get_loc() <= hi + 1e-9:
                    undrawn |= {id(tick.label1), id(tick.label2)}
    found = []
    for t in fig.findobj(Text):
        if t.get_visible() and t.get_text().strip() and id(t) not in undrawn:
            found.append((t, Text.get_window_extent(t, renderer)))
    return found


@pytest.mark.parametrize("key", ["gpt4", "gpt4_small_buckets", "gpt2", "p2"])
def test_timeline_labels_never_overlap(outs, key):
    pytest.importorskip("matplotlib")
    from matplotlib.patches import Rectangle
    from matplotlib.text import Annotation

    from inspection.draw import timeline_figure

    report = build_report(outs[key])
    fig, sched = timeline_figure(report)
    fig.canvas.draw()
    boxes = _text_boxes(fig)
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[i + 1:]:
            overlap_w = min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0)
            overlap_h = min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0)
            assert overlap_w <= 0.5 or overlap_h <= 0.5, (a.get_text(), b.get_text(), box_a, box_b)
    fig_box = fig.bbox
    for t, box in boxes:  # nothing drawn off the figure
        assert box.x0 >= -0.5 and box.y0 >= -0.5 and box.x1 <= fig_box.x1 + 0.5 and box.y1 <= fig_box.y1 + 0.5, \
            t.get_text()
    (ax,) = fig.axes
    renderer = fig.canvas.get_renderer()
    bars = [p.get_window_extent(renderer) for p in ax.patches if isinstance(p, Rectangle)]
    inside = [(t, box) for t, box in boxes if t in ax.texts and not isinstance(t, Annotation)]
    for t, box in inside:  # a label written in a box fits in it
        assert any(bar.x0 - 0.5 <= box.x0 and box.x1 <= bar.x1 + 0.5 and bar.y0 - 0.5 <= box.y0
                   and box.y1 <= bar.y1 + 0.5 for bar in bars), t.get_text()
    tags = [t for t in ax.texts if isinstance(t, Annotation)]
    axes_top = ax.get_window_extent(renderer).y1
    assert all(box.y0 >= axes_top for t, box in boxes if t in tags)
    # every collective is labelled: inside its boxes, or by a tag the key spells out
    orders = {it["index"] for it in sched["items"] if it["lane"] == "comm"}
    labelled = {int(m.group(1)) for t, _ in inside if (m := re.match(r"#(\d+) ", t.get_text()))}
    tagged = {int(t.get_text()[1:]) for t in tags}
    assert labelled | tagged == orders and not labelled & tagged
    keyed = {int(m.group(1)) for t in fig.texts if (m := re.match(r"#(\d+): ", t.get_text()))}
    assert keyed == tagged or (len(tagged) > 48 and len(keyed) == 47)
    if key == "gpt4_small_buckets":
        assert len(orders) > 40 and len({t.xyann[1] for t in tags}) >= 2  # a second row of tags


def test_timeline_file_is_the_same_for_the_same_drawing(outs, tmp_path):
    pytest.importorskip("matplotlib")
    from inspection.draw import draw_timeline

    report = build_report(outs["gpt4"])
    for suffix in (".svg", ".png", ".pdf"):
        a, b = tmp_path / f"a{suffix}", tmp_path / f"b{suffix}"
        draw_timeline(report, str(a))
        draw_timeline(report, str(b))
        assert a.read_bytes() == b.read_bytes(), suffix
    svg = (tmp_path / "a.svg").read_text()
    assert "<dc:date>" not in svg
