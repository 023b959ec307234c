"""Train the Llama-style example model sequence-parallel with autosp.

    torchrun --nproc-per-node 2 examples/train.py --out runs/sp2     # 2 ranks, gloo on CPU
    python examples/train.py --out runs/single                        # the same, one device

Every rank gets the same full batch; autosp splits the sequence. The loss curve is written to
``OUT/loss.json`` (rank 0) and matches the single-device run's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import autosp  # noqa: E402
from examples.data import batches, corpus  # noqa: E402
from examples.models import Llama, LlamaConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--compiler", default="aot_eager", choices=["aot_eager", "inductor"])
    ap.add_argument("--out", type=Path, default=Path("runs/latest"))
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab=256, dim=128, layers=4, heads=8, kv_heads=4, ffn=384))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    data = batches(corpus(), args.batch, args.seq, seed=1)

    with autosp.mesh() as mesh:
        @autosp.shard(seq=True, compiler=args.compiler)
        def loss_fn(input_ids, labels):
            return model(input_ids, labels)

        rank0 = torch.distributed.get_rank() == 0
        losses, tokens, t0 = [], 0, None
        bar = tqdm(range(args.steps), disable=not rank0, desc=f"sp={mesh.sp_size}")
        for step in bar:
            input_ids, labels = next(data)
            loss = loss_fn(input_ids, labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if step == 0:
                t0 = time.perf_counter()  # after compilation
            else:
                tokens += input_ids.numel()
                bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
        if rank0:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "loss.json").write_text(json.dumps({"sp": mesh.sp_size, "losses": losses,
                                                            "tokens_per_s": tokens / (time.perf_counter() - t0)}))
            print(f"sp={mesh.sp_size}: final loss {losses[-1]:.4f}, wrote {args.out / 'loss.json'}")


if __name__ == "__main__":
    main()
