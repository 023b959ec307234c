"""``autosp::annotate``: the op that carries a placement into the captured graph, and its rule.

``autosp.annotate(x, spec)`` (a hard constraint: JAX's ``with_sharding_constraint``) and
``autosp.shard``'s inputs (a permission: the planner may keep them replicated) both become this
op; its gradient is the same constraint on the cotangent.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Placement

from ._placement import R, parse_placement, placement_str
from ._strategy import Strategy, rule

__all__ = ["ANNOTATE", "annotate_placement"]


@torch.library.custom_op("autosp::annotate", mutates_args=())
def annotate_op(x: torch.Tensor, placement: str, hard: bool) -> torch.Tensor:
    return x.clone()


@annotate_op.register_fake
def _(x, placement, hard):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.placement, ctx.hard = inputs[1], inputs[2]


def _backward(ctx, grad):
    # JAX's with_sharding_constraint transposes to the same constraint on the cotangent.
    return torch.ops.autosp.annotate(grad, ctx.placement, ctx.hard), None, None


annotate_op.register_autograd(_backward, setup_context=_setup)

ANNOTATE = torch.ops.autosp.annotate.default


def annotate_placement(x: torch.Tensor, p: Placement, hard: bool) -> torch.Tensor:
    """``x`` marked with placement ``p`` on the sp axis: a constraint (``hard``) or a permission."""
    return torch.ops.autosp.annotate(x, placement_str(p), hard)


@rule(ANNOTATE)
def _annotate(node, A, n):
    p = parse_placement(node.args[1])
    if node.args[2]:
        return [Strategy((p,), (p,), introduces=True)]
    return [Strategy((R,), (R,)), Strategy((p,), (p,), introduces=True)]
