"""CUDA C++ 2:4 linear for N <= 64 on the sparse tensor cores (``mma.sp``), operands staged by cp.async.

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
* The values and words are stored tiled in that order (the one device
  layout, ``sparse24/layout.py``), a warp step reading a run
  of 1024 bytes and one of 128.  Each lane copies its own fragments into
  shared memory by cp.async and reads them back whole: with no expansion
  that costs little, and a ring of up to 6 steps in flight costs no
  registers (on an H200 at n = 32 a register ring, as ``cuda_mma``'s, ran
  0.9-1.0x of this at its best configurations).
* x is staged in shared memory by cp.async, once per CTA step, and read
  into B fragments by ``ldmatrix``.  A warp multiplies ``RT`` row tiles with
  each fragment, and ``MW`` warps share each staged step.

A CTA is ``MW x KW`` warps over ``16 RT MW`` rows of W: ``MW`` warps along
M, ``KW`` slices of K, the slices summed through shared memory in a fixed
order (deterministic).  Then bias and activation, and y is written.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from ..sparse24.layout import SP_LAYOUT, layout_of, pack
from .sparse24 import sm_count
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
        """One step: x for each K slice (8 N-tile rows of 128 bytes), then each warp's weight (1152 bytes a row tile)."""
        return self.k_warps * 8 * self.n_tiles * 128 + self.m_warps * self.k_warps * self.row_tiles * 1152

    @property
    def shared(self) -> int:
        """Bytes of dynamic shared memory: the ring, then (reused) the K slices' sums."""
        sums = self.k_warps * self.rows * (8 * self.n_tiles + 1) * 4
        return max(self.stages * self.stage_bytes, sums)


SM_SHARED = 227 * 1024  # shared memory an sm_90 SM gives its CTAs; each CTA also takes 1 KiB of the driver's


def sp_config(n: int, m: int, k: int, sms: int) -> SpConfig:
    """Rows per CTA, then K slices to make the warps an SM holds in one wave, then as many steps as fit.

    Each CTA reads all of x for its rows, so larger CTAs read less of it,
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
    m_warps = 4 if -(-m // 128) >= 0.8 * sms else 2
    per_sm = -(-m // (32 * m_warps * sms))  # CTAs an SM holds for one wave
    k_warps = max(1, min(8, (16 if n_tiles == 8 else 8) // (m_warps * per_sm)))
    while (k // 64) % k_warps:
        k_warps //= 2
    cfg = SpConfig(n_tiles, m_warps=m_warps, k_warps=k_warps)
    stages = (SM_SHARED // per_sm - 1024) // cfg.stage_bytes
    return dataclasses.replace(cfg, stages=max(2, min(6, stages)), min_blocks=min(per_sm, max(1, 512 // cfg.threads)))


_SOURCE = r"""
__device__ __forceinline__ uint4 ldsm4(u32 addr) {
    uint4 v;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

// d += A (16 x 32, 2:4, compressed) * B (32 x 8); SEL picks the lanes whose e holds the metadata.
template <int SEL>
__device__ __forceinline__ void mma_sp(float (&d)[4], const uint4 &a, const uint4 &b, u32 e) {
    asm volatile("mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32." DT "." DT ".f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9,%10,%11}, {%0,%1,%2,%3}, %12, %13;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b.x), "r"(b.y), "r"(b.z), "r"(b.w),
                   "r"(e), "n"(SEL));
}

// 16 bytes global -> shared; zero-filled where !ok.
__device__ __forceinline__ void cp16(u32 dst, const void *src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(ok ? 16 : 0));
}

__device__ __forceinline__ void cp4(u32 dst, const void *src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(dst), "l"(src), "r"(ok ? 4 : 0));
}

__device__ __forceinline__ uint4 lds4(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

__device__ __forceinline__ u32 lds1(u32 addr) {
    u32 v; asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr)); return v;
}

template <int PENDING>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(PENDING)); }

#define ROWS (8 * NT)                  // rows of x staged
#define THREADS (32 * MW * KW)
#define BM (16 * RT * MW)              // rows of W a CTA
#define X_BYTES (KW * ROWS * 128)      // one step of x: each K slice's 64 columns
#define STAGE_BYTES (X_BYTES + MW * KW * RT * 1152)

// y[N, M] = act(x[N, K] @ W^T + bias), W in the device layout (sparse24/layout.py); a CTA per BM rows of W.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
kp_sparse24_sp(const u16 *__restrict__ x, const u32 *__restrict__ vals, const u32 *__restrict__ meta,
               const u16 *__restrict__ bias, u16 *__restrict__ y, int N, int M, int K, int sxn, int syn)
{
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int mw = warp % MW, kw = warp / MW;
    const int g = lane >> 2, t = lane & 3;
    const int ksteps = K / 64, steps = ksteps / KW, tiles = (M + 15) / 16;

    // Per row tile and step: 256 words of values, 32 of metadata; a tile's steps follow each other.
    const u32 *vp[RT]; const u32 *ep[RT]; bool tok[RT];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
        int tile = (blockIdx.x * MW + mw) * RT + r;
        tok[r] = tile < tiles;
        long base = (long)(tok[r] ? tile : 0) * ksteps + kw * steps;
        vp[r] = vals + base * 256 + lane * 4;
        ep[r] = meta + base * 32 + lane;
    }
    const u32 sx = (u32)__cvta_generic_to_shared(smem);

    float acc[RT][NT][4];
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[r][j][e] = 0.f;

    // Step STEP of every K slice's x into buffer BUF: rows of 8 16-byte chunks, chunk c at c ^ (row % 8)
    // so that ldmatrix's eight rows fall in different banks.  Rows past N are zeros.
#define COPY_X(BUF, STEP) do { \
        _Pragma("unroll") for (int i = threadIdx.x; i < KW * ROWS * 8; i += THREADS) { \
            int c = i & 7, row = (i >> 3) % ROWS, q = i / (ROWS * 8); \
            bool ok = (STEP) < steps && row < N; \
            const u16 *src = ok ? x + (long)row * sxn + (long)(q * steps + (STEP)) * 64 + c * 8 : x; \
            cp16(sx + (BUF) * STAGE_BYTES + (q * ROWS + row) * 128 + ((c ^ (row & 7)) << 4), src, ok); } \
    } while (0)
    // This warp's fragments of step STEP, each lane's own, into buffer BUF.
    const u32 wslot = sx + X_BYTES + warp * RT * 1152;
#define COPY_W(BUF, STEP) do { \
        bool live = (STEP) < steps; \
        _Pragma("unroll") for (int r = 0; r < RT; ++r) { \
            u32 d = wslot + (BUF) * STAGE_BYTES + r * 1152; \
            cp16(d + lane * 16, vp[r] + (long)(STEP) * 256, live && tok[r]); \
            cp16(d + 512 + lane * 16, vp[r] + (long)(STEP) * 256 + 128, live && tok[r]); \
            cp4(d + 1024 + lane * 4, ep[r] + (long)(STEP) * 32, live && tok[r]); } \
    } while (0)
#define ISSUE(BUF, STEP) do { COPY_X(BUF, STEP); COPY_W(BUF, STEP); asm volatile("cp.async.commit_group;"); } while (0)
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) ISSUE(s, s);

    for (int s0 = 0; s0 < steps; s0 += STAGES) {
#pragma unroll
        for (int u = 0; u < STAGES; ++u) {
            const int s = s0 + u;
            cp_wait<STAGES - 2>();  // this thread's copies of step s have landed
            __syncthreads();        // everyone's have, and everyone is done with step s - 1's buffer
            ISSUE((u + STAGES - 1) % STAGES, s + STAGES - 1);
            if (s < steps) {
                const u32 buf = sx + u * STAGE_BYTES + kw * ROWS * 128;
                uint4 a[RT][2]; u32 e[RT];  // per row tile: the two halves' A fragments, this lane's metadata word
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    u32 d = wslot + u * STAGE_BYTES + r * 1152;
                    a[r][0] = lds4(d + lane * 16);
                    a[r][1] = lds4(d + 512 + lane * 16);
                    e[r] = lds1(d + 1024 + lane * 4);
                }
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    if (8 * j >= N) break;
                    const int row = 8 * j + (lane & 7);
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        uint4 b = ldsm4(buf + row * 128 + (((4 * h + (lane >> 3)) ^ (row & 7)) << 4));
#pragma unroll
                        for (int r = 0; r < RT; ++r) {
                            if (h == 0) mma_sp<0>(acc[r][j], a[r][0], b, e[r]);
                            else mma_sp<1>(acc[r][j], a[r][1], b, e[r]);
                        }
                    }
                }
            }
        }
    }

    // The K slices summed in slice order (deterministic); then bias, activation, y.
    cp_wait<0>();
    __syncthreads();
    float *red = (float *)smem;  // [KW][BM][ROWS + 1]
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                red[(kw * BM + (mw * RT + r) * 16 + g + 8 * (e >> 1)) * (ROWS + 1) + 8 * j + 2 * t + (e & 1)] =
                    acc[r][j][e];
    __syncthreads();
    for (int idx = threadIdx.x; idx < BM * ROWS; idx += THREADS) {
        int ml = idx % BM, nl = idx / BM, m = blockIdx.x * BM + ml;
        if (m >= M || nl >= N) continue;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < KW; ++w) v += red[(w * BM + ml) * (ROWS + 1) + nl];
#if HAS_BIAS
        v += to_f32(bias[m]);
#endif
        y[(long)nl * syn + m] = from_f32(activate(v));
    }
}
"""


def source(cfg: SpConfig, dtype: str, has_bias: bool, activation: str | None) -> str:
    """The CUDA C++ of one kernel variant (``kp_sparse24_sp``), compiled by NVRTC."""
    head = defines(dtype, has_bias, activation, NT=cfg.n_tiles, RT=cfg.row_tiles, MW=cfg.m_warps, KW=cfg.k_warps,
                   STAGES=cfg.stages, MIN_BLOCKS=cfg.min_blocks)
    return head + COMMON_SOURCE + _SOURCE


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
    from . import nvrtc

    return nvrtc.launch(source(cfg, dtype, has_bias, activation), "kp_sparse24_sp", device_index, f"{cfg} {dtype}",
                        block=cfg.threads, shared=cfg.shared, architecture=SpKernel.architecture)


class SpKernel(TiledKernel):
    name = "cuda_sp"
    layout = SP_LAYOUT
    max_n = MAX_N
    chunks = True
    source = staticmethod(source)

    def tiled(self, values, metadata):
        return _tiled(values, metadata)

    def launch_for(self, n, m, k, dtype, has_bias, activation, device):
        cfg = self.config(n, m, k, device)
        return _launcher(cfg, dtype, has_bias, activation, device), (-(-m // cfg.rows), 1, 1)

    def config(self, n, m, k, device):
        from ..sparse24.dispatch import config_for

        return config_for(self.name, n, m, k, sm_count(device))
