// The trip-wire copy: how Leto's parity copies and the optimizer's results land in
// faultkit's kernel-abort mode (a DMA-engine copy cannot be stopped after N blocks; an
// SM copy kernel can). One block copies TW_TILE bytes. Only used while armed, so it is
// kept simple: byte stores, no vector path.
#include "tripwire.cuh"

#define TW_TILE 4096

extern "C" __global__ void __launch_bounds__(256) tripwire_copy(
    unsigned char* __restrict__ dst, const unsigned char* __restrict__ src, long long n,
    LetoTripwire* tw) {
  if (tw && !tripwire_enter(tw)) return;
  const long long base = (long long)blockIdx.x * TW_TILE;
  const long long end = min(base + TW_TILE, n);
  for (long long i = base + threadIdx.x; i < end; i += blockDim.x) dst[i] = src[i];
  if (tw) tripwire_leave(tw);
}
