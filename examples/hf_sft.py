"""Fine-tune a small Llama-architecture model with TRL's ``SFTTrainer``, sequence-parallel through
``autosp.integrations.transformers``: the instruction data of ``examples/sft.jsonl`` (400
prompt / completion pairs), packed (padding-free rows of whole examples, ``position_ids``
restarting per example), a byte-level tokenizer and a random-init model built here (no
downloads).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/hf_sft.py --out runs/sft-sp2   # 2 ranks, gloo
    python examples/hf_sft.py --sp 1 --out runs/sft-sp1 --compare runs/sft-sp2            # one process

Rank 0 writes ``OUT/loss.json`` (the logged loss of each step); with ``--compare DIR`` (another
run's OUT) it prints the largest difference between the two runs' losses and, with matplotlib
installed, draws both curves in ``OUT/loss.png``. Needs the ``[hf]`` extra.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from examples.train import _follow_live_tensors, _reset_peak, _rss  # the main job's RSS measure

DATA = Path(__file__).resolve().parent / "sft.jsonl"


def byte_tokenizer():
    """One token per byte (GPT-2's byte-to-character map, no merges), plus <pad> and <eos>."""
    import tokenizers

    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))} | {"<pad>": len(alphabet), "<eos>": len(alphabet) + 1}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def small_llama(vocab_size: int, max_length: int):

    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_length,
        use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sp", type=int, default=None, help="sequence-parallel ranks (default: the world size)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=4, help="packed rows per step (flattened into one padding-free row)")
    ap.add_argument("--max-length", type=int, default=1024, help="tokens per packed row")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--compiler", default="aot_eager", choices=["aot_eager", "inductor"])
    ap.add_argument("--out", type=Path, default=Path("runs/sft"))
    ap.add_argument("--compare", type=Path, default=None, help="another run's --out: compare the losses")
    ap.add_argument("--memory", action="store_true", help="measure each step's peak RSS growth (loss.json's peak)")
    args = ap.parse_args()

    import datasets
    import trl

    world = int(os.environ.get("WORLD_SIZE", "1"))
    sp = world if args.sp is None else args.sp
    tokenizer = byte_tokenizer()
    model = small_llama(len(tokenizer), args.max_length * args.batch)
    config = trl.SFTConfig(
        output_dir=str(args.out),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        packing=True,
        max_length=args.max_length,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
        ddp_backend="gloo" if world > 1 else None,
        disable_tqdm=True,
    )
    data = datasets.load_dataset("json", data_files=str(DATA), split="train")
    kwargs = dict(model=model, args=config, train_dataset=data, processing_class=tokenizer)
    if sp > 1 or world > 1:
        from autosp.integrations.transformers import sequence_parallel

        trainer = sequence_parallel(trl.SFTTrainer)(**kwargs, sp=sp, compiler=args.compiler)
    else:
        trainer = trl.SFTTrainer(**kwargs)
    memory = PeakMemory() if args.memory else None
    if memory is not None:
        trainer.add_callback(memory)
    trainer.train()

    peak = memory.peak() if memory is not None else None
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loss.json").write_text(json.dumps(dict(sp=sp, world=world, loss=losses, peak_bytes=peak)))
    print(f"{len(losses)} steps, sp={sp}: first loss {losses[0]:.4f}, last {losses[-1]:.4f} -> {args.out}/loss.json")
    if peak is not None:
        print(f"peak memory per rank during a step (median over steps 2-{args.steps}): {peak / 2**20:.1f} MiB")
    if args.compare is not None:
        _compare(args.out, args.compare, dict(sp=sp, loss=losses, peak_bytes=peak))


class PeakMemory(transformers.TrainerCallback):
    """A Trainer callback: each step's RSS high-water mark above the RSS at its start, from the
    second step on (the first compiles and allocates the optimizer state), with glibc returning
    freed memory at once (as the main job measures, ``examples/train.py``); ``peak()``: the
    median over the steps, the largest over the ranks."""

    def __init__(self):
        _follow_live_tensors()
        self.peaks: list[int] = []
        self.base = 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.base = _reset_peak()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > 1:
            self.peaks.append(_rss("VmHWM") - self.base)

    def peak(self) -> int:
        mine = torch.tensor(float(sorted(self.peaks)[len(self.peaks) // 2]))
        if dist.is_initialized():
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return int(mine)


def _compare(out: Path, other: Path, mine: dict) -> None:
    theirs = json.loads((other / "loss.json").read_text())
    n = min(len(mine["loss"]), len(theirs["loss"]))
    worst = max(abs(a - b) / abs(b) for a, b in zip(mine["loss"][:n], theirs["loss"][:n]))
    print(f"sp={mine['sp']} against sp={theirs['sp']}: the first {n} losses agree to {worst:.1e} (relative)")
    if mine.get("peak_bytes") and theirs.get("peak_bytes"):
        ratio = mine["peak_bytes"] / theirs["peak_bytes"]
        print(f"peak memory per rank: {ratio:.2f}x the other run's")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run, style in ((theirs, "-"), (mine, "--")):
        ax.plot(range(1, len(run["loss"]) + 1), run["loss"], style, label=f"sp={run['sp']}")
    ax.set(xlabel="step", ylabel="training loss", title="SFTTrainer, packed, tiny Llama")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)


if __name__ == "__main__":
    main()
