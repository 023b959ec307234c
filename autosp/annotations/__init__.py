"""User-facing annotations: the mesh, ``shard``, ``annotate``, ``token_local``, ``explain`` and the YAML config."""

from ._config import Config, load_config
from ._local import token_local
from ._mesh import Mesh, current_mesh, mesh
from ._shard import explain, shard
from ._spec import annotate, parse_spec

__all__ = [
    "Config",
    "load_config",
    "Mesh",
    "mesh",
    "current_mesh",
    "shard",
    "explain",
    "annotate",
    "parse_spec",
    "token_local",
]
