"""Base class of the collective node executors: one small subclass per op of domain graph_transpiler.

An executor is built once per node (when a rank graph is cut into segments) from the node's
attributes and the static types of its outputs, checks what it can against this rank's role
(root or not), and then runs every step by calling the Communicator.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import onnx
from onnx import helper

from runtime.collectives.base import Communicator, TensorSpec
from runtime.errors import RunError


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


def _attr_value(attr: onnx.AttributeProto):
    value = helper.get_attribute_value(attr)
    return value.decode() if isinstance(value, bytes) else value
