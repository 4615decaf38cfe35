"""Pruning dense models to 2:4: the methods (magnitude, Wanda, SparseGPT), sequential calibration, and perplexity."""

from .calibrate import find_blocks
from .evaluate import evaluate
from .methods import METHODS, InputStats, magnitude, relative_error, sparsegpt, wanda
from .sparsify import SparsifyReport, eligibility, sparsify

__all__ = ["METHODS", "InputStats", "SparsifyReport", "eligibility", "evaluate", "find_blocks", "magnitude",
           "relative_error", "sparsegpt", "sparsify", "wanda"]
