"""nn.Module drop-ins built on kernelplan's functional ops."""

from .gated_mlp import GatedMLP
from .sparse24_linear import Sparse24Linear

__all__ = ["GatedMLP", "Sparse24Linear"]
