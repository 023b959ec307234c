"""``autosp.token_local(module)``: the user's word that a module maps each token's row to its own
output row, so it runs as one op on each rank's own tokens (``propagate._local``), as HF's experts
layers do (``backend._experts``). JAX's ``shard_map`` in spirit: the claim is the user's."""

from __future__ import annotations

import functools
import types

import torch
import torch.nn as nn

from ..backend._experts import token_local_call

__all__ = ["token_local"]


def token_local(module: nn.Module) -> nn.Module:
    """Mark ``module`` token-local and return it: each output token is a function of the same
    token's rows of the inputs and of the parameters, whatever the other tokens are, e.g. a
    mixture-of-experts layer that routes each token to its top-k experts with no capacity limit,
    written with ``torch.where`` / ``index_add_`` / ``sort`` dispatch (whose ops have no rule that
    keeps tokens where they are). Under autosp's capture its positional tensor arguments, of one
    leading shape (``(batch, seq, ...)``), run on each rank's tokens, and it returns one tensor
    shaped and typed like its first argument; the backward runs its forward again
    (``propagate._local``). A module that drops tokens over a capacity, or reduces over the tokens
    inside (an auxiliary loss, a norm over the sequence), is not token-local: its results would
    differ from one device's."""
    forward = module.forward
    if getattr(forward, "__autosp_token_local__", False):
        return module
    if not (isinstance(forward, types.MethodType) and forward.__self__ is module):
        raise TypeError(f"autosp: token_local({type(module).__name__}): its forward is not its own method")
    # a method of the module's, not a closure over it: a deepcopy of the module calls its own forward
    module.forward = types.MethodType(_local_forward(forward.__func__), module)
    return module


def _local_forward(forward):
    def wrapped(self, *args, **kwargs):
        if kwargs or not args or not torch.compiler.is_compiling():
            return forward(self, *args, **kwargs)
        lead = args[0].ndim - 1
        if lead < 1 or any(not isinstance(a, torch.Tensor) or a.shape[:lead] != args[0].shape[:lead] for a in args):
            raise TypeError(
                f"autosp: token_local({type(self).__name__}) was called with "
                f"{[tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args]}: "
                "pass its tensors positionally, of one leading shape (the tokens' dims), features last"
            )
        rows = [a.reshape(-1, *a.shape[lead:]) for a in args]
        return token_local_call(self, None, rows, lead).reshape(args[0].shape)

    functools.update_wrapper(wrapped, forward)
    wrapped.__autosp_token_local__ = True
    return wrapped
