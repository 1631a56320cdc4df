"""Optimizer updates as standard ONNX ops (opset 18), bit-for-bit equal to torch.optim.

Public surface:

- ``OptimizerConfig``: the optimizer and its hyper-parameters, validated; ``to_json()`` for plan.json
  (defined beside the optimizer table, transpiler/optimizer_table.py; re-exported here).
- ``emit_step_increment(graph, step)``: the shared float32 step counter plus one.
- ``emit_update(graph, config, param=, grad=, lr=, step=, state=, name=)``: appends one parameter's
  update as standard ops and returns its new value and new optimizer state.
- ``Emitter``, ``check_update_arguments``, ``unique_name``: what transpiler/update_node.py (the same
  update as ONE node of domain ``graph_transpiler.optimizer``, what the rank graphs use) builds on.
- ``emit_squared_norm(graph, grads)`` and ``emit_clip(graph, config, squared_norm, grads)``: gradient
  clipping by the global L2 norm (``config.max_grad_norm``), torch.nn.utils.clip_grad_norm_'s formula.
  The squared norm is a sum, so a rank holding part of the gradients (sharded, zero) contributes its
  part and the caller sums the parts over the ranks in between.

The update formulas are those of torch 2.13's single-tensor (``foreach=False``) implementations in
``torch/optim/sgd.py`` and ``torch/optim/adam.py`` (AdamW is Adam with ``decoupled_weight_decay``),
including where torch rounds:

- hyper-parameter arithmetic (``1 - beta1**step``, ``lr / bias_correction1``, ``1 - lr*wd``) is done in
  float64 like torch's Python scalars, and rounded to float32 once, where torch's kernel casts it;
- torch's ``add(alpha=)``, ``addcmul`` and ``lerp`` kernels are fused multiply-adds (one rounding) on
  CPU and CUDA. ONNX has no FMA op, so with ``exact=True`` (the default) they are computed in
  float64 and rounded to float32 once: the product of two float32 numbers is exact in float64, so only
  the sum is rounded twice, which almost never changes the float32 result. ``exact=False`` uses a
  float32 Mul then Add (fewer, narrower kernels; differs from torch by an ulp per fused op).

onnxruntime's CPU Sqrt is correctly rounded (measured; CUDA's sqrtf is too, by IEEE default); torch
2.13's CPU sqrt (x86 wheel, MKL, AVX-512) is not: one ulp off for ~1.5% of float32 inputs, measured.
So against torch on CPU, SGD and momentum are bitwise equal, and Adam/AdamW bitwise equal once torch's
sqrt is the correctly rounded one, else within those ulps (tests/test_optimizer.py).

``docs/optimizers.md`` lists the formulas per optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import numpy as np
import onnx_ir as ir
from onnx_ir import tape as ir_tape

from transpiler.errors import TranspileError
from transpiler.optimizer_table import OPTIMIZER_TABLE, OptimizerConfig

__all__ = [
    "OPTIMIZERS", "Emitter", "OptimizerConfig", "check_update_arguments", "emit_clip", "emit_squared_norm",
    "emit_step_increment", "emit_update", "unique_name",
]  # fmt: skip

# The table (transpiler/optimizer_table.py) says which optimizers exist, their state slots, default
# weight decay and whether they read the step counter; this module emits their formulas.
OPTIMIZERS = tuple(OPTIMIZER_TABLE)

_FLOAT = ir.DataType.FLOAT
_DOUBLE = ir.DataType.DOUBLE
_SCALAR = ir.Shape([])

# Key in graph.meta (in memory, never serialized) of the scalars that every parameter's update shares.
_SHARED_META_KEY = "graph_transpiler.optimizer.shared_scalars"


def emit_step_increment(graph: ir.Graph, step: ir.Value) -> ir.Value:
    """Append ``step + 1`` for the float32 scalar step counter shared by all parameters.

    torch increments the step before its bias corrections use it, so the updates take this value.
    A float32 counter (as torch keeps it) counts exactly up to 2**24 steps.
    """
    emitter = Emitter(graph, prefix=step.name or "optimizer.step")
    one = emitter.constant(1.0, _FLOAT, "one")
    return emitter.op(
        "Add", [step, one], "next", _FLOAT, _SCALAR, output_name=f"{step.name or 'optimizer.step'}.next"
    )


def emit_update(
    graph: ir.Graph,
    config: OptimizerConfig,
    *,
    param: ir.Value,
    grad: ir.Value,
    lr: ir.Value,
    step: ir.Value | None,
    state: dict[str, ir.Value],
    name: str,
    exact: bool = True,
) -> tuple[ir.Value, dict[str, ir.Value]]:
    """Append the update of one parameter; return its new value and its new state (keys of ``state``).

    ``lr`` is the float32 scalar learning-rate input; ``step`` the already incremented counter
    (``emit_step_increment``), required by adam/adamw and ignored otherwise. New values are named
    ``{name}.next`` and ``{name}.{slot}.next``, intermediates ``{name}.{optimizer}.*`` (made unique
    in the graph if taken). Scalars that depend only on lr and step are emitted once per graph and
    shared by every parameter's update.
    """
    check_update_arguments(config, param, state, step, name)
    emitter = Emitter(graph, prefix=f"{name}.{config.name}", shape=param.shape, exact=exact)
    if config.name in ("sgd", "momentum"):
        new_param, new_state = _sgd(emitter, config, param, grad, lr, state)
    else:
        new_param, new_state = _adam(emitter, config, param, grad, lr, step, state)

    # Rename the results last, so their names say what they are whatever op produced them.
    new_param.name = emitter.unique_value_name(f"{name}.next")
    for slot, value in new_state.items():
        value.name = emitter.unique_value_name(f"{name}.{slot}.next")
    return new_param, new_state


def check_update_arguments(config: OptimizerConfig, param: ir.Value, state: dict, step, name: str) -> None:
    config.validate()  # an unvalidated name would otherwise fall through to the Adam branch
    if param.dtype != _FLOAT:
        raise TranspileError(
            f"parameter {name!r}: optimizer updates support float32 parameters only, got {param.dtype}"
        )
    if set(state) != set(config.slots()):
        raise ValueError(
            f"{name}: state keys {sorted(state)} do not match {config.name}'s slots {list(config.slots())}"
        )
    if config.uses_step() and step is None:
        raise ValueError(f"{name}: {config.name} needs the incremented step counter")


def emit_squared_norm(graph: ir.Graph, grads: list[ir.Value], *, name: str = "grad_norm") -> ir.Value:
    """Append the float32 sum of the squares of every element of ``grads`` (0 for no gradients)."""
    emitter = Emitter(graph, prefix=name)
    squares = []
    for index, grad in enumerate(grads):
        if grad.dtype != _FLOAT:
            raise TranspileError(f"--clip-grad-norm: gradient {grad.name!r} is {grad.dtype}; only float32 is supported")
        squares.append(emitter.op("ReduceSumSquare", [grad], f"square{index}", _FLOAT, _SCALAR, {"keepdims": 0}))
    if not squares:
        return emitter.constant(0.0, _FLOAT, "squared")
    if len(squares) == 1:
        return squares[0]
    return emitter.op("Sum", squares, "squared", _FLOAT, _SCALAR)


def emit_clip(graph: ir.Graph, config: OptimizerConfig, squared_norm: ir.Value, grads: list[ir.Value],
              *, name: str = "grad_norm") -> list[ir.Value]:
    """Append torch.nn.utils.clip_grad_norm_ (L2, float32): every gradient times
    ``min(1, max_norm / (sqrt(squared_norm) + 1e-6))``; return the clipped gradients."""
    assert config.max_grad_norm is not None
    emitter = Emitter(graph, prefix=name)
    norm = emitter.op("Sqrt", [squared_norm], "total", _FLOAT, _SCALAR)
    denominator = emitter.op("Add", [norm, emitter.constant32(1e-6, "eps")], "total_eps", _FLOAT, _SCALAR)
    coef = emitter.op("Div", [emitter.constant32(config.max_grad_norm, "max_norm"), denominator], "coef", _FLOAT,
                      _SCALAR)
    clamped = emitter.op("Min", [coef, emitter.constant32(1.0, "one")], "coef_clamped", _FLOAT, _SCALAR)
    return [emitter.op("Mul", [grad, clamped], f"clipped{index}", grad.dtype, grad.shape, output_name=f"{grad.name}.clipped")
            for index, grad in enumerate(grads)]


def _sgd(emitter, config, param, grad, lr, state):
    # torch: grad = grad.add(param, alpha=wd); buf.mul_(momentum).add_(grad);
    #        grad = grad.add(buf, alpha=momentum) if nesterov else buf; param.add_(grad, alpha=-lr)
    if config.weight_decay != 0:
        grad = emitter.fma(param, (config.weight_decay, "weight_decay"), grad, "grad_wd")
    new_state = {}
    if config.name == "momentum":
        momentum = emitter.constant32(config.momentum, "momentum")
        decayed = emitter.op(
            "Mul", [state["momentum_buffer"], momentum], "buf_decayed", _FLOAT, emitter.shape
        )
        # add_(grad, alpha=1 - dampening) with dampening 0: an FMA by 1 rounds like a plain Add. A zero
        # initial buffer gives momentum*0 + grad == grad, torch's clone of the first gradient.
        buf = emitter.op("Add", [decayed, grad], "buf", _FLOAT, emitter.shape)
        new_state["momentum_buffer"] = buf
        grad = (
            emitter.fma(buf, (config.momentum, "momentum"), grad, "nesterov_grad") if config.nesterov else buf
        )
    neg_lr = emitter.shared(("neg_lr", lr), lambda e: e.op("Neg", [lr], "neg_lr", _FLOAT, _SCALAR))
    return emitter.fma(grad, neg_lr, param, "param"), new_state


def _adam(emitter, config, param, grad, lr, step, state):
    beta1, beta2 = config.betas
    weight_decay = config.weight_decay
    if weight_decay != 0 and config.name == "adamw":
        # torch: param.mul_(1 - lr * weight_decay), the factor computed in float64.
        def decay_factor(e):
            lr64 = e.op("Cast", [lr], "lr_f64", _DOUBLE, _SCALAR, {"to": _DOUBLE})
            decay = e.op(
                "Mul", [lr64, e.constant(weight_decay, _DOUBLE, "weight_decay")], "lr_wd", _DOUBLE, _SCALAR
            )
            factor = e.op(
                "Sub", [e.constant(1.0, _DOUBLE, "one"), decay], "decay_factor_f64", _DOUBLE, _SCALAR
            )
            return e.op("Cast", [factor], "decay_factor", _FLOAT, _SCALAR, {"to": _FLOAT})

        factor = emitter.shared(("adamw_decay_factor", lr, weight_decay), decay_factor, family="adamw")
        param = emitter.op("Mul", [param, factor], "param_decayed", _FLOAT, emitter.shape)
    elif weight_decay != 0:
        # torch: grad = grad.add(param, alpha=weight_decay), an FMA.
        grad = emitter.fma(param, (weight_decay, "weight_decay"), grad, "grad_wd")

    # torch: exp_avg.lerp_(grad, 1 - beta1). The lerp kernel computes, with w = float32(1 - beta1),
    # fma(w, grad - exp_avg, exp_avg) for |w| < 0.5, else fma(w - 1, grad - exp_avg, grad).
    exp_avg = state["exp_avg"]
    weight = np.float32(1.0 - beta1)
    diff = emitter.op("Sub", [grad, exp_avg], "grad_minus_exp_avg", _FLOAT, emitter.shape)
    if abs(weight) < 0.5:
        new_exp_avg = emitter.fma((weight, "one_minus_beta1"), diff, exp_avg, "exp_avg")
    else:
        coefficient = float(weight - np.float32(1.0))  # float32 arithmetic, as in the kernel
        new_exp_avg = emitter.fma((coefficient, "one_minus_beta1_minus_one"), diff, grad, "exp_avg")

    # torch: exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2); addcmul computes
    # fma(value * grad, grad, self).
    decayed_sq = emitter.op(
        "Mul",
        [state["exp_avg_sq"], emitter.constant32(beta2, "beta2")],
        "exp_avg_sq_decayed",
        _FLOAT,
        emitter.shape,
    )
    scaled_grad = emitter.op(
        "Mul",
        [emitter.constant32(1.0 - beta2, "one_minus_beta2"), grad],
        "grad_scaled",
        _FLOAT,
        emitter.shape,
    )
    new_exp_avg_sq = emitter.fma(scaled_grad, grad, decayed_sq, "exp_avg_sq")

    # torch, in float64 Python scalars: bias_correction1 = 1 - beta1**step, step_size = lr / it,
    # bias_correction2_sqrt = (1 - beta2**step) ** 0.5; each is cast to float32 where a kernel takes it.
    def bias_scalars(e):
        step64 = e.op("Cast", [step], "step_f64", _DOUBLE, _SCALAR, {"to": _DOUBLE})
        one = e.constant(1.0, _DOUBLE, "one")
        power1 = e.op("Pow", [e.constant(beta1, _DOUBLE, "beta1"), step64], "beta1_pow", _DOUBLE, _SCALAR)
        power2 = e.op("Pow", [e.constant(beta2, _DOUBLE, "beta2"), step64], "beta2_pow", _DOUBLE, _SCALAR)
        correction1 = e.op("Sub", [one, power1], "bias_correction1", _DOUBLE, _SCALAR)
        correction2 = e.op("Sub", [one, power2], "bias_correction2", _DOUBLE, _SCALAR)
        lr64 = e.op("Cast", [lr], "lr_f64", _DOUBLE, _SCALAR, {"to": _DOUBLE})
        step_size = e.op("Div", [lr64, correction1], "step_size_f64", _DOUBLE, _SCALAR)
        neg_step_size = e.op("Neg", [step_size], "neg_step_size_f64", _DOUBLE, _SCALAR)
        correction2_sqrt = e.op("Sqrt", [correction2], "bias_correction2_sqrt_f64", _DOUBLE, _SCALAR)
        return (
            e.op("Cast", [neg_step_size], "neg_step_size", _FLOAT, _SCALAR, {"to": _FLOAT}),
            e.op("Cast", [correction2_sqrt], "bias_correction2_sqrt", _FLOAT, _SCALAR, {"to": _FLOAT}),
        )

    neg_step_size, correction2_sqrt = emitter.shared(
        ("adam_bias", lr, step, beta1, beta2), bias_scalars, family="adam"
    )

    # torch: denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps);
    #        param.addcdiv_(exp_avg, denom, value=-step_size), i.e. param + (value * exp_avg) / denom.
    root = emitter.op("Sqrt", [new_exp_avg_sq], "exp_avg_sq_sqrt", _FLOAT, emitter.shape)
    corrected = emitter.op(
        "Div", [root, correction2_sqrt], "exp_avg_sq_sqrt_corrected", _FLOAT, emitter.shape
    )
    denom = emitter.op(
        "Add", [corrected, emitter.constant32(config.eps, "eps")], "denom", _FLOAT, emitter.shape
    )
    scaled_avg = emitter.op("Mul", [neg_step_size, new_exp_avg], "exp_avg_scaled", _FLOAT, emitter.shape)
    update = emitter.op("Div", [scaled_avg, denom], "update", _FLOAT, emitter.shape)
    new_param = emitter.op("Add", [param, update], "param", _FLOAT, emitter.shape)
    return new_param, {"exp_avg": new_exp_avg, "exp_avg_sq": new_exp_avg_sq}


# An fma operand: a graph value, or a hyper-parameter as (number, label for its Constant's name).
Operand = ir.Value | tuple[float, str]


class Emitter:
    """Appends typed, readably and uniquely named nodes to a graph, in topological order."""

    def __init__(self, graph: ir.Graph, *, prefix: str, shape: ir.Shape | None = None, exact: bool = True):
        self.graph = graph
        self.prefix = prefix
        self.shape = shape
        self.exact = exact
        self.tape = ir_tape.Tape(graph)
        self.value_names = {v.name for v in graph.inputs} | set(graph.initializers)
        self.value_names |= {out.name for node in graph for out in node.outputs}
        self.node_names = {node.name for node in graph}

    def child(self, prefix: str) -> Emitter:
        """An emitter with another name prefix that shares this one's record of taken names."""
        child = object.__new__(Emitter)
        child.__dict__.update(self.__dict__, prefix=prefix, shape=None)
        return child

    def unique_value_name(self, wanted: str) -> str:
        return unique_name(wanted, self.value_names)

    def op(self, op_type, inputs, what, dtype, shape, attributes=None, *, output_name=None) -> ir.Value:
        base = f"{self.prefix}.{what}"
        value = self.tape.op(op_type, inputs, attributes, name=unique_name(base, self.node_names))
        value.name = unique_name(output_name or base, self.value_names)
        value.dtype = dtype
        value.shape = ir.Shape(shape) if shape is not None else None
        return value

    def constant(self, number: float, dtype: ir.DataType, what: str) -> ir.Value:
        # Constant nodes rather than initializers: later passes read float initializers as candidate
        # trainable parameters, and a Constant keeps the hyper-parameter next to its use in Netron.
        array = np.array(number, dtype=dtype.numpy())
        return self.op("Constant", [], what, dtype, _SCALAR, {"value": ir.tensor(array)})

    def constant32(self, number: float, what: str) -> ir.Value:
        """A hyper-parameter as torch's float32 kernels see it: the Python float rounded to float32."""
        return self.constant(float(np.float32(number)), _FLOAT, what)

    def fma(self, a: Operand, b: Operand, c: ir.Value, what: str) -> ir.Value:
        """float32 ``a * b + c`` rounded once like torch's fused kernels (see the module docstring).

        ``a`` and ``b`` are values or hyper-parameters ``(number, label)``; a hyper-parameter is first
        rounded to float32, as torch's kernels take it.
        """
        if not self.exact:
            a, b = (self._operand(v, _FLOAT, f"{what}_arg{i}") for i, v in enumerate((a, b)))
            product = self.op("Mul", [a, b], f"{what}_product", _FLOAT, self.shape)
            return self.op("Add", [product, c], what, _FLOAT, self.shape)
        a, b, c = (self._operand(v, _DOUBLE, f"{what}_arg{i}_f64") for i, v in enumerate((a, b, c)))
        product = self.op("Mul", [a, b], f"{what}_product_f64", _DOUBLE, self.shape)
        total = self.op("Add", [product, c], f"{what}_f64", _DOUBLE, self.shape)
        return self.op("Cast", [total], what, _FLOAT, self.shape, {"to": _FLOAT})

    def _operand(self, operand: Operand, dtype: ir.DataType, what: str) -> ir.Value:
        if isinstance(operand, tuple):
            number, label = operand
            # Rounding to float32 first keeps the value torch's kernel uses; widening it is exact.
            return self.constant(float(np.float32(number)), dtype, label)
        if operand.dtype == dtype:
            return operand
        shape = operand.shape if operand.shape is not None else self.shape
        return self.op("Cast", [operand], what, dtype, shape, {"to": dtype})

    def shared(self, key: tuple[Hashable, ...], build: Callable[[Emitter], object], *, family: str = ""):
        """Build the scalars for ``key`` once per graph and reuse them for every parameter.

        Sharing keeps the number of tiny scalar kernels per step independent of the parameter count.
        The cache lives in ``graph.meta`` (never serialized); a stale entry, whose nodes were removed
        from the graph, is rebuilt.
        """
        cache = self.graph.meta.setdefault(_SHARED_META_KEY, {})
        cached = cache.get(key)
        if cached is not None and all(_still_in(self.graph, v) for v in _as_tuple(cached)):
            return cached
        built = build(self.child(f"optimizer.{family}" if family else "optimizer"))
        cache[key] = built
        return built


def _as_tuple(values) -> tuple[ir.Value, ...]:
    return values if isinstance(values, tuple) else (values,)


def _still_in(graph: ir.Graph, value: ir.Value) -> bool:
    producer = value.producer()
    return producer is not None and producer.graph is graph


def unique_name(wanted: str, taken: set[str]) -> str:
    name, suffix = wanted, 1
    while name in taken:
        name = f"{wanted}_{suffix}"
        suffix += 1
    taken.add(name)
    return name
