"""The torch.compile backend that runs the autosp passes."""
from ._backend import Options, make_backend

__all__ = ["Options", "make_backend"]
