"""Symbolic lengths against one device over the test models (run as a script under torchrun, one
process per rank, gloo): each kind of ``cases.many_lengths`` called with the lengths given, a
line per kind on rank 0 with the worst relative error of the loss and gradients over the steps,
the compiled steps autosp keeps, the graphs Dynamo compiled and this rank's share of one
device's matmul FLOPs, or the error it stopped with.

    PYTHONPATH=.:tests OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 tests/lengths_sweep.py \
        llama,llama_gqa,gpt,hf_llama 64,37,93,20,101,58

A kind is a ``cases.MODELS`` name, "embed", "embed_shift_logits", "embed_chunked" or "hf_" and
a ``hf_models`` architecture. ``--limit`` is Dynamo's recompile limit (8, its default).
"""

import argparse
import time

import cases
import torch.distributed as dist

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("kinds", help="comma-separated")
    ap.add_argument("lengths", help="comma-separated")
    ap.add_argument("--limit", type=int, default=8)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    lengths = [int(x) for x in args.lengths.split(",")]
    for kind in args.kinds.split(","):
        t0 = time.monotonic()
        try:
            r = cases.many_lengths(kind, lengths, limit=args.limit)
            worst = max(max(abs(a - b) / abs(b), g) for a, b, g in r["steps"])
            mine, one = r["flops"]
            line = f"worst {worst:.2e}, compiled {r['compiled']}, graphs {r['graphs']}, flops {mine / one:.3f}"
        except Exception as e:  # a kind that fails is a finding; the others still run
            line = f"FAILED {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
        if dist.get_rank() == 0:
            print(f"{kind}: {line} ({time.monotonic() - t0:.1f} s)", flush=True)
    dist.destroy_process_group()
