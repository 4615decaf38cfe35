// The rate of Hopper's warpgroup MMA, sparse (wgmma.mma_async.sp, m64nNk32) beside dense (m64nNk16), with A in
// registers and B in shared memory as the 2:4 kernels issue them: the ceiling the kernels are measured against.
//
// Every CTA (one per SM) runs STEPS steps of 64 columns of K, each WGS consumer warpgroups x CHAINS independent
// accumulator sets (2 sparse or 4 dense instructions a set: the same dense-equivalent work), committed as one
// group and waited on with one group left in flight, as sparse24_ring.cuh's consume_steps does.  Where the sparse
// A operand (1024 bytes of fragments and 128 of metadata a warp and set a step) comes from, RELOAD:
//  0 registers loaded once (the instruction alone);
//  1 shared memory, read just before the step's wgmma.fence (the 2:4 kernels' consume_steps);
//  2 global memory (an L2-resident buffer), read SETS - 2 steps ahead, after the previous step's commit;
//  3 shared memory through a descriptor (wgmma's A from shared memory), the metadata word read as in 1;
//  4 as 3, the metadata word loaded once;
//  5 shared memory as 1, read SETS - 2 steps ahead, after the previous step's commit.
// And:
//  * COPY: a producer warpgroup (registers handed to the consumers by setmaxnreg, as in sparse24_ws.cu) whose
//    first thread streams 32 KiB bulk copies from global memory (an L2-resident buffer) into a separate region of
//    shared memory for as long as the consumers run: the write traffic of a TMA ring;
//  * FRESH_B: each step reads B from the next of 4 shared-memory boxes (a ring's stages), not one.
// Thread 0 writes the CTA's cycles (clock64 around the loop) and, with COPY, the bytes copied.
//
// Defines: SPARSE, NI, CHAINS, WGS, STEPS (a multiple of SETS), RELOAD, SETS, COPY, FRESH_B, IS_BF16, DT, ACT.

#include "common.cuh"
#include "hopper.cuh"
#include "wgmma_sp.cuh"
#include "wgmma_dense.cuh"

constexpr int kBBox = NI * 128;                      // NI rows x 64 columns of 16-bit B, 128-byte swizzle
constexpr int kBoxes = FRESH_B ? 4 : 1;
constexpr int kABytes = 1152;                        // one warp's fragment (1024) and metadata (128) per set
constexpr int kASS = 8192;                           // RELOAD 3, 4: 64 rows x 128 bytes a warpgroup and set
constexpr int kARegion = RELOAD == 3 || RELOAD == 4 ? WGS * CHAINS * kASS : WGS * 4 * CHAINS * kABytes;
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
    // SETS register sets, as consume_steps keeps two: a step's fragments are loaded while earlier steps' MMAs
    // may still read other sets.
    uint4 a[SETS][CHAINS][2];
    u32 e[SETS][CHAINS];
#pragma unroll
    for (int p = 0; p < SETS; ++p)
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) {
#pragma unroll
            for (int q = 0; q < 2; ++q)
                a[p][c][q] = make_uint4(mix(threadIdx.x + 4 * q), mix(threadIdx.x + 4 * q + 1),
                                        mix(threadIdx.x + 4 * q + 2), mix(threadIdx.x + 4 * q + 3));
            e[p][c] = 0x44444444u;  // every group of 4 keeps its elements 0 and 1
        }
    const int warp_id = (wg * 4 + wq) * CHAINS;
    const u32 a_at = sbase + kBoxes * kBBox + warp_id * kABytes;
    const u32 a_ss = sbase + kBoxes * kBBox + wg * CHAINS * kASS;
    // RELOAD 2: step t's data for set c of this warp, 72 uint4 (1152 bytes) apart, round a 1 MiB buffer.
    auto global_at = [&](int t, int c) { return src + ((t * 8 * WGS * CHAINS + warp_id + c) * 72) % (65536 - 72); };
    auto load = [&](uint4 (&av)[CHAINS][2], u32 (&ev)[CHAINS], int t) {
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) {
#if RELOAD == 2
            const uint4 *g = global_at(t, c);
            av[c][0] = __ldg(g + lane);
            av[c][1] = __ldg(g + 32 + lane);
            ev[c] = __ldg((const u32 *)(g + 64) + lane);
#elif RELOAD == 3
            ev[c] = lds1(a_at + c * kABytes + 1024 + lane * 4);
#elif RELOAD == 1 || RELOAD == 5
            av[c][0] = lds4(a_at + c * kABytes + lane * 16);
            av[c][1] = lds4(a_at + c * kABytes + 512 + lane * 16);
            ev[c] = lds1(a_at + c * kABytes + 1024 + lane * 4);
#endif
        }
    };
#if RELOAD == 2 || RELOAD == 5
#pragma unroll
    for (int t = 0; t < SETS - 2; ++t) load(a[t], e[t], t);
#endif

    named_sync(1, 128 * WGS);
    const long long t0 = clock64();
    for (int s0 = 0; s0 < STEPS; s0 += SETS) {
#pragma unroll
        for (int p = 0; p < SETS; ++p) {
            const int s = s0 + p;
            const u32 b_at = sbase + (s % kBoxes) * kBBox;
#if RELOAD == 1 || RELOAD == 3
            load(a[p], e[p], s);
#endif
            wg_fence();
#pragma unroll
            for (int c = 0; c < CHAINS; ++c) {
#if SPARSE && (RELOAD == 3 || RELOAD == 4)
                const u32 at = a_ss + c * kASS + (s & 1) * 64;
                WgmmaSpSS<NI>::template run<0>(acc[c], b_desc(at), b_desc(b_at), e[p][c]);
                WgmmaSpSS<NI>::template run<1>(acc[c], b_desc(at + 32), b_desc(b_at + 64), e[p][c]);
#elif SPARSE
                WgmmaSp<NI>::template run<0>(acc[c], a[p][c][0], b_desc(b_at), e[p][c]);
                WgmmaSp<NI>::template run<1>(acc[c], a[p][c][1], b_desc(b_at + 64), e[p][c]);
#else
#pragma unroll
                for (int q = 0; q < 4; ++q)
                    WgmmaDense<NI>::run(acc[c], a[p][c][q >> 1], b_desc(b_at + 32 * q));
#endif
            }
            wg_commit();
#if RELOAD == 2 || RELOAD == 5
            // The set step s - 2 read is free (the last wait left only step s - 1 in flight).
            load(a[(p + SETS - 2) % SETS], e[(p + SETS - 2) % SETS], s + SETS - 2);
#endif
            wg_wait<1>();
#pragma unroll
            for (int q = 0; q < SETS; ++q)
                if (q != p)
#pragma unroll
                    for (int c = 0; c < CHAINS; ++c) keep_regs(a[q][c], e[q][c]);
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
