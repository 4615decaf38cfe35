// The rate of Hopper's warpgroup MMA, sparse (wgmma.mma_async.sp, m64nNk32) beside dense (m64nNk16), with A in
// registers and B in shared memory as the 2:4 kernels issue them: the ceiling the kernels are measured against.
//
// Every CTA (one per SM) runs STEPS steps of 64 columns of K, each WGS consumer warpgroups x CHAINS independent
// accumulator sets (2 sparse or 4 dense instructions a set: the same dense-equivalent work), committed as one
// group and waited on with one group left in flight, as sparse24_ring.cuh's consume_steps does.  Variants:
//  * RELOAD: each step's A fragments and metadata are read from shared memory first (1152 bytes a warp and
//    set, as the 2:4 kernels' A comes from their ring), then wgmma.fence;
//  * COPY: a producer warpgroup (registers handed to the consumers by setmaxnreg, as in sparse24_ws.cu) whose
//    first thread streams 32 KiB bulk copies from global memory (an L2-resident buffer) into a separate region of
//    shared memory for as long as the consumers run: the write traffic of a TMA ring;
//  * FRESH_B: each step reads B from the next of 4 shared-memory boxes (a ring's stages), not one.
// Thread 0 writes the CTA's cycles (clock64 around the loop) and, with COPY, the bytes copied.
//
// Defines: SPARSE, NI, CHAINS, WGS, STEPS (even), RELOAD, COPY, FRESH_B, IS_BF16, DT, ACT (common.cuh's codes).

#include "common.cuh"
#include "hopper.cuh"
#include "wgmma_sp.cuh"
#include "wgmma_dense.cuh"

constexpr int kBBox = NI * 128;                      // NI rows x 64 columns of 16-bit B, 128-byte swizzle
constexpr int kBoxes = FRESH_B ? 4 : 1;
constexpr int kABytes = 1152;                        // one warp's fragment (1024) and metadata (128) per set
constexpr int kARegion = WGS * 4 * CHAINS * kABytes;
constexpr int kCopyBytes = 32768;
constexpr int kCopyAt = (kBoxes * kBBox + kARegion + 1023) / 1024 * 1024;
constexpr int kBarAt = kCopyAt + (COPY ? kCopyBytes : 0);
constexpr int kThreads = 128 * WGS + (COPY ? 128 : 0);

__device__ __forceinline__ u32 mix(u32 v) {  // operand bits: moderate exponents, varied mantissas
    v ^= v >> 16; v *= 0x7feb352du; v ^= v >> 15;
    return (v & 0x00ff00ffu) | 0x3c003c00u;
}

extern "C" __global__ void __launch_bounds__(kThreads, 1)
kp_wgmma_rate(const uint4 *__restrict__ src, float *__restrict__ sink, long long *__restrict__ out)
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 sraw = (u32)__cvta_generic_to_shared(smem_raw);
    const u32 sbase = (sraw + 1023u) & ~1023u;
    unsigned char *base = smem_raw + (sbase - sraw);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    volatile int *done = (volatile int *)(base + kBarAt + 8);

    for (int i = threadIdx.x; i < (kBoxes * kBBox + kARegion) / 4; i += blockDim.x)
        ((u32 *)base)[i] = mix(i * 2654435761u + blockIdx.x);
    if (threadIdx.x == 0) {
        mbar_init(sbase + kBarAt, 1);
        *done = 0;
        mbar_init_fence();
    }
    __syncthreads();

    if (warp >= 4 * WGS) {
#if COPY
        // The copy warpgroup: one bulk copy in flight at a time, until the consumers are done.
        regs_down<40>();
        long long copied = 0;
        if (threadIdx.x == 128 * WGS) {
            const u32 bar = sbase + kBarAt;
            for (u32 phase = 0; *done == 0; phase ^= 1) {
                mbar_expect_tx(bar, kCopyBytes);
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                             :: "r"(sbase + kCopyAt), "l"(src + (copied / 16) % 65536), "r"(kCopyBytes), "r"(bar)
                             : "memory");
                mbar_wait(bar, phase);
                copied += kCopyBytes;
            }
            out[3 * blockIdx.x + 2] = copied;
        }
#endif
        return;
    }

#if COPY && WGS == 2
    regs_up<232>();
#endif
    const int wq = warp & 3, wg = warp >> 2;
    float acc[CHAINS][NI / 2];
#pragma unroll
    for (int c = 0; c < CHAINS; ++c)
#pragma unroll
        for (int r = 0; r < NI / 2; ++r) acc[c][r] = 0.f;
    // Two register sets, as consume_steps keeps them: a step's fragments are loaded while the previous step's
    // MMAs may still read the other set.
    uint4 a[2][CHAINS][4];
    u32 e[2][CHAINS];
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) {
#pragma unroll
            for (int q = 0; q < 4; ++q)
                a[p][c][q] = make_uint4(mix(threadIdx.x + 4 * q), mix(threadIdx.x + 4 * q + 1),
                                        mix(threadIdx.x + 4 * q + 2), mix(threadIdx.x + 4 * q + 3));
            e[p][c] = 0x44444444u;  // every group of 4 keeps its elements 0 and 1
        }
    const u32 a_at = sbase + kBoxes * kBBox + ((wg * 4 + wq) * CHAINS) * kABytes;

    named_sync(1, 128 * WGS);
    const long long t0 = clock64();
    for (int s0 = 0; s0 < STEPS; s0 += 2) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const u32 b_at = sbase + ((s0 + p) % kBoxes) * kBBox;
#if RELOAD
#pragma unroll
            for (int c = 0; c < CHAINS; ++c) {
                a[p][c][0] = lds4(a_at + c * kABytes + lane * 16);
                a[p][c][1] = lds4(a_at + c * kABytes + 512 + lane * 16);
                e[p][c] = lds1(a_at + c * kABytes + 1024 + lane * 4);
            }
#endif
            wg_fence();
#pragma unroll
            for (int c = 0; c < CHAINS; ++c) {
#if SPARSE
                WgmmaSp<NI>::template run<0>(acc[c], a[p][c][0], b_desc(b_at), e[p][c]);
                WgmmaSp<NI>::template run<1>(acc[c], a[p][c][1], b_desc(b_at + 64), e[p][c]);
#else
#pragma unroll
                for (int q = 0; q < 4; ++q) WgmmaDense<NI>::run(acc[c], a[p][c][q], b_desc(b_at + 32 * q));
#endif
            }
            wg_commit();
            wg_wait<1>();
#pragma unroll
            for (int c = 0; c < CHAINS; ++c) {
                keep_regs(*(uint4(*)[2])a[p ^ 1][c], e[p ^ 1][c]);
                keep_regs(*(uint4(*)[2])(a[p ^ 1][c] + 2), e[p ^ 1][c]);
            }
        }
    }
    wg_wait<0>();
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) keep(acc[c]);
    const long long t1 = clock64();
    named_sync(1, 128 * WGS);
    if (threadIdx.x == 0) {
        *done = 1;
        out[3 * blockIdx.x] = t1 - t0;
        out[3 * blockIdx.x + 1] = STEPS;
    }
    float total = 0.f;
#pragma unroll
    for (int c = 0; c < CHAINS; ++c)
#pragma unroll
        for (int r = 0; r < NI / 2; ++r) total += acc[c][r];
    sink[blockIdx.x * kThreads + threadIdx.x] = total;
}
