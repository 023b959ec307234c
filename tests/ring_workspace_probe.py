"""Workspace of the ring attention ops (``RING_WORKSPACE`` in autosp/partition/_memory.py): the
RSS high-water mark during one call above the RSS before it, less the op's outputs (which the
liveness walk counts), for the local query of 8 heads of 32 and S / N rows, causal and not.

    MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0 OMP_NUM_THREADS=1 \
        torchrun --nproc-per-node 2 tests/ring_workspace_probe.py 8192     # and 4 ranks, 16384
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from autosp.partition._attention import ring_attention_backward_op, ring_attention_op

dist.init_process_group("gloo")
torch.set_num_threads(1)
r, n = dist.get_rank(), dist.get_world_size()


def rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


H, D, B = 8, 32, 1
for S, causal in [(int(sys.argv[1]), True), (int(sys.argv[1]), False)]:
    c = S // n
    g = torch.Generator().manual_seed(r)
    q, k, v = (torch.randn(B, H, c, D, generator=g) for _ in range(3))
    grp = dist.group.WORLD.group_name
    for _ in range(2):  # two passes; the second's figures are printed
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")
        base = rss("VmRSS")
        out, lse = ring_attention_op(q, k, v, None, S, r, n, grp, causal, None, 1, "")
        fwd = rss("VmHWM") - base - out.numel() * 4 - lse.numel() * 4
        go = torch.randn_like(out)
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")
        base = rss("VmRSS")
        dq, dk, dv = ring_attention_backward_op(go, q, k, v, out, lse, None, S, r, n, grp, causal, None, 1, "")
        bwd = rss("VmHWM") - base - 3 * q.numel() * 4
    qb = q.numel() * 4
    if r == 0:
        print(
            f"n={n} S={S} causal={causal} q=k=v=out={qb / 2**20:.1f} MiB  "
            f"fwd workspace {fwd / 2**20:.1f} MiB ({fwd / qb:.2f} q)  "
            f"bwd workspace {bwd / 2**20:.1f} MiB ({bwd / qb:.2f} q)",
            flush=True,
        )
dist.destroy_process_group()
