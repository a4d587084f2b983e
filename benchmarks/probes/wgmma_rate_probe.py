"""How fast do bare wgmma streams run on this GPU (not a suite)?  One CTA per SM, two warpgroups, each issuing
m64nNk16 (bf16, fp32 accumulators) back to back on a resident shared-memory tile, GS instructions per commit group and
wgmma.wait_group WAIT after each group, no data movement: the tensor rate w4_wgmma_kernel's consumers could reach
with A from registers (RS, as they issue it: N = 256 at M = 256, GS = 2, WAIT = 1) against A from shared memory (SS,
as cuBLAS issues it), and with deeper or shallower queues.  Prints TFLOP/s per variant (132 SMs).

    PYTHONPATH=. python3 benchmarks/probes/wgmma_rate_probe.py
"""
import os

import cupy as cp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

SRC = r'''
#include "common/wgmma.cuh"
template <int N, int RS, int GS, int WAIT, int WGS>
__global__ void __launch_bounds__(128 * WGS, 1) wgmma_rate(float* out, int iters) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (sc::smem_addr(smem_raw) & 1023u)) & 1023u);
  for (int i = threadIdx.x; i < (32768 + 8192 * WGS) / 16; i += blockDim.x)
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0x3c003c00u, 0u, 0x3c00u, 0u);
  __syncthreads();
  const int wg = threadIdx.x / 128;
  const unsigned long long db = sc::wgmma_desc_k128(smem);                     // B: N rows x 128 bytes, shared
  const unsigned long long da = sc::wgmma_desc_k128(smem + 32768 + 8192 * wg);  // A (SS): 64 rows x 128 bytes
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  const unsigned a[4] = {0x3c003c00u + threadIdx.x, 0u, 0x3c00u, 0u};
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int s = 0; s < 4; s += GS) {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) sc::wgmma_fence_operand(acc[i]);
      sc::wgmma_fence();
#pragma unroll
      for (int j = 0; j < GS; ++j) {
        const unsigned off = (s + j) * 32;
        if constexpr (RS) sc::WgmmaRS<N, __nv_bfloat16, 0>::mma(acc, a, sc::wgmma_desc_advance(db, off));
        else sc::Wgmma<N, __nv_bfloat16, 0>::mma(acc, sc::wgmma_desc_advance(da, off), sc::wgmma_desc_advance(db, off),
                                                 1);
      }
      sc::wgmma_commit();
#pragma unroll
      for (int i = 0; i < N / 2; ++i) sc::wgmma_fence_operand(acc[i]);
      sc::wgmma_wait<WAIT>();
    }
  }
  sc::wgmma_wait<0>();
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) sum += acc[i];
  if (sum == 1234.5f) out[threadIdx.x] = sum;
}
'''

VARIANTS = [  # (label, N, RS, GS, WAIT, WGS)
    ("RS n256 gs2 wait1 (w4_wgmma M=256)", 256, 1, 2, 1, 2),
    ("SS n256 gs2 wait1", 256, 0, 2, 1, 2),
    ("RS n256 gs4 wait1", 256, 1, 4, 1, 2),
    ("RS n256 gs1 wait1", 256, 1, 1, 1, 2),
    ("RS n256 gs2 wait0", 256, 1, 2, 0, 2),
    ("RS n128 gs4 wait1 (M=128 tiles)", 128, 1, 4, 1, 2),
    ("SS n128 gs4 wait1 (cuBLAS-like)", 128, 0, 4, 1, 2),
    ("RS n64 gs4 wait1 (M=64 tiles)", 64, 1, 4, 1, 2),
    ("RS n256 gs2 wait1, 1 warpgroup", 256, 1, 2, 1, 1),
]


def main():
    import cuda.pathfinder as pf

    names = [f"wgmma_rate<{n}, {rs}, {gs}, {w}, {wgs}>" for _, n, rs, gs, w, wgs in VARIANTS]
    opts = ("-arch=sm_90a", "-std=c++17", f"-I{os.path.join(HERE, '..', '..', 'kernels')}",
            f"-I{pf.find_nvidia_header_directory('cudart')}")
    mod = cp.RawModule(code=SRC, options=opts, name_expressions=names)
    sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    out = cp.zeros(512, dtype=cp.float32)
    iters = 4000
    for (label, n, rs, gs, w, wgs), name in zip(VARIANTS, names):
        k = mod.get_function(name)
        smem = 1024 + 32768 + 8192 * wgs
        k.max_dynamic_shared_size_bytes = smem
        args = (out, np.int32(iters))
        k((sms,), (128 * wgs,), args, shared_mem=smem)
        cp.cuda.Device().synchronize()
        s, e = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(5):
            s.record()
            k((sms,), (128 * wgs,), args, shared_mem=smem)
            e.record()
            e.synchronize()
            times.append(cp.cuda.get_elapsed_time(s, e) * 1e-3)
        t = sorted(times)[2]
        flops = sms * wgs * iters * 4 * 2 * 64 * n * 16
        print(f"{label:40s} {flops / t * 1e-12:7.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
