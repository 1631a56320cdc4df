"""The cut the GPU backend makes (native stages for the BatchNorm, Conv weight-gradient and fused
update nodes between onnxruntime segments, the tail split by collective), run on CPU: each
segment by onnxruntime, each native group by onnxruntime through the nodes' functions. Training a
Conv + BatchNorm ResNet this way ends where the CPU backend's uncut graph does, so the stages are a
valid order of the graph (runtime/segments.py ``_stages``): checked here without a GPU."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

import models
from contract.ops import BATCHNORM_DOMAIN, CONV_GRAD_DOMAIN, FUSED_UPDATE_DOMAIN
from runtime.collectives import LocalGroup
from runtime.config import RunConfig
from runtime.data import Dataset
from runtime.executor import CpuBackend, OrtCpuSegment
from runtime.loop import train
from runtime.plan import load_plan
from runtime.schedule import Schedule
from runtime.segments import NativeGroup
from runtime.trainer import Trainer
from transpiler import OptimizerConfig, Options, transpile

NATIVE = frozenset({BATCHNORM_DOMAIN, CONV_GRAD_DOMAIN, FUSED_UPDATE_DOMAIN})


class _NativeGroupOnCpu:
    """A native group as one onnxruntime CPU session of its nodes and the step model's functions."""

    def __init__(self, group: NativeGroup, step: onnx.ModelProto, types: dict[str, onnx.TypeProto]):
        self.outputs = list(group.outputs)
        graph = helper.make_graph(list(group.nodes), "native", [helper.make_value_info(n, types[n]) for n in group.inputs],
                                  [helper.make_value_info(n, types[n]) for n in group.outputs])
        model = helper.make_model(graph, opset_imports=step.opset_import, ir_version=step.ir_version,
                                  functions=step.functions)
        self.session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

    def run(self, feeds):
        return self.session.run(self.outputs, feeds)


class _CutLikeTheGpu(CpuBackend):
    """The CPU backend with the GPU's cut: native domains and the tail split."""

    native_domains = NATIVE

    def __init__(self, step: onnx.ModelProto):
        super().__init__(threads=1)
        self.step = step
        inferred = onnx.shape_inference.infer_shapes(step)
        self.types = {v.name: v.type for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
        self.groups: list[NativeGroup] = []

    def split_tail(self) -> bool:
        return True

    def compile(self, segment, where):
        if isinstance(segment, NativeGroup):
            self.groups.append(segment)
            return _NativeGroupOnCpu(segment, self.step, self.types)
        return OrtCpuSegment(segment, where, self.threads)


def _train(out, data, backend) -> dict[str, np.ndarray]:
    plan = load_plan(out)
    trainer = Trainer(plan, LocalGroup(1).communicator(0), rank=0, backend=backend)
    config = RunConfig(batch=8, steps=3, lr=plan.lr, shuffle=False, seed=0, schedule=Schedule(), eval_every=0)
    train(trainer, Dataset(data, plan.data_inputs, "<data>"), config)
    return {name: np.asarray(value) for name, value in trainer.parameters().items()}


def test_the_gpu_cut_of_a_batchnorm_resnet_trains_like_the_uncut_graph(tmp_path):
    model, data_path = models.generate("cnn_small", tmp_path / "model", seed=0, rows=32)
    out = tmp_path / "out"
    transpile(model, out, Options(world_size=1, optimizer=OptimizerConfig("sgd", lr=0.05, momentum=0.9)))
    data = dict(np.load(data_path))
    step = onnx.load(out / "rank0.onnx")
    assert {n.domain for n in step.graph.node} >= NATIVE

    backend = _CutLikeTheGpu(step)
    cut = _train(out, data, backend)
    # Native stages between onnxruntime segments, in the forward and the backward alike.
    assert len(backend.groups) >= 4
    assert any(n.domain == BATCHNORM_DOMAIN for g in backend.groups for n in g.nodes)
    uncut = _train(out, data, CpuBackend(threads=1))
    assert cut.keys() == uncut.keys()
    for name, value in uncut.items():
        np.testing.assert_allclose(cut[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
