"""The pictures in docs/images/ are what docs/images/make_images.py makes from the current code.

The full check makes every picture again (the GPT exported and transpiled, the digits CNN trained on
4 CPU ranks: about 15 s on 2 cores) and is marked slow; that every file there has a maker is quick.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _make_images():
    spec = importlib.util.spec_from_file_location("make_images", REPO / "docs" / "images" / "make_images.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_images", module)
    spec.loader.exec_module(module)
    return module


def test_every_docs_image_has_a_maker():
    make = _make_images()
    assert make.unmade() == []
    # and every maker's files are there
    made = [f for _, files in make.MAKERS.values() for f in files]
    assert [f for f in made if not (REPO / "docs" / "images" / f).is_file()] == []


def test_the_benchmarks_picture_shows_the_run_the_doc_shows():
    make = _make_images()
    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert f"### Run `{make.benchmarks_run()}`" in text


@pytest.mark.slow
def test_docs_images_are_current():
    if shutil.which("dot") is None:
        pytest.skip("graphviz 'dot' is not installed (apt-get install graphviz)")
    pytest.importorskip("torch")  # the GPT and the digits CNN are exported from PyTorch
    pytest.importorskip("matplotlib")
    make = _make_images()
    results = make.check(list(make.MAKERS))
    stale = [f"{f}: {why}" for f, status, why in results if status == "differs"]
    assert not stale, "stale pictures (run 'python docs/images/make_images.py'): " + "; ".join(stale)
    assert {f for f, _, _ in results} == {f for _, files in make.MAKERS.values() for f in files}
