"""Distributed-shared-memory exchange rates (not a suite): the kernel below (written to kernels/_dsmem_probe.cu for the
run, so that it compiles with the project's headers, and removed after), 66 clusters of 2 CTAs (every SM), each CTA
handing half of NV x 16 bytes per thread (256 threads) to its peer and summing what it owns.  Prints, per mode, the
median and p90 over CTAs of the exchange's clock64 cycles, cold (first iteration) and warm, with the probe's own
shared memory and with 227 KB.

    PYTHONPATH=. python3 benchmarks/probes/dsmem_probe.py
"""
import os

import numpy as np
import torch

from speedcore._compile import Kernel, kernels_dir
from speedcore._launch import LaunchConfig, launch, get_kernel

SRC = r'''// Probe (not shipped): how fast two CTAs of a cluster exchange NV x 16 bytes per thread (256 threads) of fp32
// partials, the split-K epilogue's traffic.  Each CTA owns half of the row groups; MODE:
// 0 st.async v4 of the peer's half straight from registers, completing on the peer's mbarrier (today's kernel)
// 1 plain st.shared::cluster v4 of the peer's half, then a cluster barrier (release / acquire)
// 2 every row group to local smem, cluster barrier, then ld.shared::cluster v4 of the own half from the peer
// 3 every row group to local smem, fence.proxy.async, one thread bulk-copies the peer's half (one contiguous piece)
//   into the peer's smem, completing on its mbarrier
// times[cta * 4 + 0..2]: clock64 before the exchange, after it (sum done), globaltimer.
#include "common/tma.cuh"

// 16 bytes into a cluster CTA's shared memory, completing on that CTA's mbarrier (both cluster_map addresses).
__device__ __forceinline__ void st_async_v4(unsigned addr, float a, float b, float c, float d, unsigned bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                   addr),
               "f"(a), "f"(b), "f"(c), "f"(d), "r"(bar)
               : "memory");
}

// Loads j = J .. N - 1 of 16 bytes at a + j * SLOT of a cluster CTA's shared memory, the offsets as immediates.
template <int J, int N, int SLOT> struct PullImm {
  static __device__ __forceinline__ void run(float4* v, unsigned a) {
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4+%5];\n"
                 : "=f"(v[J].x), "=f"(v[J].y), "=f"(v[J].z), "=f"(v[J].w)
                 : "r"(a), "n"(J * SLOT));
    PullImm<J + 1, N, SLOT>::run(v, a);
  }
};
template <int N, int SLOT> struct PullImm<N, N, SLOT> {
  static __device__ __forceinline__ void run(float4*, unsigned) {}
};

template <int MODE, int NV>
__global__ void __launch_bounds__(MODE == 2 || MODE == 6 ? 384 : 256, 1) dsmem_probe(long long* times, float* out, int iters, int active,
                                                                                                 float4* gbuf, int gs) {
  extern __shared__ __align__(1024) unsigned char smem[];
  constexpr int HALF = NV / 2;
  constexpr int SLOT = 256 * 16;
  unsigned long long* bar = reinterpret_cast<unsigned long long*>(smem + (NV + HALF) * SLOT);
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  const unsigned peer = rank ^ 1u;
  const int tid = threadIdx.x;
  float acc[NV * 4];
#pragma unroll
  for (int i = 0; i < NV * 4; ++i) acc[i] = (float)(tid + i + blockIdx.x);
  if (tid == 0) {
    for (int i = 0; i < 32; ++i) sc::mbar_init(&bar[i], 1);
    sc::fence_mbar_init();
  }
  __syncthreads();
  sc::cluster_arrive_relaxed();
  sc::cluster_wait();
  const unsigned base = sc::smem_addr(smem);
  const unsigned rbase = sc::cluster_map(base, peer);
  float total = 0.f;
  long long t0 = 0, t1 = 0;
  for (int it = 0; it < iters; ++it) {
    __syncthreads();
    sc::cluster_arrive_relaxed();
    sc::cluster_wait();
    if (tid == 0 && it == iters - 1) t0 = clock64();
    // row groups [rank HALF, rank HALF + HALF) are this CTA's; the rest go to the peer's slots
    float4 sum[HALF];
    if constexpr (MODE == 0) {
      const unsigned rbar = sc::cluster_map(sc::smem_addr(&bar[it]), peer);
      if (tid == 0) sc::mbar_arrive_expect_tx(&bar[it], HALF * SLOT);
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        if ((j / HALF) != (int)rank)
          st_async_v4(rbase + (j % HALF) * SLOT + tid * 16, acc[4 * j], acc[4 * j + 1], acc[4 * j + 2],
                          acc[4 * j + 3], rbar);
      }
      sc::mbar_wait(&bar[it], 0);
#pragma unroll
      for (int j = 0; j < HALF; ++j) sum[j] = *reinterpret_cast<const float4*>(smem + j * SLOT + tid * 16);
    } else if constexpr (MODE == 1) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        if ((j / HALF) != (int)rank)
          asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(rbase + (j % HALF) * SLOT + tid * 16),
                       "f"(acc[4 * j]), "f"(acc[4 * j + 1]), "f"(acc[4 * j + 2]), "f"(acc[4 * j + 3])
                       : "memory");
      }
      asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
      sc::cluster_wait();
#pragma unroll
      for (int j = 0; j < HALF; ++j) sum[j] = *reinterpret_cast<const float4*>(smem + j * SLOT + tid * 16);
    } else if constexpr (MODE == 2) {
      // (threads from `active` on only take part in the barriers: the w4_wgmma kernel's producer warpgroup)
      if (tid < active) {
#pragma unroll
        for (int j = 0; j < NV; ++j)
          *reinterpret_cast<float4*>(smem + j * SLOT + tid * 16) =
              make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
      }
      asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
      sc::cluster_wait();
#pragma unroll
      for (int j = 0; j < HALF; ++j) {
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (tid < active)
          asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                       : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                       : "r"(rbase + (rank * HALF + j) * SLOT + tid * 16)
                       : "memory");
        sum[j] = v;
      }
    } else if constexpr (MODE == 6) {
      // as 2 (the working threads only), the loads' addresses one base register plus constant offsets: the form the
      // w4_wgmma epilogue's pulls compile to (LD.E.128 [R + 0x1000 j]), where mode 2's get a register pair each
      if (tid < active) {
#pragma unroll
        for (int j = 0; j < NV; ++j)
          *reinterpret_cast<float4*>(smem + j * SLOT + tid * 16) =
              make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
      }
      asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
      sc::cluster_wait();
      if (tid < active) PullImm<0, HALF, SLOT>::run(sum, rbase + rank * HALF * SLOT + tid * 16);
      else
#pragma unroll
        for (int j = 0; j < HALF; ++j) sum[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    } else if constexpr (MODE == 7) {
      // the first gs of the peer's row groups through global memory (L2), the rest through the peer's shared memory
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int jj = j % HALF;
        const float4 v = make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
        if ((j / HALF) != (int)rank && jj < gs) __stcg(&gbuf[(blockIdx.x * HALF + jj) * 256 + tid], v);
        else *reinterpret_cast<float4*>(smem + j * SLOT + tid * 16) = v;
      }
      asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
      sc::cluster_wait();
#pragma unroll
      for (int j = 0; j < HALF; ++j) {
        if (j < gs) {
          sum[j] = __ldcg(&gbuf[((blockIdx.x ^ 1u) * HALF + j) * 256 + tid]);
        } else {
          float4 v;
          asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                       : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                       : "r"(rbase + (rank * HALF + j) * SLOT + tid * 16));
          sum[j] = v;
        }
      }
    } else if constexpr (MODE == 4 || MODE == 5) {
      // every row group to local smem, cluster barrier, then the own half summed over both ranks: the peer's by
      // ld.shared::cluster, the own by ld.shared::cluster of its own window address (4) or plain ld.shared (5)
#pragma unroll
      for (int j = 0; j < NV; ++j)
        *reinterpret_cast<float4*>(smem + j * SLOT + tid * 16) =
            make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
      asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
      sc::cluster_wait();
      const unsigned obase = sc::cluster_map(base, rank);
#pragma unroll
      for (int j = 0; j < HALF; ++j) {
        float4 v, w;
        asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                     : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                     : "r"(rbase + (rank * HALF + j) * SLOT + tid * 16));
        if constexpr (MODE == 4) {
          asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                       : "=f"(w.x), "=f"(w.y), "=f"(w.z), "=f"(w.w)
                       : "r"(obase + (rank * HALF + j) * SLOT + tid * 16));
        } else {
          w = *reinterpret_cast<const float4*>(smem + (rank * HALF + j) * SLOT + tid * 16);
        }
        sum[j] = make_float4(v.x + w.x, v.y + w.y, v.z + w.z, v.w + w.w);
      }
    } else {
      // local layout: [j] slots; the peer's half is one contiguous piece
#pragma unroll
      for (int j = 0; j < NV; ++j)
        *reinterpret_cast<float4*>(smem + (HALF + j) * SLOT + tid * 16) =
            make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
      sc::fence_proxy_async();
      __syncthreads();
      if (tid == 0) {
        sc::mbar_arrive_expect_tx(&bar[it], HALF * SLOT);
        const unsigned src = base + (HALF + peer * HALF) * SLOT;
        const unsigned dst = rbase;  // peer's slots [0, HALF)
        const unsigned rbar = sc::cluster_map(sc::smem_addr(&bar[it]), peer);
        asm volatile(
            "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
            "r"(src), "r"(HALF * SLOT), "r"(rbar)
            : "memory");
      }
      sc::mbar_wait(&bar[it], 0);
#pragma unroll
      for (int j = 0; j < HALF; ++j) sum[j] = *reinterpret_cast<const float4*>(smem + j * SLOT + tid * 16);
    }
    // the sum consumed before the stamp: a load's data arrives after the instruction issues
#pragma unroll
    for (int j = 0; j < HALF; ++j) total += sum[j].x + sum[j].y + sum[j].z + sum[j].w;
    __syncthreads();
    if (tid == 0 && it == iters - 1) t1 = clock64();
  }
  sc::cluster_arrive_relaxed();
  sc::cluster_wait();
  if (tid < 256) out[blockIdx.x * 256 + tid] = total;
  if (tid == 0) {
    times[blockIdx.x * 4 + 0] = t0;
    times[blockIdx.x * 4 + 1] = t1;
    times[blockIdx.x * 4 + 2] = (long long)sc::globaltimer_ns();
  }
}
'''

MODES = {0: "st.async from registers", 1: "st.shared::cluster + barrier", 2: "local + barrier + ld pull",
         3: "local + one bulk copy", 4: "local + barrier + pull own+peer (cluster)",
         5: "local + barrier + pull peer, own ld.shared", 6: "local + barrier + ld pull, base + offsets", 7: "global for some, ld pull the rest"}


def main():
    path = kernels_dir() / "_dsmem_probe.cu"
    path.write_text(SRC)
    try:
        run()
    finally:
        os.remove(path)


def run():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ctas = sms // 2 * 2
    from cupy.cuda import Stream
    cs = Stream.from_external(torch.cuda.current_stream())
    print(f"{'mode':56s} {'KB sent':>8s} {'cold p50':>9s} {'p90':>6s} {'warm p50':>9s} {'p90':>6s}")
    big = torch.empty(64 * 2**20, dtype=torch.float32, device="cuda")
    gbuf = torch.empty(ctas * 16 * 256 * 4, dtype=torch.float32, device="cuda")
    # (mode, NV, gs, threads): the exchange of NV / 2 slots of 4 KB each way; the same exchange with fewer bytes
    # (as packed partials would send); part of it through L2
    runs = [(0, 20, 0, 256), (2, 20, 0, 256), (6, 20, 0, 256), (6, 20, 0, 384), (6, 16, 0, 256), (6, 14, 0, 256),
            (6, 10, 0, 256), (7, 20, 2, 256), (7, 20, 3, 256), (7, 20, 4, 256), (7, 20, 5, 256), (7, 20, 10, 256),
            (7, 16, 3, 256)]
    for mode, nv, gs, threads in runs:
        name = MODES[mode] + (f", {gs} via L2" if mode == 7 else "") + (f", {threads} thr" if threads != 256 else "")
        smem = 227 * 1024
        k = Kernel("_dsmem_probe.cu", f"dsmem_probe<{mode}, {nv}>", hopper=True)
        res = []
        for iters in (1, 8):
            times = torch.zeros(ctas * 4, dtype=torch.int64, device="cuda")
            out = torch.empty(ctas * 256, dtype=torch.float32, device="cuda")
            cfg = LaunchConfig((ctas,), (threads,), smem, cluster=2)
            big.fill_(1.0)
            torch.cuda._sleep(200_000)
            launch(k, cfg, (times.data_ptr(), out.data_ptr(), np.int32(iters), np.int32(256), gbuf.data_ptr(),
                            np.int32(gs)), device=0, stream=cs)
            torch.cuda.synchronize()
            t = times.view(ctas, 4).cpu().numpy()
            d = (t[:, 1] - t[:, 0]).astype(np.float64)
            res.append((np.median(d), np.percentile(d, 90)))
        print(f"{name:56s} {nv // 2 * 4:8d} {res[0][0]:9.0f} {res[0][1]:6.0f} {res[1][0]:9.0f} {res[1][1]:6.0f}"
              f"   (regs {get_kernel(k, 0).num_regs})", flush=True)

if __name__ == "__main__":
    main()
