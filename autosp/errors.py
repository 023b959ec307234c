"""autosp's errors: each names the op, the user's source line, the shapes and placements, and a fix."""

from __future__ import annotations

import os
import re

import torch
import torch.fx as fx

from ._graph import out_vals

__all__ = [
    "PlanError",
    "UnsupportedOpError",
    "GraphBreakError",
    "RecompileLimitError",
    "source_line",
    "module_path",
    "collective_error",
    "peer_lost",
]


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
# with the separator: torchtitan's and torchtune's files (".../torchtitan/...") are not torch's
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def source_line(node: fx.Node | None) -> str:
    """The innermost user frame (outside autosp) of the node's stack trace: 'file.py:12, in fn: code'."""
    trace = (node.meta.get("stack_trace") or "") if node is not None else ""
    return user_frame(trace, _PACKAGE) or "<no source line recorded>"


def user_frame(trace: str, package: str = _PACKAGE) -> str:
    """'file.py:12, in fn: code' for the innermost frame of a printed traceback that is neither in
    ``package`` nor in torch (``F.pad`` is the user's line, not torch's ``functional.py``), else
    the innermost outside ``package``; "" when there is none."""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    frames = [i for i, line in enumerate(lines) if line.startswith("File ") and package not in line]
    frames = [i for i in frames if _TORCH not in lines[i]] or frames
    if not frames:
        return ""
    i = frames[-1]
    where = lines[i].replace("File ", "").replace('"', "").replace(", line ", ":")
    code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
    return f"{where}: {code}" if code else where


# Dynamo's names for where a module came from: an argument, a global
_ROOT = re.compile(r"^[LG]\['[^']*'\]\.?")


def module_path(node: fx.Node) -> str:
    """The modules the node's op ran in, outermost first, as Dynamo recorded them
    (``nn_module_stack``): 'layers[0].moe (MoE) > layers[0].moe.experts (Experts)'; "" outside any."""
    names = []
    for fqn, cls in (node.meta.get("nn_module_stack") or {}).values():
        cls = getattr(cls, "__name__", None) or str(cls).rsplit(".", 1)[-1].strip("'>")
        path = _ROOT.sub("", fqn) or "the model"
        names.append(f"{path} ({cls})")
    return " > ".join(names)


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


class RecompileLimitError(PlanError):
    """The step recompiled for the same input shapes more often than Dynamo allows."""


# how gloo reports a peer that went away in the middle of a collective (torch 2.13)
_PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe")


def peer_lost(e: BaseException) -> bool:
    """Whether a collective failed because another rank's connection went away."""
    return any(x in str(e).lower() for x in _PEER_LOST)


def collective_error(e: RuntimeError) -> PlanError | None:
    """autosp's error for a collective of a sharded step that failed at run time (another rank
    stopped, or did not arrive within the mesh's timeout); None for any other error."""
    text, first = str(e).lower(), (str(e).strip().splitlines() or [""])[0][:200]
    if peer_lost(e):
        return PlanError(
            None,
            f"another rank stopped while this one was in a collective of the sharded step ({first})",
            "look at the other ranks' output for why it stopped (an error, a kill, out of memory); "
            "every rank of the sp group must run every step",
        )
    if "timed out" in text or "timeout" in text:
        return PlanError(
            None,
            f"a collective of the sharded step timed out ({first})",
            "every rank of the sp group must run the same steps with the same shapes; "
            "check for a rank that skipped or changed a step",
        )
    return None
