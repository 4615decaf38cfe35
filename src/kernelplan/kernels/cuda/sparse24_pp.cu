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
// The epilogue: bias and activation in registers, then 16-bit through the warpgroup's own staging buffer
// (sparse24_epilogue.cuh).
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
#include "sparse24_epilogue.cuh"

constexpr int kPpThreads = 384;                    // the producer warpgroup and two consumers (not ring.cuh's kThreads)
constexpr int kYBytes = (BN * kYStride + 1023) / 1024 * 1024;
constexpr int kOutBlocks = WM / kRegions;          // 64-column blocks of y a tile

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
    named_sync(bar, 128);  // the last tile's rows have been read out of the staging buffer
#pragma unroll
    for (int b = 0; b < kOutBlocks; ++b) {
        float b0[kRegions], b1[kRegions];
        bias_rows(bias, m0 + 64 * b + 16 * wq + (lane >> 2), cols, b0, b1);
        stage_block16(stage, 64 * b, n0, N, wq, lane, sc,
                      [&](int i, int at, bool hi) { return out_value(acc, b, i, at, hi ? b1 : b0); });
    }
    named_sync(bar, 128);
    store_rows16(stage, y, n0, m0, N, cols, syn, u, 128, sc);
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
    const int steps = (K + 63) / 64, tiles_m = (M + kBM - 1) / kBM;  // K padded to 64: x past K reads as zeros
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
        KP_PHASE(0);  // bench/sparse24_phases.py's marks (KP_PROBE 3; sparse24_ring.cuh), else nothing
        ring_init(&xmap, &vmap, &emap, full0, empty0, 1);  // one release a stage: the warpgroup that reads it
        mbar_init(order0, 1);
        mbar_init(order0 + 8, 1);
        mbar_init_fence();
    }
    __syncthreads();
    if (threadIdx.x == 0) KP_PHASE(1);
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
#if KP_PROBE == 3
        // The phases of warpgroup 0's first tile: its first stage landed, its K loop done, its y stored; then the
        // warpgroup's exit.  (Where a CTA has one tile, as sparse24_ws.cu's marks; warpgroup 1 then has none.)
        if (threadIdx.x == 128 && j == 0) {
            mbar_wait(full0, 0);
            KP_PHASE(2);
        }
#endif
        consume_steps<true, WM>(acc, sbase, full0, empty0, j * steps, steps, wq, lane, wq, 0);
        if (u == 0) mbar_arrive(order0 + 8 * (c ^ 1));  // the warpgroup's MMAs are done, so are its waits
        if (threadIdx.x == 128 && j == 0) KP_PHASE(3);
        const u16 *own = HAS_BIAS ? bias + (long)at.expert * M : bias;  // grouped: the biases are [E, M]
        store_tile(acc, ybase + c * kYBytes, own, y, at.n0, at.block * kOut, at.n_end, M / kRegions, syn, wq, lane, u,
                   1 + c, sc);
        if (threadIdx.x == 128 && j == 0) KP_PHASE(4);
    }
    if (threadIdx.x == 128) KP_PHASE(5);
}
