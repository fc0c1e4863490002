// Gradient parity in clip_grad_norm_'s pass (see grad_clip.py for the contract).
//
// clip_grad_norm_ multiplies every gradient by its clipping coefficient in place (one read
// and one write of them all, even at a coefficient of 1.0); the updater then encoded the
// gradients' tier-1 parity at the step (a second read). Here one pass does both: each
// thread owns 16 bytes (4 floats) at one offset of every page of a protection group,
// walks the group's pages in the codec's column order, multiplies the elements that lie
// inside a clipped gradient by the coefficient (x * c in float, as torch's _foreach_mul_
// computes it), stores them, and folds the page's bytes as they now are into the code's
// Horner sums (gf_horner.cuh) — what the codec's encode of the group gives, byte for
// byte (the parity is written, not accumulated).
//
// Pages: a pointer per column (the group's pages; a page outside the gradient buffer has
// no segment and is only encoded). Segments: per page, sorted disjoint element ranges
// [lo, hi) relative to the page (page_seg[k] .. page_seg[k + 1] index them), the clipped
// gradients' elements; nothing outside them is written (the alignment gaps, gradients the
// script did not clip).
//
// Trip-wire (nvbit_tools/tripwire.cuh): a held block writes nothing.

#include "gf_horner.cuh"
#include "tripwire.cuh"

struct PageSeg {
  long long lo, hi;
};

template <int H>
__device__ __forceinline__ uint4 scale_item(const unsigned long long* __restrict__ page_ptrs,
                                            const int* __restrict__ page_seg,
                                            const PageSeg* __restrict__ segs, int k,
                                            long long item, float c, uint4 d) {
  const int a = page_seg[k], b = page_seg[k + 1];
  if (a == b) return d;
  const long long e = 4 * item;
  float x[4] = {__uint_as_float(d.x), __uint_as_float(d.y), __uint_as_float(d.z),
                __uint_as_float(d.w)};
  bool any = false;
  for (int s = a; s < b; ++s) {
    const PageSeg g = segs[s];
    if (g.hi <= e) continue;
    if (g.lo >= e + 4) break;
#pragma unroll
    for (int l = 0; l < 4; ++l)
      if (e + l >= g.lo && e + l < g.hi) {
        x[l] = __fmul_rn(x[l], c);
        any = true;
      }
  }
  if (!any) return d;
  const uint4 w = make_uint4(__float_as_uint(x[0]), __float_as_uint(x[1]), __float_as_uint(x[2]),
                             __float_as_uint(x[3]));
  reinterpret_cast<uint4*>(page_ptrs[k])[item] = w;
  return w;
}

template <int H>
__device__ __forceinline__ void grad_clip_body(
    const unsigned long long* __restrict__ page_ptrs, const int* __restrict__ page_seg,
    const PageSeg* __restrict__ segs, int n_pages, long long n_items,
    const float* __restrict__ coef, const unsigned int* __restrict__ mtables,
    const unsigned long long* __restrict__ out_ptrs, LetoTripwire* tw) {
  if (tw && !tripwire_enter(tw)) return;
  constexpr int NP = (H + 1) / 2;
  __shared__ __align__(16) unsigned int tab[H * 4 * NP * 16];
  stage<NP>(tab, mtables, 0, H);
  __syncthreads();
  const long long item = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (item < n_items) {
    const float c = *coef;
    unsigned int t[H][4];
#pragma unroll
    for (int r = 0; r < H; ++r) t[r][0] = t[r][1] = t[r][2] = t[r][3] = 0;
    int k = 0;
    // Four pages' loads in flight before their steps (as the codec's encode).
    for (; k + 4 <= n_pages; k += 4) {
      uint4 d[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) d[j] = reinterpret_cast<const uint4*>(page_ptrs[k + j])[item];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        horner_step<H>(t, scale_item<H>(page_ptrs, page_seg, segs, k + j, item, c, d[j]));
    }
    for (; k < n_pages; ++k) {
      const uint4 d = reinterpret_cast<const uint4*>(page_ptrs[k])[item];
      horner_step<H>(t, scale_item<H>(page_ptrs, page_seg, segs, k, item, c, d));
    }
    horner_finish<H>(t, tab, out_ptrs, item, false);
  }
  if (tw) tripwire_leave(tw);
}

#define GRAD_CLIP(NAME, H)                                                                \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                 \
      const unsigned long long* page_ptrs, const int* page_seg, const PageSeg* segs,      \
      int n_pages, long long n_items, const float* coef, const unsigned int* mtables,     \
      const unsigned long long* out_ptrs, LetoTripwire* tw) {                             \
    grad_clip_body<H>(page_ptrs, page_seg, segs, n_pages, n_items, coef, mtables,         \
                      out_ptrs, tw);                                                      \
  }

GRAD_CLIP(grad_clip_h1, 1)
GRAD_CLIP(grad_clip_h2, 2)
GRAD_CLIP(grad_clip_h3, 3)
GRAD_CLIP(grad_clip_h4, 4)
