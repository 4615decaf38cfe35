"""The pruning methods on one weight: magnitude, Wanda and SparseGPT, each to the 2:4 pattern.

Each takes the dense weight ``W [M, K]`` and, for the calibrated methods, the
statistics of the layer's inputs ``X [N, K]`` gathered by :class:`InputStats`,
and returns the pruned weight, dense, in W's dtype (2 of every 4 along K kept).
The arithmetic runs in fp32 on W's device (fp64 for an fp64 W, which
the tests' references use).

* magnitude: keep the 2 largest ``|W|`` of each group.
* Wanda (Sun et al. 2023, "A Simple and Effective Pruning Approach for LLMs"):
  score ``|W_ij| * ||X_j||_2`` and keep the 2 best-scored of each group, per
  output row.  The kept weights are not changed.
* SparseGPT (Frantar & Alistarh 2023): optimal-brain-surgeon reconstruction
  with ``H = X^T X`` (dampened by ``damp`` times its mean diagonal), in blocks
  of ``blocksize`` columns; in each block the mask of each group of 4 is chosen
  when its first column is reached, by ``w^2 / [H^-1]_jj^2``, and every pruned
  weight's error is propagated into the columns not yet visited.
"""

from __future__ import annotations

import torch

from ..errors import InvalidProblem

METHODS = ("magnitude", "wanda", "sparsegpt")


class InputStats:
    """Running statistics of a linear layer's inputs: ``X^T X`` if ``full``, else ``sum x_j^2`` per column."""

    def __init__(self, k: int, device: torch.device, full: bool, dtype: torch.dtype = torch.float32):
        self.tokens = 0
        self.gram = torch.zeros(k, k, dtype=dtype, device=device) if full else None
        self._sq = None if full else torch.zeros(k, dtype=dtype, device=device)

    @property
    def sq(self) -> torch.Tensor:
        """``||X_j||_2^2`` of each input column."""
        return torch.diagonal(self.gram) if self.gram is not None else self._sq

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1])
        dtype = self.sq.dtype
        self.tokens += x.shape[0]
        if self.gram is None:
            x = x.to(self._sq.device)
            widening = torch.promote_types(x.dtype, dtype) == dtype  # then the norm reads x without a converted copy
            norm = torch.linalg.vector_norm(x, dim=0, dtype=dtype) if widening else torch.linalg.vector_norm(x, dim=0)
            self._sq += norm.to(dtype).square()
        elif x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and dtype == torch.float32:
            # 16-bit products are exact in fp32 and cuBLAS accumulates them in fp32: no fp32 copy of X, and
            # tensor cores (the fp32 path is ~2 s of an 8B-shaped layer's calibration on an H100).
            self.gram += torch.mm(x.T, x, out_dtype=torch.float32)
        else:
            x = x.to(self.gram.device, dtype)
            self.gram.addmm_(x.T, x)


def _keep_top2(score: torch.Tensor) -> torch.Tensor:
    """Bool mask keeping the 2 highest scores of each group of 4 along the last dim (ties: lower index)."""
    groups = score.reshape(*score.shape[:-1], -1, 4)
    top2 = torch.sort(groups, dim=-1, descending=True, stable=True).indices[..., :2]
    return torch.zeros(groups.shape, dtype=torch.bool, device=score.device).scatter_(-1, top2, True).reshape(score.shape)


def _check(weight: torch.Tensor, stats: InputStats | None = None) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] % 4 or not weight.is_floating_point():
        raise InvalidProblem(f"weight is {getattr(weight, 'dtype', type(weight).__name__)} of shape "
                             f"{tuple(getattr(weight, 'shape', ()))}; pruning to 2:4 takes a floating-point [M, K] "
                             f"weight with K a multiple of 4")
    if stats is not None and stats.sq.shape[0] != weight.shape[1]:
        raise InvalidProblem(f"the input statistics are of {stats.sq.shape[0]} features, and weight has K = "
                             f"{weight.shape[1]}: gather them from this layer's inputs")


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    _check(weight)
    return torch.float64 if weight.dtype == torch.float64 else torch.float32


def magnitude(weight: torch.Tensor) -> torch.Tensor:
    w = weight.detach()
    return torch.where(_keep_top2(w.abs().to(_compute_dtype(w))), w, torch.zeros((), dtype=w.dtype, device=w.device))


def wanda(weight: torch.Tensor, stats: InputStats) -> torch.Tensor:
    _check(weight, stats)
    w = weight.detach()
    score = w.abs().to(_compute_dtype(w)) * stats.sq.sqrt().to(_compute_dtype(w))  # ||X_j||_2 over every calibration token
    return torch.where(_keep_top2(score), w, torch.zeros((), dtype=w.dtype, device=w.device))


def sparsegpt(weight: torch.Tensor, stats: InputStats, blocksize: int = 128, damp: float = 0.01) -> torch.Tensor:
    _check(weight, stats)
    if stats.gram is None:
        raise InvalidProblem("sparsegpt needs the inputs' X^T X: gather InputStats with full=True")
    if blocksize < 4 or blocksize % 4:
        raise InvalidProblem(f"blocksize is {blocksize}; SparseGPT's blocks hold whole groups of 4: use a "
                             f"positive multiple of 4, such as 128")
    if not 0 < damp < 1:
        raise InvalidProblem(f"damp is {damp}; the dampening is a fraction of the mean diagonal of H: use 0 < damp < 1, "
                             f"such as 0.01")
    w = weight.detach().to(_compute_dtype(weight), copy=True)
    k = w.shape[1]
    h = stats.gram.to(w.dtype, copy=True)
    dead = torch.diagonal(h) == 0  # a column no calibration token reached: prune freely, it adds no error
    h[dead, dead] = 1
    w[:, dead] = 0
    h.diagonal().add_(damp * torch.diagonal(h).mean())
    # The upper Cholesky factor of H^-1: row i holds the update of columns i.. when column i is pruned.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    for b0 in range(0, k, blocksize):
        b1 = min(b0 + blocksize, k)
        w1, hinv1 = w[:, b0:b1].clone(), hinv[b0:b1, b0:b1]
        err1 = torch.zeros_like(w1)
        d = torch.diagonal(hinv1)
        keep = torch.zeros_like(w1, dtype=torch.bool)
        for i in range(b1 - b0):
            if i % 4 == 0:  # a group's mask is chosen when its first column is reached, from the updated weights
                keep[:, i:i + 4] = _keep_top2(w1[:, i:i + 4].square() / d[i:i + 4].square())
            col = w1[:, i]
            q = torch.where(keep[:, i], col, torch.zeros((), dtype=w.dtype, device=w.device))
            err = (col - q) / d[i]
            w1[:, i:] -= err[:, None] * hinv1[i, i:][None, :]
            w1[:, i] = q
            err1[:, i] = err
        w[:, b0:b1] = w1
        w[:, b1:] -= err1 @ hinv[b0:b1, b1:]
    return w.to(weight.dtype)


def prune(method: str, weight: torch.Tensor, stats: InputStats | None, blocksize: int = 128,
          damp: float = 0.01) -> torch.Tensor:
    """``weight`` pruned by ``method`` (one of ``METHODS``) on the inputs ``stats`` describes (unused by magnitude)."""
    if method == "magnitude":
        return magnitude(weight)
    if method == "wanda":
        return wanda(weight, stats)
    return sparsegpt(weight, stats, blocksize, damp)


def relative_error(weight: torch.Tensor, pruned: torch.Tensor, stats: InputStats) -> float:
    """``||X (W - W')^T||_F^2 / ||X W^T||_F^2`` over the calibration inputs, from ``X^T X``."""
    if stats.gram is None:
        raise InvalidProblem("relative_error needs the inputs' X^T X: gather InputStats with full=True")
    w = weight.detach().to(stats.gram.dtype)
    delta = w - pruned.detach().to(stats.gram.dtype)
    num = ((delta @ stats.gram) * delta).sum()
    den = ((w @ stats.gram) * w).sum()
    return float(num / den) if float(den) > 0 else 0.0
