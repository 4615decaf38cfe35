// 2:4 linear on Hopper's sparse warpgroup MMA, persistent and ping-pong: one CTA per SM walks the output tiles, its
// producer warp keeps the ring full across them, and its two consumer warpgroups take alternate tiles, so that one
// warpgroup's epilogue runs while the other's MMAs do.  (sparse24_ws.cu runs one tile per CTA, and both its
// consumer warpgroups store y together, with no MMA running; sparse24_sk.cu is persistent but did the same:
// docs/design/0006.)
//
// y[N, M] = act(x[N, K] @ W^T + bias), W in the one device layout (sparse24/layout.py), read as sparse24_ws.cu
// reads it: per 64-column step one tensor-map copy of x's BN x 64 box and one each of the tile's values and metadata.
//
// The work: output tiles of BN rows of x by kBM = 64 WM rows of W, numbered along N first (as sparse24_sk.cu's
// tile_origin), each K / 64 ring steps long.  CTA c takes tiles c, c + G, c + 2G, ... (G CTAs, all resident); its
// j-th tile goes to consumer warpgroup j mod 2 and fills ring steps j K/64 ... (j + 1) K/64 - 1, which that
// warpgroup alone reads, so a stage's "empty" barrier takes one arrival.  The warpgroups' K loops run in the
// tiles' order, each after the other's (two "order" mbarriers, CUTLASS's ping-pong math order): a warpgroup then
// never waits on a stage's phase while an older phase of that stage is still due, which a wait by parity cannot
// tell apart; and one warpgroup's epilogue runs beside the other's MMAs.
//
// The epilogue: bias and activation in registers, the 16-bit results through stmatrix (transposed: a row of the
// staging buffer is 8 rows of W, 16 bytes of y) into the warpgroup's own staging buffer [BN][kBM + 8] (rows padded
// by 16 bytes: stmatrix's 8 rows then fall on distinct banks), then 16-byte stores of y's rows.
//
// Stream-K (STREAMK 1): the CTAs share the tiles' steps evenly instead, so a grid of one CTA an SM is busy to the
// end whatever the number of tiles (4608 x 256 in tiles of 128 x 128 is 72 tiles: 72 of 132 SMs, one tile long).
// The grid is tiles_n columns of G CTAs (CTA b is column b % tiles_n, c = b / tiles_n within it): column j takes
// the tiles of x's rows j, and its CTA c takes steps [c S / G, (c + 1) S / G) of their S = tiles_m x K/64 steps, in
// order, as units of (tile, k0, k1).  The CTAs of one c read the same steps of one block of W at the same time, so
// it comes from DRAM once.  A unit is a whole tile or, where the range starts or ends inside a tile, a part.  Only
// a CTA's first unit can start past a tile's step 0 ("handed over": its sums go to the workspace, slot b, and flag
// b is set with release); only its last can stop short of a tile's end with step 0 in it (the tile's "head": it
// waits for, adds in order, and clears the flags of the column's CTAs c + 1, ... whose ranges start inside the
// tile, then writes y).  The CTAs a head waits on hand over in their first unit, before anything of theirs waits,
// so every wait ends (all CTAs resident).  The workspace: a flag a CTA (ints, in whole KiB), then a slot a CTA of a
// warpgroup's accumulators in register order, [slot][WM x kInst x kAcc][128] f32; the host zeroes the flags before
// each launch.
//
// Compile-time sizes come from the variant's #defines: BN (a multiple of 16), NI, WM (64-row blocks of W a tile: a
// warpgroup's m64 instructions per k32), STAGES, CONSUMER_REGS, IS_BF16, HAS_BIAS, ACT, GATED, DT, STREAMK.  Gated
// (sparse24_ws.cu says what), a tile's blocks come from both halves of W (sparse24_ring.cuh, load_w), and block b
// of the first meets block b of the second in the same registers: y's column is gate2 of the two.

#define CM 1
#include "wgmma_sp.cuh"
#include "hopper.cuh"
#include "sparse24_ring.cuh"

constexpr int kPpThreads = 384;                    // the producer warpgroup and two consumers (not ring.cuh's kThreads)
constexpr int kYStride = kBM * 2 + 16;             // bytes a row of the staging buffer
constexpr int kYBytes = (BN * kYStride + 1023) / 1024 * 1024;
constexpr int kOutBlocks = WM / kRegions;          // 64-column blocks of y a tile
constexpr int kOut = 64 * kOutBlocks;              // columns of y a tile
static_assert(NI % 16 == 0, "stmatrix stores two 8-column groups of an instruction at once");

// This CTA's work, in order: (tile, first step, end step) a unit.
struct Units {
#if STREAMK
    long long p, end, total;  // steps of this CTA's column: its range, all of them
    int steps, tiles_n, column, c, g;  // g: the column's CTAs
    __device__ Units(int tiles, int steps_, int tiles_n_)
        : steps(steps_), tiles_n(tiles_n_), column((int)blockIdx.x % tiles_n_), c((int)blockIdx.x / tiles_n_),
          g((int)gridDim.x / tiles_n_) {
        total = (long long)(tiles / tiles_n) * steps;
        p = total * c / g;
        end = total * (c + 1) / g;
    }
    __device__ bool next(int &t, int &k0, int &k1) {
        if (p >= end) return false;
        t = (int)(p / steps) * tiles_n + column, k0 = (int)(p % steps);
        k1 = (int)min((long long)steps, k0 + (end - p));
        p += k1 - k0;
        return true;
    }
    // The CTAs (grid index) whose parts the head of tile t adds: the column's c + 1, ... that start inside it.
    __device__ int partners(int t) const {
        const long long stop = (long long)(t / tiles_n + 1) * steps;
        int count = 0;
        while (c + 1 + count < g && total * (c + 1 + count) / g < stop) ++count;
        return count;
    }
#else
    int at, tiles, steps;
    __device__ Units(int tiles_, int steps_, int) : at((int)blockIdx.x), tiles(tiles_), steps(steps_) {}
    __device__ bool next(int &t, int &k0, int &k1) {
        if (at >= tiles) return false;
        t = at, k0 = 0, k1 = steps;
        at += (int)gridDim.x;
        return true;
    }
#endif
};

constexpr int kSlotFloats = WM * kInst * kAcc * 128;  // a warpgroup's accumulators

// Stream-K: a part's sums into slot `cta` of the workspace, then its flag (sparse24_sk.cu hands over alike).
__device__ __forceinline__ void hand_over(const float (&acc)[WM][kInst][kAcc], int *flags, float *slots, int cta,
                                          int u, int bar) {
    float *mine = slots + (long long)cta * kSlotFloats;
#pragma unroll
    for (int b = 0; b < WM; ++b)
#pragma unroll
        for (int i = 0; i < kInst; ++i)
#pragma unroll
            for (int r = 0; r < kAcc; ++r) __stcg(mine + ((b * kInst + i) * kAcc + r) * 128 + u, acc[b][i][r]);
    named_sync(bar, 128);
    if (u == 0) {
        __threadfence();
        atomicExch(flags + cta, 1);
    }
}

// Stream-K: a head adds the parts of its tile that the `count` CTAs cta + stride, cta + 2 stride, ... handed over,
// in that order, so every launch sums alike.
__device__ __forceinline__ void take_parts(float (&acc)[WM][kInst][kAcc], int *flags, const float *slots, int cta,
                                           int stride, int count, int u, int bar) {
    for (int c = cta + stride; c <= cta + count * stride; c += stride) {
        if (u == 0) {
            while (ld_acquire(flags + c) == 0) {
            }
            flags[c] = 0;  // for the next launch: only this head reads it
        }
        named_sync(bar, 128);
        const float *theirs = slots + (long long)c * kSlotFloats;
#pragma unroll
        for (int b = 0; b < WM; ++b)
#pragma unroll
            for (int i = 0; i < kInst; ++i)
#pragma unroll
                for (int r = 0; r < kAcc; ++r) acc[b][i][r] += __ldcg(theirs + ((b * kInst + i) * kAcc + r) * 128 + u);
    }
}

__device__ __forceinline__ u32 pack2(float lo, float hi) { return from_f32(lo) | ((u32)from_f32(hi) << 16); }

// Column `at` of a thread's accumulators of output block b: act(z + bias), or, gated, gate2 of the two halves' sums.
__device__ __forceinline__ float out_value(const float (&acc)[WM][kInst][kAcc], int b, int i, int at,
                                           const float (&add)[kRegions]) {
    if constexpr (kRegions == 1) {
        return activate(acc[b][i][at] + add[0]);
    } else {
        return gate2(acc[b][i][at] + add[0], acc[b + kOutBlocks][i][at] + add[1]);
    }
}

// This warpgroup's tile of y (x's rows n0 ..., y's columns m0 ..., of `cols`) from its accumulators, through
// `stage`.  Barrier `bar` is the warpgroup's own; `u` is the thread within the warpgroup.
__device__ __forceinline__ void store_tile(float (&acc)[WM][kInst][kAcc], u32 stage, const u16 *__restrict__ bias,
                                           u16 *__restrict__ y, int n0, int m0, int N, int cols, int syn, int wq,
                                           int lane, int u, int bar) {
    const int g = lane >> 2, q = lane >> 3, i8 = lane & 7;
    named_sync(bar, 128);  // the last tile's rows have been read out of the staging buffer
#pragma unroll
    for (int b = 0; b < kOutBlocks; ++b) {
        const int row = m0 + 64 * b + 16 * wq + g;  // this thread's columns of y: row, row + 8 (of each half of W)
        float b0[kRegions], b1[kRegions];
#pragma unroll
        for (int h = 0; h < kRegions; ++h) {
            b0[h] = b1[h] = 0.f;
#if HAS_BIAS
            if (row < cols) b0[h] = to_f32(bias[h * cols + row]);
            if (row + 8 < cols) b1[h] = to_f32(bias[h * cols + row + 8]);
#endif
        }
        (void)row;
#pragma unroll
        for (int i = 0; i < kInst; ++i)
#pragma unroll
            for (int j = 0; j < NI / 8; j += 2) {
                u32 r[4];
#pragma unroll
                for (int p = 0; p < 4; ++p) {  // matrix p: rows + 8 (p & 1) of W, columns 8 (j + p / 2) of x
                    const int at = 4 * (j + (p >> 1)) + 2 * (p & 1);
                    r[p] = pack2(out_value(acc, b, i, at, (p & 1) ? b1 : b0),
                                 out_value(acc, b, i, at + 1, (p & 1) ? b1 : b0));
                }
                const int nl = i * NI + 8 * (j + (q >> 1)) + i8, ml = 64 * b + 16 * wq + 8 * (q & 1);
                stmatrix_t4(stage + nl * kYStride + ml * 2, r[0], r[1], r[2], r[3]);
            }
    }
    named_sync(bar, 128);
    const bool vec = syn % 8 == 0 && ((unsigned long long)y & 15) == 0;
    const int M = cols;
    for (int idx = u; idx < BN * (kOut / 8); idx += 128) {
        const int nl = idx / (kOut / 8), m8 = idx % (kOut / 8), n = n0 + nl, m = m0 + m8 * 8;
        if (n >= N || m >= M) continue;
        const uint4 v = lds4(stage + nl * kYStride + m8 * 16);
        u16 *out = y + (long)n * syn + m;
        if (vec && m + 8 <= M) {
            *(uint4 *)out = v;
        } else {
            const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (m + e < M) out[e] = (u16)(w[e >> 1] >> (16 * (e & 1)));
        }
    }
}

extern "C" __global__ void __launch_bounds__(kPpThreads, 1)
kp_sparse24_pp(const __grid_constant__ TensorMap xmap, const __grid_constant__ TensorMap vmap,
               const __grid_constant__ TensorMap emap, const u16 *__restrict__ bias, u16 *__restrict__ y, int N, int M,
               int K, int syn, int tiles_n, unsigned char *__restrict__ work)
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 sbase = ((u32)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
    const u32 ybase = sbase + kRingBytes, full0 = ybase + 2 * kYBytes, empty0 = full0 + 8 * STAGES;
    const u32 order0 = empty0 + 8 * STAGES;  // order0 + 8 c: warpgroup c may run its next K loop
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int steps = K / 64, tiles = tiles_n * ((M + kBM - 1) / kBM);

    if (threadIdx.x == 0) {
        ring_init(&xmap, &vmap, &emap, full0, empty0, 1);  // one release a stage: the warpgroup that reads it
        mbar_init(order0, 1);
        mbar_init(order0 + 8, 1);
        mbar_init_fence();
    }
    __syncthreads();

    if (warp < 4) {
#if CONSUMER_REGS
        regs_down<40>();
#endif
        if (threadIdx.x == 0) {
            Units units(tiles, steps, tiles_n);
            int g = 0, t, k0, k1;
            while (units.next(t, k0, k1))
                g = produce_steps(g, k0, k1, t % tiles_n * BN, t / tiles_n, sbase, full0, empty0, &xmap, &vmap, &emap);
        }
        return;
    }
#if CONSUMER_REGS
    regs_up<CONSUMER_REGS>();
#endif
    const int c = warp / 4 - 1, wq = warp & 3, u = threadIdx.x - 128 * (c + 1);
    float acc[WM][kInst][kAcc];
    Units units(tiles, steps, tiles_n);
    int t, k0, k1, g = 0;  // g: the unit's first ring step
    // This CTA's units, counted: warpgroup c takes j = c, c + 2, ...
    for (int j = 0; units.next(t, k0, k1); g += k1 - k0, ++j) {
        if ((j & 1) != c) continue;
        // Unit j's K loop after unit j - 1's: the other warpgroup's (j / 2)-th arrival (warpgroup 0's first unit
        // waits on nothing).
        if (j > 0) mbar_wait(order0 + 8 * c, (u32)(((j - 1) >> 1) & 1));
#pragma unroll
        for (int b = 0; b < WM; ++b)
#pragma unroll
            for (int i = 0; i < kInst; ++i)
#pragma unroll
                for (int r = 0; r < kAcc; ++r) acc[b][i][r] = 0.f;
        consume_steps<true, WM>(acc, sbase, full0, empty0, g, k1 - k0, wq, lane, wq, 0);
        if (u == 0) mbar_arrive(order0 + 8 * (c ^ 1));  // the warpgroup's MMAs are done, so are its waits
#if STREAMK
        if (k1 - k0 < steps) {
            int *flags = (int *)work;
            float *slots = (float *)(work + ((long long)gridDim.x * 4 + 1023) / 1024 * 1024);
            if (k0 > 0) {
                hand_over(acc, flags, slots, blockIdx.x, u, 1 + c);
                continue;
            }
            take_parts(acc, flags, slots, blockIdx.x, tiles_n, units.partners(t), u, 1 + c);
        }
#else
        (void)work;
#endif
        store_tile(acc, ybase + c * kYBytes, bias, y, t % tiles_n * BN, t / tiles_n * kOut, N, M / kRegions, syn, wq,
                   lane, u, 1 + c);
    }
}
