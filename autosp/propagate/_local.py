"""``autosp::token_local``: a function that maps each token's row to its own output row, run as
one op, on each rank's own tokens; its backward, and their rules.

A mixture-of-experts layer dispatches tokens to experts by sorting, indexing and scattering over
all tokens, and each token's result is its own experts' output: the layer is token-local as a
whole, but none of its ops is. As one op, it runs on each rank's rows as is, with the sort, the
grouped matmuls and the scatter back all on the rank's own tokens.

The op's tensors are ``rows`` token tensors (dim 0 indexes tokens, the same tokens in each, as
``(hidden_states, top_k_index, top_k_weights)``), then the function's parameters; its output is a
token tensor like the first. The backward runs the function again on the same rows and takes its
vector-Jacobian product (autograd's, on detached leaves): a token's input gradient is its own, and a
parameter's gradient is each rank's tokens' part of the sum (``Partial``). The module's buffers are
the rank's own: a forward that updates one in place (a count of the tokens each expert got) counts
the rank's tokens, as under torchtitan's context parallelism (whose load-balancing update
all-reduces the counts); the backward's second run updates copies. The function runs twice
per step (forward, and again in the backward): its activations are never kept, as with
checkpointing. Which functions become this op: ``backend._experts``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from ._placement import P, R, shard
from ._placement import shard_specs as _shards
from ._strategy import Strategy, rule

__all__ = ["PARAMETERS", "TOKEN_LOCAL", "TOKEN_LOCAL_BACKWARD", "register", "run_backward", "run_forward"]

# key -> the function the op runs; filled at capture, read by the op on every call of the step
_FUNCTIONS: dict[int, Callable[..., torch.Tensor]] = {}
# key -> the module's own parameters, the op's tensors after the rows (the memory model runs the
# function on them)
PARAMETERS: dict[int, tuple[torch.Tensor, ...]] = {}
_KEYS: dict[tuple, int] = {}


def register(fn: Callable[..., torch.Tensor], identity: tuple, parameters: tuple[torch.Tensor, ...]) -> int:
    """The op's key for ``fn(*tensors, scratch=...)`` (``run_forward``) on ``parameters``; the
    same ``identity`` (what makes two calls one function: a module and its implementation) always
    gets the same key, so a step captured again reuses it."""
    key = _KEYS.get(identity)
    if key is None:
        key = _KEYS[identity] = len(_FUNCTIONS)
        _FUNCTIONS[key] = fn
        PARAMETERS[key] = parameters
    return key


def run_forward(key: int, tensors: list[torch.Tensor], scratch: bool = False) -> torch.Tensor:
    """What the op computes (also run by the memory model for its working set, ``partition._memory``,
    with ``scratch``: on copies of the module's buffers, which a forward may update in place, as
    torchtitan's MoE counts the tokens each expert got; the step's own forward updates them)."""
    with torch.no_grad():
        return _FUNCTIONS[key](*tensors, scratch=scratch)


def run_backward(key: int, grad: torch.Tensor, tensors: list[torch.Tensor], need: list[bool]) -> list[torch.Tensor]:
    """The gradients of the ``need``-ed tensors, in order: the function run again, on leaves
    detached from the step's graph, and differentiated by autograd. (Not ``torch.func.vjp``: a
    custom op's autograd formula inside the function, as torchtitan's ``deterministic_scatter_add``
    has, runs under autograd but under no functorch transform.)"""
    leaves = [t.detach().requires_grad_(w) for t, w in zip(tensors, need)]
    wrt = [t for t, w in zip(leaves, need) if w]
    with _with_autograd():
        # on copies of the buffers: the forward already updated them once
        out = _FUNCTIONS[key](*leaves, scratch=True)
        grads = torch.autograd.grad(out, wrt, grad, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(wrt, grads)]


def _with_autograd():
    """Autograd back on inside an op's kernel (which runs with the autograd dispatch keys excluded
    and grad mode off), the rest of the dispatch state as it is."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for k in (_KEY.AutogradFunctionality, _KEY.AutogradOther, _KEY.AutogradNestedTensor):
        exclude = exclude.remove(k)
    guard = torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)
    stack = contextlib.ExitStack()
    stack.enter_context(guard)
    stack.enter_context(torch.enable_grad())
    return stack


_KEY = torch._C.DispatchKey


@torch.library.custom_op("autosp::token_local", mutates_args=())
def token_local_op(key: int, rows: int, tensors: list[torch.Tensor]) -> torch.Tensor:
    out = run_forward(key, tensors)
    ptr = out.untyped_storage().data_ptr()
    return out.clone() if any(ptr == t.untyped_storage().data_ptr() for t in tensors) else out


@token_local_op.register_fake
def _(key, rows, tensors):
    return torch.empty_like(tensors[0])


@torch.library.custom_op("autosp::token_local_backward", mutates_args=())
def token_local_backward_op(
    key: int, rows: int, grad: torch.Tensor, tensors: list[torch.Tensor], need: list[bool]
) -> list[torch.Tensor]:
    return run_backward(key, grad, tensors, need)


@token_local_backward_op.register_fake
def _(key, rows, grad, tensors, need):
    return [torch.empty_like(t) for t, w in zip(tensors, need) if w]


def _setup(ctx, inputs, output):
    ctx.key, ctx.rows = inputs[0], inputs[1]
    ctx.need = [t.requires_grad and t.is_floating_point() for t in inputs[2]]
    ctx.save_for_backward(*inputs[2])


def _backward(ctx, grad):
    grads = iter(torch.ops.autosp.token_local_backward(ctx.key, ctx.rows, grad, list(ctx.saved_tensors), ctx.need))
    return None, None, [next(grads) if w else None for w in ctx.need]


token_local_op.register_autograd(_backward, setup_context=_setup)

TOKEN_LOCAL = torch.ops.autosp.token_local.default
TOKEN_LOCAL_BACKWARD = torch.ops.autosp.token_local_backward.default


def _row_shards(A, rows: range) -> list[tuple[int, int]]:
    """The shardings of dim 0 every token tensor can take (with its split factor: a flattened
    batch of sequences, ``_S(0, b)``, is as good: any rows are a rank's own)."""
    common = None
    for j in rows:
        specs = {(d, sf) for d, sf in _shards(A[j]) if d == 0}
        common = specs if common is None else common & specs
    return sorted(common or ())


# Once the tokens reach the op sharded, it runs on them sharded only: replicated, every rank would
# run every expert on every token and hold every token's activations, which the solver, counting
# bytes sent and not FLOPs, may take for cheaper where the expert weights' gradients outweigh a
# short test length's activations (OLMoE's 64 experts at 48 tokens did).


@rule(TOKEN_LOCAL)
def _token_local(node, A, n):
    rows, k = node.args[1], len(node.args[2])
    res = []
    for _, sf in _row_shards(A, range(rows)):
        p = shard(0, sf)
        res.append(Strategy((p,), (p,) * rows + (R,) * (k - rows)))
    return res or [Strategy((R,), (R,) * k)]


@rule(TOKEN_LOCAL_BACKWARD)
def _token_local_backward(node, A, n):
    """Inputs (grad, *tensors): the gradient and the token tensors as the forward's output and
    rows; outputs: a token tensor's gradient its rows, a parameter's a partial sum."""
    rows, k, need = node.args[1], len(node.args[3]), node.args[4]
    res = []
    for _, sf in _row_shards(A, range(rows + 1)):
        p = shard(0, sf)
        outs = tuple(p if j < rows else P for j, w in enumerate(need) if w)
        res.append(Strategy(outs, (p,) * (rows + 1) + (R,) * (k - rows)))
    return res or [Strategy((R,) * sum(need), (R,) * (k + 1))]
