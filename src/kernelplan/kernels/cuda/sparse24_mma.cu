// 2:4 linear for N <= 16, every operand straight from global memory into dense MMA registers: the kernel of
// kernels/sparse24_mma.py (cuda_mma), which says how it works.  Each 2:4 group is expanded to dense in registers by
// EXPAND, the PTX string of the Triton kernel's expansion (kernels/sparse24.py, _expand_ptx), one source for both.
// Compile-time sizes come from the variant's #defines: NT, WARPS, STAGES, MIN_BLOCKS, IS_BF16, HAS_BIAS, ACT, DT,
// EXPAND; common.cuh comes first.

__device__ __forceinline__ void expand(u32 pair, u32 word, u32 shift, u32 &lo, u32 &hi) {
    asm(EXPAND : "=r"(lo), "=r"(hi) : "r"(pair), "r"(word), "r"(shift));
}

__device__ __forceinline__ void mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." DT "." DT ".f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The weight is read once: past L1.
__device__ __forceinline__ uint4 ld_weight(const u32 *p, bool ok) {
    uint4 v = make_uint4(0, 0, 0, 0);
    if (ok) asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ u32 ld_code(const u32 *p, bool ok) {
    u32 v = 0;
    if (ok) asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ uint4 ld_x(const u16 *p, bool ok) {
    uint4 v = make_uint4(0, 0, 0, 0);
    if (ok) v = __ldg((const uint4 *)p);
    return v;
}

__device__ __forceinline__ u32 pick(const uint4 &v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

struct Stage {
    uint4 p[2];      // rows g and g + 8: four groups each, as (v0 | v1 << 16)
    u32 c[2];        // their code words
    uint4 x[NT][2];  // row g of each 8-row tile of x: the same four groups' 16 elements
};

// y[N, M] = act(x[N, K] @ W^T + bias), W as tiled_values / tiled_codes; a CTA per 16 rows of W.
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
kp_sparse24_mma(const u16 *__restrict__ x, const u32 *__restrict__ pairs, const u32 *__restrict__ codes,
                const u16 *__restrict__ bias, u16 *__restrict__ y, int N, int M, int K, int sxn, int syn)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int kw = K / WARPS, kbeg = warp * kw, steps = kw / 64;

    // Each warp step of a row tile is one run: 2 x 512 bytes of values, 2 x 64 bytes of codes.
    const long step0 = (long)blockIdx.x * (K / 64) + kbeg / 64;
    const u32 *pp = pairs + step0 * 256 + lane * 4;
    const u32 *cp = codes + step0 * 32 + g * 2 + (t >> 1);
    const u16 *xp[NT]; bool nok[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        int n = 8 * j + g;
        nok[j] = n < N;
        xp[j] = x + (long)(nok[j] ? n : 0) * sxn + kbeg + 16 * t;
    }
    const u32 shift = (t & 1) * 16;  // this lane's four codes in the word

    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;

    // A ring of STAGES steps in registers: step s + STAGES - 1 is loaded while step s is multiplied.
    Stage st[STAGES];
    auto load = [&](int slot, int step) {
        bool live = step < steps;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            st[slot].p[h] = ld_weight(pp + (long)step * 256 + h * 128, live);
            st[slot].c[h] = ld_code(cp + (long)step * 32 + h * 16, live);
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            st[slot].x[j][0] = ld_x(xp[j] + (long)step * 64, live && nok[j]);
            st[slot].x[j][1] = ld_x(xp[j] + (long)step * 64 + 8, live && nok[j]);
        }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) load(s, s);

    for (int s0 = 0; s0 < steps; s0 += STAGES) {
#pragma unroll
        for (int u = 0; u < STAGES; ++u) {
            load((u + STAGES - 1) % STAGES, s0 + u + STAGES - 1);
            const Stage &cur = st[u];  // past the last step: all zeros, adding nothing
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                u32 lo[2], hi[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) expand(pick(cur.p[h], c), cur.c[h], shift + 4 * c, lo[h], hi[h]);
#pragma unroll
                for (int j = 0; j < NT; ++j)
                    mma(acc[j], lo[0], lo[1], hi[0], hi[1],
                        pick(cur.x[j][c >> 1], 2 * (c & 1)), pick(cur.x[j][c >> 1], 2 * (c & 1) + 1));
            }
        }
    }

    // The K slices summed in warp order (deterministic); then bias, activation, y.
    __shared__ float red[WARPS][16][8 * NT + 1];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) red[warp][g + 8 * (e >> 1)][8 * j + 2 * t + (e & 1)] = acc[j][e];
    __syncthreads();
    for (int idx = threadIdx.x; idx < 16 * 8 * NT; idx += WARPS * 32) {
        int ml = idx % 16, nl = idx / 16, m = blockIdx.x * 16 + ml;
        if (m >= M || nl >= N) continue;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) v += red[w][ml][nl];
#if HAS_BIAS
        v += to_f32(bias[m]);
#endif
        y[(long)nl * syn + m] = from_f32(activate(v));
    }
}
