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
    device = hidden_states.device.type
    # the op's kernel runs outside the step's autocast (it was traced into casts): it enters the
    # autocast the call was traced under, as the layer runs on one device
    amp = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    key = _key(module, impl, device, amp)
    return torch.ops.autosp.token_local(key, 3, [hidden_states, *args, *module.parameters()])


@torch._dynamo.assume_constant_result
def _key(module, impl, device: str, amp: torch.dtype | None) -> int:
    """The op's key for ``impl`` on ``module`` under autocast to ``amp`` (None: none), evaluated
    while Dynamo traces (a constant in the graph)."""
    names = tuple(name for name, _ in module.named_parameters())  # the order of module.parameters()
    return register(functools.partial(_run, module, names, device, amp), (module, impl, device, amp))


def _run(module, names, device, amp, hidden_states, top_k_index, top_k_weights, *params):
    # through the module's forward, outside compile: HF's dispatch picks the implementation again
    with torch.autocast(device, dtype=amp, enabled=amp is not None):
        out = torch.func.functional_call(module, dict(zip(names, params)), (hidden_states, top_k_index, top_k_weights))
    if out.dtype != hidden_states.dtype:
        raise NotImplementedError(
            f"autosp: {type(module).__name__} returned {out.dtype} from {hidden_states.dtype} hidden states (under "
            f"autocast to {amp}); the token-local experts op returns its input's dtype: run the experts without "
            "autocast, or in the hidden states' dtype"
        )
    return out
