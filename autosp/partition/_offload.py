"""Activation offload: the layers' saved activations held in host memory from their last use in
the forward to their first in the backward, as DeepSpeed ALST keeps its checkpointed hidden
states. autosp chooses what moves: the values a rung saves that the layers compute (under "full",
each layer's input, its attention's output and log-sum-exp, its collectives' results: the values
computed in a layer or read by one); torch's
compiled activation-offloading pass (``torch._functorch._activation_offloading``) moves them: a
copy to the host after the value's last forward use, a copy back before its first backward use
(``prims.device_put``, non-blocking), so a layer's saved values are on the device only while its
forward and its backward run. The pass's separate-stream variant (``activation_offload_separate
_stream``, with reloads prefetched) is turned off here, whatever torch's config says: it times
ops on the device to place its prefetches, which a plan traced on fake tensors cannot. The pass keeps an output of a
multi-output op (a ``getitem``: attention's output and log-sum-exp), a view and a non-contiguous
value where they are; such a value is copied once on the device into a contiguous tensor and
the copy moves. Memory reads the pass's marks
(``_memory.on_host``)."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._functorch import config as functorch_config
from torch._functorch._activation_offloading.activation_offloading import enable_activation_offloading
from torch._functorch.partitioners import get_default_op_list
from torch._subclasses.fake_tensor import extract_tensor_metadata
from torch.utils._ordered_set import OrderedSet
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

__all__ = ["offload_saved"]


def _copied(fw: fx.GraphModule, bw: fx.GraphModule, nd: fx.Node, num_fwd_outputs: int) -> fx.Node:
    """A copy of the saved ``nd`` handed to the backward in its place, under the name the
    backward's input takes (torch's pass pairs the two by name)."""
    name = f"{nd.name}_saved"
    kwargs = {"memory_format": torch.contiguous_format}
    with fw.graph.inserting_after(nd):
        copy = fw.graph.create_node("call_function", aten.clone.default, (nd,), kwargs, name=name)
    val = nd.meta["val"].clone(**kwargs)
    copy.meta.update(val=val, tensor_meta=extract_tensor_metadata(val))
    out = fw.graph.output_node()
    outs = list(out.args[0])
    outs[num_fwd_outputs:] = [copy if a is nd else a for a in outs[num_fwd_outputs:]]  # saved only
    out.args = (tuple(outs), *out.args[1:])
    ph = next(p for p in bw.graph.find_nodes(op="placeholder") if p.name == nd.name)
    ph._rename(copy.name)
    if ph.name != copy.name:
        raise AssertionError(f"autosp: offload: the backward's input {ph.name} is not named as the copy {copy.name}")
    ph.target = ph.name
    ph.meta.update(copy.meta)
    return copy


def offload_saved(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, layers: set[str]) -> int:
    """Marks the forward's saved values that ops in ``layers`` (names of the layers' ops) compute
    or read for offloading and runs torch's pass on the partitioned ``fw`` and ``bw`` (in place):
    the number of values moved."""
    views = get_default_op_list()
    # the backward's inputs, named as the forward's saved values but for the RNG state the
    # partitioner saves for a recomputed random op (``run_and_save_rng_state``'s getitem, whose
    # fresh name may be a layer op's of the joint graph: CUDA's flash kernel in whole layers)
    inputs = {p.name for p in bw.graph.find_nodes(op="placeholder")}
    for nd in tree_leaves(fw.graph.output_node().args)[num_fwd_outputs:]:
        if not isinstance(nd, fx.Node) or nd.op != "call_function" or not isinstance(nd.meta.get("val"), torch.Tensor):
            continue
        if nd.name not in inputs:
            continue
        if nd.name in layers or any(u.name in layers for u in nd.users):
            moved = nd.target is operator.getitem or views.is_view(nd) or not nd.meta["val"].is_contiguous()
            (_copied(fw, bw, nd, num_fwd_outputs) if moved else nd).meta["should_offload"] = True
    with functorch_config.patch(activation_offload_separate_stream=False):  # see the module's docstring
        enable_activation_offloading(fw, bw, num_fwd_outputs, OrderedSet())
    fw.recompile()
    bw.recompile()
    return sum(1 for nd in bw.graph.find_nodes(op="placeholder") if nd.meta.get("saved_for_offloading"))
