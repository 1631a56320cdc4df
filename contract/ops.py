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

# BatchNormalization in training mode, as two nodes (docs/contracts.md), rank-4 (N, C, H, W) float32:
#   BatchNormTraining(X, scale, B, running_mean, running_var) -> (Y, running_mean_next,
#       running_var_next, saved_mean, saved_inv_std)        attributes epsilon, momentum
#   BatchNormTrainingGrad(dY, X, scale, saved_mean, saved_inv_std) -> (dX, dscale, dB)   epsilon
BATCHNORM_DOMAIN = "graph_transpiler.batchnorm"
BATCHNORM_VERSION = 1
BATCHNORM_TRAINING = "BatchNormTraining"
BATCHNORM_TRAINING_GRAD = "BatchNormTrainingGrad"

# The gradient of LayerNormalization over the last axis (axis = -1), float32 (docs/contracts.md):
#   LayerNormGrad(dY, X, scale, mean, inv_std_dev) -> (dX, dscale, dB)
# X and dY (..., C), scale (C,), mean and inv_std_dev the forward's saved statistics (..., 1);
# dscale and dB (C,). No attributes: epsilon is in inv_std_dev.
LAYERNORM_DOMAIN = "graph_transpiler.layernorm"
LAYERNORM_VERSION = 1
LAYERNORM_GRAD = "LayerNormGrad"

# The gradient of a mean-reduced SoftmaxCrossEntropyLoss over 2-D scores (docs/contracts.md):
#   SoftmaxCrossEntropyGrad(dloss, scores, labels, log_prob) -> dscores      attribute ignore_index (int)
# scores, log_prob, dscores (N, C) float32, log_prob the forward node's output 1; labels (N,) int32 or
# int64; dloss a float32 scalar. A row whose label is ignore_index weighs 0 (the transpiler writes
# -2**63 where the loss ignores none: no label is that), every other row 1:
#   dscores[i, j] = dloss * w_i / sum(w) * (exp(log_prob[i, j]) - (j == labels[i]))
LOSS_DOMAIN = "graph_transpiler.loss"
LOSS_VERSION = 1
CROSS_ENTROPY_GRAD = "SoftmaxCrossEntropyGrad"
NO_IGNORED_LABEL = -(2 ** 63)

# Scaled dot-product attention, forward and gradient, on the heads as the projections lay them out
# (docs/contracts.md):
#   Attention(Q, K, V) -> (Y, LSE)                           attributes scale (float), causal (int)
#   AttentionGrad(dY, Q, K, V, Y, LSE) -> (dQ, dK, dV)       the same attributes
# Q, Y, dY, dQ (batch, queries, heads, head size); K, V, dK, dV (batch, keys, heads, head size); all of
# one float dtype. LSE (batch, heads, queries, 1) float32: each row's log-sum-exp of the scaled, masked
# scores. causal = 1: query i sees key j only where j <= i (top-left aligned, torch.tril's mask).
ATTENTION_DOMAIN = "graph_transpiler.attention"
ATTENTION_VERSION = 1
ATTENTION = "Attention"
ATTENTION_GRAD = "AttentionGrad"
ATTENTION_ATTRIBUTES = ("scale", "causal")
