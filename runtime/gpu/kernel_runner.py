"""``RawKernelRunner``: the nodes of a NativeGroup run by the RawKernels of one CUDA source, on the
device's compute stream (layernorm.py, cross_entropy.py, scatter_add.py, parameter_casts.py,
bias_grad.py).

What such runners share: the group's nodes parsed once (a malformed node is refused naming it), the
source compiled once per process and device (cuda.compiled_module) and its kernels looked up once,
and a launch error that names the node (CuPy's name none).
"""

from __future__ import annotations

from abc import abstractmethod

from runtime.errors import RunError
from runtime.executor import LaunchRunner
from runtime.gpu.cuda import compiled_module
from runtime.segments import place


def aligned(*arrays, to: int = 16) -> bool:
    """Whether every device array starts on a ``to``-byte boundary (a kernel's vector accesses;
    onnxruntime's and CuPy's buffers are at least 256-byte aligned, a view into a bucket may not be)."""
    return all(a.data.ptr % to == 0 for a in arrays)


def vector_width(width: int, *arrays) -> int:
    """4 where rows of ``width`` values hold whole accesses of 4 and every array is ``aligned`` (each
    row then is), else 1: the values a thread takes in one access (column_sums.py, layernorm.py)."""
    return 4 if width % 4 == 0 and aligned(*arrays) else 1


def refuse_unless(node, where: str, op: str, inputs: int, outputs: int) -> None:
    """A RunError naming ``node`` where it is not a fused ``op`` node of that many inputs and
    outputs (a runner's ``parse``)."""
    if not node.op_type.startswith(op) or len(node.input) != inputs or len(node.output) != outputs:
        raise RunError(f"{where}: node '{node.name}' ({node.domain}::{node.op_type}) is not a fused "
                       f"{op} node ({inputs} inputs, {outputs} output{'s' if outputs != 1 else ''})")


class RawKernelRunner(LaunchRunner):
    SOURCE: str  # the CUDA source of the kernels
    KERNELS: tuple[str, ...]  # their names, in the order ``functions`` gives them
    WHAT: str  # what the nodes are, in errors ("LayerNorm gradients")

    def __init__(self, group, where: str, device):
        super().__init__(group.outputs)
        self.cp = device.cp
        self.stream = device.compute
        self.where = f"{where}: {self.WHAT} in {place(group)}"
        self.ops = [self.parse(node) for node in group.nodes]
        self._functions: tuple | None = None

    @abstractmethod
    def parse(self, node):
        """The node as the runner keeps it; a RunError naming it where it is not the runner's op."""

    def functions(self) -> tuple:
        """The compiled kernels, in ``KERNELS`` order."""
        if self._functions is None:
            module = compiled_module(self.cp, self.SOURCE)
            self._functions = tuple(module.get_function(name) for name in self.KERNELS)
        return self._functions

    def launch_error(self, node_name: str, exc: Exception) -> RunError:
        return RunError(f"{self.where}: '{node_name}': {str(exc).splitlines()[0]}")
