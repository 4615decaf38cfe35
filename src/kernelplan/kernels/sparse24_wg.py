"""2:4 linear on Hopper's ``wgmma.mma_async.sp`` (sm_90a) for N > 64: the kernel is ``cuda/sparse24_wg.cu``.

It reads the weight in the one device layout of ``cuda_sp`` (``sparse24/layout.py``,
one copy shared by both kernels): per warp, a warpgroup's
sparse A fragment and metadata word are exactly ``mma.sp.m16n8k32``'s.  x is
staged by cp.async into wgmma's 128-byte-swizzled K-major B layout.

``wg_config`` is the configuration rule: a pure function of (N, M, K, SMs),
the candidate tile (``wg_candidates``) of least estimated cost (``tile_cost``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..activations import GATED_EPILOGUES
from .nvrtc import cuda_source
from .sparse24 import sm_count
from .sparse24_mma import COMMON_SOURCE, TiledKernel, defines
from ..sparse24.layout import SP_LAYOUT
from .sparse24_sp import SM_SHARED, _tiled

INSTRUCTION_N = (8, 16, 32, 64, 128, 256)  # the wgmma.sp shapes kernels/cuda/wgmma_sp.cuh wraps


@dataclass(frozen=True)
class WgConfig:
    bn: int  # rows of x (tokens) a CTA multiplies: a multiple of ni
    ni: int  # wgmma N per instruction
    wm: int = 2  # warpgroups along M: 64 rows each
    ks: int = 1  # warpgroups along K: slices summed in shared memory
    kc: int = 1  # CTAs of a cluster along K (grid z): slices summed through distributed shared memory
    stages: int = 4  # buffers in the shared-memory ring (the MMAs of one in flight, STAGES - 2 loading)
    sub: int = 2  # 64-column steps a buffer: MMAs issued per barrier
    min_blocks: int = 1

    @property
    def rows(self) -> int:
        return 64 * self.wm

    @property
    def slices(self) -> int:
        return self.ks * self.kc

    @property
    def threads(self) -> int:
        return 128 * self.wm * self.ks

    @property
    def stage_bytes(self) -> int:
        """One buffer: per step, x for each K slice and each warp's 1152 bytes of W, rounded to 1024 (the swizzle)."""
        return self.sub * (-(-(self.ks * self.bn * 128 + self.wm * self.ks * 4 * 1152) // 1024) * 1024)

    @property
    def shared(self) -> int:
        """Dynamic shared memory: the ring or the K slices' sums, whichever is larger, and 1 KiB to align to 1024."""
        sums = self.ks * self.bn * (self.rows + 4) * 4
        return max(self.stages * self.stage_bytes, sums) + 1024


def _ring(bn: int, ni: int, wm: int, ks: int, kc: int) -> WgConfig | None:
    """The tile with the deepest ring that fits: two steps a buffer where four buffers fit, else one step and up to six.

    A CTA of one warpgroup leaves room for a second CTA on the SM, to hide its barriers.
    """
    blocks = 2 if wm * ks == 1 and kc == 1 else 1
    for sub, most in ((2, 4), (1, 6)):
        cfg = WgConfig(bn, ni, wm, ks, kc, sub=sub)
        stages = min(most, (SM_SHARED // blocks - 2048) // cfg.stage_bytes)
        if stages >= (4 if sub == 2 else 3):
            cfg = WgConfig(bn, ni, wm, ks, kc, stages, sub, blocks)
            return cfg if cfg.shared * blocks <= SM_SHARED else None
    return None


def instruction_n(bn: int) -> int:
    return next(i for i in reversed(INSTRUCTION_N) if bn % i == 0)


def wg_candidates(n: int, m: int, k: int) -> list[WgConfig]:
    """Every tile the kernel can run for this problem: the space the sweep (``bench/sparse24_wg_tiles.py``) measures."""
    out = []
    fitted = -(-(-(-n // -(-n // 256))) // 16) * 16  # n in the fewest N tiles of at most 256, rounded to 16
    for bn in sorted({min(fitted, b) for b in (32, 64, 128, 256)} | {fitted}):
        for wm in (1, 2, 4):
            for ks in (1, 2):
                for kc in (1, 2, 4, 8):
                    if (k // 64) % (ks * kc) or ks * kc > 1 and k // 64 < 4 * ks * kc or bn % kc:
                        continue
                    if wm == 4 and (bn > 128 or ks > 1):  # 512 threads: at most 128 registers each
                        continue
                    cfg = _ring(bn, instruction_n(bn), wm, ks, kc)
                    if cfg is not None:
                        out.append(cfg)
    return out


# The rule's weights, fitted on bench/results/sparse24-wg-tiles-h100.json (11 sweep shapes x n = 32..4096,
# every candidate tile timed as CUDA graph replays; bench/sparse24_wg_tiles.py): over those 88 problems the
# chosen tile's time is on average 0.91x of the best tile's (median 0.94x, worst 0.50x on a BERT-sized layer).
_UNDERFILL = 0.25  # exponent on 1 / (share of the SMs the grid fills), when it fills less than one wave
_PER_SLICE = 0.1  # each K slice past the first: its sums reduced, its pipeline filled again
_ONE_WARPGROUP = 0.2  # 64-row CTAs: x re-read per 64 rows
_ONE_STEP_A_BUFFER = 0.1  # a barrier per 64-column step
_NARROW = 0.1  # times 256 / BN: x re-read per N tile and W per M tile


def tile_cost(cfg: WgConfig, n: int, m: int, sms: int) -> float:
    """The rule's estimate of a tile's time, relative: lower is faster."""
    ctas = -(-n // cfg.bn) * -(-m // cfg.rows) * cfg.slices
    fill = min(1.0, ctas / (sms * cfg.min_blocks))
    padded = -(-n // cfg.bn) * cfg.bn / n  # rows of x computed per row asked for
    return ((1 / fill) ** _UNDERFILL * (1 + _PER_SLICE * (cfg.slices - 1)) * (1 + _ONE_WARPGROUP * (cfg.wm == 1))
            * (1 + _ONE_STEP_A_BUFFER * (cfg.sub == 1)) * (1 + _NARROW * 256 / cfg.bn) * padded)


@functools.lru_cache(maxsize=4096)
def wg_config(n: int, m: int, k: int, sms: int) -> WgConfig:
    """The tile for N = n: the candidate of least ``tile_cost`` (ties: the first in ``wg_candidates``' order)."""
    return min(wg_candidates(n, m, k), key=lambda cfg: tile_cost(cfg, n, m, sms))


def source(cfg: WgConfig, dtype: str, has_bias: bool, activation: str | None) -> str:
    """The CUDA C++ of one kernel variant (``kp_sparse24_wg``), compiled by NVRTC for sm_90a."""
    head = defines(dtype, has_bias, activation, BN=cfg.bn, NI=cfg.ni, WM=cfg.wm, KS=cfg.ks, KC=cfg.kc, SUB=cfg.sub,
                   STAGES=cfg.stages, MIN_BLOCKS=cfg.min_blocks)
    return head + COMMON_SOURCE + cuda_source("sparse24_wg.cu")


@functools.lru_cache(maxsize=256)
def _launcher(cfg: WgConfig, dtype: str, has_bias: bool, activation: str | None, device_index: int):
    from . import nvrtc

    return nvrtc.launch(source(cfg, dtype, has_bias, activation), "kp_sparse24_wg", device_index, f"{cfg} {dtype}",
                        block=cfg.threads, shared=cfg.shared, architecture=WgKernel.architecture)


class WgKernel(TiledKernel):
    name = "cuda_wg"
    layout = SP_LAYOUT
    max_n = 1 << 31
    architecture = "sm_90a"  # wgmma is an sm_90a instruction
    source = staticmethod(source)

    def tiled(self, values, metadata):
        return _tiled(values, metadata)

    def launch_for(self, n, m, k, dtype, has_bias, activation, device):
        return self.launch_config(self.config(n, m, k, device, activation), n, m, dtype, has_bias, activation, device)

    def config(self, n, m, k, device, activation=None):
        from ..sparse24.dispatch import config_for

        return config_for(self.name, n, m, k, sm_count(device), activation in GATED_EPILOGUES)

    def launch_config(self, cfg: WgConfig, n, m, dtype, has_bias, activation, device):
        return _launcher(cfg, dtype, has_bias, activation, device), (-(-n // cfg.bn), -(-m // cfg.rows), cfg.kc)
