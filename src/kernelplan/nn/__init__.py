"""nn.Module drop-ins built on kernelplan's functional ops."""

from .adapters import lora
from .experts import Sparse24Experts
from .fused_linear import FusedLinear, FusedMLP
from .gated_mlp import GatedMLP
from .siblings import Siblings, fuse_siblings, siblings_of
from .sparse24_linear import Sparse24Linear

__all__ = ["FusedLinear", "FusedMLP", "GatedMLP", "Siblings", "Sparse24Experts", "Sparse24Linear", "fuse_siblings",
           "lora", "siblings_of"]
