// 2:4 linear for N <= 64 on the sparse tensor cores (mma.sp), operands staged by cp.async: the kernel of
// kernels/sparse24_sp.py (cuda_sp), which says how it works and how its tile is chosen.
// Compile-time sizes come from the variant's #defines: NT, RT, MW, KW, STAGES, MIN_BLOCKS, IS_BF16, HAS_BIAS,
// ACT, GATED (sparse24_ws.cu says what it is), DT; common.cuh comes first.

#include "sm80.cuh"

// d += A (16 x 32, 2:4, compressed) * B (32 x 8); SEL picks the lanes whose e holds the metadata.
template <int SEL>
__device__ __forceinline__ void mma_sp(float (&d)[4], const uint4 &a, const uint4 &b, u32 e) {
    asm volatile("mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32." DT "." DT ".f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9,%10,%11}, {%0,%1,%2,%3}, %12, %13;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b.x), "r"(b.y), "r"(b.z), "r"(b.w),
                   "r"(e), "n"(SEL));
}

constexpr int kRows = 8 * NT;                                  // rows of x staged
constexpr int kThreads = 32 * MW * KW;
constexpr int kBM = 16 * RT * MW;                              // rows of W a CTA
constexpr int kXBytes = KW * kRows * 128;                      // one step of x: each K slice's 64 columns
constexpr int kStageBytes = kXBytes + MW * KW * RT * 1152;     // then each warp's weight, 1152 bytes a row tile

// y[N, M] = act(x[N, K] @ W^T + bias), W in the device layout (sparse24/layout.py); a CTA per kBM rows of W.
extern "C" __global__ void __launch_bounds__(kThreads, MIN_BLOCKS)
kp_sparse24_sp(const u16 *__restrict__ x, const u32 *__restrict__ vals, const u32 *__restrict__ meta,
               const u16 *__restrict__ bias, u16 *__restrict__ y, int N, int M, int K, int sxn, int syn)
{
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int mw = warp % MW, kw = warp / MW;
    const int g = lane >> 2, t = lane & 3;
    const int ksteps = (K + 63) / 64, tiles = (M + 15) / 16;  // K padded to 64 (sparse24/layout.py)
    // Warp kw's K slice (k_slice_begin): `mine` steps from step0.  The loop runs the longest, the last.
    const int step0 = k_slice_begin(ksteps, kw, KW), mine = k_slice_begin(ksteps, kw + 1, KW) - step0;
    const int steps = (ksteps + KW - 1) / KW;

    // Per row tile and step: 256 words of values, 32 of metadata; a tile's steps follow each other.  Gated, the
    // CTA's first half of tiles comes from W's first half of rows and its second from the same rows of the other.
    constexpr int kRegions = GATED ? 2 : 1, kCtaTiles = MW * RT / kRegions;
    static_assert(MW * RT % kRegions == 0, "a gated CTA has as many tiles from each half of W");
    const int half = tiles / kRegions;  // tiles of each half (all of them, not gated)
    const u32 *vp[RT]; const u32 *ep[RT]; bool tok[RT];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
        const int c = mw * RT + r, in_half = blockIdx.x * kCtaTiles + c % kCtaTiles;
        const int tile = in_half + c / kCtaTiles * half;
        tok[r] = in_half < half;
        long base = (long)(tok[r] ? tile : 0) * ksteps + step0;
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

    // Step `step` of every K slice's x into buffer `buf`: rows of 8 16-byte chunks, chunk c at c ^ (row % 8)
    // so that ldmatrix's eight rows fall in different banks.  Rows past N are zeros, and so are columns past K (a
    // K padded to 64: K % 8 == 0, so a chunk is all in or all out).
    auto copy_x = [&](int buf, int step) {
#pragma unroll
        for (int i = threadIdx.x; i < KW * kRows * 8; i += kThreads) {
            int c = i & 7, row = (i >> 3) % kRows, q = i / (kRows * 8);
            const int q0 = k_slice_begin(ksteps, q, KW), col = (q0 + step) * 64 + c * 8;
            bool ok = step < k_slice_begin(ksteps, q + 1, KW) - q0 && row < N && col < K;
            const u16 *src = ok ? x + (long)row * sxn + col : x;
            cp16(sx + buf * kStageBytes + (q * kRows + row) * 128 + ((c ^ (row & 7)) << 4), src, ok);
        }
    };
    // This warp's fragments of step `step`, each lane's own, into buffer `buf`.
    const u32 wslot = sx + kXBytes + warp * RT * 1152;
    auto copy_w = [&](int buf, int step) {
        bool live = step < mine;
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            u32 d = wslot + buf * kStageBytes + r * 1152;
            cp16(d + lane * 16, vp[r] + (long)step * 256, live && tok[r]);
            cp16(d + 512 + lane * 16, vp[r] + (long)step * 256 + 128, live && tok[r]);
            cp4(d + 1024 + lane * 4, ep[r] + (long)step * 32, live && tok[r]);
        }
    };
    auto issue = [&](int buf, int step) {
        copy_x(buf, step);
        copy_w(buf, step);
        asm volatile("cp.async.commit_group;");
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue(s, s);

    for (int s0 = 0; s0 < steps; s0 += STAGES) {
#pragma unroll
        for (int u = 0; u < STAGES; ++u) {
            const int s = s0 + u;
            cp_wait<STAGES - 2>();  // this thread's copies of step s have landed
            __syncthreads();        // everyone's have, and everyone is done with step s - 1's buffer
            issue((u + STAGES - 1) % STAGES, s + STAGES - 1);
            if (s < mine) {
                const u32 buf = sx + u * kStageBytes + kw * kRows * 128;
                uint4 a[RT][2]; u32 e[RT];  // per row tile: the two halves' A fragments, this lane's metadata word
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    u32 d = wslot + u * kStageBytes + r * 1152;
                    a[r][0] = ldsm4(d + lane * 16);
                    a[r][1] = ldsm4(d + 512 + lane * 16);
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
    float *red = (float *)smem;  // [KW][kBM][kRows + 1]
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                red[(kw * kBM + (mw * RT + r) * 16 + g + 8 * (e >> 1)) * (kRows + 1) + 8 * j + 2 * t + (e & 1)] =
                    acc[r][j][e];
    __syncthreads();
    constexpr int kOut = kBM / kRegions;  // columns of y a CTA; gated, column c pairs local rows c and kOut + c
    const int cols = M / kRegions;
    for (int idx = threadIdx.x; idx < kOut * kRows; idx += kThreads) {
        int ml = idx % kOut, nl = idx / kOut, m = blockIdx.x * kOut + ml;
        if (m >= cols || nl >= N) continue;
        float v[kRegions][8];
#pragma unroll
        for (int h = 0; h < kRegions; ++h) {
            v[h][0] = 0.f;
#pragma unroll
            for (int w = 0; w < KW; ++w) v[h][0] += red[(w * kBM + h * kOut + ml) * (kRows + 1) + nl];
#if HAS_BIAS
            v[h][0] += to_f32(bias[h * cols + m]);
#endif
        }
        y[(long)nl * syn + m] = from_f32(epilogue<kRegions>(v, 0));
    }
}
