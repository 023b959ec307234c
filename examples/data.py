"""A small real text corpus that ships with Python itself: the docstrings of standard-library
modules (English prose about programming), byte-level tokens (vocab 256). No downloads."""

from __future__ import annotations

import importlib
import inspect

import torch

__all__ = ["corpus", "batches"]

_MODULES = [
    "argparse",
    "asyncio",
    "collections",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "email",
    "enum",
    "fractions",
    "functools",
    "heapq",
    "http.client",
    "inspect",
    "itertools",
    "json",
    "logging",
    "pathlib",
    "pickle",
    "random",
    "re",
    "shutil",
    "socket",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.parse",
    "zipfile",
]


def corpus() -> torch.Tensor:
    """The corpus as a 1-D uint8 tensor (about a megabyte), the same on every machine with the
    same Python."""
    parts = []
    for name in _MODULES:
        mod = importlib.import_module(name)
        for _, obj in sorted(vars(mod).items()):
            doc = inspect.getdoc(obj) if (inspect.isclass(obj) or inspect.isfunction(obj)) else None
            if doc and getattr(obj, "__module__", None) == mod.__name__:
                parts.append(doc)
    text = "\n\n".join(parts).encode("utf-8", errors="replace")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def batches(data: torch.Tensor, batch: int, seq: int, seed: int):
    """Endless random windows (input_ids, labels=input_ids), identical on every rank: the causal
    shift happens inside the model."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq, (batch,), generator=g)
        ids = torch.stack([data[s : s + seq] for s in starts.tolist()]).long()
        yield ids, ids.clone()
