"""Partitioning: the per-rank graph and the collectives on its edges."""
from ._collectives import redistribute
from ._localize import localize

__all__ = ["localize", "redistribute"]
