// What the warp-specialized wgmma.sp kernels (sparse24_ws.cu, sparse24_sk.cu) share: the sizes of a CTA and of
// its ring of shared-memory stages, and the consumers' K loop over the ring.
//
// Needs wgmma_sp.cuh, hopper.cuh and the variant's #defines BN, NI, WM, CM, STAGES.  The ring's stage b is
// x's BN x 64 box (128-byte swizzle) then the CTA's tiles' values and metadata for one 64-column step; its
// "full" mbarrier is at full0 + 8 b and its "empty" one at empty0 + 8 b.
//
// The values of a stage are wgmma's A operand as it reads it from shared memory (K-major, no swizzle): the device
// layout holds each tile's step as 8 core matrices (k32 u, matrix j along K, h along M: sparse24/layout.py), and
// the copy engine's 5-D box (kernels/sparse24_ws.py, TensorMaps.w) writes them as [u][j][tile][h][128 bytes], so
// that for each k32 the CTA's 64 WM rows are core matrices 128 bytes apart along M, and the two along K are
// kTiles * 256 bytes apart.
#pragma once

// KP_PROBE splits a step's time in two, for bench/sparse24_feed_probe.py only (docs/design/0037): 1, the copies
// alone (the consumers wait for each stage and release it, no MMA); 2, the MMAs alone (the producer arrives on
// each stage's "full" barrier and copies nothing, so the MMAs read whatever the stage holds).  3, for
// bench/sparse24_phases.py only (sparse24_ws.cu; docs/design/0048): the kernel as it ships, which also writes each
// CTA's phase times (%globaltimer) past y's N rows.
#ifndef KP_PROBE
#define KP_PROBE 0
#endif

#if KP_PROBE == 3
// Phase p of this CTA: u64 slot p of 8 a CTA, in CTA order (x fastest), from y's row N on.
__device__ __forceinline__ void phase_mark(u16 *y, int N, int syn, int p) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    const long cta = blockIdx.x + (long)gridDim.x * (blockIdx.y + (long)gridDim.y * blockIdx.z);
    ((unsigned long long *)(y + (long)N * syn))[cta * 8 + p] = t;
}
#define KP_PHASE(p) phase_mark(y, N, syn, p)
#else
#define KP_PHASE(p)
#endif

constexpr int kConsumers = 128 * WM;
constexpr int kThreads = kConsumers + 128;
constexpr int kBM = 64 * WM;                       // rows of W a CTA
constexpr int kTiles = 4 * WM;                     // 16-row tiles of W a CTA
constexpr int kXBytes = BN * 128;                  // one step of x: BN rows of 64 columns
constexpr int kWValues = kTiles * 1024;            // one step of W's values for the CTA's tiles
constexpr int kWBytes = kTiles * 1152;             // ... and their metadata
constexpr u32 kWK32 = kTiles * 512;                // one k32 of the values: its 2 core matrices along K
constexpr u32 kWAlongK = kTiles * 256;             // between those 2
// A gated epilogue (GATED: 1 gate rows first, 2 second; sparse24_ws.cu, sparse24_pp.cu) pairs row r of W's first
// half with row M / 2 + r: a CTA's row block tm is kRegTiles tiles of each half, its first kRegTiles tiles in the
// stage the first half's.  The gated tensor maps (kernels/sparse24_ws.py, TensorMaps.w) have a dimension for the
// half, so that one box still writes the stage as the consumers read it.
constexpr int kRegions = GATED ? 2 : 1;
constexpr int kRegTiles = kTiles / kRegions;       // 16-row tiles of W a CTA takes from each half
static_assert(WM % kRegions == 0, "a gated tile has as many 64-row blocks of W from each half");
// Each stage starts on 1024 bytes: the 128-byte swizzle's phase is taken from address bits 7-9.
constexpr int kStageBytes = (kXBytes + kWBytes + 1023) / 1024 * 1024;
constexpr int kRingBytes = STAGES * kStageBytes;
constexpr int kAcc = NI / 2;                       // f32 accumulators per thread per instruction
constexpr int kInst = BN / NI;                     // instructions per k32 per warpgroup
static_assert(BN <= 256 && BN % 8 == 0, "a tensor-map box has at most 256 rows");

// Thread 0's setup of the ring: the three tensor maps fetched into the descriptor cache while the CTA sets up, so
// the first copy does not wait on them (CUTLASS's producers do the same: cute::prefetch_tma_descriptor), and each
// stage's "full" barrier (the producer's expect_tx, then the bytes) and "empty" one (`releases` arrivals).  The
// caller fences the barriers' initialization (mbar_init_fence) after any barriers of its own.
__device__ __forceinline__ void ring_init(const TensorMap *xmap, const TensorMap *vmap, const TensorMap *emap,
                                          u32 full0, u32 empty0, u32 releases) {
    tma_prefetch_map(xmap);
    tma_prefetch_map(vmap);
    tma_prefetch_map(emap);
    for (int s = 0; s < STAGES; ++s) {
        mbar_init(full0 + 8 * s, 1);
        mbar_init(empty0 + 8 * s, releases);
    }
}

// Ring step g (counted over the CTA's whole life): its stage and the parity of its stage's current phase.
__device__ __forceinline__ int ring_stage(int g) { return g % STAGES; }
__device__ __forceinline__ u32 ring_parity(int g) { return (u32)((g / STAGES) & 1); }

// The copies of one 64-column step of W for the CTA's row block tm into the stage at `at`: its kTiles tiles, or,
// gated, kRegTiles of each half of W's rows (tiles past a half read as zeros).  Gated, `half` is the pair's first
// half: 0, or 2 e for expert e of a grouped launch, whose gated maps hold every expert's two halves in turn.
__device__ __forceinline__ void load_w(u32 at, const TensorMap *vmap, const TensorMap *emap, int step, int tm,
                                       int half, u32 full) {
#if GATED
    tma_load_5d(at + kXBytes, vmap, 0, tm * kRegTiles, half, 0, step, full);       // (256 B, tile, half, k32 x j, step)
    tma_load_4d(at + kXBytes + kWValues, emap, 0, step, tm * kRegTiles, half, full);  // (128 B, step, tile, half)
#else
    (void)half;
    tma_load_5d(at + kXBytes, vmap, 0, tm * kTiles, 0, 0, step, full);
    tma_load_3d(at + kXBytes + kWValues, emap, 0, step, tm * kTiles, full);
#endif
}

// The producer thread's copies of one tile's steps k0 .. k1 - 1 (x's rows from n0, W's row block tm and `half`, as
// load_w takes them) into ring steps g, g + 1, ..., each into its stage once the stage's readers have released it;
// returns the next ring step.
// (sparse24_ws.cu's producer multicasts x across a cluster: its own loop.)
__device__ __forceinline__ int produce_steps(int g, int k0, int k1, int n0, int tm, int half, u32 sbase, u32 full0,
                                             u32 empty0, const TensorMap *xmap, const TensorMap *vmap,
                                             const TensorMap *emap) {
    constexpr u32 bytes = kXBytes + kWBytes;  // boxes past N or M count in full (zero-filled)
    for (int step = k0; step < k1; ++step, ++g) {
        const int b = ring_stage(g);
        mbar_wait(empty0 + 8 * b, ring_parity(g) ^ 1);
        const u32 full = full0 + 8 * b, at = sbase + b * kStageBytes;
#if KP_PROBE == 2
        (void)at, (void)bytes, (void)n0, (void)xmap, (void)step;
        mbar_arrive(full);
#else
        mbar_expect_tx(full, bytes);
        tma_load_2d(at, xmap, step * 64, n0, full);
        load_w(at, vmap, emap, step, tm, half, full);
#endif
    }
    return g;
}

// The warpgroup's MMAs have read the stage at `bar`'s index: warp j of each warpgroup releases it in CTA j of the
// M group (CUTLASS's PipelineTmaAsync does the same); `cz` is the M group's first rank / CM.
__device__ __forceinline__ void release_stage(u32 bar, int lane, int wq, int cz) {
    if (lane == 0 && wq < CM) {
#if CM > 1
        mbar_arrive_cluster(bar, cz * CM + wq);
#else
        (void)cz;
        mbar_arrive(bar);
#endif
    }
}

// acc += this warpgroup's 64-row blocks of W x x's box over `count` ring steps, the g0-th first: BLOCKS blocks
// (BLOCKS m64 instructions a k32), block b being tiles tl / 4 * 4 + 4 b ... + 3 and this warp's metadata that of
// tile tl + 4 b.  wgmma reads A (the values) and B (x) from the stage; only the metadata word passes through
// registers.  Each stage is released once the MMAs that read it are done, the last one before returning where
// RELEASE_LAST (a kernel that runs on past its K loop); without it the kernel's last stage stays taken: releasing
// it there made ptxas serialize the loop's wgmmas (its warning C7515) in sparse24_ws.cu.
template <bool RELEASE_LAST, int BLOCKS = 1>
__device__ __forceinline__ void consume_steps(float (&acc)[BLOCKS][kInst][kAcc], u32 sbase, u32 full0, u32 empty0,
                                              int g0, int count, int tl, int lane, int wq, int cz)
{
    u32 e[2][BLOCKS];
    // The stage and its phase advance by one a step (one division a call, not two a step), and the descriptors are
    // a fixed low word on the stage's address: each consumer warp issues a step's instructions alone on its
    // scheduler, and the shorter chain gave 2-4% (docs/design/0029).
    int b = ring_stage(g0);
    u32 parity = ring_parity(g0), at = sbase + b * kStageBytes;
    int b_prev = b;  // the step before's stage, released once its MMAs are done
    // wgmma descriptors (hopper.cuh, core_desc and b_desc) as a 32-bit low word on top of the stage's address's
    // bits 4-17 (`lo`): the CTA's shared memory is under 2^18 bytes, so that 14-bit field never carries into the
    // fields above it.  (A cluster launch's shared addresses have bits above 17 set: hence the mask.)
    const u32 lo0 = (sbase & 0x3FFFF) >> 4;
    u32 lo = lo0 + b * (kStageBytes >> 4);
    const u32 a_lo = ((kXBytes + (tl / 4) * 1024) >> 4) | ((kWAlongK >> 4) << 16), a_hi = 128 >> 4;
    const u32 b_lo = 1u << 16, b_hi = (1024 >> 4) | (1u << 30);
    for (int s0 = 0; s0 < count; s0 += 2) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {  // p: which register set (compile-time), so no set is indexed at run time
            const int s = s0 + p;
            if (s < count) {
                mbar_wait(full0 + 8 * b, parity);
#if KP_PROBE != 1
#pragma unroll
                for (int j = 0; j < BLOCKS; ++j) e[p][j] = lds1(at + kXBytes + kWValues + (tl + 4 * j) * 128 + lane * 4);
                wg_fence();
#pragma unroll
                for (int j = 0; j < BLOCKS; ++j) {
#pragma unroll
                    for (int i = 0; i < kInst; ++i) {
                        // N block i starts NI rows (NI / 8 groups of 1024 bytes) in; the second k32 64 bytes in.
                        if (NI >= 64 || kInst > 1) {
                            const u32 a0 = lo + a_lo + j * (1024 >> 4), b0 = lo + b_lo + i * NI * (128 >> 4);
                            WgmmaSpSS<NI>::template run<0>(acc[j][i], desc(a0, a_hi), desc(b0, b_hi), e[p][j]);
                            WgmmaSpSS<NI>::template run<1>(acc[j][i], desc(a0 + (kWK32 >> 4), a_hi),
                                                           desc(b0 + (64 >> 4), b_hi), e[p][j]);
                        } else {  // one N block of 16 or 32 rows: from the address, as the form above made ptxas
                                  // serialize these loops' MMAs (docs/design/0029; with more blocks it does not: 0030)
                            const u32 a0 = at + kXBytes + (tl / 4 + j) * 1024;  // the block's 8 core matrices
                            WgmmaSpSS<NI>::template run<0>(acc[j][i], core_desc(a0, kWAlongK, 128),
                                                           b_desc(at + i * NI * 128), e[p][j]);
                            WgmmaSpSS<NI>::template run<1>(acc[j][i], core_desc(a0 + kWK32, kWAlongK, 128),
                                                           b_desc(at + i * NI * 128 + 64), e[p][j]);
                        }
                    }
                }
#else
                (void)e, (void)at, (void)lo, (void)a_lo, (void)a_hi, (void)b_lo, (void)b_hi;
#endif
                wg_commit();
                wg_wait<1>();  // step g - 1's MMAs are done: its stage and its metadata register are free
                // The other set stays allocated until here, so the compiler cannot reuse its registers
                // while step g - 1's MMAs might still read them.
#pragma unroll
                for (int j = 0; j < BLOCKS; ++j) keep_word(e[p ^ 1][j]);
                if (s > 0) release_stage(empty0 + 8 * b_prev, lane, wq, cz);
                b_prev = b;
                if (++b == STAGES) {
                    b = 0, parity ^= 1u, at = sbase, lo = lo0;
                } else {
                    at += kStageBytes, lo += kStageBytes >> 4;
                }
            }
        }
    }
    wg_wait<0>();
#pragma unroll
    for (int j = 0; j < BLOCKS; ++j)
#pragma unroll
        for (int i = 0; i < kInst; ++i) keep(acc[j][i]);
    if (RELEASE_LAST && count > 0) release_stage(empty0 + 8 * b_prev, lane, wq, cz);
}
