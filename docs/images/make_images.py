"""Make every picture in docs/images/ from the current code, or check that the ones there are current.

    python docs/images/make_images.py [NAME ...]          # write them (default: all)
    python docs/images/make_images.py --check [NAME ...]  # make them in a temporary directory and compare

``--check`` exits 1 when a picture is not what this script makes now (tests/test_inspect_images.py
runs it in the full suite). What is made, and from what:

- ``inspect_gpt_rank0.svg``, ``inspect_gpt_rank0_blocks.svg``, ``inspect_gpt_timeline.png``: the
  commands docs/inspect.md lists (the built-in GPT, exported from PyTorch, transpiled for 4 ranks with
  AdamW), run from a scratch directory with this checkout first on PYTHONPATH.
- ``benchmarks.png``: the run docs/benchmarks.md shows (its ``### Run `ID``` heading), drawn from
  benchmarks/results/*.jsonl by ``benchmarks.bench_lib.plot``, as ``python -m benchmarks render`` does.
- ``scaling.svg``, ``scaling-h200x2.svg``, ``scaling-h200x4.svg``: step time and efficiency against GPUs, each by the
  command docs/benchmarks.md gives for it (``python -m benchmarks chart --runs ... -o ...``), from benchmarks/results/*.jsonl by benchmarks/chart.py
  (tests/test_benchmarks_chart.py also compares the points written into it with the rows).
- ``digits_loss.png``: models/digits.py's recipe (4 CPU ranks, 15 epochs). Its loss curve and held-out
  accuracy are kept beside it in ``digits_loss.json`` and the picture is drawn from that file: floating
  point sums may round differently on another CPU, so ``--check`` trains again and compares the curve
  with a tolerance (CURVE_TOLERANCE), then checks the picture against the one drawn from the file.

Not made here: ``run-progress.svg``, a screenshot of a real ``transpile run`` on a terminal, made by
docs/images/run_progress.py; it shows measured times (samples/s, ms/step, elapsed), which differ from
one run to the next, so it cannot be made again byte for byte.

Determinism: the models and data come from fixed seeds; graphviz writes the same SVG for the same
source; matplotlib writes no date (``metadata={'Date': None}`` where it would, ``svg.hashsalt``
fixed, SOURCE_DATE_EPOCH set) and the same pixels for the same drawing. What may differ without
the picture being stale: graphviz's layout (its coordinates depend on its version and on the fonts
installed), so a graphviz SVG that is not the same byte for byte is compared by what it shows (every
text, node and edge title and colour); and matplotlib's anti-aliasing across its versions, so a PNG
drawn by another matplotlib version than the committed one (its "Software" metadata) is reported as
"not compared" instead of failing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
NOT_MADE = {"run-progress.svg": "a terminal screenshot of a real run (measured times): docs/images/run_progress.py",
            "run_progress.py": "a script", "make_images.py": "this script"}
# --check of digits_loss: the curve trained again may differ from the committed one by float rounding
# (another CPU's kernels sum in another order); in log space per step, and the held-out accuracy.
CURVE_TOLERANCE = {"median_log_ratio": 0.05, "max_log_ratio": 1.0, "accuracy": 2 / 360}


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONHASHSEED": "0", "SOURCE_DATE_EPOCH": "0",
            "MPLBACKEND": "Agg", "COLUMNS": "200"}


def _run(args: list[str], cwd: Path) -> None:
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")


# ---------------------------------------------------------------- makers: each writes its pictures into `into`


def make_inspect(into: Path, work: Path) -> None:
    """docs/inspect.md's example, command by command (`transpile` is `python -m transpiler.cli`)."""
    transpile = ["-m", "transpiler.cli"]
    _run(["-m", "models", "gpt", "-o", "examples/gpt"], work)
    _run([*transpile, "examples/gpt/model.onnx", "--gpus", "4", "--strategy", "sharded", "--placement", "hash",
          "--optimizer", "adamw", "-o", "out/gpt"], work)
    _run([*transpile, "inspect", "out/gpt", "--svg", str(into / "inspect_gpt_rank0.svg"), "--rank", "0"], work)
    _run([*transpile, "inspect", "out/gpt", "--svg", str(into / "inspect_gpt_rank0_blocks.svg"), "--rank", "0",
          "--collapse", "blocks"], work)
    _run([*transpile, "inspect", "out/gpt", "--timeline", str(into / "inspect_gpt_timeline.png")], work)


def benchmarks_run(doc: Path = REPO / "docs" / "benchmarks.md") -> str:
    found = re.search(r"^### Run `([^`]+)`", doc.read_text(), re.M)
    if not found:
        raise RuntimeError(f"{doc}: no '### Run `ID`' heading: which run does it show?")
    return found.group(1)


def make_benchmarks(into: Path, work: Path) -> None:
    sys.path.insert(0, str(REPO))
    from benchmarks import bench_lib

    records = bench_lib.load_jsonl(sorted((REPO / "benchmarks" / "results").glob("*.jsonl")))
    bench_lib.plot(bench_lib.select_run(records, benchmarks_run()), into / "benchmarks.png")


def _chart(name: str):
    """The maker of docs/images/NAME: the `python -m benchmarks chart ... -o docs/images/NAME`
    command docs/benchmarks.md gives, run again from benchmarks/results/*.jsonl."""
    def make(into: Path, work: Path) -> None:
        sys.path.insert(0, str(REPO))
        from benchmarks import chart

        args = chart.doc_command(output=f"docs/images/{name}")
        args[args.index("-o") + 1] = str(into / name)
        if chart.main(args) != 0:
            raise RuntimeError("python -m benchmarks chart " + " ".join(args) + " failed")
    return make


def _digits_plot(curve_file: Path, png: Path) -> None:
    sys.path.insert(0, str(REPO))
    from models import digits

    data = json.loads(curve_file.read_text())
    digits.plot([tuple(p) for p in data["curve"]], data["accuracy"], png)


def train_digits(work: Path) -> dict:
    """models/digits.py's recipe, through the real CLI: {"curve": [[step, loss], ...], "accuracy": a}."""
    sys.path.insert(0, str(REPO))
    from models import digits

    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]  # the ranks it starts run this checkout
    try:
        _, curve, accuracy = digits.train(work)
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = old
    return {"recipe": "python -m models.digits --train (models/digits.py: TRANSPILE_ARGS, RUN_ARGS)",
            "accuracy": accuracy, "curve": [[int(s), float(v)] for s, v in curve]}


def make_digits(into: Path, work: Path) -> None:
    data = train_digits(work)
    rows = ",\n".join(json.dumps(point) for point in data.pop("curve"))  # a line per step: diffs read well
    (into / "digits_loss.json").write_text(json.dumps(data)[:-1] + ', "curve": [\n' + rows + "\n]}\n")
    _digits_plot(into / "digits_loss.json", into / "digits_loss.png")


MAKERS = {  # picture -> (maker, every file it writes)
    "inspect": (make_inspect, ["inspect_gpt_rank0.svg", "inspect_gpt_rank0_blocks.svg", "inspect_gpt_timeline.png"]),
    "benchmarks": (make_benchmarks, ["benchmarks.png"]),
    "scaling": (_chart("scaling.svg"), ["scaling.svg"]),
    "scaling-h200x2": (_chart("scaling-h200x2.svg"), ["scaling-h200x2.svg"]),
    "scaling-h200x4": (_chart("scaling-h200x4.svg"), ["scaling-h200x4.svg"]),
    "digits": (make_digits, ["digits_loss.json", "digits_loss.png"]),
}


# ---------------------------------------------------------------- comparing


def _graphviz_version(text: str) -> str | None:
    found = re.search(r"Generated by graphviz version ([^\n]*?)\s*\n", text)
    return found.group(1) if found else None


def _svg_content(text: str) -> tuple[list[str], list[str]]:
    """What a graphviz SVG shows, without where: every text and title (nodes and edges are titled
    by their ids) and every colour, sorted."""
    return (sorted(re.findall(r"<(?:text|title)[^>]*>([^<]*)</(?:text|title)>", text)),
            sorted(re.findall(r'(?:fill|stroke)="([^"]*)"', text)))


def _png_software(path: Path) -> str | None:
    from PIL import Image

    with Image.open(path) as image:
        return image.info.get("Software")


def _png_pixels(path: Path):
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGBA"))


def compare(committed: Path, fresh: Path) -> tuple[str, str]:
    """("same" | "differs" | "not compared", why) for one picture."""
    if not committed.exists():
        return "differs", "missing from docs/images/"
    if committed.read_bytes() == fresh.read_bytes():
        return "same", ""
    if committed.suffix == ".svg":  # graphviz: the layout depends on its version and on the fonts installed
        old, new = committed.read_text(), fresh.read_text()
        if _svg_content(old) == _svg_content(new):
            v_old, v_new = _graphviz_version(old), _graphviz_version(new)
            return "same", ("same texts, boxes and colours; the layout differs" +
                            (f" (drawn by graphviz {v_old}, this is {v_new})" if v_old != v_new else " (fonts?)"))
        return "differs", "its texts, boxes or colours differ from what this script draws now"
    if committed.suffix == ".png":
        a, b = _png_pixels(committed), _png_pixels(fresh)
        if a.shape == b.shape and (a == b).all():
            return "same", "same pixels (metadata differs)"
        s_old, s_new = _png_software(committed), _png_software(fresh)
        if s_old != s_new:
            return "not compared", f"drawn by {s_old}, this is {s_new}: pixels may differ with the renderer"
        if a.shape != b.shape:
            return "differs", f"other size: {a.shape[1]}x{a.shape[0]} committed, {b.shape[1]}x{b.shape[0]} now"
        return "differs", f"{int((a != b).any(axis=-1).sum())} pixels differ"
    return "differs", "not the file this script makes now"


def compare_curves(committed: dict, fresh: dict) -> tuple[str, str]:
    """The digits loss curve trained again against the committed one, within CURVE_TOLERANCE."""
    a, b = committed["curve"], fresh["curve"]
    if [s for s, _ in a] != [s for s, _ in b]:
        return "differs", f"other steps ({len(a)} committed, {len(b)} now)"
    ratios = sorted(abs(math.log(x / y)) for (_, x), (_, y) in zip(a, b))
    median, worst = ratios[len(ratios) // 2], ratios[-1]
    d_acc = abs(committed["accuracy"] - fresh["accuracy"])
    t = CURVE_TOLERANCE
    if median > t["median_log_ratio"] or worst > t["max_log_ratio"] or d_acc > t["accuracy"]:
        return "differs", (f"the loss curve moved: median |log ratio| {median:.3g}, max {worst:.3g}, accuracy "
                           f"{committed['accuracy']:.4f} -> {fresh['accuracy']:.4f} (tolerance {t})")
    return "same", f"curve within tolerance (median |log ratio| {median:.2g}, accuracy {fresh['accuracy']:.4f})"


def check(names: list[str], images: Path = HERE) -> list[tuple[str, str, str]]:
    """(file, status, why) for every file of the named makers, made afresh and compared with `images`."""
    results = []
    with tempfile.TemporaryDirectory(prefix="docs-images-") as tmp:
        tmp = Path(tmp)
        for name in names:
            maker, files = MAKERS[name]
            into, work = tmp / name, tmp / f"{name}-work"
            into.mkdir()
            work.mkdir()
            if name == "digits":  # the curve with a tolerance; the picture drawn from the committed curve
                curve = images / "digits_loss.json"
                if not curve.exists():
                    results.append(("digits_loss.json", "differs", "missing from docs/images/"))
                    continue
                results.append(("digits_loss.json", *compare_curves(json.loads(curve.read_text()), train_digits(work))))
                _digits_plot(curve, into / "digits_loss.png")
                results.append(("digits_loss.png", *compare(images / "digits_loss.png", into / "digits_loss.png")))
                continue
            maker(into, work)
            results += [(f, *compare(images / f, into / f)) for f in files]
    return results


def unmade(images: Path = HERE) -> list[str]:
    """Files in docs/images/ that no maker writes and NOT_MADE does not explain."""
    made = {f for _, files in MAKERS.values() for f in files}
    return sorted(p.name for p in images.iterdir() if p.is_file() and p.name not in made and p.name not in NOT_MADE
                  and not p.name.startswith("."))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"which (default: all): {', '.join(MAKERS)}")
    parser.add_argument("--check", action="store_true", help="compare with docs/images/ instead of writing; exit 1 "
                                                             "if any differs")
    args = parser.parse_args(argv)
    names = args.names or list(MAKERS)
    if set(names) - set(MAKERS):
        parser.error(f"unknown: {', '.join(sorted(set(names) - set(MAKERS)))} (known: {', '.join(MAKERS)})")
    if shutil.which("dot") is None and "inspect" in names:
        print("graphviz 'dot' is not installed (apt-get install graphviz)", file=sys.stderr)
        return 2
    if args.check:
        results = check(names)
        for f, status, why in results:
            print(f"{status:12s} {f}" + (f": {why}" if why else ""))
        extra = unmade()
        for f in extra:
            print(f"{'unknown':12s} {f}: no maker writes it (add one to MAKERS, or say why in NOT_MADE)")
        stale = [f for f, status, _ in results if status == "differs"] + extra
        if stale:
            print(f"stale: {', '.join(stale)}; run 'python docs/images/make_images.py' and commit the result")
            return 1
        return 0
    with tempfile.TemporaryDirectory(prefix="docs-images-") as tmp:
        for name in names:
            maker, files = MAKERS[name]
            work = Path(tmp) / name
            work.mkdir()
            maker(HERE, work)
            print("wrote " + ", ".join(f"docs/images/{f}" for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
