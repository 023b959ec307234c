"""YAML configuration: the mesh and ``shard`` settings in one file, checked on load.

mesh: {sp: 2}
shard: {seq: {input_ids: 1, labels: 1}, compiler: aot_eager}
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .._context import Options
from ._mesh import mesh

__all__ = ["Config", "load_config"]

# the keywords of autosp.mesh and autosp.shard: the options, and which inputs are sharded
_MESH_KEYS = set(inspect.signature(mesh).parameters)
_SHARD_KEYS = {"seq", *Options.keys()}


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """``autosp.mesh(**config.mesh)`` and ``autosp.shard(fn, **config.shard)``."""

    mesh: dict[str, Any] = field(default_factory=dict)
    shard: dict[str, Any] = field(default_factory=dict)


def load_config(source: str | Path) -> Config:
    """Read a YAML file (or a YAML string) with optional sections ``mesh`` and ``shard``."""
    text = Path(source).read_text() if Path(str(source)).suffix in {".yaml", ".yml"} else str(source)
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(
            f"autosp: config must be a mapping with 'mesh' and 'shard' sections, got {type(data).__name__}"
        )
    unknown = set(data) - {"mesh", "shard"}
    if unknown:
        raise ValueError(f"autosp: unknown config section(s) {sorted(unknown)}; expected 'mesh' and 'shard'")
    for section, keys in (("mesh", _MESH_KEYS), ("shard", _SHARD_KEYS)):
        bad = set(data.get(section) or {}) - keys
        if bad:
            raise ValueError(
                f"autosp: unknown key(s) {sorted(bad)} in config section '{section}'; allowed: {sorted(keys)}"
            )
    return Config(mesh=dict(data.get("mesh") or {}), shard=dict(data.get("shard") or {}))
