"""Runtime: execute a transpiler output directory (OUT) as data-parallel training.

OUT's files are the only contract with the transpiler (docs/contracts.md; its schema is the shared
``contract`` package); nothing here imports ``transpiler``. How it works: docs/runtime.md.
"""

from runtime.collectives import Communicator, LocalGroup, TensorSpec
from runtime.config import RunConfig
from runtime.data import Dataset, shard_size
from runtime.errors import RunError
from runtime.executor import Backend, CpuBackend, Program
from runtime.export import export_model
from runtime.loop import train
from runtime.plan import Plan, load_plan
from runtime.segments import CutGraph, Segment, cut_graph
from runtime.simulate import SimResult, simulate
from runtime.trainer import Trainer

__all__ = [
    "Backend",
    "Communicator",
    "CpuBackend",
    "CutGraph",
    "Dataset",
    "LocalGroup",
    "Plan",
    "Program",
    "RunConfig",
    "RunError",
    "Segment",
    "SimResult",
    "TensorSpec",
    "Trainer",
    "cut_graph",
    "export_model",
    "load_plan",
    "shard_size",
    "simulate",
    "train",
]
