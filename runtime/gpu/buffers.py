"""Where a GPU program's values live: the decisions of GpuProgram's allocation (program.py) that
need no device, each a pure function of the step's items.

- ``value_lifetimes``: which values go in that block and from which item to which they live;
- ``pack_buffers``: the offsets of the values passed between a step's items in one block;
- ``carried_in_place``: the state outputs written over the buffer their input is read from;
- ``bfloat16_edges``: the bfloat16 values that pass between items as they are, not widened;
- ``bucket_dtype``: the element type of a collective's flat buffer.
"""

from __future__ import annotations

import numpy as np

from runtime.errors import RunError

BUFFER_ALIGN = 256  # bytes: where pack_buffers starts each value (cudaMalloc's own alignment)


def carried_in_place(items: list[tuple[list[str], list[str], bool]], readers: dict[str, list[int]],
                     carried: dict[str, str], program_outputs: set[str], fed: set[str], taken: set[str]) -> dict[str, str]:
    """The state outputs that may be written over the buffer of the input they are fed back as on
    the next call: ``output -> input``, from ``carried`` (the same map for every output the caller
    carries). ``items``: per position, (inputs, outputs, whether it runs on the compute stream: a
    session or a native group, not a collective between sessions); ``readers``: value -> the
    positions that read it; ``taken``: outputs already given a buffer of their own (a collective's
    slot, the update's in-place state).

    An output qualifies where its input is fed (not computed in the step, not itself an output)
    and every item that reads the input comes before the item that computes the output, which
    does not read it, all on the compute stream: in stream order each read of this call's value
    is done before the next value is written. (sharded: the Broadcasts' session writes the next
    parameters after the forward, backward and update read them; zero: the AllGathers' session.)"""
    pairs: dict[str, str] = {}
    for pos, (inputs, outputs, on_compute) in enumerate(items):
        if not on_compute:
            continue
        for out in outputs:
            src = carried.get(out)
            if (src is None or out in taken or out not in program_outputs or src not in fed
                    or src in program_outputs or src in inputs):
                continue
            if all(r < pos and items[r][2] for r in readers.get(src, [])):
                pairs[out] = src
    return pairs


def value_lifetimes(items: list[tuple[list[str], bool]], readers: dict[str, list[int]], nbytes: dict[str, int],
                    own: set[str], once: dict[int, set[str]]) -> list[tuple[str, int, int, int]]:
    """``(name, nbytes, first, last)`` of every value of the block (pack_buffers' input).
    ``items``: per position, (outputs, whether it runs on the compute stream; a collective between
    sessions does not and computes no value of the block); ``own``: values with a buffer of their
    own (a collective's slot, state, the program's outputs). A value lives from the item that
    computes it to its last reader, or to the step's end where a collective between sessions reads
    it (NCCL reads it on its own stream), or all the step where its session writes it once, when
    bound (``once``, per position: a constant it folded)."""
    end = len(items)
    lifetimes = []
    for pos, (outputs, on_compute) in enumerate(items):
        if not on_compute:
            continue
        for name in outputs:
            if name in own:
                continue
            reads = readers.get(name, [])
            last = end if any(not items[r][1] for r in reads) else max(reads, default=pos)
            if name in once.get(pos, ()):
                lifetimes.append((name, nbytes[name], 0, end))
            else:
                lifetimes.append((name, nbytes[name], pos, last))
    return lifetimes


def pack_buffers(lifetimes: list[tuple[str, int, int, int]], align: int = BUFFER_ALIGN) -> tuple[dict[str, int], int]:
    """Places for values ``(name, nbytes, first, last)`` (the positions of the item that computes
    one and of the last that reads it, inclusive) in one block: ``(name -> byte offset, the block's
    bytes)``, two values overlapping in bytes only if one's ``last`` is before the other's
    ``first``. Greedy by size, largest first, each at the lowest offset (a multiple of ``align``)
    free of the values placed so far that live at the same time; for a step's activations this
    comes within a few percent of the most bytes alive at once."""
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
    offsets: dict[str, int] = {}
    for name, nbytes, first, last in sorted(lifetimes, key=lambda v: (-v[1], v[2], v[0])):
        size = -(-max(nbytes, 1) // align) * align
        offset = 0
        for begin, end in sorted((o, e) for o, e, f, la in placed if not (la < first or last < f)):
            if offset + size <= begin:
                break
            offset = max(offset, end)
        offsets[name] = offset
        placed.append((offset, offset + size, first, last))
    return offsets, max((end for _, end, _, _ in placed), default=0)


def bfloat16_edges(items: list[tuple[list[str], frozenset[str] | None]], producer: dict[str, int],
                   program_io: set[str]) -> frozenset[str]:
    """The values that may pass between a step's items as bfloat16 (raw bits; compile.WidenBfloat16
    widens every other bfloat16 value at a session's edge, which every runner reads). ``items``:
    per position, (inputs, what it takes in bfloat16): None for a session, which reads a value of
    any type as its graph says; for a native runner or a collective, the inputs it reads as
    bfloat16 where they come so (FusedUpdateRunner: its marked gradients), for a collective none.
    ``producer``: value -> the position computing it; ``program_io``: the program's inputs and
    outputs, which the caller feeds and reads as float32.

    A value qualifies where a session computes it, at least one native runner takes it, and no
    item but sessions and such runners reads it."""
    sessions = {pos for pos, (_, takes) in enumerate(items) if takes is None}
    taken: set[str] = set()
    refused: set[str] = set()
    for inputs, takes in items:
        if takes is not None:
            taken |= takes & set(inputs)
            refused |= set(inputs) - takes
    return frozenset(name for name in taken - refused - program_io if producer.get(name) in sessions)


def bucket_dtype(inputs: list[str], outputs: list[str], specs, seen: dict[str, np.dtype], where: str) -> np.dtype:
    """The one element type of a collective's flat buffer: that of the values its first call
    moved (``seen``: value -> dtype, its inputs and the outputs it made); an output the first call
    did not make on this rank by its spec (``specs``, the outputs' TensorSpecs). So a bfloat16
    bucket between sessions (``--grad-dtype bf16`` where the collectives are cut out of the
    sessions: no custom ops, or ``--timings``) moves as the float32 its inputs crossed as
    (compile.WidenBfloat16; a collective takes no bfloat16 there, ``bfloat16_edges``): the right
    numbers, float32 bytes on the wire. Its spec says bfloat16, which no CuPy buffer can be."""
    dtypes = {np.dtype(seen[name]) for name in inputs}
    dtypes |= {np.dtype(seen[name]) if name in seen else np.dtype(spec.dtype) for name, spec in zip(outputs, specs)}
    if len(dtypes) != 1:
        raise RunError(f"{where}: the nccl backend needs one dtype per bucket, got {sorted(map(str, dtypes))}")
    return dtypes.pop()
