"""Base class of the collective node executors: one small subclass per op of domain graph_transpiler.

An executor is built once per node (when a rank graph is cut into segments) from the node's
attributes and the static types of its outputs, checks what it can against this rank's role
(root or not), and then runs every step by calling the Communicator.

Two ways to run a node, behind the same class:
- ``run``: the list form (each backend's Communicator packs the bucket its own way); the CPU
  program, init graphs and the GPU program's first call use it.
- the flat form, for programs that keep one persistent flat buffer per collective (the GPU program,
  runtime/gpu/program.py): ``flat_layout`` says how big the buffer is and which rank owns which
  slice, ``flat_inputs``/``flat_outputs`` give the node's values as views of it, ``launch_flat``
  enqueues the Communicator's flat call in place (and the mean division).
A new collective implements both here; no program switches on the op name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import numpy as np
import onnx
from onnx import helper

from runtime.collectives.base import Communicator, TensorSpec, aligned_offsets, flat_views
from runtime.errors import RunError

# Where a bucket's layout is the runtime's own (a bucket that moves whole), each tensor starts at a
# multiple of this many elements (256 bytes in float32): the tensors are bound as device views into
# the bucket, and cuDNN refuses a Conv weight at an address not aligned to 16 bytes
# (CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER, ResNet-18 on 2 GPUs); cuBLAS is fastest from 256.
# The padding is zeros and stays zeros (sums and copies of zeros). ReduceScatter/AllGather keep the
# contract's packed layout (docs/contracts.md).
FLAT_ALIGN = 64


@dataclass(frozen=True)
class FlatLayout:
    """One collective's flat buffer: ``total`` elements; this rank's slice is
    ``[rank*shard, (rank+1)*shard)`` (``shard`` is 0 where no rank owns a slice); the node's inputs
    and outputs are views shaped ``in_shapes`` / ``out_shapes`` (where the op says), in order, each
    at a multiple of ``align`` elements."""

    total: int
    shard: int
    rank: int
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    align: int = 1  # each view starts at a multiple of this many elements

    @cached_property
    def inputs_end(self) -> int:
        """Where the inputs' views end (after it, to ``total``, the padding)."""
        return aligned_offsets(self.in_shapes, self.align)[-1]

    def mine(self, buf):
        """This rank's slice of ``buf`` (NumPy or CuPy, ``total`` elements)."""
        return buf[self.rank * self.shard:(self.rank + 1) * self.shard]


def _size(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


class CollectiveOp(ABC):
    op_type: ClassVar[str]
    required: ClassVar[tuple[str, ...]] = ("order",)

    def __init__(self, node: onnx.NodeProto, output_specs: Sequence[TensorSpec], rank: int, where: str):
        self.name = node.name or f"{node.op_type}({', '.join(node.output) or ', '.join(node.input)})"
        self.where = f"{where}: node '{self.name}'"
        self.rank = rank
        self.inputs = tuple(node.input)
        self.outputs = tuple(node.output)
        self.output_specs = tuple(output_specs)
        self.attrs = {a.name: _attr_value(a) for a in node.attribute}
        missing = [name for name in self.required if name not in self.attrs]
        if missing:
            raise RunError(f"{self.where}: {self.op_type} lacks attribute(s) {', '.join(missing)}")
        self.order = int(self.attrs["order"])
        # How messages (a timeout, an NCCL failure) name this collective; made once, read every step.
        self.label = f"{self.op_type} '{self.name}' (order {self.order})"
        self.check()

    def check(self) -> None:
        """Validate the node against this rank's role; subclasses add their own rules."""
        if "" in self.inputs or "" in self.outputs:
            raise RunError(f"{self.where}: collectives take no omitted (empty-named) inputs or outputs")

    def fail(self, what: str) -> RunError:
        return RunError(f"{self.where}: {what}")

    @abstractmethod
    def run(self, comm: Communicator, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """Outputs of the node on this rank, in ``self.outputs`` order."""

    # -- the flat form (one persistent buffer per collective, the collective in place) ----------
    def flat_layout(self, in_shapes: Sequence[Sequence[int]], world: int, rank: int) -> FlatLayout:
        """The buffer of a bucket that moves whole: the inputs back to back, no slice per rank.
        ``in_shapes`` are the inputs' run-time shapes (the output specs give the outputs')."""
        in_shapes = tuple(tuple(s) for s in in_shapes)
        return FlatLayout(aligned_offsets(in_shapes, FLAT_ALIGN)[-1], 0, rank, in_shapes, self._out_shapes(), FLAT_ALIGN)

    def _out_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(s.shape) for s in self.output_specs)

    def flat_inputs(self, layout: FlatLayout, buf) -> dict[str, Any]:
        """Input name -> its view of ``buf``: where the producer writes it (or it is copied in)."""
        return dict(zip(self.inputs, flat_views(buf, layout.in_shapes, layout.align))) if self.inputs else {}

    def flat_outputs(self, layout: FlatLayout, buf) -> dict[str, Any]:
        """Output name -> its view of ``buf`` once the collective is done."""
        return dict(zip(self.outputs, flat_views(buf, layout.out_shapes, layout.align)))

    def flat_mean_view(self, layout: FlatLayout, buf):
        """What ``reduction="mean"`` divides after the sum: the reduced part of ``buf``."""
        return buf

    @abstractmethod
    def call_flat(self, comm: Communicator, buf, label: str) -> None:
        """Enqueue this collective on ``buf`` in place: one ``Communicator.*_flat`` call."""

    def receives_result(self, rank: int) -> bool:
        """Whether ``rank`` holds the reduced result (all ranks, except for a rooted reduction)."""
        return True

    def launch_flat(self, comm: Communicator, buf, mean_view, label: str) -> None:
        """The flat call, then the contract's mean (``sum / size``) where this rank holds the sum."""
        self.call_flat(comm, buf, label)
        if self.attrs.get("reduction") == "mean" and self.receives_result(comm.rank):
            comm.finish_mean(mean_view)


def _attr_value(attr: onnx.AttributeProto):
    value = helper.get_attribute_value(attr)
    return value.decode() if isinstance(value, bytes) else value
