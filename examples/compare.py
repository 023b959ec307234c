"""Compare loss curves written by examples/train.py, and plot them.

python examples/compare.py runs/single runs/sp2 --plot docs/loss.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    runs = {r: json.loads((r / "loss.json").read_text()) for r in args.runs}
    base = runs[args.runs[0]]["losses"]
    for r, d in runs.items():
        diff = max(abs(a - b) for a, b in zip(d["losses"], base))
        print(
            f"{r}: sp={d['sp']} steps={len(d['losses'])} final={d['losses'][-1]:.4f} "
            f"tokens/s={d['tokens_per_s']:.0f} max|loss - {args.runs[0]}|={diff:.2e}"
        )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for (r, d), style in zip(runs.items(), ["-", "--", ":", "-."]):
            ax.plot(d["losses"], style, label=f"{r.name} (sp={d['sp']})")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        ax.grid(alpha=0.3)
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
