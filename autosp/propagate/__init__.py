"""Propagation: the sharding rules, the candidates of every node, the whole-graph solver, and
placement helpers. Importing it registers every rule (``_rules``, ``_attention``, ``_shift``, ``_annotate``,
``_local``)."""

from ._annotate import ANNOTATE
from ._attention import attention_notes, hybrid_bytes, ring_bytes
from ._local import TOKEN_LOCAL, TOKEN_LOCAL_BACKWARD
from ._placement import local_shape, parse_placement, placement_str, redistribute_kind, transfer_bytes
from ._propagate import Candidates, propagate
from ._rules import strategies_for
from ._shift import Window, flip_pieces, halo_pieces, window_of
from ._solver import Choice, solve
from ._strategy import RULES, Strategy, rule

__all__ = [
    "ANNOTATE",
    "TOKEN_LOCAL",
    "TOKEN_LOCAL_BACKWARD",
    "RULES",
    "Strategy",
    "rule",
    "Candidates",
    "Choice",
    "propagate",
    "solve",
    "strategies_for",
    "attention_notes",
    "ring_bytes",
    "hybrid_bytes",
    "Window",
    "halo_pieces",
    "flip_pieces",
    "window_of",
    "local_shape",
    "parse_placement",
    "placement_str",
    "redistribute_kind",
    "transfer_bytes",
]
