// 2:4 linear on Hopper's sparse warpgroup MMA (wgmma.mma_async.sp, sm_90a), for mid and large N.
//
// y[N, M] = act(x[N, K] @ W^T + bias), W in the one device layout of kernels/sparse24_sp.py
// (sparse24/layout.py: 16-row tiles, 64-column steps, each warp step's mma.sp fragments in
// lane order).  A wgmma.sp with A in registers takes, per warp of the warpgroup, exactly the
// mma.sp.m16n8k32 fragment and metadata word of that warp's 16 rows; so warp w of a warpgroup
// reads row tile 4 * (warpgroup's 64-row block) + w of that layout unchanged.
//
// A CTA is WM x KS warpgroups: WM blocks of 64 rows along M, KS slices of K; a cluster of KC CTAs
// (grid z) splits K further, and its CTAs sum their slices through distributed shared memory, so
// that a wide N tile (W read once) still gives every SM work without a pass through global memory.
// Each 64-column step
// of x (BN rows, one 128-byte row each, 128-byte swizzled as wgmma's K-major B operand expects)
// and each warp's A fragments (1152 bytes: 1024 of values, 128 of metadata) go through a ring of
// STAGES shared-memory buffers by cp.async, SUB steps a buffer, the MMAs of one buffer in flight while
// the next is loaded.  The K slices' sums meet in shared memory in slice
// order (deterministic), then across the cluster in rank order, each CTA summing 1/KC of the N tile;
// then bias, activation, and y, written along M.
//
// Compile-time sizes come from the variant's #defines: BN, NI (wgmma N per instruction),
// WM, KS, KC, SUB (steps a stage), STAGES, MIN_BLOCKS, IS_BF16, HAS_BIAS, ACT, DT.

#include "wgmma_sp.cuh"
#include "hopper.cuh"

constexpr int kThreads = 128 * WM * KS;
constexpr int kBM = 64 * WM;                       // rows of W a CTA
constexpr int kSub = SUB;                          // 64-column steps per pipeline stage
constexpr int kXSub = KS * BN * 128;               // one step of x: each K slice's 64 columns
constexpr int kWarpABytes = 1152;                  // one warp's step of W: 1024 bytes of values, 128 of metadata
constexpr int kASub = WM * KS * 4 * kWarpABytes;
// Each x sub-tile starts on 1024 bytes: the 128-byte swizzle's phase is taken from address bits 7-9.
constexpr int kSubBytes = (kXSub + kASub + 1023) / 1024 * 1024;
constexpr int kStageBytes = kSub * kSubBytes;
constexpr int kAcc = NI / 2;                       // f32 accumulators per thread per instruction
constexpr int kInst = BN / NI;                     // instructions per k32 per warpgroup
constexpr int kRedStride = kBM + 4;                // padded: lanes t = 0..3 land in different banks
constexpr int kSlices = KS * KC;
constexpr int kXChunks = KS * BN * 8;              // 16-byte chunks of x a step
constexpr int kXPer = (kXChunks + kThreads - 1) / kThreads;                   // K slices of one output tile
static_assert(BN % KC == 0, "each CTA of a cluster sums BN / KC rows of the tile");

#if KC > 1
#define KP_CLUSTER __cluster_dims__(1, 1, KC)
#else
#define KP_CLUSTER
#endif

extern "C" __global__ void KP_CLUSTER __launch_bounds__(kThreads, MIN_BLOCKS)
kp_sparse24_wg(const u16 *__restrict__ x, const u32 *__restrict__ vals, const u32 *__restrict__ meta,
               const u16 *__restrict__ bias, u16 *__restrict__ y, int N, int M, int K, int sxn, int syn)
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 sbase = ((u32)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
    const int lane = threadIdx.x & 31, warp = warp_uniform();
    const int wg = warp >> 2, wq = warp & 3;               // warpgroup, warp within it
    const int wm = wg % WM, ks = wg / WM;
    const int ksteps = K / 64, steps = ksteps / kSlices, tiles = (M + 15) / 16;
    const int slice0 = blockIdx.z * KS;                    // this CTA's first K slice; blockIdx.z is its cluster rank
    const int n0 = blockIdx.x * BN;
    const int tile = (blockIdx.y * WM + wm) * 4 + wq;      // this warp's 16-row tile of W
    const bool tok = tile < tiles;
    const long wbase = (long)(tok ? tile : 0) * ksteps + (slice0 + ks) * steps;
    const u32 *vp = vals + wbase * 256 + lane * 4;
    const u32 *ep = meta + wbase * 32 + lane;

    float acc[kInst][kAcc];
#pragma unroll
    for (int i = 0; i < kInst; ++i)
#pragma unroll
        for (int r = 0; r < kAcc; ++r) acc[i][r] = 0.f;

    const u32 aslot = kXSub + warp * kWarpABytes;  // offset of this warp's A in a sub-stage
    // Step `step` of every K slice's x: row r's 16-byte chunk c at c ^ (r % 8), the 128-byte swizzle;
    // rows past N and steps past the last are zeros.  Each thread copies the same chunks of every
    // step, so their places are worked out once: a copy is then an add and a cp.async (the per-copy
    // index arithmetic had the kernel issue-bound, 126M instructions for one 8192^2 x 1024 call).
    const u16 *xsrc[kXPer];
    u32 xdst[kXPer];
    bool xok[kXPer];
#pragma unroll
    for (int j = 0; j < kXPer; ++j) {
        const int i = threadIdx.x + j * kThreads;
        const int c = i & 7, row = (i >> 3) % BN, q = i / (BN * 8);
        xok[j] = i < kXChunks && n0 + row < N;
        xsrc[j] = x + (xok[j] ? (long)(n0 + row) * sxn + (long)(slice0 + q) * steps * 64 + c * 8 : 0);
        xdst[j] = (q * BN + row) * 128 + ((c ^ (row & 7)) << 4);
    }
    auto copy_sub = [&](u32 at, int step) {
        const bool live = step < steps;
#pragma unroll
        for (int j = 0; j < kXPer; ++j)
            if (kXChunks % kThreads == 0 || threadIdx.x + j * kThreads < kXChunks)
                cp16(at + xdst[j], xsrc[j] + (live ? step * 64 : 0), live && xok[j]);
        const u32 d = at + aslot;
        cp16(d + lane * 16, vp + (long)step * 256, live && tok);
        cp16(d + 512 + lane * 16, vp + (long)step * 256 + 128, live && tok);
        cp4(d + 1024 + lane * 4, ep + (long)step * 32, live && tok);
    };
    auto issue = [&](int buf, int stage) {
#pragma unroll
        for (int j = 0; j < kSub; ++j) copy_sub(sbase + buf * kStageBytes + j * kSubBytes, stage * kSub + j);
        asm volatile("cp.async.commit_group;");
    };

    // A ring of STAGES buffers, STAGES - 2 stages ahead: the MMAs of one stage stay in flight while
    // the next is loaded, so the buffer refilled at stage s is the one stage s - 2 read.
    const int stages_n = (steps + kSub - 1) / kSub;
#pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) issue(s, s);

    uint4 a[2][kSub][2];
    u32 e[2][kSub];
    for (int s0 = 0; s0 < stages_n; s0 += 2) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {  // p: which register set (compile-time), so no set is indexed at run time
            const int s = s0 + p;
            if (s < stages_n) {
                const int buf = s % STAGES;
                cp_wait<STAGES - 3>();                                       // this thread's copies of stage s
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // visible to the tensor cores
                __syncthreads();                              // everyone's; every warpgroup's stage s - 2 MMAs done
                issue((s + STAGES - 2) % STAGES, s + STAGES - 2);
#pragma unroll
                for (int j = 0; j < kSub; ++j) {
                    const u32 at = sbase + buf * kStageBytes + j * kSubBytes + aslot;
                    a[p][j][0] = ldsm4(at + lane * 16);
                    a[p][j][1] = ldsm4(at + 512 + lane * 16);
                    e[p][j] = lds1(at + 1024 + lane * 4);
                }
                wg_fence();
#pragma unroll
                for (int j = 0; j < kSub; ++j) {
                    const u32 xb = sbase + buf * kStageBytes + j * kSubBytes + ks * BN * 128;
#pragma unroll
                    for (int i = 0; i < kInst; ++i) {
                        // N block i starts NI rows (NI / 8 groups of 1024 bytes) in; the second k32 64 bytes in.
                        WgmmaSp<NI>::template run<0>(acc[i], a[p][j][0], b_desc(xb + i * NI * 128), e[p][j]);
                        WgmmaSp<NI>::template run<1>(acc[i], a[p][j][1], b_desc(xb + i * NI * 128 + 64), e[p][j]);
                    }
                }
                wg_commit();
                wg_wait<1>();  // stage s - 1's MMAs are done: its register set may be loaded again
                // The other set stays allocated until here, so the compiler cannot reuse its registers
                // while stage s - 1's MMAs might still read them.
#pragma unroll
                for (int j = 0; j < kSub; ++j) keep_regs(a[p ^ 1][j], e[p ^ 1][j]);
            }
        }
    }
    wg_wait<0>();
#pragma unroll
    for (int i = 0; i < kInst; ++i) keep(acc[i]);

    // The K slices summed in slice order (deterministic); then bias, activation, y along M.
    cp_wait<0>();
    __syncthreads();
    float *red = (float *)(smem_raw + (sbase - (u32)__cvta_generic_to_shared(smem_raw)));  // [KS][BN][kRedStride]
    store_acc<NI>(red + ks * BN * kRedStride, acc, wm * 64 + wq * 16, kRedStride, lane);
    __syncthreads();
    const int m0 = blockIdx.y * kBM;
#if KC > 1
    cluster_sync();  // every CTA's sums are in its shared memory
    const u32 red_at = sbase;
    const int rows_here = BN / KC, nl0 = blockIdx.z * rows_here;
    for (int idx = threadIdx.x; idx < kBM * rows_here; idx += kThreads) {
        const int ml = idx % kBM, nl = nl0 + idx / kBM, m = m0 + ml, n = n0 + nl;
        float v = 0.f;
        if (m < M && n < N) {
#pragma unroll
            for (int r = 0; r < KC; ++r)
#pragma unroll
                for (int q = 0; q < KS; ++q) v += ld_peer(red_at + ((q * BN + nl) * kRedStride + ml) * 4, r);
#if HAS_BIAS
            v += to_f32(bias[m]);
#endif
            y[(long)n * syn + m] = from_f32(activate(v));
        }
    }
    cluster_sync();  // no CTA leaves while another reads its shared memory
#else
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
#endif
}
