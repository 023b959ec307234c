"""The main job: train the Llama-style example model sequence-parallel with autosp, and compare it
with the same training on one device: the loss curves and the peak memory per rank.

    torchrun --nproc-per-node 2 examples/train.py --out runs/sp2     # 2 ranks (gloo on CPU), then
                                                                     # the one-device run, compared
    python examples/train.py --plain --out runs/single               # the one-device run alone
    python examples/train.py --out runs/one                          # autosp on one process

Every rank gets the same full batch; autosp splits the sequence. Rank 0 writes ``OUT/loss.json``.
After the sharded run, rank 0 runs the same training as one process with plain ``torch.compile``
(``--plain``: no autosp, so no checkpointing or tiling either; ``OUT/single``) and prints
the comparison (``OUT/summary.json``; ``OUT/loss.png`` with matplotlib installed). Peak memory
is each process's RSS high-water mark during the training steps above its RSS after the first
step (parameters and optimizer state allocated, compilation done), with glibc told to return
freed memory at once so that RSS follows the live tensors.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import autosp
from examples.data import batches, corpus
from examples.models import Llama, LlamaConfig


def _follow_live_tensors() -> None:
    """glibc: every allocation over 64 KiB mmapped and returned on free, so RSS follows the live
    tensors (mallopt's M_MMAP_THRESHOLD = -3, M_TRIM_THRESHOLD = -1)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 65536)
        libc.mallopt(-1, 0)
    except OSError:  # not glibc: RSS then over-counts freed memory; the comparison still holds
        pass


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> int:
    """The current RSS, with the high-water mark reset to it."""
    Path("/proc/self/clear_refs").write_text("5")
    return _rss("VmRSS")


def train(args) -> dict:
    """One training run on the current mesh; returns what rank 0 writes to loss.json."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab=256, dim=128, layers=4, heads=8, kv_heads=4, ffn=384))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    data = batches(corpus(), args.batch, args.seq, seed=1)
    with autosp.mesh() as mesh:

        def loss(input_ids, labels):
            return model(input_ids, labels)

        if args.plain:  # the reference: one device, without autosp
            loss_fn = torch.compile(loss, backend=args.compiler, fullgraph=True)
        else:  # a world of one (plain `python`) runs autosp's passes too
            loss_fn = autosp.shard(loss, seq=True, compiler=args.compiler, checkpoint=args.checkpoint)

        rank0 = dist.get_rank() == 0
        losses, tokens, t0, base = [], 0, 0.0, 0
        bar = tqdm(range(args.steps), disable=not rank0, desc=f"sp={mesh.sp_size}")
        for step in bar:
            input_ids, labels = next(data)
            loss = loss_fn(input_ids, labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if step == 0:  # compiled, parameters and optimizer state allocated
                base, t0 = _reset_peak(), time.perf_counter()
            else:
                tokens += input_ids.numel()
                bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
        peak = torch.tensor([_rss("VmHWM") - base], dtype=torch.float64)
        if dist.get_world_size() > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the rank that needs most
        plan = getattr(loss_fn, "plan", None)
        return {
            "sp": mesh.sp_size,
            "seq": args.seq,
            "losses": losses,
            "tokens_per_s": tokens / max(time.perf_counter() - t0, 1e-9),
            "peak_bytes": int(peak.item()),
            "predicted_bytes": plan.memory.peak if plan is not None and plan.memory is not None else None,
            "checkpoint": plan.checkpoint.chosen if plan is not None and plan.checkpoint is not None else None,
        }


def compare(sharded: dict, single: dict, out: Path) -> dict:
    """The two runs side by side: printed, written to ``out / "summary.json"`` and plotted."""
    first = min(100, len(single["losses"]))
    diff = max(abs(a - b) for a, b in zip(sharded["losses"][:first], single["losses"][:first]))
    mib = 2**20
    summary = {
        "steps": len(single["losses"]),
        "seq": single["seq"],
        "sp": sharded["sp"],
        "max_loss_diff_first_steps": diff,
        "first_steps": first,
        "final_loss": {"sharded": sharded["losses"][-1], "single": single["losses"][-1]},
        "peak_bytes": {"sharded": sharded["peak_bytes"], "single": single["peak_bytes"]},
        "peak_ratio": sharded["peak_bytes"] / max(single["peak_bytes"], 1),
        "predicted_bytes": sharded["predicted_bytes"],
        "checkpoint": sharded["checkpoint"],
        "tokens_per_s": {"sharded": sharded["tokens_per_s"], "single": single["tokens_per_s"]},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    predicted = sharded["predicted_bytes"] / mib if sharded["predicted_bytes"] is not None else float("nan")
    print(
        f"{summary['steps']} steps of {single['seq']} tokens, sp={sharded['sp']} against one device:\n"
        f"  loss: the first {first} steps agree to {diff:.2g}; final {sharded['losses'][-1]:.4f} "
        f"(sp={sharded['sp']}) and {single['losses'][-1]:.4f} (one device)\n"
        f"  peak memory per rank during the steps: {sharded['peak_bytes'] / mib:.1f} MiB (autosp predicted "
        f"{predicted:.1f} MiB; checkpoint rung {sharded['checkpoint']!r}) against one device's "
        f"{single['peak_bytes'] / mib:.1f} MiB (plain torch.compile, no checkpointing): "
        f"{summary['peak_ratio']:.2f}x\n"
        f"  tokens/s: {sharded['tokens_per_s']:.0f} (sp={sharded['sp']}, both ranks on this machine) and "
        f"{single['tokens_per_s']:.0f} (one device)"
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return summary
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(single["losses"], "-", label="one device")
    ax.plot(sharded["losses"], "--", label=f"autosp, sp={sharded['sp']}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    print(f"  wrote {out / 'summary.json'} and {out / 'loss.png'}")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--compiler", default="aot_eager", choices=["aot_eager", "inductor"])
    ap.add_argument("--checkpoint", default="auto", help="autosp.shard's checkpoint: auto, none, full, or bytes")
    ap.add_argument("--no-reference", action="store_true", help="under torchrun: skip the one-device run")
    ap.add_argument("--plain", action="store_true", help="plain torch.compile, without autosp (the one-device run)")
    ap.add_argument("--out", type=Path, default=Path("runs/latest"))
    args = ap.parse_args()
    if args.checkpoint.isdigit():
        args.checkpoint = int(args.checkpoint)
    _follow_live_tensors()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result = train(args)
    rank0 = dist.get_rank() == 0
    if rank0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "loss.json").write_text(json.dumps(result))
        print(f"sp={result['sp']}: final loss {result['losses'][-1]:.4f}, wrote {args.out / 'loss.json'}")
    sharded = dist.get_world_size() > 1
    dist.barrier()
    dist.destroy_process_group()
    if rank0 and sharded and not args.no_reference:
        # the same training as one process, after the ranks are done (the cores are free again)
        ref = args.out / "single"
        cmd = [
            sys.executable,
            __file__,
            "--steps",
            str(args.steps),
            "--seq",
            str(args.seq),
            "--batch",
            str(args.batch),
            "--lr",
            str(args.lr),
            "--compiler",
            args.compiler,
            "--checkpoint",
            str(args.checkpoint),
            "--plain",
            "--out",
            str(ref),
        ]
        launcher = (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "GROUP_WORLD_SIZE",
            "ROLE_RANK",
            "ROLE_WORLD_SIZE",
            "ROLE_NAME",
            "MASTER_ADDR",
            "MASTER_PORT",
        )
        env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("TORCHELASTIC")}
        print("one device, the same training:")
        subprocess.run(cmd, env=env, check=True)
        compare(result, json.loads((ref / "loss.json").read_text()), args.out)


if __name__ == "__main__":
    main()
