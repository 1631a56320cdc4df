"""Fresh value and node names for the runtime's own graph rewrites (runtime/low_precision.py,
runtime/accumulation.py). The transpiler has its own (transpiler/autodiff/_context.py): the runtime
imports nothing of the transpiler."""

from __future__ import annotations

import onnx


class FreshNames:
    """``fresh(base)`` is ``base`` unless ``graph`` (or an earlier call) uses it as a value or node
    name, then ``base{sep}1``, ``base{sep}2``, ..."""

    def __init__(self, graph: onnx.GraphProto, sep: str = "."):
        self.sep = sep
        self.used = {v.name for v in [*graph.input, *graph.output, *graph.value_info]}
        self.used |= {t.name for t in graph.initializer}
        self.used |= {name for node in graph.node for name in [*node.output, node.name]}

    def fresh(self, base: str) -> str:
        name, n = base, 0
        while name in self.used:
            n += 1
            name = f"{base}{self.sep}{n}"
        self.used.add(name)
        return name
