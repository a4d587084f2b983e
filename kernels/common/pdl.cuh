// Programmatic dependent launch (sm_90; a kernel launched with speedcore._launch.LaunchConfig(overlap=True) may
// start before the stream's previous kernel has finished).  Both compile to nothing before sm_90, and are no-ops
// where the launch has no such dependency.
#pragma once

namespace sc {

// Lets the stream's next kernel, if launched so, be scheduled once every CTA of this grid has run this or exited.
__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Waits until the grids this one was allowed to overlap have completed and their writes are visible.
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// The start of a kernel of the decode chain (speedcore._launch.chained): launched as the stream's previous kernel's
// programmatic dependent, it reads and writes nothing before that kernel has finished, and lets the next kernel be
// scheduled at once.  Without a chained launch both halves are no-ops.
__device__ __forceinline__ void chain_after_previous() {
  grid_dependency_wait();
  launch_dependents();
}

}  // namespace sc
