"""Read-bandwidth ceilings on the GPU (not a suite): how fast can an SM-resident design read B bytes once?

* ring: one producer thread per CTA issues 1-D cp.async.bulk copies of CHUNK bytes into a CTA-wide ring of STAGES
  slots (mbarrier full / empty pairs); NC consumer warps take the slots in turn, read every 16-byte word from shared
  memory (xor-folded, so the reads happen) and free the slot.  One CTA per SM ("persistent"), each a contiguous
  1 / P share of the bytes: the engine the M <= 16 INT4 / INT8 linears and the decode kernel could use.
* ldg: a grid-stride loop of 16-byte ld.global.nc loads, 4 in flight per thread (the streaming kernels' engine).
* torch: x.sum() over the same bytes (bf16), and a device-to-device copy (bytes read + written).
Every run is preceded by an L2 flush; medians of 20 runs.  Sizes: 34 MB (INT4 8192^2), 117 MB (INT4 28672 x 8192),
1 GB (the (64, 4096) decode cache).

    PYTHONPATH=. python3 benchmarks/probes/read_probe.py
"""
import statistics

import cupy as cp
import numpy as np
import torch

SRC = r'''
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void bar_init(unsigned long long* b, unsigned n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_u32(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_wait(unsigned long long* b, unsigned parity) {
  unsigned done = 0;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(smem_u32(b)), "r"(parity) : "memory");
  } while (!done);
}
__device__ __forceinline__ void bar_arrive(unsigned long long* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void bar_expect(unsigned long long* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_u32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, unsigned bytes, unsigned long long* b,
                                         unsigned long long policy) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
               :: "r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(b)), "l"(policy) : "memory");
}

// bytes: a multiple of chunk; CTA c reads chunks [c n / P, (c + 1) n / P).
extern "C" __global__ void __launch_bounds__(32 * 9, 1) ring_read(const unsigned char* __restrict__ src,
    long long nchunks, int chunk, int stages, int nc, unsigned* sink) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned long long* full = reinterpret_cast<unsigned long long*>(smem);
  unsigned long long* empty = full + stages;
  unsigned char* ring = smem + 1024;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long c0 = (long long)blockIdx.x * nchunks / gridDim.x, c1 = (long long)(blockIdx.x + 1) * nchunks / gridDim.x;
  const int n = (int)(c1 - c0);
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) { bar_init(full + s, 1); bar_init(empty + s, 1); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == nc) {
    if (lane == 0) {
      unsigned long long policy;
      asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
      for (int i = 0; i < n; ++i) {
        const int s = i % stages;
        bar_wait(empty + s, ((i / stages) & 1) ^ 1);
        bar_expect(full + s, chunk);
        bulk_g2s(ring + (long long)s * chunk, src + (c0 + i) * (long long)chunk, chunk, full + s, policy);
      }
    }
    return;
  }
  unsigned acc = 0;
  for (int i = warp; i < n; i += nc) {
    const int s = i % stages;
    bar_wait(full + s, (i / stages) & 1);
    const uint4* p = reinterpret_cast<const uint4*>(ring + (long long)s * chunk);
    for (int j = lane; j < chunk / 16; j += 32) { const uint4 v = p[j]; acc ^= v.x ^ v.y ^ v.z ^ v.w; }
    __syncwarp();
    if (lane == 0) bar_arrive(empty + s);
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

extern "C" __global__ void __launch_bounds__(256) ldg_read(const uint4* __restrict__ src, long long n16, unsigned* sink) {
  unsigned acc = 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(src + i + u * stride));
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n16; i += stride) { const uint4 v = src[i]; acc ^= v.x ^ v.y ^ v.z ^ v.w; }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}
'''


def main(sizes_mb, reps, only_first):
    mod = cp.RawModule(code=SRC, options=("-arch=sm_90a", "-std=c++17"))
    ring = mod.get_function("ring_read")
    ldg = mod.get_function("ldg_read")
    sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    buf = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    buf.random_(0, 256)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    sink = cp.zeros(4, dtype=cp.uint32)
    ptr = buf.data_ptr()

    def timed(fn):
        ts = []
        for _ in range(reps):
            flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(100_000)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e) * 1e-3)
        return statistics.median(ts)

    results = []
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    configs = ((4096, 48, 8, 1), (8192, 24, 8, 1), (16384, 12, 6, 1), (32768, 6, 6, 1), (8192, 12, 4, 2),
               (16384, 6, 6, 2), (4096, 12, 4, 4), (8192, 6, 6, 4))  # stages % consumers == 0: a slot's reader is fixed
    for size in (mb << 20 for mb in sizes_mb):
        row = {"MB": size >> 20}
        for chunk, stages, nc, per_sm in configs[:1] if only_first else configs:
            smem = 1024 + chunk * stages
            ring.max_dynamic_shared_size_bytes = smem
            grid = sms * per_sm
            args = (np.uint64(ptr), np.int64(size // chunk), np.int32(chunk), np.int32(stages), np.int32(nc), sink)

            def go():
                with stream:
                    ring((grid,), (32 * (nc + 1),), args, shared_mem=smem)
            t = timed(go)
            row[f"ring {chunk // 1024}K x{stages} nc{nc} {per_sm}/SM"] = size / t * 1e-12
        if only_first:
            print(row, flush=True)
            continue
        for per_sm in (4, 8):
            def go():
                with stream:
                    ldg((sms * per_sm,), (256,), (np.uint64(ptr), np.int64(size // 16), sink))
            row[f"ldg {per_sm}x256/SM"] = size / timed(go) * 1e-12
        t16 = buf[:size].view(torch.bfloat16)
        row["torch sum"] = size / timed(lambda: t16.sum()) * 1e-12
        dst = torch.empty(size, dtype=torch.uint8, device="cuda")
        row["torch copy (r+w)"] = 2 * size / timed(lambda: dst.copy_(buf[:size])) * 1e-12
        dst = None
        results.append(row)
        print(f"--- {size >> 20} MB (TB/s read)", flush=True)
        for k, v in row.items():
            if k != "MB":
                print(f"  {k:28s} {v:6.2f}", flush=True)


if __name__ == "__main__":
    import sys

    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    main([int(a) for a in args] or [34, 117, 1024], 1 if "--one" in sys.argv else 20, "--one" in sys.argv)
