"""GEMM with fused epilogues and fp8 scaling."""

from .epilogue import Epilogue, EpilogueSpec, ScaleSet
from .functional import linear
from .plan import GemmArgs, GemmDescriptor, GemmPlan
from . import cublaslt, scaled_mm  # noqa: F401  (register the GPU backends)

__all__ = ["Epilogue", "EpilogueSpec", "ScaleSet", "linear", "GemmArgs", "GemmDescriptor", "GemmPlan"]
