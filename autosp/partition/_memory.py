"""Predicted memory per rank: a liveness walk over the partitioned forward and backward graphs.

Every op's outputs are allocated when it runs and freed after their last use, unless they alias
an input (views, ``wait_tensor``) or leave the graph. What the forward hands the backward (the
saved activations) is live from the end of the forward; in the backward it is freed after its
last use (both compilers autosp runs free a boxed input after its last use). Measured against
peak RSS (tests/memory_probe.py, small preset, aot_eager): 1.01-1.03 with "none", 1.07 with "full"
tiled in 4 at 4096 tokens over 2, 1.10-1.14 tiled in 8 at 8192 over 2 and 16384 over 4, where
RSS growth under-counts live tensors by ~10 MiB (an RSS trace per backward op peaks at the same op
as the prediction); Inductor (its peak-memory reordering off, ``_backend``): 0.94-1.02 with "none"
and "full" at 8192 over 2 and 16384 over 4. The backward's outputs
(parameter gradients) stay. Sizes come from the fake tensors on the nodes, so the walk runs on
graphs traced at any size without allocating anything. Workspace inside an op (a matmul's
packing buffers, attention's blocks) is not seen, except ring attention's (``RING_WORKSPACE``,
measured) and a token-local op's (a mixture-of-experts layer as one op: its function run at 2
small row counts; benchmarks.moe_memory, 4096 tokens: 0.92 of the measured at 2 ranks, 0.97 at 4,
0.62 and 0.68 without it), nor Inductor's fusions, which only remove intermediates.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from torch._functorch._activation_offloading.activation_offloading import CPU_OFFLOAD_PREFIX
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .._graph import hint, op_args
from ..propagate._local import PARAMETERS, TOKEN_LOCAL, TOKEN_LOCAL_BACKWARD, run_backward, run_forward
from ._attention import RING, RING_BACKWARD

__all__ = ["MemoryEstimate", "estimate_memory", "graph_peak", "sequence_peak", "at_length", "on_host"]


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Bytes per rank for one training step. ``peak`` is the step's high-water mark beyond
    parameters and optimizer state (activations, gradients, temporaries); the other fields say
    what it is made of."""

    params: int
    grads: int
    saved: int
    forward_peak: int
    backward_peak: int
    host: int = 0  # saved activations held in host memory between the forward and the backward

    @property
    def peak(self) -> int:
        """On the device (what a host-offloaded activation takes is ``host``)."""
        return max(self.forward_peak, self.backward_peak)

    def __str__(self) -> str:
        mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
        host = f", offloaded to host memory {mib(self.host)}" if self.host else ""
        return (
            f"predicted peak memory per rank: {mib(self.peak)} beyond parameters ({mib(self.params)}) "
            f"and optimizer state; saved activations {mib(self.saved)}{host}, gradients {mib(self.grads)}, "
            f"forward peak {mib(self.forward_peak)}, backward peak {mib(self.backward_peak)}"
        )


def _nbytes(v, read: Callable = hint) -> int:
    """``v``'s bytes, its size read with ``read`` (at its hint by default; ``at_length``)."""
    if not isinstance(v, torch.Tensor):
        return 0
    try:
        n = v.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):
        n = v.numel() * v.element_size()
    return read(n)  # symbolic with a symbolic length, or after the partitioner's RNG functionalization


def at_length(symbol: sympy.Symbol, value: int) -> Callable:
    """A reader of sizes with the symbolic length ``symbol`` at ``value`` (the memory of a compile
    at another length than its first); a size with another symbol in it raises ``TypeError``."""
    cache: dict = {}

    def read(x):
        if not isinstance(x, torch.SymInt):
            return hint(x)
        e = x.node.expr
        if e not in cache:
            cache[e] = int(e.xreplace({symbol: value}))
        return cache[e]

    return read


def _aliased_input(nd: fx.Node) -> fx.Node | None:
    """The input whose storage this node's output shares, if any."""
    target = nd.target
    # wait_tensor returns its input; _unsafe_view has no alias annotation but is a view
    if target in (torch.ops._c10d_functional.wait_tensor.default, torch.ops.aten._unsafe_view.default):
        return nd.args[0]
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    alias_set = schema.returns[0].alias_info.before_set  # empty for a list return: Tensor(a)[]
    for arg, a in zip(schema.arguments, nd.args):
        if (
            isinstance(a, fx.Node)
            and arg.alias_info is not None
            and (not alias_set or arg.alias_info.before_set & alias_set)
        ):
            return a
    return None


# Workspace of the ring attention ops beyond their inputs and outputs, in units of the local
# query's bytes: K/V chunks in flight, the zigzag copies, per-block results and merges in the
# accumulation dtype, and the CPU attention kernel's own buffers. Measured on 2 and 4 gloo ranks
# (tests/ring_workspace_probe.py: 8 heads of 32, 4096 rows per rank; RSS high-water mark during
# one call, its outputs taken off): forward 6.0-8.1, backward 11.0-17.0 (causal and not); 8 and
# 17 are taken, at or near the upper ends.
RING_WORKSPACE = {RING: 8.0, RING_BACKWARD: 17.0}


def _token_local_workspace(nd: fx.Node, read: Callable) -> int:
    """The working set of a token-local op (``propagate._local``: a mixture-of-experts layer run as
    one op) at the node's row count: affine in the rows, measured by running the op's function on
    its own parameters at 2 small row counts. The forward's is its temporaries (every expert's
    activations at once with HF's grouped matmuls); the backward's, the function run again for
    autograd, holds them all until the gradients are taken: at least the forward's (a custom op's
    temporaries inside the function, as HF's ``grouped_mm_fallback`` loop's, are not seen by the
    measure, which runs below the op; autograd's saved tensors may then be fewer). Fake or meta
    parameters (a plan with no model) are not run: 0."""
    backward = nd.target is TOKEN_LOCAL_BACKWARD
    key, rows = nd.args[0], nd.args[1]
    tensors = [nd.args[2], *nd.args[3][:rows]] if backward else nd.args[2][:rows]
    per_row = tuple((tuple(read(d) for d in a.meta["val"].shape[1:]), a.meta["val"].dtype) for a in tensors)
    fit = _working_set_fit(key, per_row, tuple(nd.args[4]) if backward else None)
    if backward:  # it runs the forward again, keeping what that frees: at least the forward's
        fit = max(fit, _working_set_fit(key, per_row[1:], None), key=lambda f: f[1])
    return max(0, round(fit[0] + fit[1] * read(tensors[0].meta["val"].shape[0])))


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages the ops under it allocate, and their high-water mark (a storage is
    freed when Python lets go of it)."""

    def __init__(self, inputs: list[torch.Tensor]):
        super().__init__()
        self.live = self.peak = 0
        self._refs = {t.untyped_storage()._cdata: None for t in inputs}  # inputs: held by the caller

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and (st := t.untyped_storage())._cdata not in self._refs:
                n = st.nbytes()
                self.live += n
                self.peak = max(self.peak, self.live)
                self._refs[st._cdata] = weakref.ref(st, functools.partial(self._free, st._cdata, n))
        return out

    def _free(self, k: int, n: int, _ref) -> None:
        self._refs.pop(k, None)
        self.live -= n


_FIT_ROWS = (64, 128)


@functools.lru_cache(maxsize=256)
def _working_set_fit(key: int, per_row: tuple, need: tuple[bool, ...] | None) -> tuple[float, float]:
    """(bytes, bytes per row) of the op's working set beyond its inputs and outputs."""
    params = PARAMETERS.get(key, ())
    # not run on fake or meta parameters (a plan without a model), nor on FSDP's sharded DTensors
    if not params or any(p.is_meta or type(p) not in (torch.Tensor, torch.nn.Parameter) for p in params):
        return 0.0, 0.0
    dev = params[0].device
    sets = []
    # the kernel runs outside compile and the function may choose by that (HF's grouped_mm picks
    # torch's kernel or its own loop by torch.compiler.is_compiling()); torch 2.13 holds the flag
    # through the compile session, this backend included. The run must not move the step's RNG.
    rng = torch.random.fork_rng(devices=[] if dev.type == "cpu" else [dev], device_type=dev.type)
    with unset_fake_temporarily(), _not_compiling(), rng:
        for r in _FIT_ROWS:
            # zeros route every row to one expert: the same rows in all, the most in one
            ts = [torch.zeros((r, *shape), dtype=dt, device=dev) for shape, dt in per_row]
            ins = [*ts, *(p.detach() for p in params)]
            try:
                with _LiveBytes(ins) as mem:
                    out = (
                        [run_forward(key, ins, scratch=True)]
                        if need is None
                        else run_backward(key, ins[0], ins[1:], list(need))
                    )
                    end = mem.live
            except (RuntimeError, IndexError, ValueError):  # it runs on the step's own rows, and says so there
                return 0.0, 0.0
            sets.append(mem.peak - end)
            del out
    slope = (sets[1] - sets[0]) / (_FIT_ROWS[1] - _FIT_ROWS[0])
    return sets[0] - slope * _FIT_ROWS[0], slope


@contextlib.contextmanager
def _not_compiling():
    flag = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = False
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = flag


def _workspace(nd: fx.Node, read: Callable = hint) -> int:
    """Bytes an op allocates and frees while it runs (the ring attention ops and the token-local
    ops are modelled; other ops' workspace is small next to their outputs)."""
    if nd.target in (TOKEN_LOCAL, TOKEN_LOCAL_BACKWARD):
        return _token_local_workspace(nd, read)
    factor = RING_WORKSPACE.get(nd.target)
    if factor is None:
        return 0
    query = op_args(nd)["query"]
    return int(factor * _nbytes(query.meta.get("val"), read)) if isinstance(query, fx.Node) else 0


def on_host(nd: fx.Node) -> bool:
    """Whether ``nd``'s value is a saved activation in host memory, put there by torch's compiled
    activation offloading (``_offload``): the forward's copy to the host, the backward's input
    holding it (on a CPU graph both are on "cpu" as well; they are told apart by the pass's own
    marks)."""
    if nd.op == "placeholder":
        return bool(nd.meta.get("saved_for_offloading"))
    return nd.target is torch.ops.prims.device_put.default and nd.name.startswith(CPU_OFFLOAD_PREFIX)


def graph_peak(gm: fx.GraphModule, counted_inputs: set[str], read: Callable = hint) -> tuple[int, int]:
    """(peak, live at the end) in bytes for one run of ``gm``: placeholders named in
    ``counted_inputs`` count from the start (freed after their last use);
    other inputs (parameters, the batch) are held by the caller and not counted. ``read``: how
    sizes are read (``_nbytes``)."""
    out_node = gm.graph.output_node()
    kept = {a for a in tree_leaves(out_node.args) if isinstance(a, fx.Node)}
    inputs = {nd: nd.name in counted_inputs for nd in gm.graph.find_nodes(op="placeholder")}
    return sequence_peak(list(gm.graph.nodes), inputs, kept, read)


def sequence_peak(
    nodes: list[fx.Node], inputs: dict[fx.Node, bool], kept: set[fx.Node], read: Callable = hint
) -> tuple[int, int]:
    """``graph_peak`` of ``nodes`` run in that order (a graph's, or a schedule made of another
    graph's nodes: ``_checkpoint._Priced``): the nodes in ``inputs`` are held from where they stand,
    counted where their value is True; what is in ``kept`` stays to the end."""
    last_use: dict[fx.Node, int] = {}
    for i, nd in enumerate(nodes):
        for a in nd.all_input_nodes:
            last_use[a] = i
    storage: dict[fx.Node, list[int]] = {}  # node -> ids of the buffers it holds
    per_output: set[fx.Node] = set()  # multi-output nodes holding one buffer per output
    size: dict[int, int] = {}
    refs: dict[int, int] = {}
    live = peak = 0

    def hold(nd: fx.Node, bufs: list[int]) -> None:
        storage[nd] = bufs
        for b in bufs:
            refs[b] = refs.get(b, 0) + 1

    def release(nd: fx.Node) -> None:
        nonlocal live
        for b in storage.pop(nd, []):
            refs[b] -= 1
            if refs[b] == 0:
                live -= size[b]

    def new(nbytes: int, counted: bool = True) -> int:
        nonlocal live
        b = len(size)
        size[b] = nbytes if counted else 0
        live += size[b]
        return b

    for i, nd in enumerate(nodes):
        if nd in inputs:
            hold(nd, [new(_nbytes(nd.meta.get("val"), read), inputs[nd] and not on_host(nd))])
        elif on_host(nd):
            hold(nd, [new(0)])
        elif nd.op == "call_function":
            if nd.target is operator.getitem and nd.args[0] in storage:
                src = storage[nd.args[0]]
                hold(nd, [src[nd.args[1]]] if nd.args[0] in per_output else list(src))
            elif (a := _aliased_input(nd)) is not None and a in storage:
                hold(nd, list(storage[a]))
            else:
                val = nd.meta.get("val")
                if isinstance(val, (tuple, list)):
                    per_output.add(nd)
                    hold(nd, [new(_nbytes(v, read)) for v in val])
                else:
                    hold(nd, [new(_nbytes(val, read))])
        elif nd.op == "get_attr":
            hold(nd, [])
        peak = max(peak, live + (_workspace(nd, read) if nd.op == "call_function" and nd not in inputs else 0))
        for a in nd.all_input_nodes:
            if last_use.get(a) == i and a not in kept:
                release(a)
        if nd.op != "output" and nd not in last_use and nd not in kept:
            release(nd)
    return peak, live


def estimate_memory(
    fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, read: Callable = hint
) -> MemoryEstimate:
    """The step's memory per rank from AOTAutograd's partitioned graphs (fake or real values);
    ``read``: how sizes are read (at their hints; ``at_length`` for another length)."""
    inputs = list(fw.graph.find_nodes(op="placeholder"))
    primals = {nd.name for nd in inputs}
    fw_peak, fw_end = graph_peak(fw, set(), read)
    user_out = tree_leaves(fw.graph.output_node().args)[:num_fwd_outputs]
    fw_end -= sum(_nbytes(a.meta.get("val"), read) for a in user_out if isinstance(a, fx.Node))
    # backward inputs: the saved activations (not parameters or inputs passed through) and the
    # tangents; its outputs, the gradients, stay
    saved = {nd.name for nd in bw.graph.find_nodes(op="placeholder") if nd.name not in primals}
    bw_peak, bw_end = graph_peak(bw, saved, read)
    host = sum(_nbytes(nd.meta.get("val"), read) for nd in bw.graph.find_nodes(op="placeholder") if on_host(nd))
    outs = list(bw.graph.output_node().args[0])
    grads = bw_end  # what stays after the backward: the gradients (buckets counted once)
    # the inputs that get a gradient (AOTAutograd returns one per input, None where none)
    params = sum(_nbytes(p.meta.get("val"), read) for p, a in zip(inputs, outs) if isinstance(a, fx.Node))
    return MemoryEstimate(params, grads, fw_end, fw_peak, bw_peak, host)
