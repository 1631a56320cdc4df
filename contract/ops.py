"""The step graphs' own ops besides the collectives: their domains, versions, op types and
attributes (docs/contracts.md). The transpiler writes them, each with a model-local function in
standard ops; a backend may run them natively (the GPU backend does) and must compute what the
function computes.
"""

from __future__ import annotations

# The optimizer update of one parameter (or zero slice): ops SGD, Momentum, Adam, AdamW.
FUSED_UPDATE_DOMAIN = "graph_transpiler.optimizer"
FUSED_UPDATE_VERSION = 1

# The weight gradient of a 2-D Conv of group 1: ConvWeightGrad(X, dY) -> dW, every attribute present.
CONV_GRAD_DOMAIN = "graph_transpiler.conv"
CONV_GRAD_VERSION = 1
CONV_WEIGHT_GRAD = "ConvWeightGrad"
CONV_WEIGHT_GRAD_ATTRIBUTES = ("kernel_shape", "strides", "dilations", "pads")
