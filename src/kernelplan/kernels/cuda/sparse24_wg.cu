// 2:4 linear on Hopper's sparse warpgroup MMA (wgmma.mma_async.sp, sm_90a), for mid and large N.
//
// y[N, M] = act(x[N, K] @ W^T + bias), W in the one device layout of kernels/sparse24_sp.py
// (tiled_values / tiled_meta: 16-row tiles, 64-column steps, each warp step's mma.sp fragments in
// lane order).  A wgmma.sp with A in registers takes, per warp of the warpgroup, exactly the
// mma.sp.m16n8k32 fragment and metadata word of that warp's 16 rows; so warp w of a warpgroup
// reads row tile 4 * (warpgroup's 64-row block) + w of that layout unchanged.
//
// A CTA is WM x KS warpgroups: WM blocks of 64 rows along M, KS slices of K.  Each 64-column step
// of x (BN rows, one 128-byte row each, 128-byte swizzled as wgmma's K-major B operand expects)
// and each warp's A fragments (1152 bytes: 1024 of values, 128 of metadata) go through a ring of
// STAGES shared-memory buffers by cp.async.  The K slices' sums meet in shared memory in slice
// order (deterministic); then bias, activation, and y, written along M.
//
// Compile-time sizes come from the variant's #defines: BN, NI (wgmma N per instruction),
// WM, KS, STAGES, MIN_BLOCKS, IS_BF16, HAS_BIAS, ACT, DT.

#include "wgmma_sp.cuh"

constexpr int kThreads = 128 * WM * KS;
constexpr int kBM = 64 * WM;                       // rows of W a CTA
constexpr int kXBytes = KS * BN * 128;             // one step of x: each K slice's 64 columns
constexpr int kWarpABytes = 1152;
constexpr int kStageBytes = kXBytes + WM * KS * 4 * kWarpABytes;
constexpr int kAcc = NI / 2;                       // f32 accumulators per thread per instruction
constexpr int kInst = BN / NI;                     // instructions per k32 per warpgroup
constexpr int kRedStride = kBM + 4;                // padded: lanes t = 0..3 land in different banks
static_assert(kXBytes % 1024 == 0, "x buffers must keep the 1024-byte alignment of the 128-byte swizzle");
static_assert(kStageBytes % 1024 == 0 || true, "");

__device__ __forceinline__ void cp16(u32 dst, const void *src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(ok ? 16 : 0));
}

__device__ __forceinline__ void cp4(u32 dst, const void *src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(dst), "l"(src), "r"(ok ? 4 : 0));
}

template <int PENDING>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(PENDING)); }

__device__ __forceinline__ uint4 lds4(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

__device__ __forceinline__ u32 lds1(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

// wgmma's shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ unsigned long long b_desc(u32 addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(PENDING) : "memory"); }

// Keeps the accumulators in place across the asynchronous MMAs (the compiler must not move them).
template <int R>
__device__ __forceinline__ void keep(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

extern "C" __global__ void __launch_bounds__(kThreads, MIN_BLOCKS)
kp_sparse24_wg(const u16 *__restrict__ x, const u32 *__restrict__ vals, const u32 *__restrict__ meta,
               const u16 *__restrict__ bias, u16 *__restrict__ y, int N, int M, int K, int sxn, int syn)
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 sbase = ((u32)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wg = warp >> 2, wq = warp & 3;               // warpgroup, warp within it
    const int wm = wg % WM, ks = wg / WM;
    const int ksteps = K / 64, steps = ksteps / KS, tiles = (M + 15) / 16;
    const int n0 = blockIdx.x * BN;
    const int tile = (blockIdx.y * WM + wm) * 4 + wq;      // this warp's 16-row tile of W
    const bool tok = tile < tiles;
    const long wbase = (long)(tok ? tile : 0) * ksteps + ks * steps;
    const u32 *vp = vals + wbase * 256 + lane * 4;
    const u32 *ep = meta + wbase * 32 + lane;

    float acc[kInst][kAcc];
#pragma unroll
    for (int i = 0; i < kInst; ++i)
#pragma unroll
        for (int r = 0; r < kAcc; ++r) acc[i][r] = 0.f;

    const u32 aslot = sbase + kXBytes + warp * kWarpABytes;
    // Step `step` of every K slice's x into buffer `buf`: row r's 16-byte chunk c at c ^ (r % 8), the
    // 128-byte swizzle; rows past N are zeros.
    auto copy_x = [&](int buf, int step) {
        for (int i = threadIdx.x; i < KS * BN * 8; i += kThreads) {
            const int c = i & 7, row = (i >> 3) % BN, q = i / (BN * 8);
            const bool ok = step < steps && n0 + row < N;
            const u16 *src = ok ? x + (long)(n0 + row) * sxn + (long)(q * steps + step) * 64 + c * 8 : x;
            cp16(sbase + buf * kStageBytes + (q * BN + row) * 128 + ((c ^ (row & 7)) << 4), src, ok);
        }
    };
    auto copy_w = [&](int buf, int step) {
        const bool live = step < steps && tok;
        const u32 d = aslot + buf * kStageBytes;
        cp16(d + lane * 16, vp + (long)step * 256, live);
        cp16(d + 512 + lane * 16, vp + (long)step * 256 + 128, live);
        cp4(d + 1024 + lane * 4, ep + (long)step * 32, live);
    };
    auto issue = [&](int buf, int step) {
        copy_x(buf, step);
        copy_w(buf, step);
        asm volatile("cp.async.commit_group;");
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue(s, s);

    for (int s = 0; s < steps; ++s) {
        const int buf = s % STAGES;
        cp_wait<STAGES - 2>();                                       // this thread's copies of step s landed
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // visible to the tensor cores' reads
        __syncthreads();                                             // everyone's; step s - 1 is done by all
        issue((s + STAGES - 1) % STAGES, s + STAGES - 1);
        const u32 a_at = aslot + buf * kStageBytes;
        const uint4 a0 = lds4(a_at + lane * 16), a1 = lds4(a_at + 512 + lane * 16);
        const u32 e = lds1(a_at + 1024 + lane * 4);
        const u32 xb = sbase + buf * kStageBytes + ks * BN * 128;
        wg_fence();
#pragma unroll
        for (int i = 0; i < kInst; ++i) {
            // N block i starts NI rows (NI / 8 groups of 1024 bytes) in; the second k32 64 bytes in.
            WgmmaSp<NI>::template run<0>(acc[i], a0, b_desc(xb + i * NI * 128), e);
            WgmmaSp<NI>::template run<1>(acc[i], a1, b_desc(xb + i * NI * 128 + 64), e);
        }
        wg_commit();
        wg_wait<0>();
#pragma unroll
        for (int i = 0; i < kInst; ++i) keep(acc[i]);
    }

    // The K slices summed in slice order (deterministic); then bias, activation, y along M.
    cp_wait<0>();
    __syncthreads();
    float *red = (float *)(smem_raw + (sbase - (u32)__cvta_generic_to_shared(smem_raw)));  // [KS][BN][kRedStride]
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < kInst; ++i)
#pragma unroll
        for (int r = 0; r < kAcc; ++r) {
            const int ml = wm * 64 + wq * 16 + g + 8 * ((r >> 1) & 1);
            const int nl = i * NI + 8 * (r >> 2) + 2 * t + (r & 1);
            red[(ks * BN + nl) * kRedStride + ml] = acc[i][r];
        }
    __syncthreads();
    const int m0 = blockIdx.y * kBM;
    for (int idx = threadIdx.x; idx < kBM * BN; idx += kThreads) {
        const int ml = idx % kBM, nl = idx / kBM, m = m0 + ml, n = n0 + nl;
        if (m >= M || n >= N) continue;
        float v = 0.f;
#pragma unroll
        for (int q = 0; q < KS; ++q) v += red[(q * BN + nl) * kRedStride + ml];
#if HAS_BIAS
        v += to_f32(bias[m]);
#endif
        y[(long)n * syn + m] = from_f32(activate(v));
    }
}
