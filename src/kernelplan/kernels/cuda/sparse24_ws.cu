// 2:4 linear on Hopper's sparse warpgroup MMA, warp-specialized: a producer warp feeds a ring of
// shared-memory stages through the copy engine (TMA), consumer warpgroups run wgmma.mma_async.sp.
//
// y[N, M] = act(x[N, K] @ W^T + bias), W in the one device layout (sparse24/layout.py: 16-row tiles by
// 64-column steps, each step 1024 bytes of values in core-matrix order, then 128 bytes of 4-bit
// metadata words per tile and step, in their own tensor).  wgmma.sp reads the values from the stage as its
// A operand (sparse24_ring.cuh); warp w of a consumer warpgroup gives its 16-row tile's metadata word.
//
// Per 64-column step (one stage of the ring):
//  * x: a BN x 64 box by one tensor-map copy, which writes the 128-byte swizzle wgmma's K-major B
//    descriptor reads, and zero-fills rows past N;
//  * W: one tensor-map copy of the CTA's tiles' values (1024 bytes a tile, as wgmma reads them) and one of their metadata
//    (128 bytes a tile), tiles past M zero-filled.  Two bulk copies per tile instead (33 copies a stage)
//    held every stage to about 1300 cycles whatever its size: the copy engine's per-copy cost
//    (bench/results/sparse24-ws-tiles-h100.json, commit cae3193).
// All land on the stage's "full" mbarrier (transaction bytes); every consumer warpgroup arrives on its "empty"
// mbarrier when the MMAs that read it are done, and only then does the producer refill it.  Nothing
// synchronizes the whole CTA inside the K loop (sparse24_wg.cu's __syncthreads per stage did).
//
// A CTA is one producer warpgroup (one thread issues the copies; setmaxnreg gives its registers to the
// consumers) and WM consumer warpgroups of 64 rows of W each.  A cluster is CM x KC CTAs (grid y, z):
//  * CM CTAs along M share x's tile: each loads BN / CM of its rows and multicasts them to all CM, which
//    divides x's traffic from L2 by CM, and each CTA's consumers release a stage in all CM CTAs;
//  * KC CTAs along K split it; their partial sums meet through distributed shared memory, each CTA
//    writing BN / KC rows of y.
//
// Compile-time sizes come from the variant's #defines: BN (rows of x a CTA), NI (wgmma N per
// instruction), WM, CM, KC, STAGES, CONSUMER_REGS (0: no setmaxnreg), IS_BF16, HAS_BIAS, ACT, GATED, DT.
//
// GATED (1: the gate is W's first half of rows, 2: its second) makes y[N, M / 2] = act(gate) * up, the pair of
// rows c and M / 2 + c (kernelplan.gated_activation's kinds): each CTA loads its tiles from both halves
// (sparse24_ring.cuh), so the pair meets in its partial sums.

#include "wgmma_sp.cuh"
#include "hopper.cuh"
#include "sparse24_ring.cuh"
#include "sparse24_grouped.cuh"
#include "sparse24_epilogue.cuh"

constexpr int kRedStride = kBM + 4;                // f32 partial sums [BN][kBM + 4]: rows 16-byte aligned
constexpr int kRedBytes = BN * kRedStride * 4;
constexpr int kBarOffset = kRingBytes > kRedBytes ? kRingBytes : kRedBytes;  // the mbarriers, past both
constexpr int kXPart = BN / CM;                    // rows of x each CTA of an M group loads for all of them
static_assert(BN % KC == 0, "each CTA of a cluster writes BN / KC rows of y");
static_assert(kXPart % 8 == 0, "each part of x starts on a 1024-byte swizzle phase");

// Where x is KP_BAND_MIN_X bytes or more, the grid's tiles run in bands of KP_BAND M groups (of CM row blocks of W
// each), a band's tiles of x one after another: the CTAs running at once then share a few tiles of x and a few row
// blocks of W, which stay in L2 between them.  In the grid's own order (x's tiles fastest) a wave took every tile of
// x for a few row blocks of W, and where x is larger than L2 (n = 8192 at K = 8192: 134 MB) each wave read all of it
// from DRAM again: bands ran 1.04-1.11x faster at n = 8192 on an H200.  Where x is smaller, the grid's own order
// was as fast or faster (up to 5% at x = 16 MB), so it stays (docs/design/0038).  kernels/sparse24_ws_rule.py's
// band_order is the same map.
#ifndef KP_BAND
#define KP_BAND 8
#endif
#ifndef KP_BAND_MIN_X
#define KP_BAND_MIN_X (24 << 20)
#endif

// This CTA's tile of x and M group: CTA l of the grid in launch order (clusters of CM CTAs along y as one) is the
// (l % width)-th M group and the (l / width)-th tile of x of its band, width M groups wide (the last band may be
// narrower).  A band of one M group is the grid's own order.
__device__ __forceinline__ void band_tile(int N, int K, int &tile_n, int &group) {
    const int tiles_n = (int)gridDim.x, groups = (int)gridDim.y / CM;
    const int bands = 2LL * N * K >= KP_BAND_MIN_X ? KP_BAND : 1;
    const int l = (int)blockIdx.x + tiles_n * ((int)blockIdx.y / CM);
    const int band = l / (bands * tiles_n), rest = l - band * bands * tiles_n;
    const int width = min(bands, groups - band * bands);
    tile_n = rest / width;
    group = band * bands + rest % width;
}

// Without x's multicast (CM = 1) no peer touches this CTA's barriers or ring (the K slices of a cluster meet after
// their K loops, behind a cluster sync of their own), so the CTA's first sync is its own, not the cluster's:
// 3.3-8.4% faster where K is split over a cluster (geometric means by kind of tile, bench/sparse24_feed_probe.py,
// H100; docs/design/0049).  KP_LOCAL_SYNC=0 builds the cluster's sync there, for the A/B.  (0048 also sent the
// ring's first fill before that sync; the sync alone read as fast or faster: 0049.)
#ifndef KP_LOCAL_SYNC
#define KP_LOCAL_SYNC 1
#endif

// KP_WARP_PRODUCER=1 runs the producer's K loop on the whole of warp 0, lane 0 alone issuing the copies, as CUTLASS's
// producers do (elect_one_sync): ptxas then keeps the loop's values in uniform registers, where on one thread it
// moves each copy's operands over (R2UR) every step.  It ran 1.7% faster with K over 2 CTAs before the sync before
// the K loop was the CTA's own (H100, docs/design/0049); since then, and with the pushed sums, the one thread's loop
// ran as fast or faster on both GPUs (up to 3% with K over 4 CTAs on small layers; docs/design/0050).
#ifndef KP_WARP_PRODUCER
#define KP_WARP_PRODUCER 0
#endif

// Where K is split without multicast, each K slice pushes the partial sums of the rows another slice stores into that
// CTA's shared memory, past its barriers (st.async, completing on its "sums" barrier), and each reads its own rows'
// sums locally.  No CTA then reads another's shared memory or waits for another's K loop: the cluster's one sync is
// split, its arrival at the start (the sums barrier is ready) and its wait before the first push.  The cluster's
// sync after the K loops, the loads of the peers' sums and the sync before leaving go: 6.2% (H100) and 2.3% (H200)
// faster with K over 2 CTAs on layers of 16 MB and more, 20% and 7.6% on smaller ones with K over 4 (geometric
// means; docs/design/0050).
// Where the buffer does not fit beside the ring (kernels/sparse24_ws_rule.py's recv_bytes, RECV_BYTES 0), and in the
// KP_PUSH_SUMS=0 build for the A/B, the sums meet as before.
#ifndef KP_PUSH_SUMS
#define KP_PUSH_SUMS 1
#endif
#ifndef RECV_BYTES
#define RECV_BYTES 0
#endif
constexpr int kRowsHere = BN / KC;                 // rows of y each CTA of a K-split cluster stores
constexpr int kRecvBytes = (KC - 1) * kRowsHere * kRedStride * 4;  // the other slices' sums of those rows
constexpr bool kPush = KP_PUSH_SUMS && CM == 1 && KC > 1 && !GROUPED && RECV_BYTES > 0;
static_assert(RECV_BYTES == 0 || RECV_BYTES >= kRecvBytes + 16, "RECV_BYTES: the pushed sums and their barrier");
constexpr int kSumsBar = kBarOffset + 16 * STAGES, kRecvAt = kSumsBar + 16;  // from sbase, past the ring's barriers

// KP_PDL=1 builds an experiment, off (docs/design/0050; measured in 0051), for a launch that lets the next
// kernel start early (FunctionLaunch's pdl): every CTA lets the next kernel start as soon as it has begun, and the
// producer sends the ring's first fill of W (a weight: no kernel before this one writes it) before it waits for the
// kernel before, whose output x is; the consumers wait for it too before they store y.  At n <= 16 a call's fixed
// part is about as long as dense's (3.4-3.7 us on the H100), and the kernel's launch and its first trip to DRAM
// are most of it; a grid of 72-128 CTAs leaves SMs free for the next call's CTAs to start on.  KP_PDL=2 reads
// nothing before the wait: the next kernel's start overlaps this one's end, but not its first trip to DRAM.  Back to
// back, =1 took 0.97x of the time on 16 MB+ layers and 0.82-0.85x on small ones, =2 1.04x (H100); after torch's
// kernels, which never trigger, PDL was slower (0022).
#ifndef KP_PDL
#define KP_PDL 0
#endif
static_assert(!KP_PDL || (!GROUPED && !KP_PROBE), "KP_PDL: the grouped kernel reads its routing before any wait");

// With K whole and no gated pair, each consumer warpgroup rounds its own results to 16 bits, bias and activation
// applied in registers, and stages them for y's stores through stmatrix (sparse24_epilogue.cuh), as
// sparse24_pp.cu does: half the staging's bytes of the f32 sums, a quarter of its store instructions, and one
// 16-byte load a store of y, not two.  Erf's gelu keeps the f32 staging from BN = 192 on: applied to every
// accumulator in registers it spilled (53-78 stores to local memory a thread at 168 registers; tests/
// test_sparse24_ws.py), where the f32 staging applies it to 8 values at a time.  KP_Y16=0 builds the f32 staging
// everywhere, for the A/B.
#ifndef KP_Y16
#define KP_Y16 1
#endif
constexpr bool kY16 = KP_Y16 && KC == 1 && kRegions == 1 && NI % 16 == 0 && !(ACT == ACT_GELU && BN >= 192);

#if CM * KC > 1
#define KP_CLUSTER __cluster_dims__(1, CM, KC)
#else
#define KP_CLUSTER
#endif

extern "C" __global__ void KP_CLUSTER __launch_bounds__(kThreads, 1)
kp_sparse24_ws(const __grid_constant__ TensorMap xmap, const __grid_constant__ TensorMap vmap,
               const __grid_constant__ TensorMap emap, const u16 *__restrict__ bias, u16 *__restrict__ y, int N, int M,
               int K, int syn KP_GROUP_PARAMS KP_SCATTER_PARAMS)
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 sraw = (u32)__cvta_generic_to_shared(smem_raw);
    const u32 sbase = (sraw + 1023u) & ~1023u;
    const u32 full0 = sbase + kBarOffset, empty0 = full0 + 8 * STAGES;
    const int warp = warp_uniform(), lane = threadIdx.x & 31;
    // This CTA's 64-column steps: blockIdx.z is its K slice, its rank along z (k_slice_begin).  A K the layout pads
    // to 64 (sparse24/layout.py) ends in a step whose columns past K x's tensor map reads as zeros.
    const int ksteps = (K + 63) / 64, step0 = k_slice_begin(ksteps, (int)blockIdx.z, KC);
    const int steps = k_slice_begin(ksteps, (int)blockIdx.z + 1, KC) - step0;
#if GROUPED
    // Grouped (sparse24_grouped.cuh): CTA t is the launch's tile t, of a grid of at least as many; the rest leave.
    static_assert(CM * KC == 1, "a grouped launch has no clusters");
    const int tiles_m = (M + kBM - 1) / kBM;
    __shared__ int first[kMaxExperts + 1];
    if (warp == 0) scan_tiles(first, offsets, experts, tiles_m, lane);
    __syncthreads();
    if ((int)blockIdx.x >= first[experts]) return;
    int e = 0;
    const Tile tile = tile_at(blockIdx.x, 0, N, tiles_m, offsets, first, e);
#else
    int tile_n, group;
    band_tile(N, K, tile_n, group);
    const Tile tile{tile_n * BN, group * CM + (int)blockIdx.y % CM, N, 0};
    const int tiles_m = 0;
#endif
#if SCATTER
    const Scatter sc{rows, scale};
#else
    const Scatter sc{nullptr, nullptr};
#endif
    const int n0 = tile.n0;
    const u16 *own = HAS_BIAS ? bias + (long)tile.expert * M : bias;  // grouped: the biases are [E, M]
    (void)own;
    // Cluster ranks run along y then z (x is 1 wide): this CTA's M group is ranks cz * CM ... cz * CM + CM - 1.
    const int cy = blockIdx.y % CM, cz = blockIdx.z;
    (void)cy, (void)cz;  // read by the cluster variants only

    const u32 sums_bar = sbase + kSumsBar;
    if (threadIdx.x == 0) {
        KP_PHASE(0);  // bench/sparse24_phases.py's marks (KP_PROBE 3), else nothing
        ring_init(&xmap, &vmap, &emap, full0, empty0, WM * CM);  // one release per consumer warpgroup of the M group
        if constexpr (kPush) mbar_init(sums_bar, 1);
        mbar_init_fence();
        if constexpr (kPush) mbar_expect_tx(sums_bar, (KC - 1) * kRowsHere * kBM * 4);
    }
    if constexpr (CM > 1 || (KC > 1 && !KP_LOCAL_SYNC && !kPush)) {
        cluster_sync();  // every CTA's barriers are ready before any copy or arrival from a peer
    } else {
        __syncthreads();
        if constexpr (kPush) cluster_arrive_relaxed();  // its sums barrier is ready (waited on before the pushes)
    }
    if constexpr (KP_PDL) griddep_launch_dependents();

    if (warp < 4) {
        // The producer warpgroup: thread 0 runs the ring's loop (KP_WARP_PRODUCER=1: warp 0, lane 0 issuing).
#if CONSUMER_REGS
        regs_down<40>();  // what the producer warp needs; its warpgroup's other registers go to the consumers
#endif
        if (KP_WARP_PRODUCER ? warp == 0 : threadIdx.x == 0) {
            const bool issuer = !KP_WARP_PRODUCER || lane == 0;
            KP_PHASE(1);
            constexpr u32 bytes = kXBytes + kWBytes;  // boxes past N or M count in full (zero-filled)
#if KP_PDL
            const int pre = KP_PDL == 1 ? min(steps, STAGES) : 0;  // steps whose W goes out before the wait
            for (int s = 0; issuer && s < pre; ++s) {
                mbar_expect_tx(full0 + 8 * s, bytes);
                load_w(sbase + s * kStageBytes, &vmap, &emap, step0 + s, w_block(tile, tiles_m), w_half(tile),
                       full0 + 8 * s);
            }
            griddep_wait();  // x is the kernel before's output
#else
            constexpr int pre = 0;
#endif
            for (int s = 0; s < steps; ++s) {
                const int b = ring_stage(s);
                mbar_wait(empty0 + 8 * b, ring_parity(s) ^ 1);
                const u32 full = full0 + 8 * b, at = sbase + b * kStageBytes;
                const int step = step0 + s;
#if KP_PROBE == 2  // sparse24_ring.cuh: the MMAs alone
                (void)at, (void)step, (void)bytes;
                if (issuer) mbar_arrive(full);
#else
                if (issuer) {
                    if (s >= pre) mbar_expect_tx(full, bytes);
#if CM > 1
                    tma_load_2d_multicast(at + cy * kXPart * 128, &xmap, step * 64, n0 + cy * kXPart, full,
                                          (unsigned short)(((1u << CM) - 1) << (cz * CM)));
#else
                    tma_load_2d(at, &xmap, step * 64, n0, full);
#endif
                    if (s >= pre) load_w(at, &vmap, &emap, step, w_block(tile, tiles_m), w_half(tile), full);
                }
#endif
#if KP_PROBE == 3
                if (s == min(steps, STAGES) - 1) {  // the ring's first fill sent: when its first stage lands
                    mbar_wait(full0, 0);
                    KP_PHASE(2);
                }
#endif
            }
        }
    } else {
#if CONSUMER_REGS
        regs_up<CONSUMER_REGS>();
#endif
        const int wm = warp / 4 - 1, wq = warp & 3;
        const int tl = wm * 4 + wq;                             // this warp's tile within the CTA
        float blocks[1][kInst][kAcc];  // one 64-row block of W a warpgroup
        float (&acc)[kInst][kAcc] = blocks[0];
#pragma unroll
        for (int i = 0; i < kInst; ++i)
#pragma unroll
            for (int r = 0; r < kAcc; ++r) acc[i][r] = 0.f;
        consume_steps<false>(blocks, sbase, full0, empty0, 0, steps, tl, lane, wq, cz);

        // Every consumer is past its last MMA before the ring is reused for the partial sums.
        named_sync(1, kConsumers);
        if (threadIdx.x == 128) KP_PHASE(3);
        if constexpr (kY16) {
            float b0[kRegions], b1[kRegions];  // kRegions is 1 here
            bias_rows(own, tile.block * kOut + 64 * wm + 16 * wq + (lane >> 2), M, b0, b1);
            stage_block16(sbase, 64 * wm, n0, tile.n_end, wq, lane, sc,
                          [&](int i, int at, bool hi) { return activate(acc[i][at] + (hi ? b1[0] : b0[0])); });
        } else {
            float *red = (float *)(smem_raw + (sbase - sraw));  // [BN][kRedStride]
            store_acc<NI>(red, acc, wm * 64 + wq * 16, kRedStride, lane);
        }
    }

    if constexpr (CM * KC > 1 && !kPush) cluster_sync();  // every CTA's partial sums are in its shared memory
    else if (warp >= 4) named_sync(1, kConsumers);
    if (threadIdx.x == 128) KP_PHASE(4);
    if (warp >= 4) {
        // y staged in 16 bits (kY16) is copied out.  Else bias, activation and y from the f32 sums, 8 columns of y
        // (16 bytes) a thread, along M: the K slices in rank order.  Gated, column c of y is the pair of rows c
        // (local row c) and H + c (local row kBM / 2 + c).
        const int nl0 = blockIdx.z * kRowsHere, mo = tile.block * kOut;
        if constexpr (kPush) {
            // The other slices' rows, 16 bytes a thread at a time, into their CTAs: slice p's rows go to p, to the
            // slot of this slice among p's others (slots in rank order).
            constexpr int kChunks = kRowsHere * kBM / 4;  // of one slice's rows
            cluster_wait();                                // every peer's sums barrier is ready
            for (int idx = threadIdx.x - 128; idx < (KC - 1) * kChunks; idx += kConsumers) {
                const int q = idx / kChunks, nl = idx % kChunks / (kBM / 4), c = idx % (kBM / 4);
                const int p = q + (q >= cz), slot = cz - (cz > p);
                const float4 v = lds4f(sbase + ((p * kRowsHere + nl) * kRedStride + 4 * c) * 4);
                st_async_peer4(sbase + kRecvAt + ((slot * kRowsHere + nl) * kRedStride + 4 * c) * 4, v, sums_bar,
                               cy + p * CM);
            }
            mbar_wait_cluster(sums_bar, 0);  // the other slices' sums of this CTA's rows are in
        }
        if constexpr (KP_PDL) griddep_wait();  // y may be memory the kernel before still reads
        const int cols = M / kRegions;                     // of y
        if constexpr (kY16) {
            store_rows16(sbase, y, n0, mo, tile.n_end, cols, syn, threadIdx.x - 128, kConsumers, sc);
        } else {
            const bool vec = syn % 8 == 0 && ((unsigned long long)y & 15) == 0;
            for (int idx = threadIdx.x - 128; idx < kRowsHere * (kOut / 8); idx += kConsumers) {
                const int m8 = idx % (kOut / 8), nl = nl0 + idx / (kOut / 8), m = mo + m8 * 8, n = n0 + nl;
                if (m >= cols || n >= tile.n_end) continue;
                float v[kRegions][8];
#pragma unroll
                for (int h = 0; h < kRegions; ++h) {
                    const u32 at = sbase + (nl * kRedStride + h * kOut + m8 * 8) * 4;
#pragma unroll
                    for (int j = 0; j < 8; ++j) v[h][j] = 0.f;
#pragma unroll
                    for (int r = 0; r < KC; ++r) {
#if KC > 1
                        float4 lo, hi;
                        if constexpr (kPush) {  // slice r's sums: this CTA's own, or the slot r pushed them to
                            const int slot = r - (r > cz);
                            const u32 from = r == cz ? at : at + kRecvAt + ((slot * kRowsHere - nl0) * kRedStride) * 4;
                            lo = lds4f(from), hi = lds4f(from + 16);
                        } else {
                            lo = ld_peer4(at, cy + r * CM), hi = ld_peer4(at + 16, cy + r * CM);
                        }
#else
                        const float4 lo = lds4f(at), hi = lds4f(at + 16);
#endif
                        v[h][0] += lo.x; v[h][1] += lo.y; v[h][2] += lo.z; v[h][3] += lo.w;
                        v[h][4] += hi.x; v[h][5] += hi.y; v[h][6] += hi.z; v[h][7] += hi.w;
                    }
#if HAS_BIAS
#pragma unroll
                    for (int j = 0; j < 8; ++j)
                        if (m + j < cols) v[h][j] += to_f32(own[h * cols + m + j]);
#endif
                }
                u16 h[8];
                const float s = row_scale(sc, n, tile.n_end);
#pragma unroll
                for (int j = 0; j < 8; ++j) h[j] = from_f32(epilogue<kRegions>(v, j) * s);
                u16 *out = y + (long)(SCATTER ? sc.rows[n] : n) * syn + m;
                if (vec && m + 8 <= cols) {
                    uint4 packed;
                    packed.x = h[0] | ((u32)h[1] << 16);
                    packed.y = h[2] | ((u32)h[3] << 16);
                    packed.z = h[4] | ((u32)h[5] << 16);
                    packed.w = h[6] | ((u32)h[7] << 16);
                    *(uint4 *)out = packed;
                } else {
#pragma unroll
                    for (int j = 0; j < 8; ++j)
                        if (m + j < cols) out[j] = h[j];
                }
            }
        }
    }
#if CM * KC > 1
    // No CTA leaves while a peer may still read its shared memory or arrive on its barriers (pushed sums: none
    // reads another's, and the pushes a CTA waits for are all in before it stores y).
    if constexpr (!kPush) cluster_sync();
    if (kPush && warp < 4) cluster_wait();  // the producers' half of the split sync (the consumers' waited)
#endif
    if (threadIdx.x == 128) KP_PHASE(5);
}
