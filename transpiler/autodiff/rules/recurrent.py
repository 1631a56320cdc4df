"""What the LSTM and GRU gradients (rules/lstm_gru.py) share: one node's view in time-major layout,
directions, sequence lengths, and the Scan bodies that run the recurrence backward.

The backward of a recurrent op is itself a recurrence: the gradient of the hidden state at step t
depends on the one at t + 1. It runs as one ONNX ``Scan`` over time (plain onnxruntime runs it on
every provider), not unrolled: a Scan works for a symbolic sequence length too, and the graph stays
the same size whatever the length. Everything that does not depend on the carried gradient is
taken out of the loop and computed for all steps at once: the gates are recomputed from the
forward's hidden states ``Y`` (one MatMul over every step), the coefficients of the step's
Jacobian are elementwise products over ``[T, B, ...]``, and the weight gradients are one Gemm over
the ``T * B`` rows after the loop. The body keeps only what the carried gradient needs: a few
elementwise ops and one ``[B, G] @ [G, H]`` MatMul by the recurrent weights per step.

Scan bodies read nothing from the outer graph (the recurrent weights are carried as loop state), so
passes that see only the main graph may rename or move any value. Directions: a reverse direction
is the forward one on the time-reversed sequence (``ReverseSequence`` within each row's length when
``sequence_lens`` is given, else a negative-step Slice): the rules work in that processing order
and reverse the input gradient back. With ``sequence_lens`` the steps past a row's length keep the
state and output zeros (onnxruntime's semantics); a 0/1 mask over ``[T, B, 1]`` does that in the
backward (the final-state gradient waits in the carry until the row's last step).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from transpiler.autodiff._context import RuleContext

_INT64_MIN = int(np.iinfo(np.int64).min)


class ScanBody:
    """A Scan body built op by op, with model-unique names and typed inputs and outputs."""

    def __init__(self, ctx: RuleContext, dtype: ir.DataType, name: str):
        self.ctx, self.dtype, self.name = ctx, dtype, name
        self.inputs: list[ir.Value] = []
        self.nodes: list[ir.Node] = []

    def input(self, name: str) -> ir.Value:
        """A body input: a rank-2 tensor (a carried [B, H] state, weights, or one step's [B, K])."""
        value = ir.Value(name=self.ctx.unique_name(f"{self.name}/{name}"), type=ir.TensorType(self.dtype),
                         shape=ir.Shape([None, None]))
        self.inputs.append(value)
        return value

    def op(self, op_type: str, inputs: Sequence[ir.Value], attributes: dict | None = None) -> ir.Value:
        name = self.ctx.unique_name(f"{self.name}/{op_type}")
        output = ir.Value(name=self.ctx.unique_name(f"{name}_output_0"))
        attrs = ir.convenience.convert_attributes(attributes or {})
        self.nodes.append(ir.Node("", op_type, inputs, attrs, outputs=[output], name=name))
        return output

    def graph(self, outputs: Sequence[ir.Value]) -> ir.Graph:
        # A body output must be made by a body node (not an input passed through), once.
        made, seen = {out for node in self.nodes for out in node.outputs}, set()
        finals = []
        for value in outputs:
            if value not in made or value in seen:
                value = self.op("Identity", [value])
            seen.add(value)
            value.type, value.shape = ir.TensorType(self.dtype), ir.Shape([None, None])
            finals.append(value)
        return ir.Graph(self.inputs, finals, nodes=self.nodes, name=self.ctx.unique_name(self.name))


def run_scan(ctx: RuleContext, body: ScanBody, outputs: Sequence[ir.Value], states: Sequence[ir.Value],
             scanned: Sequence[ir.Value], *, reverse: bool) -> list[ir.Value]:
    """Scan ``body`` over axis 0 of ``scanned`` with ``states`` carried; returns the final states
    then the stacked per-step outputs (in time order whichever way the scan runs)."""
    graph = body.graph(outputs)
    direction = [1 if reverse else 0]
    scan_outputs = len(outputs) - len(states)
    attributes = {"body": graph, "num_scan_inputs": len(scanned),
                  "scan_input_directions": direction * len(scanned),
                  "scan_output_directions": direction * scan_outputs}
    return ctx.op_multi("Scan", [*states, *scanned], attributes, num_outputs=len(outputs))


class Recurrence:
    """One LSTM/GRU node seen in time-major layout (``layout=0``): X ``[T, B, I]``, Y
    ``[T, D, B, H]``, states ``[D, B, H]``, whatever the node's ``layout``."""

    def __init__(self, ctx: RuleContext, gate_count: int, default_activations: Sequence[str], states: int):
        self.ctx, node = ctx, ctx.node
        attrs = node.attributes
        self.hidden = attrs.get_int("hidden_size", 0)
        if self.hidden <= 0:
            raise ctx.error("the hidden_size attribute is required")
        direction = attrs.get_string("direction", "forward")
        if direction not in ("forward", "reverse", "bidirectional"):
            raise ctx.error(f"unknown direction {direction!r}")
        # Per direction: whether it runs over the reversed sequence.
        self.reverse = [False, True] if direction == "bidirectional" else [direction == "reverse"]
        self.layout = attrs.get_int("layout", 0)
        activations = [a.lower() for a in attrs.get_strings("activations", [])]
        expected = [a.lower() for a in default_activations] * len(self.reverse)
        if activations and activations != expected:
            raise ctx.error(f"activations {attrs.get_strings('activations')} are not supported "
                            f"(only the default {list(default_activations)}, as PyTorch exports)")
        if "clip" in attrs:
            raise ctx.error("the clip attribute is not supported (PyTorch never exports it)")
        self.gates = gate_count * self.hidden
        self.dtype = ctx.dtype(node.inputs[0])
        self.x = self._time_major(node.inputs[0], [1, 0, 2])
        self.y = self._time_major(self._y_output(), [1, 2, 0, 3])
        dys = list(ctx.dys) + [None] * (1 + states - len(ctx.dys))
        self.dy = None if dys[0] is None else self._time_major(dys[0], [1, 2, 0, 3])
        # Gradients of the final states Y_h (and LSTM's Y_c), [D, B, H].
        self.d_final = [None if g is None else self._time_major(g, [1, 0, 2]) for g in dys[1:1 + states]]
        self.lens = self.keep = self.hold = None
        if ctx.has_input(4):
            self._masks()
        self._processing: dict[bool, ir.Value] = {}

    def _time_major(self, value: ir.Value, perm: list[int]) -> ir.Value:
        return value if self.layout == 0 else self.ctx.op("Transpose", [value], {"perm": perm})

    def _y_output(self) -> ir.Value:
        """Y, all hidden states: the forward computes it anyway; dynamo leaves it off a GRU whose
        final state only is read, so the rule switches it on."""
        x = self.ctx.inputs[0]
        shape = None
        if x.shape is not None and x.shape.rank() == 3:
            first, second = list(x.shape)[:2]
            dims = [first, len(self.reverse), second, self.hidden] if self.layout == 0 else \
                [first, second, len(self.reverse), self.hidden]
            shape = ir.Shape(dims)
        return self.ctx.forward_output(0, "Y", self.dtype, shape)

    def _masks(self) -> None:
        ctx = self.ctx
        self.lens = ctx.op("Cast", [ctx.inputs[4]], {"to": ir.DataType.INT64})
        length = ctx.op("Squeeze", [ctx.shape_of(self.x, 0, 1), ctx.const([0])])
        steps = ctx.op("Range", [ctx.const(np.array(0, np.int64)), length, ctx.const(np.array(1, np.int64))])
        valid = ctx.op("Less", [ctx.op("Unsqueeze", [steps, ctx.const([1])]), self.lens])
        keep = ctx.op("Cast", [valid], {"to": self.dtype})
        self.keep = ctx.op("Unsqueeze", [keep, ctx.const([2])])  # [T, B, 1]
        self.hold = self.one_minus(self.keep)

    # --- per direction -------------------------------------------------------------------------

    def pick(self, value: ir.Value, direction: int, axis: int = 0) -> ir.Value:
        """Direction ``direction``'s slice of a per-direction tensor (the axis dropped)."""
        if len(self.reverse) == 1:
            return self.ctx.op("Squeeze", [value, self.ctx.const([axis])])
        return self.ctx.op("Gather", [value, self.ctx.const(np.array(direction, np.int64))], {"axis": axis})

    def in_order(self, value: ir.Value, reverse: bool) -> ir.Value:
        """A time-major ``[T, B, ...]`` tensor in the order a direction processes it (its own
        inverse: it also takes processing order back to time order)."""
        if not reverse:
            return value
        if self.lens is not None:
            return self.ctx.op("ReverseSequence", [value, self.lens], {"batch_axis": 1, "time_axis": 0})
        c = self.ctx.const
        return self.ctx.op("Slice", [value, c([-1]), c([_INT64_MIN]), c([0]), c([-1])])

    def x_in_order(self, reverse: bool) -> ir.Value:
        if reverse not in self._processing:
            self._processing[reverse] = self.in_order(self.x, reverse)
        return self._processing[reverse]

    def zeros_state(self) -> ir.Value:
        """Zeros ``[B, H]``."""
        ctx = self.ctx
        shape = ctx.op("Concat", [ctx.shape_of(self.x, 1, 2), ctx.const([self.hidden])], {"axis": 0})
        return ctx.op("ConstantOfShape", [shape], {"value": ir.tensor(np.zeros([1], self.dtype.numpy()))})

    def initial(self, index: int, direction: int) -> ir.Value:
        """The initial state of input ``index`` (initial_h, initial_c) for one direction, ``[B, H]``."""
        if not self.ctx.has_input(index):
            return self.zeros_state()
        return self.pick(self._time_major(self.ctx.inputs[index], [1, 0, 2]), direction)

    def previous(self, states: ir.Value, first: ir.Value) -> ir.Value:
        """``[first, states[0], ..., states[T-2]]``: the state each step starts from."""
        ctx = self.ctx
        shifted = ctx.op("Slice", [states, ctx.const([0]), ctx.const([-1]), ctx.const([0])])
        return ctx.op("Concat", [ctx.op("Unsqueeze", [first, ctx.const([0])]), shifted], {"axis": 0})

    def y_in_order(self, direction: int) -> ir.Value:
        return self.in_order(self.pick(self.y, direction, axis=1), self.reverse[direction])

    def dy_in_order(self, direction: int) -> ir.Value | None:
        """The gradient of Y's hidden states in processing order, zero past each row's length."""
        if self.dy is None:
            return None
        dy = self.in_order(self.pick(self.dy, direction, axis=1), self.reverse[direction])
        return dy if self.keep is None else self.ctx.op("Mul", [dy, self.keep])

    def d_final_state(self, state: int, direction: int) -> ir.Value:
        """The gradient of final state ``state`` (0: Y_h, 1: Y_c) for one direction, ``[B, H]``."""
        grad = self.d_final[state]
        return self.zeros_state() if grad is None else self.pick(grad, direction)

    def masked_carry(self, body: ScanBody, carried: ir.Value, keep: ir.Value | None) -> ir.Value:
        return carried if keep is None else body.op("Mul", [carried, keep])

    def held(self, body: ScanBody, value: ir.Value, carried: ir.Value, hold: ir.Value | None) -> ir.Value:
        """Past a row's length the state is held: its gradient passes straight to the step before."""
        return value if hold is None else body.op("Add", [value, body.op("Mul", [carried, hold])])

    # --- shared algebra --------------------------------------------------------------------------

    def matmul_t(self, rows: ir.Value, weight: ir.Value) -> ir.Value:
        """``rows @ weight^T`` for ``rows [T, B, K]`` and ``weight [G, K]``."""
        return self.ctx.op("MatMul", [rows, self.ctx.op("Transpose", [weight], {"perm": [1, 0]})])

    def outer_sum(self, grads: ir.Value, rows: ir.Value) -> ir.Value:
        """``sum_t grads_t^T rows_t``, ``[G, K]``: one Gemm over the ``T * B`` rows."""
        ctx = self.ctx
        flat = [ctx.op("Flatten", [v], {"axis": 2}) for v in (grads, rows)]
        return ctx.op("Gemm", flat, {"transA": 1})

    def row_sum(self, grads: ir.Value) -> ir.Value:
        return self.ctx.op("ReduceSum", [grads, self.ctx.const([0, 1])], {"keepdims": 0})

    def split(self, value: ir.Value, parts: int) -> list[ir.Value]:
        sizes = self.ctx.const([self.hidden] * parts)
        return self.ctx.op_multi("Split", [value, sizes], {"axis": -1}, num_outputs=parts)

    def bias_halves(self, bias: ir.Value) -> tuple[ir.Value, ir.Value]:
        """``[Wb, Rb]`` of one direction's ``B [2G]``."""
        ctx, g = self.ctx, self.gates
        return (ctx.op("Slice", [bias, ctx.const([0]), ctx.const([g]), ctx.const([0])]),
                ctx.op("Slice", [bias, ctx.const([g]), ctx.const([2 * g]), ctx.const([0])]))

    def one_minus(self, value: ir.Value) -> ir.Value:
        return self.ctx.op("Sub", [self.ctx.const(np.array(1, self.dtype.numpy())), value])

    def sigmoid_slope(self, s: ir.Value) -> ir.Value:
        return self.ctx.op("Mul", [s, self.one_minus(s)])

    def tanh_slope(self, t: ir.Value) -> ir.Value:
        return self.one_minus(self.ctx.op("Mul", [t, t]))

    # --- assembling the node's gradients ---------------------------------------------------------

    def stack(self, per_direction: list[ir.Value]) -> ir.Value:
        """Per-direction ``[...]`` tensors stacked into ``[D, ...]``."""
        ctx = self.ctx
        parts = [ctx.op("Unsqueeze", [v, ctx.const([0])]) for v in per_direction]
        return parts[0] if len(parts) == 1 else ctx.op("Concat", parts, {"axis": 0})

    def input_grad(self, per_direction: list[ir.Value]) -> ir.Value:
        """X's gradient from each direction's (in processing order), in the node's layout."""
        ctx = self.ctx
        parts = [self.in_order(g, reverse) for g, reverse in zip(per_direction, self.reverse)]
        total = parts[0] if len(parts) == 1 else ctx.op("Sum", parts)
        return self._time_major(total, [1, 0, 2])

    def state_grad(self, per_direction: list[ir.Value]) -> ir.Value:
        """An initial state's gradient ``[D, B, H]`` in the node's layout."""
        return self._time_major(self.stack(per_direction), [1, 0, 2])
