// The 16-bit epilogue of sparse24_pp.cu (every tile) and sparse24_ws.cu (K whole, not gated, KP_Y16): a
// warpgroup's results, bias and activation applied in registers, go through stmatrix (transposed: a row of the
// staging buffer is 8 rows of W, 16 bytes of y) into a staging buffer [BN][kBM + 8] (rows padded by 16 bytes:
// stmatrix's 8 rows then fall on distinct banks), then 16-byte stores of y's rows.  (sparse24_ws.cu's K splits and
// gated tiles stage f32 sums instead: the slices' sums, and a gated pair's two rows, meet there before rounding.)
//
// Needs sparse24_ring.cuh's sizes and sparse24_grouped.cuh's Scatter.

constexpr int kYStride = kBM * 2 + 16;             // bytes a row of the staging buffer
constexpr int kOut = kBM / kRegions;               // columns of y a tile

__device__ __forceinline__ u32 pack2(float lo, float hi) { return from_f32(lo) | ((u32)from_f32(hi) << 16); }

// The bias of a thread's columns of y, row and row + 8 (of each half of W where gated; 0 past `cols`, and without a
// bias): b0 and b1 as stage_block16's value() adds them.
__device__ __forceinline__ void bias_rows(const u16 *__restrict__ bias, int row, int cols, float (&b0)[kRegions],
                                          float (&b1)[kRegions]) {
#pragma unroll
    for (int h = 0; h < kRegions; ++h) {
        b0[h] = b1[h] = 0.f;
#if HAS_BIAS
        if (row < cols) b0[h] = to_f32(bias[h * cols + row]);
        if (row + 8 < cols) b1[h] = to_f32(bias[h * cols + row + 8]);
#endif
    }
    (void)bias, (void)row, (void)cols;
}

// One 64-row block of W of a warpgroup's results into the staging buffer at `stage`, its rows of W from the
// buffer's column ml0 (this warp's 16 from ml0 + 16 wq); x's rows from n0, rows from N on scaled to 0.
// value(i, at, hi) is the thread's result (bias and activation applied) at accumulator `at` of instruction i, hi
// for its rows + 8.  Lane 4g + t holds rows g, g + 8 and columns 2t, 2t + 1 of each 8 (hopper.cuh, store_acc).
template <class Value>
__device__ __forceinline__ void stage_block16(u32 stage, int ml0, int n0, int N, int wq, int lane, const Scatter &sc,
                                              Value value) {
    static_assert(NI % 16 == 0, "stmatrix stores two 8-column groups of an instruction at once");
    const int q = lane >> 3, i8 = lane & 7;
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
                r[p] = pack2(value(i, at, p & 1) * s[p >> 1][0], value(i, at + 1, p & 1) * s[p >> 1][1]);
            }
            const int nl = i * NI + 8 * (j + (q >> 1)) + i8, ml = ml0 + 16 * wq + 8 * (q & 1);
            stmatrix_t4(stage + nl * kYStride + ml * 2, r[0], r[1], r[2], r[3]);
        }
}

// The staging buffer's BN rows to y's rows n0 ... (scattered: sc.rows[n]) and columns m0 ... m0 + kOut - 1, by thread
// u of `threads`; x's rows from N and y's columns from `cols` on are not stored.
__device__ __forceinline__ void store_rows16(u32 stage, u16 *__restrict__ y, int n0, int m0, int N, int cols, int syn,
                                             int u, int threads, const Scatter &sc) {
    const bool vec = syn % 8 == 0 && ((unsigned long long)y & 15) == 0;
    for (int idx = u; idx < BN * (kOut / 8); idx += threads) {
        const int nl = idx / (kOut / 8), m8 = idx % (kOut / 8), n = n0 + nl, m = m0 + m8 * 8;
        if (n >= N || m >= cols) continue;
        const uint4 v = lds4(stage + nl * kYStride + m8 * 16);
        u16 *out = y + (long)(SCATTER ? sc.rows[n] : n) * syn + m;
        if (vec && m + 8 <= cols) {
            *(uint4 *)out = v;
        } else {
            const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (m + e < cols) out[e] = (u16)(w[e >> 1] >> (16 * (e & 1)));
        }
    }
}
