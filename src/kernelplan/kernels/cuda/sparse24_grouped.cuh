// What the grouped forms of the warp-specialized kernels (sparse24_pp.cu, sparse24_ws.cu: GROUPED 1) share: a MoE
// layer's experts as one launch (kernels/sparse24_grouped.py).  Needs the variant's BN, GATED, GROUPED, SCATTER.
#pragma once
#ifndef GROUPED
#define GROUPED 0
#endif
#ifndef SCATTER
#define SCATTER 0
#endif

// The kernels' parameters past their plain ones: the offsets and the experts, then the scattered store's rows and
// scales (grouped_linear passes them in this order).
#if GROUPED
#define KP_GROUP_PARAMS , const int *__restrict__ offsets, int experts
#else
#define KP_GROUP_PARAMS
#endif
#if SCATTER
#define KP_SCATTER_PARAMS , const long long *__restrict__ rows, const float *__restrict__ scale
#else
#define KP_SCATTER_PARAMS
#endif

// Grouped (GROUPED 1: a MoE layer's experts, nn/experts.py), W is E weights of M rows each, end to end (the device
// layout of the stacked rows), and x's rows are sorted by expert: expert e's are offsets[e] .. offsets[e + 1] - 1.
// Its output tiles are those of each expert's own problem, expert by expert, N first within one; `first` holds each
// expert's first tile number (a scan of its tile counts, made by each CTA before the walk).  Rows of a box past an
// expert's last are another expert's, or zeros: they are computed and not stored.  Grouped and gated, each expert's
// M rows are its two halves (gate and up), and the gated maps' half dimension runs over all 2 E of them.
constexpr int kMaxExperts = 1024;
struct Tile {
    int n0, block, n_end, expert;  // x's first row, W's 64 WM-row block within the expert, x's row bound, expert
};

// The tile's W as load_w takes it: the row block of the stacked rows and 0, or, gated, the block within each half
// and the expert's first half.
__device__ __forceinline__ int w_block(const Tile &t, int tiles_m) {
    return GATED ? t.block : t.expert * tiles_m + t.block;
}
__device__ __forceinline__ int w_half(const Tile &t) { return GATED ? 2 * t.expert : 0; }

__device__ __forceinline__ Tile tile_at(int t, int tiles_n, int N, int tiles_m, const int *__restrict__ offsets,
                                        const int *first, int &e) {
#if GROUPED
    while (first[e + 1] <= t) ++e;  // tiles come in increasing order: the cursor only moves on
    const int start = offsets[e], count = offsets[e + 1] - start, local = t - first[e];
    const int per = (count + BN - 1) / BN;
    return {start + local % per * BN, local / per, start + count, e};
#else
    (void)tiles_m, (void)offsets, (void)first, (void)e;
    return {t % tiles_n * BN, t / tiles_n, N, 0};
#endif
}

// first[e] for e = 0 .. experts: the tiles of the experts before e, by one warp (32 experts at a time).
__device__ __forceinline__ void scan_tiles(int *first, const int *__restrict__ offsets, int experts, int tiles_m,
                                           int lane) {
    int carry = 0;
    for (int base = 0; base < experts; base += 32) {
        const int i = base + lane;
        int v = i < experts ? (offsets[i + 1] - offsets[i] + BN - 1) / BN * tiles_m : 0;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int o = __shfl_up_sync(0xffffffffu, v, d);
            if (lane >= d) v += o;
        }
        if (i < experts) first[i + 1] = carry + v;
        carry += __shfl_sync(0xffffffffu, v, 31);
    }
    if (lane == 0) first[0] = 0;
}

// Scattered (SCATTER 1, grouped only: a MoE layer's down projection), row n of x is (token, k) pair rows[n] of the
// layer, its output goes to row rows[n] of y, scaled by that pair's routing weight scale[rows[n]] before it is
// rounded: the pairs' reordering and weighting in the store, not in two passes over y after it (nn/experts.py).
struct Scatter {
    const long long *__restrict__ rows;
    const float *__restrict__ scale;
};

// The factor of x's row n of the tile (1 unless scattered); rows past `N` are not stored.
__device__ __forceinline__ float row_scale(const Scatter &sc, int n, int N) {
#if SCATTER
    return n < N ? sc.scale[sc.rows[n]] : 0.f;
#else
    (void)sc, (void)n, (void)N;
    return 1.f;
#endif
}
