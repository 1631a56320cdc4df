"""The pipeline as units: PIPELINE is what docs/architecture.md draws, and each pass checks its
preconditions and postconditions."""

from __future__ import annotations

import re
from pathlib import Path

import onnx_ir as ir
import pytest
from onnx_ir.passes import PostconditionError, PreconditionError

from transpiler import Options, build, load_problem
from transpiler.job import Job
from transpiler.passes import PIPELINE, AutodiffPass, BucketingPass

ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def test_pipeline_is_the_one_the_docs_draw():
    drawn = re.search(r"^PIPELINE = \[(.*)\]$", ARCHITECTURE.read_text(), re.M).group(1)
    assert [name.strip() for name in drawn.split(",")] == [p.__name__ for p in PIPELINE]


def test_every_pass_is_in_its_own_module():
    modules = [p.__module__ for p in PIPELINE]
    assert len(set(modules)) == len(modules) and all(m.startswith("transpiler.passes.") for m in modules)


def test_autodiff_requires_the_batchnorm_pass(model_dir):
    problem = load_problem(model_dir("perceptron") / "model.onnx")
    with pytest.raises(PreconditionError, match="BatchNormPass"):
        AutodiffPass(Job(problem=problem, options=Options()))(problem.model)


def test_bucketing_ensures_one_root_per_bucket_where_the_strategy_needs_it(model_dir):
    job = build(model_dir("perceptron") / "model.onnx", Options(world_size=2, strategy="sharded", placement="balanced"))
    assert len({job.placement.roots[p] for p in job.problem.params}) == 2
    mixed = job.buckets[0]
    mixed.params = list(job.problem.params)
    job.buckets = [mixed]
    with pytest.raises(PostconditionError, match="mix roots"):
        BucketingPass(job).ensures(ir.Model(ir.Graph([], [], nodes=[]), ir_version=10))
