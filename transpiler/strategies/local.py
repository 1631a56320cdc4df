"""``local``: one device, no collective. The single-device graphs (train.onnx) and --gpus 1."""

from __future__ import annotations

from transpiler.strategies.base import Strategy


class Local(Strategy):
    name = "local"
    user_selectable = False
    single_device = True
    reductions_per_gradient = 0

    def reduce(self, step, bucket):
        return [step.grads[p] for p in bucket.params]

    def broadcast_at_init(self, state):
        return []

    def updates_per_param(self, world):
        return 1, 1
