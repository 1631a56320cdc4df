"""``local``: one device, no collective. The single-device graphs (train.onnx) and --gpus 1."""

from __future__ import annotations

from transpiler.strategies.base import Strategy
from transpiler.update import emit_bucket_update


class Local(Strategy):
    name = "local"
    user_selectable = False
    single_device = True
    reductions_per_gradient = 0

    def reduce(self, step, bucket):
        return [step.grads[p] for p in bucket.params]

    def update(self, step, bucket, grads):
        return emit_bucket_update(step, bucket, grads)

    def publish(self, step, bucket, new_values):
        for name, value in zip(bucket.params, new_values):
            step.add_state(step.params[name], value, "param", name)

    def broadcast_at_init(self, state):
        return []

    def updates_per_param(self, world):
        return 1, 1
