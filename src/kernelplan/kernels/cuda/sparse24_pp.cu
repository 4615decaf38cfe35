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
// Compile-time sizes come from the variant's #defines: BN (a multiple of 16), NI, WM (64-row blocks of W a tile: a
// warpgroup's m64 instructions per k32), STAGES, CONSUMER_REGS, IS_BF16, HAS_BIAS, ACT, GATED, DT.  Gated
// (sparse24_ws.cu says what), a tile's blocks come from both halves of W (sparse24_ring.cuh, load_w), and block b
// of the first meets block b of the second in the same registers: y's column is gate2 of the two.

#define CM 1
#include "wgmma_sp.cuh"
#include "hopper.cuh"
#include "sparse24_ring.cuh"
#include "sparse24_grouped.cuh"

constexpr int kPpThreads = 384;                    // the producer warpgroup and two consumers (not ring.cuh's kThreads)
constexpr int kYStride = kBM * 2 + 16;             // bytes a row of the staging buffer
constexpr int kYBytes = (BN * kYStride + 1023) / 1024 * 1024;
constexpr int kOutBlocks = WM / kRegions;          // 64-column blocks of y a tile
constexpr int kOut = 64 * kOutBlocks;              // columns of y a tile
static_assert(NI % 16 == 0, "stmatrix stores two 8-column groups of an instruction at once");

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
                                           int lane, int u, int bar, const Scatter &sc) {
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
                // The thread's columns of x in blocks j and j + 1: 8 c + 2 (lane & 3) and the next.
                const int nx = n0 + i * NI + 8 * j + 2 * (lane & 3);
                const float s[2][2] = {{row_scale(sc, nx, N), row_scale(sc, nx + 1, N)},
                                       {row_scale(sc, nx + 8, N), row_scale(sc, nx + 9, N)}};
                u32 r[4];
#pragma unroll
                for (int p = 0; p < 4; ++p) {  // matrix p: rows + 8 (p & 1) of W, columns 8 (j + p / 2) of x
                    const int at = 4 * (j + (p >> 1)) + 2 * (p & 1);
                    r[p] = pack2(out_value(acc, b, i, at, (p & 1) ? b1 : b0) * s[p >> 1][0],
                                 out_value(acc, b, i, at + 1, (p & 1) ? b1 : b0) * s[p >> 1][1]);
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
        u16 *out = y + (long)(SCATTER ? sc.rows[n] : n) * syn + m;
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
               int K, int syn, int tiles_n KP_GROUP_PARAMS KP_SCATTER_PARAMS)
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 sbase = ((u32)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
    const u32 ybase = sbase + kRingBytes, full0 = ybase + 2 * kYBytes, empty0 = full0 + 8 * STAGES;
    const u32 order0 = empty0 + 8 * STAGES;  // order0 + 8 c: warpgroup c may run its next K loop
    const int warp = warp_uniform(), lane = threadIdx.x & 31;
    const int steps = K / 64, tiles_m = (M + kBM - 1) / kBM;
#if GROUPED
    __shared__ int first[kMaxExperts + 1];
    if (warp == 0) scan_tiles(first, offsets, experts, tiles_m, lane);
#else
    const int *offsets = nullptr, *first = nullptr;
    const int experts = 0;
#endif
#if SCATTER
    static_assert(GROUPED, "a scattered store is a grouped launch's");
    const Scatter sc{rows, scale};
#else
    const Scatter sc{nullptr, nullptr};
#endif

    if (threadIdx.x == 0) {
        ring_init(&xmap, &vmap, &emap, full0, empty0, 1);  // one release a stage: the warpgroup that reads it
        mbar_init(order0, 1);
        mbar_init(order0 + 8, 1);
        mbar_init_fence();
    }
    __syncthreads();
    const int tiles = GROUPED ? first[experts] : tiles_n * tiles_m;

    if (warp < 4) {
#if CONSUMER_REGS
        regs_down<40>();
#endif
        if (threadIdx.x == 0) {
            int g = 0, e = 0;
            for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
                const Tile at = tile_at(t, tiles_n, N, tiles_m, offsets, first, e);
                g = produce_steps(g, 0, steps, at.n0, w_block(at, tiles_m), w_half(at), sbase, full0, empty0, &xmap,
                                  &vmap, &emap);
            }
        }
        return;
    }
#if CONSUMER_REGS
    regs_up<CONSUMER_REGS>();
#endif
    const int c = warp / 4 - 1, wq = warp & 3, u = threadIdx.x - 128 * (c + 1);
    float acc[WM][kInst][kAcc];
    int j = c, e = 0;  // this CTA's tiles, counted: warpgroup c takes j = c, c + 2, ...
    for (int t = blockIdx.x + c * gridDim.x; t < tiles; t += 2 * gridDim.x, j += 2) {
        const Tile at = tile_at(t, tiles_n, N, tiles_m, offsets, first, e);
        // Tile j's K loop after tile j - 1's: the other warpgroup's (j / 2)-th arrival (warpgroup 0's first tile
        // waits on nothing).
        if (j > 0) mbar_wait(order0 + 8 * c, (u32)(((j - 1) >> 1) & 1));
#pragma unroll
        for (int b = 0; b < WM; ++b)
#pragma unroll
            for (int i = 0; i < kInst; ++i)
#pragma unroll
                for (int r = 0; r < kAcc; ++r) acc[b][i][r] = 0.f;
        consume_steps<true, WM>(acc, sbase, full0, empty0, j * steps, steps, wq, lane, wq, 0);
        if (u == 0) mbar_arrive(order0 + 8 * (c ^ 1));  // the warpgroup's MMAs are done, so are its waits
        const u16 *own = HAS_BIAS ? bias + (long)at.expert * M : bias;  // grouped: the biases are [E, M]
        store_tile(acc, ybase + c * kYBytes, own, y, at.n0, at.block * kOut, at.n_end, M / kRegions, syn, wq, lane, u,
                   1 + c, sc);
    }
}
