"""nn.Module drop-ins built on kernelplan's functional ops."""

from .sparse24_linear import Sparse24Linear

__all__ = ["Sparse24Linear"]
