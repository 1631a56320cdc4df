"""``--outputs NAMES`` of ``transpile export`` and ``transpile run --export``: the trained model cut for
inference, the way HF's ``save_pretrained`` gives a model ready to serve.

From the user's model with the trained values (runtime/export.py), ``inference_model`` keeps the
forward up to the named values (``logits``, say): their graph outputs replace the model's (the
loss), nodes and initializers they do not depend on are dropped, and so are the inputs they do not
read (the labels). The cut itself is onnx's own ``onnx.utils.Extractor``, after shape inference has
typed the intermediate values that become outputs.

The result is in inference mode, as PyTorch's ``model.eval()``: BatchNormalization normalizes with
its running statistics (``training_mode`` 0) and Dropout is the identity (its ``training_mode``
input removed), the same switch as the evaluation graph's (OUT/eval.onnx, docs/contracts.md). Those
are the only standard ops whose result depends on the mode.
"""

from __future__ import annotations

import difflib

import onnx
from onnx import helper

from contract.collectives import consumed
from runtime.errors import RunError

_DEFAULT_DOMAINS = ("", "ai.onnx")


def parse_outputs(text: str | None, option: str = "--outputs") -> tuple[str, ...]:
    """``"logits,probs"`` -> ``("logits", "probs")``; None -> ``()``; a one-line RunError for an
    empty name or a name given twice."""
    if text is None:
        return ()
    names = tuple(name.strip() for name in text.split(","))
    if any(not name for name in names):
        raise RunError(f"{option} {text!r}: expected value names of the model separated by commas (e.g. {option} logits)")
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:
        raise RunError(f"{option} {text!r}: names '{twice}' twice")
    return names


def check_outputs(model: onnx.ModelProto, names: tuple[str, ...], where: str, option: str = "--outputs") -> None:
    """Every name is a value the graph computes or takes as input (not an initializer): else a
    one-line RunError naming it, ``where`` (the model's file) and the closest name."""
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    values = [i.name for i in graph.input if i.name not in initializers]
    values += [o for node in graph.node for o in node.output if o]
    known = set(values)
    for name in names:
        if name in initializers:
            raise RunError(f"{option} {name}: is an initializer (a trained or constant tensor) of {where}, not a value "
                           "the model computes")
        if name not in known:
            close = difflib.get_close_matches(name, values, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (its outputs: {', '.join(o.name for o in graph.output)})"
            raise RunError(f"{option} {name}: not a value of {where}{hint}")


def inference_model(model: onnx.ModelProto, names: tuple[str, ...], where: str) -> onnx.ModelProto:
    """``model`` (with its trained values) cut to the forward up to ``names``, in inference mode
    (see the module docstring); ``model`` itself is switched to inference mode in place. ``where``
    names the model's file in errors."""
    check_outputs(model, names, where)
    _inference_mode(model.graph)
    try:
        typed = onnx.shape_inference.infer_shapes(model)
    except Exception as exc:  # noqa: BLE001 - onnx raises several kinds; one line either way
        raise RunError(f"{where}: shape inference failed, so --outputs cannot type its values: "
                       f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    initializers = {t.name for t in typed.graph.initializer}
    inputs = [i.name for i in typed.graph.input if i.name not in initializers]
    extractor = onnx.utils.Extractor(typed)
    untyped = [name for name in names if name not in extractor.value_infos]
    if untyped:
        raise RunError(f"--outputs {untyped[0]}: shape inference gives no type for it in {where}; it cannot be a graph "
                       "output (name a value whose type is known, e.g. the output of the next node)")
    cut = extractor.extract_model(inputs, list(names))
    read = {name for node in cut.graph.node for name in consumed(node)} | set(names)
    kept = [i for i in cut.graph.input if i.name in read]
    del cut.graph.input[:]
    cut.graph.input.extend(kept)
    cut.graph.name = model.graph.name or cut.graph.name
    cut.producer_name, cut.producer_version = model.producer_name, model.producer_version
    return cut


def _inference_mode(graph: onnx.GraphProto) -> None:
    """BatchNormalization and Dropout of ``graph`` switched to inference, in place."""
    added: dict[int, list[onnx.NodeProto]] = {}  # Identity nodes to insert after node i
    for i, node in enumerate(graph.node):
        if node.domain in _DEFAULT_DOMAINS and node.op_type == "BatchNormalization":
            for attr in node.attribute:
                if attr.name == "training_mode":
                    attr.i = 0
            # Outputs 1 and 2 (the updated running statistics) exist only in training mode; a reader
            # of them gets the running statistics themselves, which inference leaves unchanged.
            added[i] = [helper.make_node("Identity", [node.input[position + 2]], [node.output[position]],
                                         name=f"{node.name}/inference/running_stat_{position}")
                        for position in (1, 2)
                        if len(node.output) > position and node.output[position] and len(node.input) > position + 2]
            del node.output[1:]
        elif node.domain in _DEFAULT_DOMAINS and node.op_type == "Dropout":
            del node.input[2:]  # no training_mode input: the identity
    if any(added.values()):
        nodes = []
        for i, node in enumerate(graph.node):
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            nodes += [copy, *added.get(i, [])]
        del graph.node[:]
        graph.node.extend(nodes)
