"""CUDA C++ 2:4 linear for N <= 64 on the sparse tensor cores (``mma.sp``), operands staged by cp.async: the
kernel is ``cuda/sparse24_sp.cu``.

``cuda_mma`` (``sparse24_mma.py``) expands each group to dense in registers
and multiplies it with a dense ``mma``; x goes straight from global memory
into every warp's B fragments.  Past n = 16 that stops paying: the
expansion and the dense products grow with the weight, and x, read once per
16 rows of W by every warp, is then more bytes than the weight.  Here:

* ``mma.sp.m16n8k32`` takes the compressed values as they are, with the
  format's own 4-bit positions as its metadata: no expansion, half the
  products.  Its A fragment gives lane ``(g, t)`` the two kept values of
  groups ``t`` and ``t + 4`` of rows ``g`` and ``g + 8``.  The metadata of a
  row's 32 columns is one 16-bit half word.  Lanes ``t = 0, 1`` hold it for
  the first 32 columns of a 64-column step (sparsity selector 0), lanes
  ``t = 2, 3`` for the second (selector 1), so each lane loads one word a step.
* The values and words are stored tiled (the one device layout,
  ``sparse24/layout.py``), a warp step reading a run of 1024 bytes and one
  of 128.  The values are in core-matrix order, so that ``wgmma.sp`` can
  read them from shared memory; ``ldmatrix.x4`` turns a k32's 512 bytes into
  every lane's A fragment.  Each lane copies 16-byte pieces into shared
  memory by cp.async: with no expansion that costs little, and a ring of up
  to 6 steps in flight costs no registers (on an H200 at n = 32 a register
  ring, as ``cuda_mma``'s, ran 0.9-1.0x of this at its best configurations).
* x is staged in shared memory by cp.async, once per CTA step, and read
  into B fragments by ``ldmatrix``.  A warp multiplies ``RT`` row tiles with
  each fragment, and ``MW`` warps share each staged step.

A CTA is ``MW x KW`` warps over ``16 RT MW`` rows of W: ``MW`` warps along
M, ``KW`` slices of K (at most one 64-column step apart where ``KW`` does not
divide K's steps), the slices summed through shared memory in a fixed
order (deterministic).  Then bias and activation, and y is written.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

import torch

from ..activations import GATED_EPILOGUES
from ..errors import KernelPlanError
from ..sparse24.layout import SP_LAYOUT, layout_of, pack
from .sparse24 import sm_count
from .nvrtc import cuda_source, shared_per_block
from .sparse24_mma import COMMON_SOURCE, TiledKernel, defines

MAX_N = 64  # eight 8-wide N tiles


@dataclass(frozen=True)
class SpConfig:
    n_tiles: int  # 8-wide N tiles staged and multiplied: N <= 8 * n_tiles
    row_tiles: int = 2  # 16-row tiles per warp, sharing each B fragment
    m_warps: int = 2  # warps along M, sharing each staged step of x
    k_warps: int = 4  # K slices per CTA
    stages: int = 4  # 64-column steps in flight in shared memory
    min_blocks: int = 1  # CTAs an SM must hold at once (__launch_bounds__): registers for 16 warps at most

    @property
    def rows(self) -> int:
        return 16 * self.row_tiles * self.m_warps

    @property
    def threads(self) -> int:
        return 32 * self.m_warps * self.k_warps

    @property
    def stage_bytes(self) -> int:
        """One step: x for each K slice (8 N-tile rows of 128 bytes), then each warp's weight (1152 bytes a row
        tile)."""
        return self.k_warps * 8 * self.n_tiles * 128 + self.m_warps * self.k_warps * self.row_tiles * 1152

    @property
    def shared(self) -> int:
        """Bytes of dynamic shared memory: the ring, then (reused) the K slices' sums."""
        sums = self.k_warps * self.rows * (8 * self.n_tiles + 1) * 4
        return max(self.stages * self.stage_bytes, sums)


SM_SHARED = 227 * 1024  # shared memory an sm_90 SM gives its CTAs; each CTA also takes 1 KiB of the driver's


# n <= 16: rows of W a CTA and the (MW, RT) that make them, largest first; a size is taken where it makes
# SMALL_N_CTAS_PER_SM CTAs an SM or more; the K slices then give the grid SMALL_N_WARPS_PER_SM warps an SM.
_SMALL_N_ROWS = ((128, 4, 2), (64, 2, 2), (32, 2, 1))
SMALL_N_CTAS_PER_SM = 4
SMALL_N_WARPS_PER_SM = 16


def sp_config(n: int, m: int, k: int, sms: int) -> SpConfig:
    """Rows per CTA, then K slices to make the warps an SM holds in one wave, then as many steps as fit.

    At n <= 16 a call streams its weight, and the more bytes in flight the faster: CTAs of 32 rows (64 and 128
    only where they still make 4 CTAs an SM), and K slices to 16 warps an SM over the grid.  Fitted on every tile
    of ``sp_candidates`` timed over the sweep set at n = 1, 8 and 16 (``sparse24-small-n-h{100,200}.json``): on the
    rows where this kernel's best tile beats ``cuda_ws``'s rule by 3% or more (45 on the H100, 37 on the H200), its
    pick reads 1.021x and 1.020x of the best tile's time (geometric mean), against 1.093x and 1.158x for the rule
    below, which kept 8 warps an SM in CTAs of 64-128 rows (docs/design/0042; ``tools/fit_sp_rule.py`` reads the
    tables for every setting of the two constants).

    Past n = 16: each CTA reads all of x for its rows, so larger CTAs read less of it,
    until too few CTAs leave SMs idle: 128 rows where there are about as many
    CTAs as SMs, else 64.  K slices then give each SM 8 warps (16 at n > 32),
    and the ring takes the SM's shared memory.  On an H200 (bf16, one run of
    20 configurations per shape, n = 32 and 64): 28672x8192 n = 64 1.13x of
    dense at 128 rows, 2 slices, 3 steps (1.04x at one slice and 6 steps, 8
    warps an SM; 0.71x at 64 rows); 8192x28672 n = 64 1.11x at 64 rows, 8
    slices, 2 steps (0.95x at 4 slices and 4 steps); 8192^2 n = 32 1.33x at
    64 rows, 4 slices, 5 steps (1.13x at 8 slices); 14336x4096 n = 32 1.36x
    and n = 64 1.11x.  K splits across CTAs, their partials summed by the last
    to finish, ran 0.65-0.9x at n = 32 and 64: the last CTA's sum is a tail.
    """
    n_tiles = next(t for t in (1, 2, 4, 8) if 8 * t >= n)
    if n_tiles <= 2:
        return _small_n_config(n_tiles, m, k, sms)
    m_warps = 4 if -(-m // 128) >= 0.8 * sms else 2
    per_sm = -(-m // (32 * m_warps * sms))  # CTAs an SM holds for one wave
    k_warps = _sliced(max(1, min(8, (16 if n_tiles == 8 else 8) // (m_warps * per_sm))), k)
    return _filled(SpConfig(n_tiles, m_warps=m_warps, k_warps=k_warps), per_sm)


def _small_n_config(n_tiles: int, m: int, k: int, sms: int) -> SpConfig:
    rows, m_warps, row_tiles = next((r for r in _SMALL_N_ROWS if -(-m // r[0]) >= SMALL_N_CTAS_PER_SM * sms),
                                    _SMALL_N_ROWS[-1])
    ctas = -(-m // rows)
    k_warps = _sliced(min(8, 1 << (max(1, SMALL_N_WARPS_PER_SM * sms // (ctas * m_warps)).bit_length() - 1)), k)
    return _filled(SpConfig(n_tiles, row_tiles, m_warps, k_warps), -(-ctas // sms))


# Steps of 64 columns a K slice of the rule's runs at least.  The slices need not divide K's steps: they run at most
# one step apart (sparse24_ws_rule.k_slices).  Slices of one step ran 0.83-0.97x of 4 slices of 3 at K = 768 (12
# steps) on the H200; at two steps or more 1.05-2.30x of the slices that divide K's steps (44 problems,
# sparse24-small-n-uneven-sp-h200.json), and 0.94-2.54x on 9 shapes not fitted (36 problems, 3 slower: 1024x640,
# sparse24-small-n-uneven-sp-grid-h200.json; docs/design/0059).
MIN_SLICE_STEPS = 2


def _sliced(k_warps: int, k: int) -> int:
    """``k_warps`` halved until each K slice has ``MIN_SLICE_STEPS`` steps or more (or there is one slice)."""
    while k_warps > 1 and k_warps * MIN_SLICE_STEPS > k // 64:
        k_warps //= 2
    return k_warps


# Registers a thread the kernel takes at n <= 16 (1 and 2 tiles of x), at most over the tiles of sp_candidates: ptxas
# gave 61-92 for sm_90a (d060424; tests/test_cuda_sources.py holds the kernel to it).  An SM's 64K registers then hold
# 65536 / (96 x threads) CTAs of any such tile.  Past n = 16, x's fragments take up to 130, and grids of more than
# one wave there (Ampere's and Ada's, where this kernel runs at every n) were not timed: their rings stay sized for
# the grid's share of an SM.
SMALL_N_MAX_REGS = 96


def _resident(cfg: SpConfig, per_sm: int) -> int:
    """The CTAs of ``cfg`` an SM holds at once, of the ``per_sm`` its share of the grid is: all of them where the
    registers hold that many (the grid is then one wave), else as many as the registers hold."""
    if cfg.n_tiles > 2:
        return per_sm
    return min(per_sm, max(1, 65536 // (SMALL_N_MAX_REGS * cfg.threads)))


def _filled(cfg: SpConfig, per_sm: int) -> SpConfig:
    """``cfg`` with as many steps in flight (2 to 6) as shared memory leaves the CTAs an SM holds at once
    (``_resident``), and the launch bound that lets an SM hold ``per_sm`` of them, up to 16 warps.  Rings sized for
    ``per_sm`` alone were 2 steps deep on grids past the registers' hold, the tall LM heads' at n <= 16
    (sparse24-small-n-sp-rings-h{100,200}.json; docs/design/0052)."""
    stages = (SM_SHARED // _resident(cfg, per_sm) - 1024) // cfg.stage_bytes
    return dataclasses.replace(cfg, stages=max(2, min(6, stages)), min_blocks=min(per_sm, max(1, 512 // cfg.threads)))


def fit_shared(cfg: SpConfig, limit: int) -> SpConfig:
    """``cfg`` with its ring, then its K slices, cut until a CTA's shared memory is at most ``limit`` bytes (the
    GPU's ``shared_per_block``).  The rules size rings by Hopper's 227 KiB, where every tile they give fits and this
    returns ``cfg``; on the A100 (163 KiB) and Ada (99 KiB) the deepest rings and widest K splits would not launch."""
    k_warps = cfg.k_warps
    while True:
        for stages in range(cfg.stages, 1, -1):
            fitted = dataclasses.replace(cfg, k_warps=k_warps, stages=stages)
            if fitted.shared <= limit:
                return fitted
        if k_warps == 1:
            raise KernelPlanError(f"cuda_sp {cfg}: no ring of 2 steps fits {limit} bytes of shared memory a CTA")
        k_warps //= 2


def sp_candidates(n: int, m: int, k: int, sms: int) -> list[SpConfig]:
    """The tiles the kernel can run for (n, M, K) on ``sms`` SMs, the rule's pick (``sp_config``) first: 32 to 128
    rows of W a CTA (2 or 4 warps along M, 1 or 2 row tiles each), 1 to 8 K slices of a step or more, 16 warps
    a CTA at most, each with the ring ``sp_config`` would give it.  What tile tuning times (``sparse24/tiles.py``)."""
    rule = sp_config(n, m, k, sms)
    space = [rule]
    for m_warps, row_tiles, k_warps in itertools.product((2, 4), (1, 2), (1, 2, 4, 8)):
        if k_warps > k // 64 or m_warps * k_warps > 16:
            continue
        cfg = SpConfig(rule.n_tiles, row_tiles, m_warps, k_warps)
        cfg = _filled(cfg, -(-m // (cfg.rows * sms)))
        if cfg.shared <= SM_SHARED - 1024 and cfg not in space:
            space.append(cfg)
    # the rule's pick, then its neighbours first: rows of W, then K slices, fewest doublings away
    return sorted(space, key=lambda c: (c != rule, abs(c.rows.bit_length() - rule.rows.bit_length())
                                        + abs(c.k_warps.bit_length() - rule.k_warps.bit_length())))


def source(cfg: SpConfig, dtype: str, has_bias: bool, activation: str | None) -> str:
    """The CUDA C++ of one kernel variant (``kp_sparse24_sp``), compiled by NVRTC."""
    head = defines(dtype, has_bias, activation, NT=cfg.n_tiles, RT=cfg.row_tiles, MW=cfg.m_warps, KW=cfg.k_warps,
                   STAGES=cfg.stages, MIN_BLOCKS=cfg.min_blocks)
    return head + COMMON_SOURCE + cuda_source("sparse24_sp.cu")


def _tiled(values: torch.Tensor, metadata: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight as the kernel reads it (``sparse24/layout.py``), rows padded to a multiple of 16.

    A weight held in the device layout already is read as it is; padded rows
    are values 0 at positions 0 and 1.
    """
    if layout_of(values) == SP_LAYOUT:
        return values.detach(), metadata
    pad = -values.shape[0] % 16
    values = values.detach()
    if pad:
        values = torch.nn.functional.pad(values, (0, 0, 0, pad))
        metadata = torch.nn.functional.pad(metadata, (0, 0, 0, pad), value=0x0404)
    return pack(values, metadata)


@functools.lru_cache(maxsize=256)
def _launcher(cfg: SpConfig, dtype: str, has_bias: bool, activation: str | None, device_index: int):
    return launch_of(cfg, source(cfg, dtype, has_bias, activation), device_index, f"{cfg} {dtype}")


def launch_of(cfg: SpConfig, text: str, device_index: int, label: str):
    """The ``FunctionLaunch`` of ``kp_sparse24_sp`` compiled from ``text`` (``source``'s, or another checkout's:
    bench/sparse24_source_ab.py), with ``cfg``'s block and shared memory."""
    from . import nvrtc

    return nvrtc.launch(text, "kp_sparse24_sp", device_index, label, block=cfg.threads, shared=cfg.shared,
                        architecture=SpKernel.architecture)


class SpKernel(TiledKernel):
    name = "cuda_sp"
    layout = SP_LAYOUT
    max_n = MAX_N
    chunks = True
    source = staticmethod(source)

    def tiled(self, values, metadata):
        return _tiled(values, metadata)

    def launch_for(self, n, m, k, dtype, has_bias, activation, device):
        return self.launch_config(self.config(n, m, k, device, activation), n, m, dtype, has_bias, activation, device)

    def launch_config(self, cfg: SpConfig, n, m, dtype, has_bias, activation, device):
        cfg = fit_shared(cfg, shared_per_block(device))  # as config gives it; a tuning candidate as it would run
        return _launcher(cfg, dtype, has_bias, activation, device), (-(-m // cfg.rows), 1, 1)

    def config(self, n, m, k, device, activation=None):  # every tile of the space has a gated variant
        """The tile this process tuned for the problem (``sparse24/tiles.py``, opt-in), else the rule's, fitted to
        the device's shared memory."""
        from ..sparse24.dispatch import config_for
        from ..sparse24.tiles import tuned_tile

        cfg = (tuned_tile(device, n, m, k, activation in GATED_EPILOGUES, self.name)
               or config_for(self.name, n, m, k, sm_count(device)))
        return fit_shared(cfg, shared_per_block(device))
