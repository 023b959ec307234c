"""Peak memory of a mixture-of-experts model's training step per rank: an HF Mixtral (2 layers,
hidden 128, 8 experts, top 2, random init; ``--experts``: HF's experts implementation) at one
length, one rank's share of an sp job (a fake process group), against the same step compiled on
one device; and autosp's prediction.

    for sp in 1 2 4; do MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0 \\
        python -m benchmarks.moe_memory --sp $sp --seq 4096; done

Prints one JSON line: the peak RSS growth of a step over the RSS before it (the least of 3 steps,
after 2 warm-up steps, gradients set to None first; benchmarks.memory's measure), and for sp > 1
``plan.memory.peak``. checkpoint="none" on both sides.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import autosp
from benchmarks.run import _peak, _reset_peak


def measure(sp: int, seq: int, steps: int = 3, experts: str | None = None) -> dict:
    import transformers as T

    torch.set_num_threads(1)
    cfg = T.MixtralConfig(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=256,
        max_position_embeddings=seq,
        use_cache=False,
        sliding_window=None,
        **({} if experts is None else dict(experts_implementation=experts)),
    )
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    ids = torch.randint(0, 256, (1, seq))

    def loss(ids):
        return model(input_ids=ids, labels=ids).loss

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=sp)
    with autosp.mesh(sp=sp):
        step = autosp.shard(loss, compiler="aot_eager", checkpoint="none") if sp > 1 else torch.compile(loss)
        peaks = []
        for i in range(2 + steps):
            model.zero_grad(set_to_none=True)
            base = _reset_peak("cpu")
            step(ids).backward()
            if i >= 2:
                peaks.append(_peak("cpu") - base)
    rec = {"sp": sp, "seq": seq, "experts": experts or "default", "peak_mib": min(peaks) / 2**20}
    if sp > 1:
        rec["predicted_mib"] = step.plan.memory.peak / 2**20
    return rec


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--experts", default=None, help="HF's experts implementation (its default: grouped_mm)")
    args = ap.parse_args()
    print(json.dumps(measure(args.sp, args.seq, experts=args.experts)))
