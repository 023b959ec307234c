"""Regenerate the benchmark tables in the docs from the results the benchmarks wrote.

    python scripts/docs_tables.py           # rewrite every table block in docs/*.md
    python scripts/docs_tables.py --check   # exit 1 if a table differs from its results.json

A table block in a docs page is

    <!-- table: runs docs/bench seq=4096,8192 columns=system,seq,step,tokens,compile,comm,peak -->
    ...the generated table...
    <!-- end table -->

``runs`` renders ``benchmarks.run``'s records (``results.json``: one record per system and
length; ``columns`` from ``RUN_COLUMNS``, ``seq`` and ``systems`` filter them); ``budget``
renders ``benchmarks.memory``'s summary (the longest sequence each system trains within the
budget, and step time and peak at a length every system fits).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20

LABELS = {
    "single": "one device",
    "ulysses_eager": "hand-written Ulysses (eager)",
    "ulysses_compiled": "hand-written Ulysses (compiled)",
    "dtensor": "plain DTensor",
    "context_parallel": "torch context parallel",
    "autosp": "autosp (auto)",
    "autosp_ring": "autosp, ring forced",
    "autosp_kv_gather": "autosp, K/V gather forced",
    "autosp_hybrid": "autosp, hybrid forced",
    "autosp_adamw": "autosp + AdamW",
    "autosp_fsdp": "autosp + AdamW, FSDP2",
    "ulysses": "hand-written Ulysses",
    "ulysses_ckpt": "hand-written Ulysses + per-layer checkpoint",
    "autosp_none": 'autosp, checkpoint="none"',
    "autosp_auto": 'autosp, checkpoint="auto"',
    "autosp_full": 'autosp, checkpoint="full"',
    "autosp_budget": "autosp, checkpoint=budget",
}


def _sp(r: dict) -> str:
    return f"{r['dp']} x {r['sp']}" if (r.get("dp") or 1) > 1 else str(r["sp"])


# column -> (header, value of a record without an error)
RUN_COLUMNS = {
    "system": ("system", lambda r: LABELS.get(r["system"], r["system"])),
    "seq": ("tokens", lambda r: str(r["seq"])),
    "sp": ("sp (dp x sp)", _sp),
    "step": ("step (s)", lambda r: f"{r['step_time_s']:.3f}"),
    "tokens": ("tokens/s", lambda r: f"{r['tokens_per_s']:.0f}"),
    "compile": ("compile (s)", lambda r: f"{r['compile_time_s']:.1f}"),
    "comm": ("comm MiB/step/rank", lambda r: f"{r['comm_bytes_per_step'] / MiB:.1f}"),
    "peak": ("peak MiB/rank", lambda r: f"{r['peak_mem_bytes'] / MiB:.0f}"),
    "held": ("held MiB/rank", lambda r: f"{r.get('held_bytes', 0) / MiB:.0f}"),
    "base": ("base RSS MiB", lambda r: f"{r.get('base_mem_bytes', 0) / MiB:.0f}"),
    "total": ("base + peak MiB", lambda r: f"{(r.get('base_mem_bytes', 0) + r['peak_mem_bytes']) / MiB:.0f}"),
}


def _options(words: list[str]) -> dict[str, str]:
    return dict(w.split("=", 1) for w in words)


def _rows(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def runs_table(results: dict, opts: dict[str, str]) -> list[str]:
    """``benchmarks.run`` records; a record with an error shows it in place of its numbers."""
    columns = opts.get("columns", "system,seq,step,comm,peak").split(",")
    seqs = {int(s) for s in opts["seq"].split(",")} if "seq" in opts else None
    systems = opts["systems"].split(",") if "systems" in opts else None
    records = [r for r in results["records"] if (seqs is None or r["seq"] in seqs)
               and (systems is None or r["system"] in systems)]
    if systems is not None:  # in the order asked for, per length
        records.sort(key=lambda r: (r["seq"], systems.index(r["system"])))
    notes = any(r.get("error") for r in records)
    rows = []
    for r in records:
        if r.get("error"):
            row = [RUN_COLUMNS[c][1](r) if c in ("system", "seq", "sp") else "-" for c in columns]
        else:
            row = [RUN_COLUMNS[c][1](r) for c in columns]
        rows.append(row + ([(r.get("error") or "").split(", ")[0][:120]] if notes else []))
    return _rows([RUN_COLUMNS[c][0] for c in columns] + (["error"] if notes else []), rows)


def budget_table(results: dict, opts: dict[str, str]) -> list[str]:
    """``benchmarks.memory``'s summary: the longest sequence under the budget per system, its
    ratio to hand-written Ulysses (with and without per-layer checkpointing), and step time and
    peak at the common length."""
    s = results["summary"]
    longest, common = s["longest_seq"], s["common_seq"]

    def ratio(system: str, base: str) -> str:
        return f"{longest[system] / longest[base]:.2f}" if longest.get(base) else "-"

    rows = []
    for system in longest:
        r = s["at_common"][system]
        ok = not r.get("error")
        rows.append([LABELS.get(system, system), str(longest[system]), ratio(system, "ulysses"),
                     ratio(system, "ulysses_ckpt"), f"{r['step_time_s']:.3f}" if ok else r["error"][:60],
                     f"{r['peak_mem_bytes'] / MiB:.0f}" if ok else "-",
                     f"{r['predicted_bytes'] / MiB:.0f}" if r.get("predicted_bytes") else "-",
                     r.get("checkpoint", "-")])
    header = ["system", f"longest under {s['budget_bytes'] / MiB:.0f} MiB", "x Ulysses", "x Ulysses + ckpt",
              f"step at {common} (s)", f"peak at {common} (MiB)", "predicted (MiB)", "rung"]
    return _rows(header, rows)


RENDERERS = {"runs": runs_table, "budget": budget_table}
BLOCK = re.compile(r"(<!-- table: (\S+) (\S+)(.*?) -->\n)(.*?)(<!-- end table -->)", re.S)


def render(text: str) -> str:
    def one(m: re.Match) -> str:
        kind, where, rest = m.group(2), m.group(3), m.group(4).split()
        results = json.loads((ROOT / where / "results.json").read_text())
        table = RENDERERS[kind](results, _options(rest))
        return m.group(1) + "\n".join(table) + "\n" + m.group(6)

    return BLOCK.sub(one, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail if a table is out of date; write nothing")
    args = ap.parse_args(argv)
    stale = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        new = render(text)
        if new != text:
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(new)
    if stale:
        print(("out of date: " if args.check else "rewrote: ") + ", ".join(map(str, stale)))
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
