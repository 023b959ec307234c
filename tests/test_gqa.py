"""The K/V repeat fold on joint graphs (no process group): exact, and only for a repeat that is
grouped-query attention."""

import copy

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from functorch.compile import aot_function, make_boxed_func
from torch._functorch.partitioners import default_partition

from autosp.partition._gqa import fold_kv_repeats

REPEATS = {
    "repeat_interleave": lambda x, r: x.repeat_interleave(r, dim=1),
    "repeat_kv": lambda x, r: (
        x[:, :, None].expand(x.shape[0], x.shape[1], r, *x.shape[2:]).reshape(x.shape[0], x.shape[1] * r, *x.shape[2:])
    ),
    "tile": lambda x, r: x.repeat(1, r, 1, 1),  # head j reads K/V head j % KV: not grouped-query attention
}


def _joint(repeat, kv: int, heads: int = 8):
    """The joint graph of causal SDPA on K/V repeated by ``repeat``, and inputs for it (fp64)."""
    captured = {}

    def partition(joint, inputs, **kwargs):
        captured["joint"] = copy.deepcopy(joint)
        return default_partition(joint, inputs, **kwargs)

    def attention(q, k, v):
        r = heads // kv
        return F.scaled_dot_product_attention(q, repeat(k, r), repeat(v, r), is_causal=True)

    boxed = lambda gm, _: make_boxed_func(gm.forward)  # noqa: E731
    fn = aot_function(attention, fw_compiler=boxed, bw_compiler=boxed, partition_fn=partition)
    torch.manual_seed(0)
    q = torch.randn(2, heads, 24, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv, 24, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    fn(q, k, v).sum().backward()
    primals = [x.detach() for x in (q, k, v)]
    return captured["joint"], (primals, [torch.randn(2, heads, 24, 16, dtype=torch.float64)])


@pytest.mark.parametrize("kind", ["repeat_interleave", "repeat_kv"])
def test_folded_repeat_gives_the_same_outputs_and_gradients(kind):
    """The folded joint graph returns the attention output and the q, k, v gradients of the
    repeated one (fp64, 1e-12), with no expand left: catches a wrong head mapping or a gradient
    not summed over the group."""
    joint, args = _joint(REPEATS[kind], kv=2)
    ref = joint(*args)
    assert len(fold_kv_repeats(joint, 2)) == 1
    assert not any(nd.target is torch.ops.aten.expand.default for nd in joint.graph.nodes)
    for want, got in zip(pytree.tree_leaves(ref), pytree.tree_leaves(joint(*args)), strict=True):
        assert want.shape == got.shape
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_tiled_repeat_and_unsplittable_kv_heads_are_not_folded():
    """``x.repeat(1, r, 1, 1)`` maps query head j to K/V head j % KV, which the kernel does not
    do; and K/V heads that do not split over the ranks keep their repeat (Ulysses splits the
    repeated heads)."""
    joint, _ = _joint(REPEATS["tile"], kv=2)
    assert fold_kv_repeats(joint, 2) == []
    joint, _ = _joint(REPEATS["repeat_kv"], kv=2)
    assert fold_kv_repeats(joint, 4) == []
