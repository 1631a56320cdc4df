"""A measurement aid: the NCCL communicator with its calls switchable off, so that a benchmark times
the same step with and without communication (the difference is the communication left exposed).
Results computed while skipping are wrong by design; it lives here, never in the runtime."""

from __future__ import annotations


def skippable_nccl(host, device: int, **kwargs):
    """A NcclCommunicator whose ``skip`` attribute, once True, enqueues no NCCL call (every other
    part of the step, the mean division included, runs as before)."""
    from runtime.gpu import NcclCommunicator

    class Skippable(NcclCommunicator):
        skip = False

        def _call(self, label, method, *args):
            if not self.skip:
                super()._call(label, method, *args)

    return Skippable(host, device, **kwargs)


def skips(backend) -> bool:
    """Whether ``skip`` takes effect on ``backend``'s programs: not where the step's collectives run
    inside its captured sessions (runtime/gpu/session_collectives.py), whose CUDA graphs replay the
    NCCL calls recorded at capture whatever ``skip`` says (the default since run h200x4-s27)."""
    return not getattr(backend, "collectives_inside", False)
