"""autosp: sequence parallelism for single-device PyTorch training code, by annotation.

with autosp.mesh(sp=N):
    @autosp.shard(seq=True)
    def loss_fn(input_ids, labels):
        return model(input_ids=input_ids, labels=labels).loss
"""

from .annotations import Config, Mesh, annotate, current_mesh, explain, load_config, mesh, shard, token_local
from .backend import Collective, Options, Plan
from .errors import GraphBreakError, PlanError, RecompileLimitError, UnsupportedOpError

__all__ = [
    "mesh",
    "shard",
    "annotate",
    "token_local",
    "explain",
    "current_mesh",
    "load_config",
    "Config",
    "Mesh",
    "Options",
    "Plan",
    "Collective",
    "PlanError",
    "UnsupportedOpError",
    "GraphBreakError",
    "RecompileLimitError",
]
__version__ = "0.1.0"
