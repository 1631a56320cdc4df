"""Elementwise fusion, recompute instead of store: a fused node's output that one other fused node
alone reads is computed again by that reader from the producer's inputs, where those inputs take
fewer bytes than the output. A pure-ONNX module (elementwise_fusion.py calls it on its fused nodes).

Why: in a bf16 GPT the forward's GELU chain reads the MLP's bf16 MatMul output and the bias, and the
autodiff's derivative of GELU (erf, exp: a function of the same pre-activation) clusters into it,
so the forward writes a float32 derivative over the [batch, T, 4C] activation that only the
backward's chain reads, 12 times a step: 4 bytes an element written, held from the forward to the
backward, and read back. The bf16 MatMul output (2 bytes an element) and the bias make the same
float32 values again in the backward, as PyTorch's compiler recomputes pointwise ops there rather
than save them. In a float32 step the rule below rarely holds: its MatMul output is as large as the
derivative.

Bytes: the pair moved 2 |o| (written, read back) and now moves the inputs the reader did not
already read; memory: the output no longer lives from producer to reader, the inputs do (where
nothing else kept them). Both shrink under the rule ``sum |inputs| < |o|``. Values: the reader runs
the producer's steps for ``o`` as they were (elementwise_steps.cuda_statements), so it computes the
same bits. The producer keeps only the steps its other outputs need, and goes if it has none.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
from onnx import helper

from contract.collectives import consumed
from runtime.gpu.elementwise_steps import DOMAIN, OP_TYPE, RELU_MASK, fused_steps, fused_types, make_fused


def recompute_in_readers(nodes: list[onnx.NodeProto], graph_outputs: set[str],
                         size_of: Callable[[str], int | None]) -> list[onnx.NodeProto | None]:
    """``nodes`` (fused nodes of op_type OP_TYPE not yet given their functions, and any others)
    with each output the module docstring names recomputed by its reader, position for position; a
    producer left with no output is None. ``size_of(value)``: its bytes (symbolic dimensions
    counted as 1), None where unknown. Any order of ``nodes`` that was valid stays valid: a reader
    only gains inputs its producer read."""
    nodes: list[onnx.NodeProto | None] = list(nodes)
    while True:
        readers: dict[str, set[int]] = {}
        for k, node in enumerate(nodes):
            for name in consumed(node) if node is not None else ():
                readers.setdefault(name, set()).add(k)
        pairs = ((f, o, next(iter(readers[o]))) for f, producer in enumerate(nodes) if _fused(producer)
                 for o in producer.output if len(readers.get(o, ())) == 1 and o not in graph_outputs)
        for f, o, b in pairs:
            moved = _recomputed(nodes[f], o, nodes[b], size_of) if b != f and _fused(nodes[b]) else None
            if moved is not None:
                nodes[b], nodes[f] = moved
                break
        else:
            return nodes


def _fused(node: onnx.NodeProto | None) -> bool:
    return node is not None and node.domain == DOMAIN and node.op_type == OP_TYPE \
        and [op for op, _ in fused_steps(node)[0]] != [RELU_MASK]


def _needed(steps: list, results: list[int]) -> list[int]:
    """The steps ``results`` depend on, in order."""
    need, stack = set(), list(results)
    while stack:
        k = stack.pop()
        if k not in need:
            need.add(k)
            stack += [i for kind, i in steps[k][1] if kind == "t"]
    return sorted(need)


def _recomputed(producer: onnx.NodeProto, o: str, reader: onnx.NodeProto, size_of: Callable[[str], int | None]):
    """(reader computing ``o`` itself, producer without ``o`` or None), or None where the inputs
    it would add take no fewer bytes than ``o``."""
    steps, results = fused_steps(producer)
    in_types, out_types = fused_types(producer)
    index = list(producer.output).index(o)
    chain = _needed(steps, [results[index]])
    used = sorted({i for k in chain for kind, i in steps[k][1] if kind == "x"})
    if not used:  # a chain of constants alone: nothing to move it by
        return None
    extra = [producer.input[i] for i in used if producer.input[i] not in reader.input]
    sizes = [size_of(name) for name in [*extra, o]]
    if any(s is None for s in sizes) or sum(sizes[:-1]) >= sizes[-1]:
        return None
    r_steps, r_results = fused_steps(reader)
    r_in, r_out = fused_types(reader)
    # The reader's inputs: its own but o, then the producer's it lacks.
    inputs = [name for name in reader.input if name != o] + extra
    types = [t for name, t in zip(reader.input, r_in) if name != o] + [in_types[list(producer.input).index(n)] for n in extra]
    at = {name: inputs.index(name) for name in inputs}
    renumber = {k: j for j, k in enumerate(chain)}
    new_steps = [(op, [("x", at[producer.input[i]]) if kind == "x" else ("t", renumber[i]) if kind == "t" else (kind, i)
                       for kind, i in refs]) for op, refs in (steps[k] for k in chain)]
    value, shift = renumber[results[index]], len(chain)
    for op, refs in r_steps:
        new_steps.append((op, [("t", value) if kind == "x" and reader.input[i] == o else
                               ("x", at[reader.input[i]]) if kind == "x" else ("t", i + shift) if kind == "t" else (kind, i)
                               for kind, i in refs]))
    ops = [*_ops(producer), *_ops(reader)]
    new_reader = make_fused(inputs, list(reader.output), reader.name, ops, new_steps, [k + shift for k in r_results],
                            types, r_out)
    keep = [j for j in range(len(results)) if j != index]
    if not keep:
        return new_reader, None
    live = _needed(steps, [results[j] for j in keep])
    live_at = {k: j for j, k in enumerate(live)}
    p_used = sorted({i for k in live for kind, i in steps[k][1] if kind == "x"})
    if not p_used:
        return None
    p_at = {i: j for j, i in enumerate(p_used)}
    p_steps = [(op, [("x", p_at[i]) if kind == "x" else ("t", live_at[i]) if kind == "t" else (kind, i)
                     for kind, i in refs]) for op, refs in (steps[k] for k in live)]
    new_producer = make_fused([producer.input[i] for i in p_used], [producer.output[j] for j in keep], producer.name,
                              _ops(producer), p_steps, [live_at[results[j]] for j in keep],
                              [in_types[i] for i in p_used], [out_types[j] for j in keep])
    return new_reader, new_producer


def _ops(node: onnx.NodeProto) -> list[str]:
    return [s.decode() if isinstance(s, bytes) else s for a in node.attribute if a.name == "ops"
            for s in helper.get_attribute_value(a)]

