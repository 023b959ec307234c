"""The torch.compile backend that runs the autosp passes, the plan it reports, and the runtime of
a sharded step."""

from .._context import Options, SpContext
from ._backend import make_backend
from ._plan import COMPILE_PHASES, Collective, Plan
from ._step import ShardedStep

__all__ = ["COMPILE_PHASES", "Options", "SpContext", "make_backend", "Collective", "Plan", "ShardedStep"]
