// What the Hopper (sm_90a) 2:4 kernels share: shared-memory loads, wgmma's descriptor and fences, the
// cluster barrier and distributed shared memory, and the mbarrier / bulk-copy (TMA) primitives.
// Needs common.cuh (u32) first.
#pragma once

#include "sm80.cuh"

__device__ __forceinline__ float4 lds4f(u32 addr) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr));
    return v;
}

// This thread's warp, broadcast from lane 0: ptxas then knows it is the same in every lane, so that what is made from
// it (a warpgroup's role and tiles, the wgmma descriptors of its K loop) is computed in uniform registers, where
// HGMMA reads its descriptors.  From threadIdx.x >> 5 the descriptors were built in per-thread registers and moved
// over each step (R2UR: 34 of a 64x128 ping-pong tile's instructions; CUTLASS's canonical_warp_idx_sync does
// the same broadcast).
__device__ __forceinline__ int warp_uniform() { return __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 5), 0); }

// wgmma's shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ unsigned long long b_desc(u32 addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}

// wgmma's shared-memory matrix descriptor, K-major, no swizzle: core matrices of 8 rows x 16 bytes (128 contiguous
// bytes), `lbo` bytes apart along K and `sbo` bytes apart along M (PTX ISA, canonical layout ((8,m),(T,2k)):
// ((1T,SBO),(1,LBO))).  The 2:4 weight's values are read through it (sparse24_ring.cuh).
__device__ __forceinline__ unsigned long long core_desc(u32 addr, u32 lbo, u32 sbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32);
}

// A descriptor from its two words (the kernels' loops build the low word from a stage's address: sparse24_ring.cuh).
__device__ __forceinline__ unsigned long long desc(u32 lo, u32 hi) { return ((unsigned long long)hi << 32) | lo; }

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

__device__ __forceinline__ void keep_regs(uint4 (&a)[2], u32 &e) {
    asm volatile("" : "+r"(a[0].x), "+r"(a[0].y), "+r"(a[0].z), "+r"(a[0].w), "+r"(a[1].x), "+r"(a[1].y),
                 "+r"(a[1].z), "+r"(a[1].w), "+r"(e) :: "memory");
}

__device__ __forceinline__ void keep_word(u32 &e) { asm volatile("" : "+r"(e) :: "memory"); }

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// cluster_sync's two halves, for a sync split around work: the arrival relaxed (what it must publish, barrier
// inits, is fenced by mbar_init_fence), the wait acquiring.
__device__ __forceinline__ void cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}

__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// Programmatic dependent launch (a launch with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION): the next
// kernel in the stream may start once every CTA of this one has called griddep_launch_dependents (or left), and
// griddep_wait returns once the kernel before this one has completed and its writes are visible.  Without the
// attribute both return at once.
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

__device__ __forceinline__ void griddep_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;"); }

// The float at this CTA's shared address `addr` in the shared memory of cluster CTA `rank`.
__device__ __forceinline__ float ld_peer(u32 addr, u32 rank) {
    u32 peer;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(peer) : "r"(addr), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(peer) : "memory");
    return v;
}

// The 4 floats at this CTA's shared address `addr` (16-byte aligned) in the shared memory of cluster CTA `rank`.
__device__ __forceinline__ float4 ld_peer4(u32 addr, u32 rank) {
    u32 peer;
    float4 v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(peer) : "r"(addr), "r"(rank));
    asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(peer) : "memory");
    return v;
}

// ---- mbarriers: a stage's "full" barrier completes when its bytes have landed (transaction count),
// its "empty" barrier when every consumer warp has released it (arrival count).
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

// Makes the initialized barriers visible to the copy engine and the cluster.
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

// Arrives on the barrier at this CTA's shared address `bar` in cluster CTA `rank` (itself included).
__device__ __forceinline__ void mbar_arrive_cluster(u32 bar, u32 rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(bar), "r"(rank));
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" :: "r"(remote) : "memory");
}

// Stores `v` at this CTA's shared address `addr` in cluster CTA `rank`'s shared memory, its 16 bytes completing on
// that CTA's barrier at this CTA's address `bar` (st.async: the data leaves from registers, so nothing of this CTA's
// must outlive the store).
__device__ __forceinline__ void st_async_peer4(u32 addr, float4 v, u32 bar, u32 rank) {
    u32 raddr, rbar;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(raddr) : "r"(addr), "r"(rank));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rbar) : "r"(bar), "r"(rank));
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
                 :: "r"(raddr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(rbar) : "memory");
}

// Waits until the barrier's phase of parity `parity` has completed (a fresh barrier: parity 1 passes at once).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile("{\n.reg .pred done;\nWAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT;\n}" :: "r"(bar), "r"(parity) : "memory");
}

// mbar_wait at the cluster's scope: what other CTAs of the cluster wrote and completed on the barrier is seen.
__device__ __forceinline__ void mbar_wait_cluster(u32 bar, u32 parity) {
    asm volatile("{\n.reg .pred done;\nWAIT:\n"
                 "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT;\n}" :: "r"(bar), "r"(parity) : "memory");
}

// A warpgroup's m64nNk32 accumulators (COUNT instructions of N = WIDTH) into f32 `red[n][m]` (row stride
// `stride`): this warp's 16 rows start at row `m0`.  Lane 4g + t holds rows g, g + 8 and columns 2t, 2t + 1 of
// each 8.  (The parameters are not named NI/kInst: the kernels' sizes are #defines.)
template <int WIDTH, int COUNT, int ACC>
__device__ __forceinline__ void store_acc(float *red, const float (&acc)[COUNT][ACC], int m0, int stride, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < COUNT; ++i)
#pragma unroll
        for (int r = 0; r < ACC; ++r)
            red[(i * WIDTH + 8 * (r >> 2) + 2 * t + (r & 1)) * stride + m0 + g + 8 * ((r >> 1) & 1)] = acc[i][r];
}

// A tensor map (CUtensorMap: 128 opaque bytes, 64-byte aligned), passed by value as a __grid_constant__ parameter.
struct __align__(64) TensorMap {
    unsigned long long opaque[16];
};

// The box of `map` at (inner, outer) element coordinates into shared memory `dst`, completing on `bar`.
// Fetch a kernel parameter's tensor map into the descriptor cache while the CTA sets up, so the first copy does not
// wait on it (CUTLASS's producers do the same: cute::prefetch_tma_descriptor).
__device__ __forceinline__ void tma_prefetch_map(const TensorMap *map) {
    asm volatile("prefetch.tensormap [%0];" :: "l"(map) : "memory");
}

__device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap *map, int inner, int outer, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(dst), "l"(map), "r"(inner), "r"(outer), "r"(bar) : "memory");
}

// The box of a 3-D `map` at (inner, middle, outer) element coordinates into shared memory `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_3d(u32 dst, const TensorMap *map, int inner, int middle, int outer, u32 bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];"
                 :: "r"(dst), "l"(map), "r"(inner), "r"(middle), "r"(outer), "r"(bar) : "memory");
}

// The box of a 4-D `map` at element coordinates (c0 innermost ... c3) into shared memory `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TensorMap *map, int c0, int c1, int c2, int c3, u32 bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];"
                 :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}

// The box of a 5-D `map` at element coordinates (c0 innermost ... c4) into shared memory `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_5d(u32 dst, const TensorMap *map, int c0, int c1, int c2, int c3, int c4,
                                            u32 bar) {
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];"
                 :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar) : "memory");
}

// The same box into shared memory `dst` of every cluster CTA in `mask`, each completing on its own `bar`.
__device__ __forceinline__ void tma_load_2d_multicast(u32 dst, const TensorMap *map, int inner, int outer, u32 bar,
                                                      unsigned short mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3}], [%4], %5;"
                 :: "r"(dst), "l"(map), "r"(inner), "r"(outer), "r"(bar), "h"(mask) : "memory");
}

template <int REGS>
__device__ __forceinline__ void regs_down() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(REGS)); }
template <int REGS>
__device__ __forceinline__ void regs_up() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(REGS)); }

// A barrier of `threads` threads (whole warps; whichever arrive at it) on hardware barrier `id` (0 is __syncthreads').
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}

// Four 8 x 8 matrices of 16-bit values into shared memory, transposed: register q holds this thread's pair of
// matrix q (row lane / 4, columns 2 (lane % 4) and + 1, the lower column in the low half, as an mma accumulator
// holds them), and lane 8 q + i gives the address of 16 bytes that receive column i of matrix q.
__device__ __forceinline__ void stmatrix_t4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
