// 2:4 linear on Hopper's sparse warpgroup MMA: the warp-specialized CTA of sparse24_ws.cu made persistent, the
// tiles of the last, partial wave split along K.  One CTA per SM walks a list of work; its producer warp keeps the
// ring full across tile boundaries while the consumers finish a tile.  Not the rule's kernel: measured slower than
// sparse24_ws.cu on 86 of 88 problems, its epilogue (from registers, 2-byte stores at BN = 256) not hidden behind
// MMAs (docs/design/0006).
//
// y[N, M] = act(x[N, K] @ W^T + bias), W in the one device layout (sparse24/layout.py), read as sparse24_ws.cu
// reads it: per 64-column step one tensor-map copy of x's BN x 64 box and one each of the CTA's tiles' values and
// metadata.
//
// The work (host: kernels/sparse24_ws_rule.py, sk_plan).  Output tiles are BN rows of x by kBM rows of W, numbered
// along N first (tile_origin), each K / 64 steps long.  Work unit v goes to CTA v mod G (G CTAs, all resident):
//  * units 0 .. dp_tiles - 1 are whole tiles, in waves (dp_tiles is a whole number of waves);
//  * the R = tiles - dp_tiles tiles left are split along K into `splits` equal parts, numbered part-major: unit
//    dp_tiles + p R + r is part p of tile dp_tiles + r.  So the CTAs at work at one time read the same K region
//    of x and W, and the second read of a block hits L2.  (Stream-K's even split by steps put every CTA at its own
//    K offset: each step then read x and W from DRAM, and steps took twice as long; docs/design/0006.)
// A tile's last part (its "head") adds the others and writes y; they have lower unit numbers, so they run before
// it or beside it.  Part p < splits - 1 of tail tile r is the consumers' accumulators in register order,
// [p R + r][BN * kBM / kConsumers][kConsumers] f32 after the flags; the int at `work`[p R + r] is its flag: set
// (release) when the part is written, waited on (acquire) and cleared by the head, so the flags are zero again
// at the end of every launch (the host zeroes them once per workspace).

// Compile-time sizes come from the variant's #defines: BN, NI, WM, STAGES, CONSUMER_REGS, IS_BF16, HAS_BIAS,
// ACT, DT (CM = KC = 1: no clusters).

#define CM 1
#include "wgmma_sp.cuh"
#include "hopper.cuh"
#include "sparse24_ring.cuh"
static_assert(!GATED, "the gated epilogue is sparse24_ws.cu's and sparse24_pp.cu's, not the split tiles'");

constexpr int kPartFloats = BN * kBM;

// Tile t's first row of x and first 16-row tile of W.  Along N first, as sparse24_ws.cu's grid runs: the tiles that
// read one block of W are neighbours in a wave.
__device__ __forceinline__ void tile_origin(int t, int tiles_n, int &n0, int &tile0) {
    tile0 = t / tiles_n * kTiles;
    n0 = t % tiles_n * BN;
}

// This CTA's work, in order: (tile, split part, first step, end step) per call of next().
struct Schedule {
    int v, tiles, steps, dp_tiles, splits, rest;

    __device__ Schedule(int tiles_, int steps_, int dp_tiles_, int splits_)
        : v((int)blockIdx.x), tiles(tiles_), steps(steps_), dp_tiles(dp_tiles_), splits(splits_),
          rest(tiles_ - dp_tiles_) {}

    __device__ bool next(int &tile, int &part, int &k0, int &k1) {
        if (v < dp_tiles) {
            tile = v, part = 0, k0 = 0, k1 = steps;
        } else if (v - dp_tiles < rest * splits) {
            part = (v - dp_tiles) / rest;
            tile = dp_tiles + (v - dp_tiles) % rest;
            k0 = steps * part / splits;
            k1 = steps * (part + 1) / splits;
        } else {
            return false;
        }
        v += (int)gridDim.x;
        return true;
    }
};

__device__ __forceinline__ int ld_acquire(const int *p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Bias, activation and y for this warp's accumulators: rows m0 + g (+ 8) of W, rows n0 + columns of x.  Up to
// BN = 128, lanes 4g + t and 4(g + 1) + t first swap one value each, in place, so that each then stores two
// adjacent elements of y (4 bytes); at BN = 256 ptxas hoists the 64 swaps and spills, so each lane stores its
// own elements (2 bytes).
constexpr bool kSwap = BN <= 128;
__device__ __forceinline__ void store_y(float (&acc)[kInst][kAcc], const u16 *__restrict__ bias,
                                        u16 *__restrict__ y, int n0, int m0, int N, int M, int syn, int lane) {
    const int g = lane >> 2, t = lane & 3, odd = g & 1;
    if (kSwap) {
#pragma unroll
        for (int i = 0; i < kInst; ++i)
#pragma unroll
            for (int r = 0; r < kAcc; r += 2) {
                // acc[i][r], acc[i][r + 1]: row g + 8 ((r >> 1) & 1) of W, columns 2t and 2t + 1 of x's block;
                // after the swap, rows g & ~1 and (g & ~1) + 1, column 2t + odd.
                const float other = __shfl_xor_sync(0xffffffffu, odd ? acc[i][r] : acc[i][r + 1], 4);
                if (odd) acc[i][r] = other;
                else acc[i][r + 1] = other;
            }
    }
    const bool pairs = kSwap && syn % 2 == 0 && ((unsigned long long)y & 3) == 0;
#pragma unroll
    for (int i = 0; i < kInst; ++i)
#pragma unroll
        for (int r = 0; r < kAcc; r += 2) {
            if (!kSwap) {  // two elements of one row of y, 8 apart along M
                const int m = m0 + g + 8 * ((r >> 1) & 1), n = n0 + i * NI + 8 * (r >> 2) + 2 * t;
#pragma unroll
                for (int c = 0; c < 2; ++c)
                    if (n + c < N && m < M) {
#if HAS_BIAS
                        y[(long)(n + c) * syn + m] = from_f32(activate(acc[i][r + c] + to_f32(bias[m])));
#else
                        y[(long)(n + c) * syn + m] = from_f32(activate(acc[i][r + c]));
#endif
                    }
                continue;
            }
            const int m = m0 + (g & ~1) + 8 * ((r >> 1) & 1);
            const int n = n0 + i * NI + 8 * (r >> 2) + 2 * t + odd;
            if (n >= N || m >= M) continue;
            float v0 = acc[i][r], v1 = acc[i][r + 1];
#if HAS_BIAS
            v0 += to_f32(bias[m]);
            if (m + 1 < M) v1 += to_f32(bias[m + 1]);
#endif
            const u16 h0 = from_f32(activate(v0)), h1 = from_f32(activate(v1));
            u16 *out = y + (long)n * syn + m;
            if (pairs && m + 1 < M) {
                *(u32 *)out = h0 | ((u32)h1 << 16);
            } else {
                out[0] = h0;
                if (m + 1 < M) out[1] = h1;
            }
        }
}

extern "C" __global__ void __launch_bounds__(kThreads, 1)
kp_sparse24_sk(const __grid_constant__ TensorMap xmap, const __grid_constant__ TensorMap vmap,
               const __grid_constant__ TensorMap emap, const u16 *__restrict__ bias, u16 *__restrict__ y, int N, int M,
               int K, int syn, int tiles_n, int dp_tiles, int splits, unsigned char *__restrict__ work)
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 sbase = ((u32)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
    const u32 full0 = sbase + kRingBytes, empty0 = full0 + 8 * STAGES;
    const int warp = warp_uniform(), lane = threadIdx.x & 31;
    const int steps = (K + 63) / 64, tiles_m = (M + kBM - 1) / kBM, tiles = tiles_n * tiles_m;  // K padded to 64
    const int rest = tiles - dp_tiles, slots = (splits - 1) * rest;  // the parts handed over
    int *flags = (int *)work;
    float *parts = (float *)(work + (slots * 4 + 1023) / 1024 * 1024);

    if (threadIdx.x == 0) {
        ring_init(&xmap, &vmap, &emap, full0, empty0, WM);  // one release a stage per consumer warpgroup
        mbar_init_fence();
    }
    __syncthreads();

    Schedule work_list(tiles, steps, dp_tiles, splits);
    int tile, part, k0, k1, n0, tile0;
    if (warp < 4) {
#if CONSUMER_REGS
        regs_down<40>();
#endif
        if (threadIdx.x == 0) {
            int g = 0;
            while (work_list.next(tile, part, k0, k1)) {
                tile_origin(tile, tiles_n, n0, tile0);
                g = produce_steps(g, k0, k1, n0, tile0 / kTiles, 0, sbase, full0, empty0, &xmap, &vmap, &emap);
            }
        }
        return;
    }
#if CONSUMER_REGS
    regs_up<CONSUMER_REGS>();
#endif
    const int wm = warp / 4 - 1, wq = warp & 3, tl = wm * 4 + wq;  // tl: this warp's tile within the CTA
    const int u = threadIdx.x - 128;                               // this thread among the consumers
    float blocks[1][kInst][kAcc];  // one 64-row block of W a warpgroup
    float (&acc)[kInst][kAcc] = blocks[0];
    int g = 0;
    while (work_list.next(tile, part, k0, k1)) {
#pragma unroll
        for (int i = 0; i < kInst; ++i)
#pragma unroll
            for (int r = 0; r < kAcc; ++r) acc[i][r] = 0.f;
        consume_steps<true>(blocks, sbase, full0, empty0, g, k1 - k0, tl, lane, wq, 0);
        g += k1 - k0;

        if (tile >= dp_tiles && splits > 1) {
            const int r = tile - dp_tiles;
            if (part < splits - 1) {
                // Handed over: the tile's head adds it.
                float *mine = parts + (long)(part * rest + r) * kPartFloats;
#pragma unroll
                for (int i = 0; i < kInst; ++i)
#pragma unroll
                    for (int j = 0; j < kAcc; ++j) __stcg(mine + (i * kAcc + j) * kConsumers + u, acc[i][j]);
                named_sync(1, kConsumers);
                if (u == 0) {
                    __threadfence();
                    atomicExch(flags + part * rest + r, 1);
                }
                continue;
            }
            for (int p = 0; p < splits - 1; ++p) {  // the head: the parts in order, so every call sums alike
                if (u == 0) {
                    while (ld_acquire(flags + p * rest + r) == 0) {
                    }
                    flags[p * rest + r] = 0;  // for the next launch: only this head reads it
                }
                named_sync(1, kConsumers);
                const float *theirs = parts + (long)(p * rest + r) * kPartFloats;
#pragma unroll
                for (int i = 0; i < kInst; ++i)
#pragma unroll
                    for (int j = 0; j < kAcc; ++j) acc[i][j] += __ldcg(theirs + (i * kAcc + j) * kConsumers + u);
            }
        }
        tile_origin(tile, tiles_n, n0, tile0);
        store_y(acc, bias, y, n0, tile0 * 16 + wm * 64 + wq * 16, N, M, syn, lane);
    }
}
