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
budget, and step time and peak at a length every system fits); ``lengths`` renders
``benchmarks.run --lengths``'s record (drawn lengths against fixed-length training).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.tables import budget_table, lengths_table, runs_table  # noqa: E402

RENDERERS = {
    "runs": lambda results, opts: runs_table(results["records"], opts),
    "budget": lambda results, opts: budget_table(results["summary"]),
    "lengths": lambda results, opts: lengths_table(results["records"][0]),
}
BLOCK = re.compile(r"(<!-- table: (\S+) (\S+)(.*?) -->\n)(.*?)(<!-- end table -->)", re.S)


def render(text: str) -> str:
    def one(m: re.Match) -> str:
        kind, where, rest = m.group(2), m.group(3), m.group(4).split()
        results = json.loads((ROOT / where / "results.json").read_text())
        table = RENDERERS[kind](results, dict(w.split("=", 1) for w in rest))
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
