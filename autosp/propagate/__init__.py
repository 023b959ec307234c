"""Propagation: the sharding rules, the whole-graph solver, and placement helpers."""
from ._placement import local_shape, redistribute_kind, transfer_bytes
from ._rules import RULES, Strategy
from ._solver import Candidates, Choice, propagate, solve

__all__ = ["RULES", "Strategy", "Candidates", "Choice", "propagate", "solve", "local_shape",
           "redistribute_kind", "transfer_bytes"]
