"""GEMM with fused epilogues and fp8 scaling."""

from .epilogue import Epilogue, EpilogueSpec, ScaleSet
from .functional import linear
from .plan import GemmArgs, GemmDescriptor, GemmPlan
from . import scaled_mm  # noqa: F401  (registers the fp8 backend)

__all__ = ["Epilogue", "EpilogueSpec", "ScaleSet", "linear", "GemmArgs", "GemmDescriptor", "GemmPlan"]
