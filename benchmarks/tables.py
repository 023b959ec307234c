"""The benchmarks' tables, in Markdown: ``benchmarks.run``'s records (``runs_table``) and
``benchmarks.memory``'s budget summary (``budget_table``). The benchmarks write them next to their
``results.json``; ``scripts/docs_tables.py`` writes them into the docs pages."""

from __future__ import annotations

__all__ = ["LABELS", "RUN_COLUMNS", "runs_table", "budget_table", "lengths_table"]

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


def _rows(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def runs_table(records: list[dict], opts: dict[str, str] | None = None) -> list[str]:
    """``benchmarks.run`` records; a record with an error shows it in place of its numbers."""
    opts = opts or {}
    columns = opts.get("columns", "system,seq,sp,step,tokens,compile,comm,peak,held").split(",")
    seqs = {int(s) for s in opts["seq"].split(",")} if "seq" in opts else None
    systems = opts["systems"].split(",") if "systems" in opts else None
    records = [r for r in records if (seqs is None or r["seq"] in seqs) and (systems is None or r["system"] in systems)]
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


def budget_table(summary: dict) -> list[str]:
    """``benchmarks.memory``'s summary: the longest sequence under the budget per system, its
    ratio to hand-written Ulysses (with and without per-layer checkpointing), and step time and
    peak at the common length."""
    s = summary
    longest, common = s["longest_seq"], s["common_seq"]

    def ratio(system: str, base: str) -> str:
        return f"{longest[system] / longest[base]:.2f}" if longest.get(base) else "-"

    rows = []
    for system in longest:
        r = s["at_common"][system]
        ok = not r.get("error")
        rows.append(
            [
                LABELS.get(system, system),
                str(longest[system]),
                ratio(system, "ulysses"),
                ratio(system, "ulysses_ckpt"),
                f"{r['step_time_s']:.3f}" if ok else r["error"][:60],
                f"{r['peak_mem_bytes'] / MiB:.0f}" if ok else "-",
                f"{r['predicted_bytes'] / MiB:.0f}" if r.get("predicted_bytes") else "-",
                r.get("checkpoint", "-"),
            ]
        )
    header = [
        "system",
        f"longest under {s['budget_bytes'] / MiB:.0f} MiB",
        "x Ulysses",
        "x Ulysses + ckpt",
        f"step at {common} (s)",
        f"peak at {common} (MiB)",
        "predicted (MiB)",
        "rung",
    ]
    return _rows(header, rows)


def lengths_table(r: dict) -> list[str]:
    """``benchmarks.run --lengths``: training on drawn lengths against fixed-length training."""
    if r.get("error"):
        return [f"error: {r['error']}"]
    n = r["lengths"]
    fixed, comm = r["fixed_step_s"], r["fixed_comm_bytes"]
    rows = [
        "| training | compiles | compile (s) | steps/s | tokens/s | step at fixed length (s) | comm MiB/step/rank |",
        "|---|---|---|---|---|---|---|",
        f"| {n['n']} steps, {n['distinct']} distinct lengths {n['min']}-{n['max']} (median {n['median']:.0f}), "
        f"symbolic | {r['compiles']} | {r['compile_time_s']:.1f} | {r['steps_per_s']:.2f} | {r['tokens_per_s']:.0f} "
        "| | |",
    ]
    for k, label in (("static", "compiled for the length (dynamic=False)"), ("symbolic", "symbolic")):
        rows.append(
            f"| fixed length {r['fixed_seq']}, {label} | | {r['fixed_compile_s'][k]:.1f} | {1 / fixed[k]:.2f} "
            f"| {r['fixed_seq'] / fixed[k]:.0f} | {fixed[k]:.4f} | {comm[k] / MiB:.2f} |"
        )
    return rows + [
        "",
        f"Symbolic over static at the fixed length: {r['fixed_ratio']:.3f}x the step time (ratio of medians). "
        f"Against one device every {r.get('check_every', 20)}th step ({r['checks']} checks): loss within "
        f"{r['loss_rel_err']:.1e}, gradients within {r['grad_rel_err']:.1e} (relative).",
    ]
