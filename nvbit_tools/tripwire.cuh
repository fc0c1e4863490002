// Leto's kernel trip-wire (nvbit_tools/tripwire.py): armed by faultkit's kernel-abort
// mode, it lets the first N blocks of Leto's kernels run (counted over every launch
// since arming) and holds every later block, so the process can be SIGKILLed with a
// kernel genuinely in flight and its output partial. Disarmed kernels get a null
// pointer and pay one uniform branch.
//
// Held blocks poll a host-mapped release flag with a system-scope load (a volatile
// read took seconds to observe on the H200; ld.relaxed.sys, 20 ms: FACTS.md) and give
// up after TW_HOLD_NS, writing nothing, so a trip-wire that is never fired cannot hang
// the GPU forever.
#pragma once

struct LetoTripwire {
  unsigned long long tickets;  // blocks that entered since arming, all launches
  unsigned long long done;     // blocks of the first `after` that finished
  unsigned long long after;    // N: blocks allowed to run
  unsigned int* host;          // host-mapped: [0] N blocks done, [1] release held blocks
};

#define TW_HOLD_NS 30000000000ull

__device__ __forceinline__ unsigned int tw_load_sys(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long tw_now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Every thread of the block calls it; true: this block runs.
__device__ __forceinline__ bool tripwire_enter(LetoTripwire* tw) {
  __shared__ int tw_run;
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    const unsigned long long t = atomicAdd(&tw->tickets, 1ull);
    tw_run = t < tw->after;
    if (!tw_run) {
      const unsigned long long t0 = tw_now_ns();
      while (!tw_load_sys(tw->host + 1) && tw_now_ns() - t0 < TW_HOLD_NS) __nanosleep(1000);
    }
  }
  __syncthreads();
  return tw_run != 0;
}

// Every thread of a running block calls it after its last store.
__device__ __forceinline__ void tripwire_leave(LetoTripwire* tw) {
  __threadfence_system();  // this thread's output is in memory before the host is told
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    if (atomicAdd(&tw->done, 1ull) + 1 == tw->after) {
      __threadfence_system();
      asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(tw->host), "r"(1u) : "memory");
    }
  }
}
