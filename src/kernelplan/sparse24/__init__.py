"""2:4 structured sparsity: the compressed format and the sparse GEMM."""

from .format import FORMAT_VERSION, Sparse24Weight, compress, is_sparse24, prune
from .gemm import GemmSparse24Args, GemmSparse24Descriptor, GemmSparse24Plan, gated_linear, linear
from . import backends  # noqa: E402,F401  registers the GPU backends (importing no GPU library)
from .tiles import clear_tuned_tiles, tune_tiles  # noqa: E402  opt-in tile tuning (imports no GPU library)

__all__ = [
    "FORMAT_VERSION",
    "Sparse24Weight",
    "compress",
    "is_sparse24",
    "prune",
    "linear",
    "gated_linear",
    "tune_tiles",
    "clear_tuned_tiles",
    "GemmSparse24Args",
    "GemmSparse24Descriptor",
    "GemmSparse24Plan",
]
