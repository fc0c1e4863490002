// Leto's fused chunk pass (see chunk_pass.py for the contract): one read of a chunk's
// state does the optimizer step and the parity delta.
//
// For every element of the chunk's trainable segments: Adam/AdamW exactly as torch's
// fused kernel computes it (ATen/native/cuda/fused_adam_utils.cuh, adam_math: float
// opmath, the lerps written as fma) — new values stored in place — and the change
// (old XOR new) of the parameter, exp_avg and exp_avg_sq pages multiplied into the
// scratch tier-1 parity: out[r] ^= sum_c M[r][col0 + c] * (old_c ^ new_c).
//
// Layout: unit u holds pages (param, exp_avg, exp_avg_sq) of the same element range,
// consecutive columns of the group. One thread owns 16 bytes (4 floats, 8 GF(2^16)
// symbols) at one offset of every page of the chunk and walks the chunk's units, so its
// parity accumulates in registers and is written once — no atomics, no second pass.
// Two ways to the parity change, chosen by the number of parity rows H:
// * H <= 4 (chunk_pass_rs_h*): the code's structure (leto.erasure.field.rs_generator).
//   The change of the chunk's K columns is C_P^-1 * (sum_k a^((b+r)(col0+k)) * d_k),
//   and the sum is a Horner scheme: t_r <- t_r * a^-(b+r) ^ d_k along the columns,
//   each step a shift and a conditional XOR of two symbols in a 32-bit word (SWAR) —
//   no table, no shared memory in the loop. Once per thread at the end, out ^= M * t
//   with M = C_P^-1 * diag(a^((b+r)(col0+K-1))) (host-built, chunk_pass.py), by
//   gf_matmul.cu's nibble tables.
// * H > 4 (chunk_pass_p*): gf_matmul.cu's multiply of every column by its generator
//   coefficient: 4 nibble tables per coefficient, two output rows per 32-bit word; only
//   the NP row pairs the code has are staged (compact), a stage of a few units at a time,
//   double-buffered.
//
// Segments: sorted, disjoint element ranges [start, end) of the chunk with their
// hyperparameters (an optimizer parameter group's); starts are multiples of 4 (the
// caller checks), so a thread's 4 elements lie in one segment or after its end.
// Elements outside every segment (frozen parameters, padding, a step a GradScaler
// skipped) are not written and change no parity.
//
// Trip-wire (nvbit_tools/tripwire.cuh): as gf_matmul.cu — a held block writes nothing.
// A block that ran has updated its state and its parity columns; the updater's undo
// copy (taken before this kernel, marker UNDO_DONE) reverts either way.
//
// Not covered: amsgrad, maximize, a gradient scale, lr as a tensor, mixed dtypes,
// more than 16 parity rows (the caller falls back to the unfused steps).

#include "gf_horner.cuh"
#include "tripwire.cuh"


struct Seg {
  long long start, end;  // shard-local elements
  float lr, beta1, beta2, weight_decay, eps, step;
  int adamw;  // 1: decoupled weight decay (AdamW), 0: Adam's L2 term
  int pad;
};

// torch's adam_math for one element (opmath float; ADAM_MODE by `adamw`).
__device__ __forceinline__ void adam_element(float& param, float grad, float& exp_avg,
                                             float& exp_avg_sq, const Seg& s, float bc1,
                                             float bc2_sqrt) {
  if (s.weight_decay != 0) {
    if (s.adamw) {
      param -= s.lr * s.weight_decay * param;
    } else {
      grad += param * s.weight_decay;
    }
  }
  exp_avg = fmaf(s.beta1, exp_avg, fmaf(-s.beta1, grad, grad));
  exp_avg_sq = fmaf(s.beta2, exp_avg_sq, fmaf(-s.beta2, grad * grad, grad * grad));
  const float step_size = s.lr / bc1;
  const float denom = (sqrtf(exp_avg_sq) / bc2_sqrt) + s.eps;
  param -= step_size * exp_avg / denom;
}

__device__ __forceinline__ void bias_corrections(const Seg& s, float& bc1, float& bc2_sqrt) {
  bc1 = 1 - powf(s.beta1, s.step);
  const float bc2 = 1 - powf(s.beta2, s.step);
  bc2_sqrt = sqrtf(bc2);
}

// Element-wise only (no parity): what the self-check compares with torch's kernel.
extern "C" __global__ void adam_check(float* p, const float* g, float* m, float* v,
                                      long long n, const Seg* seg) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= n) return;
  const Seg s = *seg;
  float bc1, bc2s;
  bias_corrections(s, bc1, bc2s);
  float a = p[i], b = m[i], c = v[i];
  adam_element(a, g[i], b, c, s, bc1, bc2s);
  p[i] = a;
  m[i] = b;
  v[i] = c;
}

__device__ __forceinline__ uint4 xor4(float4 a, float4 b) {
  return make_uint4(__float_as_uint(a.x) ^ __float_as_uint(b.x),
                    __float_as_uint(a.y) ^ __float_as_uint(b.y),
                    __float_as_uint(a.z) ^ __float_as_uint(b.z),
                    __float_as_uint(a.w) ^ __float_as_uint(b.w));
}

template <int NP>
__device__ __forceinline__ void chunk_pass_body(
    float* __restrict__ p, float* __restrict__ m, float* __restrict__ v,
    const float* __restrict__ g, long long unit_elems, int u_begin, int u_end,
    long long item_lo, long long item_hi, const Seg* __restrict__ segs, int n_seg,
    const unsigned int* __restrict__ tables,
    int table_cols, int col0, const unsigned long long* __restrict__ out_ptrs, int n_rows,
    LetoTripwire* tw) {
  if (tw && !tripwire_enter(tw)) return;
  constexpr int SU = NP >= 8 ? 2 : 4;  // units per table stage (static shared <= 48 KiB)
  __shared__ __align__(16) unsigned int tab[2][3 * SU * 4 * NP * 16];
  // Items (4 elements, 16 bytes) item_lo .. item_hi of every page: the updater runs a
  // chunk in two halves of its pages, a crash point between them.
  const long long item = item_lo + blockIdx.x * (long long)blockDim.x + threadIdx.x;
  const bool active = item < item_hi;
  (void)table_cols;  // one row block: the tables start at column 0 of row block 0

  unsigned int acc[8][NP];
#pragma unroll
  for (int s = 0; s < 8; ++s)
#pragma unroll
    for (int q = 0; q < NP; ++q) acc[s][q] = 0;

  int si = 0;  // this thread's segment: its elements only grow along the units
  int cached = -1;
  Seg s;
  float bc1 = 1, bc2s = 1;

  const int n_units = u_end - u_begin;
  const int n_stages = (n_units + SU - 1) / SU;
  stage<NP>(tab[0], tables, col0, 3 * min(SU, n_units));
  __syncthreads();
  for (int st = 0; st < n_stages; ++st) {
    const int base = st * SU;
    const int here = min(SU, n_units - base);
    if (st + 1 < n_stages)
      stage<NP>(tab[(st + 1) & 1], tables, col0 + 3 * (base + SU),
                3 * min(SU, n_units - base - SU));
    const unsigned int* cur = tab[st & 1];
    if (active) {
      for (int j = 0; j < here; ++j) {
        const long long e = (long long)(u_begin + base + j) * unit_elems + item * 4;
        while (si < n_seg && segs[si].end <= e) ++si;
        if (si >= n_seg || segs[si].start > e) continue;  // nothing of ours to update
        if (si != cached) {
          s = segs[si];
          bias_corrections(s, bc1, bc2s);
          cached = si;
        }
        float4* pp = reinterpret_cast<float4*>(p + e);
        float4* mp = reinterpret_cast<float4*>(m + e);
        float4* vp = reinterpret_cast<float4*>(v + e);
        const float4 p0 = *pp, m0 = *mp, v0 = *vp;
        const float4 gg = *reinterpret_cast<const float4*>(g + e);
        float4 p1 = p0, m1 = m0, v1 = v0;
        const long long left = s.end - e;  // elements of this segment from e on
        adam_element(p1.x, gg.x, m1.x, v1.x, s, bc1, bc2s);
        if (left > 1) adam_element(p1.y, gg.y, m1.y, v1.y, s, bc1, bc2s);
        if (left > 2) adam_element(p1.z, gg.z, m1.z, v1.z, s, bc1, bc2s);
        if (left > 3) adam_element(p1.w, gg.w, m1.w, v1.w, s, bc1, bc2s);
        *pp = p1;
        *mp = m1;
        *vp = v1;
        const unsigned int* t = cur + j * 3 * (4 * NP * 16);
        gf_accumulate<NP>(acc, xor4(p0, p1), t);
        gf_accumulate<NP>(acc, xor4(m0, m1), t + 4 * NP * 16);
        gf_accumulate<NP>(acc, xor4(v0, v1), t + 2 * 4 * NP * 16);
      }
    }
    __syncthreads();
  }
  if (active) {
#pragma unroll
    for (int r = 0; r < 2 * NP; ++r) {
      if (r >= n_rows) break;
      uint4* out = reinterpret_cast<uint4*>(out_ptrs[r]) + item;
      uint4 o = *out;
      unsigned int w[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const unsigned int lo = (acc[2 * k][r >> 1] >> (16 * (r & 1))) & 0xFFFFu;
        const unsigned int hi = (acc[2 * k + 1][r >> 1] >> (16 * (r & 1))) & 0xFFFFu;
        w[k] ^= lo | (hi << 16);
      }
      *out = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
  if (tw) tripwire_leave(tw);
}

// ---- H <= 4: the Horner scheme -------------------------------------------------------

template <int H>
__device__ __forceinline__ void chunk_pass_rs_body(
    float* __restrict__ p, float* __restrict__ m, float* __restrict__ v,
    const float* __restrict__ g, long long unit_elems, int u_begin, int u_end,
    long long item_lo, long long item_hi, const Seg* __restrict__ segs, int n_seg,
    const unsigned int* __restrict__ mtables, const unsigned long long* __restrict__ out_ptrs,
    LetoTripwire* tw) {
  if (tw && !tripwire_enter(tw)) return;
  constexpr int NP = (H + 1) / 2;
  __shared__ __align__(16) unsigned int tab[H * 4 * NP * 16];
  stage<NP>(tab, mtables, 0, H);  // M's H columns; read once, at the end
  __syncthreads();
  const long long item = item_lo + blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (item < item_hi) {
    unsigned int t[H][4];
#pragma unroll
    for (int r = 0; r < H; ++r) t[r][0] = t[r][1] = t[r][2] = t[r][3] = 0;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    int si = 0, cached = -1;
    Seg s;
    float bc1 = 1, bc2s = 1;
    for (int u = u_begin; u < u_end; ++u) {
      const long long e = (long long)u * unit_elems + item * 4;
      while (si < n_seg && segs[si].end <= e) ++si;
      if (si >= n_seg || segs[si].start > e) {  // nothing of ours here: no change, but
        horner_step<H>(t, zero);                // every column is still a Horner step
        horner_step<H>(t, zero);
        horner_step<H>(t, zero);
        continue;
      }
      if (si != cached) {
        s = segs[si];
        bias_corrections(s, bc1, bc2s);
        cached = si;
      }
      float4* pp = reinterpret_cast<float4*>(p + e);
      float4* mp = reinterpret_cast<float4*>(m + e);
      float4* vp = reinterpret_cast<float4*>(v + e);
      const float4 p0 = *pp, m0 = *mp, v0 = *vp;
      const float4 gg = *reinterpret_cast<const float4*>(g + e);
      float4 p1 = p0, m1 = m0, v1 = v0;
      const long long left = s.end - e;
      adam_element(p1.x, gg.x, m1.x, v1.x, s, bc1, bc2s);
      if (left > 1) adam_element(p1.y, gg.y, m1.y, v1.y, s, bc1, bc2s);
      if (left > 2) adam_element(p1.z, gg.z, m1.z, v1.z, s, bc1, bc2s);
      if (left > 3) adam_element(p1.w, gg.w, m1.w, v1.w, s, bc1, bc2s);
      *pp = p1;
      *mp = m1;
      *vp = v1;
      horner_step<H>(t, xor4(p0, p1));  // columns in group order: param, exp_avg,
      horner_step<H>(t, xor4(m0, m1));  // exp_avg_sq of each unit
      horner_step<H>(t, xor4(v0, v1));
    }
    horner_finish<H>(t, tab, out_ptrs, item, true);
  }
  if (tw) tripwire_leave(tw);
}

#define CHUNK_PASS_RS(NAME, H)                                                           \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                \
      float* p, float* m, float* v, const float* g, long long unit_elems, int u_begin,   \
      int u_end, long long item_lo, long long item_hi, const Seg* segs, int n_seg,       \
      const unsigned int* mtables, const unsigned long long* out_ptrs, LetoTripwire* tw) { \
    chunk_pass_rs_body<H>(p, m, v, g, unit_elems, u_begin, u_end, item_lo, item_hi, segs, \
                          n_seg, mtables, out_ptrs, tw);                                  \
  }

CHUNK_PASS_RS(chunk_pass_rs_h1, 1)
CHUNK_PASS_RS(chunk_pass_rs_h2, 2)
CHUNK_PASS_RS(chunk_pass_rs_h3, 3)
CHUNK_PASS_RS(chunk_pass_rs_h4, 4)

// ---- H <= 4, resumable: the pass without an undo copy ---------------------------------
//
// The same arithmetic and Horner scheme, made crash-consistent item by item instead of by
// an undo copy of the whole chunk. A thread walks its units G at a time (a step). Before
// a step's stores it saves what they overwrite — the old parameter, exp_avg and
// exp_avg_sq of the step's units that have values to change (16 bytes each), and its
// Horner sums before the step — in one of two slots (alternating by step: the slot a
// record names is never the one being written), then records the step in its progress
// word, then stores the new values. After its last unit it saves its final sums and
// records "done". Fences order the three. The slots and progress words are small and
// rewritten at the same places every step, and L2 cache policies ask the cache to keep
// them: what of them stays there costs no memory traffic (on an H100 not all did —
// docs/benchmarks.md), where a copy of the chunk cost a read and a write of all of it.
//
// Progress word of an item: (tag << 24) | c, tag naming the update's chunk (the caller
// clears the words before an update's first chunk, so an older chunk's words never match):
//   c odd: c = (k << 10) | (mask << 2) | (slot << 1) | 1 — units before k are updated; the
//          step from unit k (G units) is in flight: the old values of its units in
//          ``mask`` and the sums before unit k are in slot ``slot`` (the units in mask
//          may be half written, the others are untouched);
//   c = 2: every unit updated, the final sums in the "fin" planes.
// Any other word (another tag): nothing of this chunk was written for the item.
//
// Modes: 0 a fresh pass (the words are only written); 1 resume a pass a crash cut short
// (restore the recorded step's units from its slot, redo it with the saved sums; "done"
// items only add their saved sums to the parity); 2 the parity of the state the crash
// left (as 1, but the units not yet updated change nothing): with the scratch parity
// starting as a copy of the authoritative one, it is the parity of the half-updated
// chunk, from which a recovery rebuilds lost pages before resuming. Mode 2 reads no
// segment (n_seg may be 0).
//
// Slot planes (uint4, n_slot each, at the item's place in its launch: item - item_lo): slot
// s at planes s*(3G+H) + 3j + a (unit j of the step; param, exp_avg, exp_avg_sq) and
// s*(3G+H) + 3G + r (sums). A chunk's items run in parts, one launch each, one after the
// other, all on the same slot planes: only the items of one launch are ever in flight, so
// the slots hold only theirs, and the fewer they are, the more of them the L2 cache keeps
// (each launch's slots are rewritten every step). The final sums outlive the launch: the
// planes "fin" (uint4, n_items each, at the item) r.

#ifndef LETO_RF_UNITS
X
#endif

// The order of a thread's stores (slot, then record, then values) as memory sees it: a
// release-acquire fence at the GPU's scope (fence.acq_rel.gpu) — what orders a thread's
// earlier stores before its later ones — not the sequentially consistent one that
// __threadfence() gives (LETO_RF_FENCE=0 builds that, for benchmarks).
#ifndef LETO_RF_FENCE
#define LETO_RF_FENCE 1
#endif
__device__ __forceinline__ void rf_fence() {
#if LETO_RF_FENCE == 0
  __threadfence();
#elif LETO_RF_FENCE == 1
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
#endif  // (2: none, a benchmark's diagnosis only: not crash-consistent)
}

// Cache hints (LETO_RF_HINTS): 0 none; 1 the chunk's state streamed (evict-first loads
// and stores: __ldcs/__stcs); 2 the state evict-first and the slots evict-last by L2
// cache policies (sm_80+), so the slots rewritten every step are what the L2 keeps.
#ifndef LETO_RF_HINTS
#define LETO_RF_HINTS 2  // leto.gpu_kernels.rf_hints() builds it
#endif
__device__ __forceinline__ unsigned long long rf_policy(bool last) {
  unsigned long long p = 0;
#if LETO_RF_HINTS == 2
  if (last)
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  else
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
#endif
  return p;
}
__device__ __forceinline__ float4 rf_load(const float* a, unsigned long long pol) {
#if LETO_RF_HINTS == 1
  return __ldcs(reinterpret_cast<const float4*>(a));
#elif LETO_RF_HINTS == 2
  float4 x;
  asm volatile("ld.global.L2::cache_hint.v4.f32 {%0,%1,%2,%3}, [%4], %5;"
               : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "l"(a), "l"(pol));
  return x;
#else
  return *reinterpret_cast<const float4*>(a);
#endif
}
__device__ __forceinline__ void rf_store(float* a, float4 x, unsigned long long pol) {
#if LETO_RF_HINTS == 1
  __stcs(reinterpret_cast<float4*>(a), x);
#elif LETO_RF_HINTS == 2
  asm volatile("st.global.L2::cache_hint.v4.f32 [%0], {%1,%2,%3,%4}, %5;"
               :: "l"(a), "f"(x.x), "f"(x.y), "f"(x.z), "f"(x.w), "l"(pol) : "memory");
#else
  *reinterpret_cast<float4*>(a) = x;
#endif
}
__device__ __forceinline__ void rf_keep(uint4* a, uint4 x, unsigned long long pol) {
#if LETO_RF_HINTS == 2
  asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1,%2,%3,%4}, %5;"
               :: "l"(a), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w), "l"(pol) : "memory");
#else
  *a = x;
#endif
}

template <int H>
__device__ __forceinline__ void rf_save_sums(uint4* planes, long long n_items, int first,
                                             long long item, const unsigned int (&t)[H][4],
                                             unsigned long long pol = 0) {
#pragma unroll
  for (int r = 0; r < H; ++r)
    rf_keep(planes + (first + r) * n_items + item, make_uint4(t[r][0], t[r][1], t[r][2], t[r][3]),
            pol);
}

template <int H>
__device__ __forceinline__ void rf_load_sums(const uint4* planes, long long n_items, int first,
                                             long long item, unsigned int (&t)[H][4]) {
#pragma unroll
  for (int r = 0; r < H; ++r) {
    const uint4 w = planes[(first + r) * n_items + item];
    t[r][0] = w.x, t[r][1] = w.y, t[r][2] = w.z, t[r][3] = w.w;
  }
}

template <int H, int G>
__device__ __forceinline__ void chunk_pass_rf_body(
    float* __restrict__ p, float* __restrict__ m, float* __restrict__ v,
    const float* __restrict__ g, long long unit_elems, int u_begin, int u_end,
    long long item_lo, long long item_hi, const Seg* __restrict__ segs, int n_seg,
    const unsigned int* __restrict__ mtables, const unsigned long long* __restrict__ out_ptrs,
    LetoTripwire* tw, unsigned long long* __restrict__ progress, uint4* __restrict__ slot_planes,
    uint4* __restrict__ fin, long long n_items, long long n_slot, unsigned long long tag,
    int mode) {
  if (tw && !tripwire_enter(tw)) return;
  constexpr int NP = (H + 1) / 2;
  constexpr int SLOT = 3 * G + H;  // planes per slot
  __shared__ __align__(16) unsigned int tab[H * 4 * NP * 16];
  stage<NP>(tab, mtables, 0, H);
  __syncthreads();
  const long long at = blockIdx.x * (long long)blockDim.x + threadIdx.x;  // in the launch
  const long long item = item_lo + at;
  const int n = u_end - u_begin;
  if (item < item_hi) {
    uint4* const slots = slot_planes + at;  // plane q of this item's slot: slots[q * n_slot]
    unsigned int t[H][4];
#pragma unroll
    for (int r = 0; r < H; ++r) t[r][0] = t[r][1] = t[r][2] = t[r][3] = 0;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    volatile unsigned long long* word = progress + item;
    const unsigned long long mine = tag << 24;
    int k = 0, slot = 0;
    bool done = false;
    if (mode != 0) {
      const unsigned long long w = *word;
      if ((w >> 24) == tag) {
        const int c = (int)(w & 0xFFFFFF);
        if (c == 2) {
          rf_load_sums<H>(fin, n_items, 0, item, t);
          done = true;
        } else if (c & 1) {
          k = c >> 10;
          slot = (c >> 1) & 1;
          const int mask = (c >> 2) & 0xFF;
          const int s0 = slot * SLOT;
#pragma unroll
          for (int j = 0; j < G; ++j) {
            if (!(mask >> j & 1)) continue;
            const long long e = (long long)(u_begin + k + j) * unit_elems + item * 4;
            *reinterpret_cast<uint4*>(p + e) = slots[(s0 + 3 * j + 0) * n_slot];
            *reinterpret_cast<uint4*>(m + e) = slots[(s0 + 3 * j + 1) * n_slot];
            *reinterpret_cast<uint4*>(v + e) = slots[(s0 + 3 * j + 2) * n_slot];
          }
          rf_load_sums<H>(slots, n_slot, s0 + 3 * G, 0, t);
        }
      }
    }
    int si = 0, cached = -1;
    Seg s;
    float bc1 = 1, bc2s = 1;
    const unsigned long long stream = rf_policy(false), keep = rf_policy(true);
    for (k = done ? n : k; k < n; k += G) {
      // The step's units that have values to change here (a segment covers the item).
      int mask = 0;
      int seg_of[G];
#pragma unroll
      for (int j = 0; j < G; ++j) {
        seg_of[j] = -1;
        if (k + j >= n || mode == 2) continue;
        const long long e = (long long)(u_begin + k + j) * unit_elems + item * 4;
        while (si < n_seg && segs[si].end <= e) ++si;
        if (si < n_seg && segs[si].start <= e) {
          seg_of[j] = si;
          mask |= 1 << j;
        }
      }
      if (!mask) {  // nothing of ours to change: every column is still a Horner step
#pragma unroll
        for (int j = 0; j < G; ++j) {
          if (k + j >= n) break;
          horner_step<H>(t, zero);
          horner_step<H>(t, zero);
          horner_step<H>(t, zero);
        }
        continue;
      }
      float4 p0[G], m0[G], v0[G], p1[G], m1[G], v1[G];
      const int s0 = slot * SLOT;
#pragma unroll
      for (int j = 0; j < G; ++j) {
        if (!(mask >> j & 1)) continue;
        const long long e = (long long)(u_begin + k + j) * unit_elems + item * 4;
        p0[j] = rf_load(p + e, stream);
        m0[j] = rf_load(m + e, stream);
        v0[j] = rf_load(v + e, stream);
        const float4 gg = rf_load(g + e, stream);
        rf_keep(slots + (s0 + 3 * j + 0) * n_slot, *reinterpret_cast<const uint4*>(&p0[j]), keep);
        rf_keep(slots + (s0 + 3 * j + 1) * n_slot, *reinterpret_cast<const uint4*>(&m0[j]), keep);
        rf_keep(slots + (s0 + 3 * j + 2) * n_slot, *reinterpret_cast<const uint4*>(&v0[j]), keep);
        if (seg_of[j] != cached) {
          s = segs[seg_of[j]];
          bias_corrections(s, bc1, bc2s);
          cached = seg_of[j];
        }
        p1[j] = p0[j], m1[j] = m0[j], v1[j] = v0[j];
        const long long left = s.end - e;
        adam_element(p1[j].x, gg.x, m1[j].x, v1[j].x, s, bc1, bc2s);
        if (left > 1) adam_element(p1[j].y, gg.y, m1[j].y, v1[j].y, s, bc1, bc2s);
        if (left > 2) adam_element(p1[j].z, gg.z, m1[j].z, v1[j].z, s, bc1, bc2s);
        if (left > 3) adam_element(p1[j].w, gg.w, m1[j].w, v1[j].w, s, bc1, bc2s);
      }
      rf_save_sums<H>(slots, n_slot, s0 + 3 * G, 0, t, keep);
      rf_fence();  // the slot before the record that names it
      *word = mine | (unsigned long long)((k << 10) | (mask << 2) | (slot << 1) | 1);
      rf_fence();  // the record before the values it allows to be half written
#pragma unroll
      for (int j = 0; j < G; ++j) {
        if (k + j >= n) break;
        if (!(mask >> j & 1)) {
          horner_step<H>(t, zero);
          horner_step<H>(t, zero);
          horner_step<H>(t, zero);
          continue;
        }
        const long long e = (long long)(u_begin + k + j) * unit_elems + item * 4;
        rf_store(p + e, p1[j], stream);
        rf_store(m + e, m1[j], stream);
        rf_store(v + e, v1[j], stream);
        horner_step<H>(t, xor4(p0[j], p1[j]));  // columns in group order: param, exp_avg,
        horner_step<H>(t, xor4(m0[j], m1[j]));  // exp_avg_sq of each unit
        horner_step<H>(t, xor4(v0[j], v1[j]));
      }
      slot ^= 1;
    }
    if (mode != 2 && !done) {
      rf_save_sums<H>(fin, n_items, 0, item, t);
      rf_fence();  // the final sums (and the last step's values) before "done"
      *word = mine | 2ull;
    }
    horner_finish<H>(t, tab, out_ptrs, item, true);
  }
  if (tw) tripwire_leave(tw);
}

#define CHUNK_PASS_RF(NAME, H)                                                            \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                 \
      float* p, float* m, float* v, const float* g, long long unit_elems, int u_begin,    \
      int u_end, long long item_lo, long long item_hi, const Seg* segs, int n_seg,        \
      const unsigned int* mtables, const unsigned long long* out_ptrs, LetoTripwire* tw,   \
      unsigned long long* progress, uint4* slots, uint4* fin, long long n_items,          \
      long long n_slot, unsigned long long tag, int mode) {                               \
    chunk_pass_rf_body<H, LETO_RF_UNITS>(p, m, v, g, unit_elems, u_begin, u_end, item_lo, \
                                         item_hi, segs, n_seg, mtables, out_ptrs, tw,     \
                                         progress, slots, fin, n_items, n_slot, tag, mode);\
  }

CHUNK_PASS_RF(chunk_pass_rf_h1, 1)
CHUNK_PASS_RF(chunk_pass_rf_h2, 2)
CHUNK_PASS_RF(chunk_pass_rf_h3, 3)
CHUNK_PASS_RF(chunk_pass_rf_h4, 4)

// ---- H > 4: a table multiply per column -----------------------------------------------

#define CHUNK_PASS(NAME, NP)                                                             \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                \
      float* p, float* m, float* v, const float* g, long long unit_elems, int u_begin,   \
      int u_end, long long item_lo, long long item_hi, const Seg* segs, int n_seg,       \
      const unsigned int* tables, int table_cols, int col0,                              \
      const unsigned long long* out_ptrs, int n_rows, LetoTripwire* tw) {                \
    chunk_pass_body<NP>(p, m, v, g, unit_elems, u_begin, u_end, item_lo, item_hi, segs,  \
                        n_seg, tables, table_cols, col0, out_ptrs, n_rows, tw);          \
  }

CHUNK_PASS(chunk_pass_p1, 1)
CHUNK_PASS(chunk_pass_p2, 2)
CHUNK_PASS(chunk_pass_p4, 4)
CHUNK_PASS(chunk_pass_p8, 8)
