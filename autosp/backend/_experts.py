"""Hugging Face's mixture-of-experts layers, captured as token-local ops (``propagate._local``).

Every HF MoE model's experts module (Mixtral, Qwen2/3-MoE, OLMoE, Granite-MoE, GPT-OSS, ...,
classes decorated with ``transformers.integrations.moe.use_experts_implementation``) dispatches
through ``ExpertsInterface.get_interface`` to one implementation, "eager", "grouped_mm" or
"batched_mm", each ``(hidden_states, top_k_index, top_k_weights) -> hidden_states``, (tokens, ...)
each, and each token's output its own top-k experts' weighted sum. That contract is what makes the
layer token-local; autosp trusts it of HF's own implementations only. Under autosp's capture the
call becomes ``autosp::token_local``, so each rank routes and computes its own tokens. A function
registered under another name (``ExpertsInterface.register``) is HF's to dispatch and autosp's
to plan op by op, as any code: it might drop tokens over a capacity, which depends on the others.
``token_local_call`` makes the op of any module's call: HF's layers, and a user's module marked
with ``autosp.token_local`` (``annotations._local``).
"""

from __future__ import annotations

import functools
import sys

import torch

from ..propagate._local import register

__all__ = ["capture_hf_experts"]

_ORIGINAL = []  # ExpertsInterface.get_interface, once replaced


def capture_hf_experts() -> None:
    """Make HF's experts implementations token-local ops under compile (once per process; a no-op
    without transformers loaded)."""
    moe = sys.modules.get("transformers.integrations.moe")
    if moe is None or _ORIGINAL:
        return
    cls = moe.ExpertsInterface
    _ORIGINAL.append(cls.get_interface)
    builtin = {id(f) for f in cls._global_mapping.values() if f.__module__.startswith("transformers.")}

    def get_interface(self, experts_implementation, default):
        impl = _ORIGINAL[0](self, experts_implementation, default)
        # "eager" is the decorated class's own forward: HF's only if the class is (the decorator
        # is public, and a user's experts class may drop tokens)
        if id(impl) in builtin or (impl is default and impl.__module__.startswith("transformers.")):
            return functools.partial(_experts_forward, impl)
        return impl

    cls.get_interface = get_interface


def _experts_forward(impl, module, hidden_states, *args, **kwargs):
    if kwargs or len(args) != 2 or hidden_states.ndim != 2 or not torch.compiler.is_compiling():
        return impl(module, hidden_states, *args, **kwargs)
    return token_local_call(module, impl, [hidden_states, *args], lead=1)


def token_local_call(module, identity, rows: list[torch.Tensor], lead: int) -> torch.Tensor:
    """``module`` called on ``rows`` (token tensors, dim 0 the tokens, flattened from ``lead``
    leading dims) as ``autosp::token_local``: its output like ``rows[0]``. ``identity``: what
    else tells two calls apart (HF's implementation)."""
    device = rows[0].device.type
    # the op's kernel runs outside the step's autocast (it was traced into casts): it enters the
    # autocast the call was traced under, as the layer runs on one device
    amp = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    key = _key(module, identity, device, amp, lead, len(rows))
    return torch.ops.autosp.token_local(key, len(rows), [*rows, *module.parameters()])


@torch._dynamo.assume_constant_result
def _key(module, identity, device: str, amp: torch.dtype | None, lead: int, rows: int) -> int:
    """The op's key for ``module`` (and ``identity``) under autocast to ``amp`` (None: none),
    evaluated while Dynamo traces (a constant in the graph)."""
    names = tuple(name for name, _ in module.named_parameters())  # the order of module.parameters()
    run = functools.partial(_run, module, names, device, amp, lead, rows)
    return register(run, (module, identity, device, amp, lead, rows), tuple(module.parameters()))


def _run(module, names, device, amp, lead: int, rows: int, *tensors, scratch: bool = False):
    # through the module's forward, outside compile (HF's dispatch picks the implementation
    # again), on this rank's tokens as one run of tokens under the leading dims; ``scratch``: on
    # copies of its buffers (``propagate._local.run_forward``)
    xs = [t.reshape(*(1,) * (lead - 1), *t.shape) for t in tensors[:rows]]
    state = dict(zip(names, tensors[rows:]))
    if scratch:
        state.update((name, b.clone()) for name, b in module.named_buffers())
    with torch.autocast(device, dtype=amp, enabled=amp is not None):
        out = torch.func.functional_call(module, state, tuple(xs))
    first = tensors[0]
    if not isinstance(out, torch.Tensor) or out.shape != xs[0].shape or out.dtype != first.dtype:
        got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise NotImplementedError(
            f"autosp: {type(module).__name__}, run token-local, returned {got} from {tuple(xs[0].shape)} "
            f"{first.dtype} tokens (under autocast to {amp}); a token-local module returns one tensor shaped "
            "and typed like its first input: return other results (an auxiliary loss) from outside it"
        )
    return out.reshape(first.shape)
