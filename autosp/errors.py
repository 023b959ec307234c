"""autosp's errors: each names the op, the user's source line, the shapes and placements, and a fix."""

from __future__ import annotations

import os

import torch.fx as fx

from ._graph import out_vals

__all__ = ["PlanError", "UnsupportedOpError", "GraphBreakError", "source_line"]


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def source_line(node: fx.Node | None) -> str:
    """The innermost user frame (outside autosp) of the node's stack trace: 'file.py:12, in fn: code'."""
    trace = (node.meta.get("stack_trace") or "") if node is not None else ""
    return user_frame(trace, _PACKAGE) or "<no source line recorded>"


def user_frame(trace: str, package: str = _PACKAGE) -> str:
    """'file.py:12, in fn: code' for the innermost frame of a printed traceback that is not in
    ``package``; "" when there is none."""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    frames = [i for i, line in enumerate(lines) if line.startswith("File ") and package not in line]
    if not frames:
        return ""
    i = frames[-1]
    where = lines[i].replace("File ", "").replace('"', "").replace(", line ", ":")
    code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
    return f"{where}: {code}" if code else where


def _describe(node: fx.Node | None) -> str:
    if node is None:
        return ""
    shapes = [tuple(v.shape) for v in out_vals(node) if v is not None]
    shape = shapes[0] if len(shapes) == 1 else shapes
    return f"{node.target} (node {node.name}, output shape {shape}) at {source_line(node)}"


class PlanError(ValueError):
    """The sharding plan cannot be built exactly for this graph."""

    def __init__(self, node: fx.Node | None, problem: str, fix: str):
        self.node, self.problem, self.fix = node, problem, fix
        where = _describe(node)
        super().__init__(f"autosp: {problem}" + (f"; in {where}" if where else "") + f". Fix: {fix}.")


class UnsupportedOpError(PlanError, NotImplementedError):
    """No sharding rule (ours or DTensor's) for an op that sees sharded data."""


class GraphBreakError(PlanError):
    """The step cannot be captured as one graph."""
