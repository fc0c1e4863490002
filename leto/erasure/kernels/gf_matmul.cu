// GF(2^16) page arithmetic for Leto's erasure code (see cuda.py for the contract).
//
// out[r][s] (^)= sum_k M[r][col_offset+k] * (in[k][s] ^ in2[k][s])
//
// Multiplication by a fixed coefficient c is GF(2)-linear, so
//   c*d = T0[d & 15] ^ T1[(d >> 4) & 15] ^ T2[(d >> 8) & 15] ^ T3[d >> 12]
// with 4 tables of 16 products. Tables for two output rows are packed into one 32-bit
// word (row 2p in the low half, row 2p+1 in the high half), so one shared-memory load
// serves two rows. Layout per page: [pos 4][pair 8][nibble 16] words = 2 KiB, chosen so
// that one warp-wide load (fixed pos and pair, any nibble) hits 16 distinct banks and
// never conflicts. A block covers 16 output rows; more rows use more blocks in y.
//
// Tables are staged STAGE pages at a time and double-buffered: while a stage is being
// used, the next one is loaded into the other buffer, with one barrier per stage.
//
// Trip-wire (nvbit_tools/tripwire.cuh): with a non-null ``tw`` (faultkit's kernel-abort
// mode) only the first N blocks since arming run; the rest are held until the process
// is killed. Null costs one uniform branch.
//
// gf_horner_h*: the same contract for the code's own generator G = C_P^-1 * C_D with
// H <= 4 rows (leto.erasure.field.rs_generator), by the Horner scheme of its parity
// checks: each thread runs the shift steps along its inputs, then multiplies by the
// host-built M once (gf_horner.cuh) — a few ALU operations a symbol instead of 4 table
// lookups per row pair.
//
// Not covered: aliasing between inputs and outputs (the caller forbids it).

#include "gf_horner.cuh"
#include "tripwire.cuh"

#define ROWS 16
#define PAIRS 8
#define STAGE 8
#define WORDS_PER_PAGE (4 * PAIRS * 16)

__device__ __forceinline__ unsigned int gf_mul(unsigned int a, unsigned int b) {
  unsigned int p = 0;
  for (int i = 0; i < 16; ++i) {
    if (b & 1u) p ^= a;
    b >>= 1;
    a <<= 1;
    if (a & 0x10000u) a ^= 0x1002Du;
  }
  return p;
}

// tables[rb][k][pos][pair][nib] from coeffs[r][k] (r padded to a multiple of 16).
extern "C" __global__ void gf_build_tables(const unsigned short* __restrict__ coeffs,
                                           unsigned int* __restrict__ tables,
                                           int n_cols, int n_rowblocks) {
  long long total = (long long)n_rowblocks * n_cols * WORDS_PER_PAGE;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    int nib = i & 15;
    int pair = (i >> 4) & 7;
    int pos = (i >> 7) & 3;
    long long pk = i >> 9;  // rb * n_cols + k
    int k = pk % n_cols;
    int rb = pk / n_cols;
    unsigned int x = (unsigned int)nib << (4 * pos);
    unsigned int r0 = rb * ROWS + 2 * pair;
    unsigned int lo = gf_mul(coeffs[(long long)r0 * n_cols + k], x);
    unsigned int hi = gf_mul(coeffs[(long long)(r0 + 1) * n_cols + k], x);
    tables[i] = lo | (hi << 16);
  }
}

__device__ __forceinline__ void stage_tables(unsigned int* dst, const unsigned int* src,
                                             int pages) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  int n = pages * WORDS_PER_PAGE / 4;
  for (int i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
}

template <int SYMS>
struct Vec;
template <>
struct Vec<8> {
  uint4 v;
  __device__ __forceinline__ void load(const unsigned char* base, long long idx) {
    v = reinterpret_cast<const uint4*>(base)[idx];
  }
  __device__ __forceinline__ void xor_load(const unsigned char* base, long long idx) {
    uint4 w = reinterpret_cast<const uint4*>(base)[idx];
    v.x ^= w.x; v.y ^= w.y; v.z ^= w.z; v.w ^= w.w;
  }
  __device__ __forceinline__ unsigned int sym(int s) const {
    unsigned int w = s < 2 ? v.x : s < 4 ? v.y : s < 6 ? v.z : v.w;
    return (s & 1) ? (w >> 16) : (w & 0xFFFFu);
  }
  __device__ __forceinline__ void set(int s, unsigned int val) {
    unsigned int* w = s < 2 ? &v.x : s < 4 ? &v.y : s < 6 ? &v.z : &v.w;
    *w = (s & 1) ? ((*w & 0xFFFFu) | (val << 16)) : ((*w & 0xFFFF0000u) | val);
  }
  __device__ __forceinline__ void store(unsigned char* base, long long idx) const {
    reinterpret_cast<uint4*>(base)[idx] = v;
  }
};
template <>
struct Vec<1> {
  unsigned int v;
  __device__ __forceinline__ void load(const unsigned char* base, long long idx) {
    v = reinterpret_cast<const unsigned short*>(base)[idx];
  }
  __device__ __forceinline__ void xor_load(const unsigned char* base, long long idx) {
    v ^= reinterpret_cast<const unsigned short*>(base)[idx];
  }
  __device__ __forceinline__ unsigned int sym(int) const { return v; }
  __device__ __forceinline__ void set(int, unsigned int val) { v = val; }
  __device__ __forceinline__ void store(unsigned char* base, long long idx) const {
    reinterpret_cast<unsigned short*>(base)[idx] = (unsigned short)v;
  }
};

// One thread owns SYMS consecutive symbols (a 16-byte vector for SYMS=8) of every page.
// NP: row pairs computed (a code with H <= 2*NP rows in this block skips the lookups of
// the rows it does not have: the cost of a multiply falls with the number of rows).
// PF: pages loaded ahead of the one being multiplied (1 or 2): more loads in flight per
// thread when the lookups are too few to hide a page's memory latency.
template <int SYMS, int NP, int PF>
__device__ __forceinline__ void matmul_body(const unsigned long long* __restrict__ in_ptrs,
                                            const unsigned long long* __restrict__ in2_ptrs,
                                            const unsigned long long* __restrict__ out_ptrs,
                                            const unsigned int* __restrict__ tables,
                                            int n_inputs, int table_cols, int col_offset,
                                            long long n_items, int n_rows, int accumulate,
                                            LetoTripwire* tw) {
  if (tw && !tripwire_enter(tw)) return;
  __shared__ __align__(16) unsigned int tab[2][STAGE * WORDS_PER_PAGE];
  const int rb = blockIdx.y;
  const unsigned int* T = tables + ((long long)rb * table_cols + col_offset) * WORDS_PER_PAGE;
  const long long item = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  const bool active = item < n_items;

  unsigned int acc[SYMS][NP];
#pragma unroll
  for (int s = 0; s < SYMS; ++s)
#pragma unroll
    for (int p = 0; p < NP; ++p) acc[s][p] = 0;

  // Data for page k+1 is loaded while page k is multiplied, so the long run of
  // shared-memory lookups hides the global-memory latency of the next page.
  Vec<SYMS> cur, nxt, nxt2;
  if (active) {
    cur.load(reinterpret_cast<const unsigned char*>(in_ptrs[0]), item);
    if (in2_ptrs) cur.xor_load(reinterpret_cast<const unsigned char*>(in2_ptrs[0]), item);
    if (PF == 2 && n_inputs > 1) {
      nxt.load(reinterpret_cast<const unsigned char*>(in_ptrs[1]), item);
      if (in2_ptrs) nxt.xor_load(reinterpret_cast<const unsigned char*>(in2_ptrs[1]), item);
    }
  }
  const int n_stages = (n_inputs + STAGE - 1) / STAGE;
  stage_tables(tab[0], T, min(STAGE, n_inputs));
  __syncthreads();
  for (int st = 0; st < n_stages; ++st) {
    const int base = st * STAGE;
    const int here = min(STAGE, n_inputs - base);
    if (st + 1 < n_stages)
      stage_tables(tab[(st + 1) & 1], T + (long long)(base + STAGE) * WORDS_PER_PAGE,
                   min(STAGE, n_inputs - base - STAGE));
    const unsigned int* cur_tab = tab[st & 1];
    if (active) {
#pragma unroll
      for (int j = 0; j < STAGE; ++j) {
        if (j < here) {
          const int k = base + j;
          if (PF == 1 && k + 1 < n_inputs) {
            nxt.load(reinterpret_cast<const unsigned char*>(in_ptrs[k + 1]), item);
            if (in2_ptrs)
              nxt.xor_load(reinterpret_cast<const unsigned char*>(in2_ptrs[k + 1]), item);
          }
          if (PF == 2 && k + 2 < n_inputs) {
            nxt2.load(reinterpret_cast<const unsigned char*>(in_ptrs[k + 2]), item);
            if (in2_ptrs)
              nxt2.xor_load(reinterpret_cast<const unsigned char*>(in2_ptrs[k + 2]), item);
          }
          const unsigned int* t = cur_tab + j * WORDS_PER_PAGE;
#pragma unroll
          for (int s = 0; s < SYMS; ++s) {
            const unsigned int x = cur.sym(s);
#pragma unroll
            for (int pos = 0; pos < 4; ++pos) {
              const unsigned int* tp = t + pos * (PAIRS * 16) + ((x >> (4 * pos)) & 15u);
#pragma unroll
              for (int p = 0; p < NP; ++p) acc[s][p] ^= tp[p * 16];
            }
          }
          cur = nxt;
          if (PF == 2) nxt = nxt2;
        }
      }
    }
    __syncthreads();
  }
  if (active) {
#pragma unroll
    for (int r = 0; r < 2 * NP; ++r) {
      const int row = rb * ROWS + r;
      if (row >= n_rows) break;
      unsigned char* out = reinterpret_cast<unsigned char*>(out_ptrs[row]);
      Vec<SYMS> o;
      if (accumulate) o.load(out, item);
#pragma unroll
      for (int s = 0; s < SYMS; ++s) {
        unsigned int v = (acc[s][r >> 1] >> (16 * (r & 1))) & 0xFFFFu;
        o.set(s, accumulate ? (o.sym(s) ^ v) : v);
      }
      o.store(out, item);
    }
  }
  if (tw) tripwire_leave(tw);
}

#define GF_MATMUL(NAME, SYMS, NP, PF)                                                    \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                \
      const unsigned long long* in_ptrs, const unsigned long long* in2_ptrs,             \
      const unsigned long long* out_ptrs, const unsigned int* tables, int n_inputs,      \
      int table_cols, int col_offset, long long n_items, int n_rows, int accumulate,     \
      LetoTripwire* tw) {                                                                \
    matmul_body<SYMS, NP, PF>(in_ptrs, in2_ptrs, out_ptrs, tables, n_inputs, table_cols, \
                              col_offset, n_items, n_rows, accumulate, tw);              \
  }

GF_MATMUL(gf_matmul_v8, 8, PAIRS, 1)
GF_MATMUL(gf_matmul_v8_p4, 8, 4, 1)
GF_MATMUL(gf_matmul_v8_p2, 8, 2, 1)
GF_MATMUL(gf_matmul_v8_p1, 8, 1, 1)
GF_MATMUL(gf_matmul_v8_pf2, 8, PAIRS, 2)
GF_MATMUL(gf_matmul_v8_p4_pf2, 8, 4, 2)
GF_MATMUL(gf_matmul_v8_p2_pf2, 8, 2, 2)
GF_MATMUL(gf_matmul_v8_p1_pf2, 8, 1, 2)
GF_MATMUL(gf_matmul_v1, 1, PAIRS, 1)

// ---- the code's generator by the Horner scheme (H <= 4, 16-byte items) ------------------

__device__ __forceinline__ uint4 load_item(const unsigned long long* ptrs,
                                           const unsigned long long* ptrs2, int k,
                                           long long item) {
  uint4 d = reinterpret_cast<const uint4*>(ptrs[k])[item];
  if (ptrs2) {
    const uint4 e = reinterpret_cast<const uint4*>(ptrs2[k])[item];
    d.x ^= e.x, d.y ^= e.y, d.z ^= e.z, d.w ^= e.w;
  }
  return d;
}

template <int H>
__device__ __forceinline__ void horner_body(const unsigned long long* __restrict__ in_ptrs,
                                            const unsigned long long* __restrict__ in2_ptrs,
                                            const unsigned long long* __restrict__ out_ptrs,
                                            const unsigned int* __restrict__ mtables,
                                            int n_inputs, long long n_items, int accumulate,
                                            LetoTripwire* tw) {
  if (tw && !tripwire_enter(tw)) return;
  constexpr int NP = (H + 1) / 2;
  __shared__ __align__(16) unsigned int tab[H * 4 * NP * 16];
  stage<NP>(tab, mtables, 0, H);
  __syncthreads();
  const long long item = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (item < n_items) {
    unsigned int t[H][4];
#pragma unroll
    for (int r = 0; r < H; ++r) t[r][0] = t[r][1] = t[r][2] = t[r][3] = 0;
    int k = 0;
    // Four pages' loads in flight before their steps: the steps are few, so a thread
    // must keep several loads outstanding to cover the memory latency.
    for (; k + 4 <= n_inputs; k += 4) {
      const uint4 d0 = load_item(in_ptrs, in2_ptrs, k, item);
      const uint4 d1 = load_item(in_ptrs, in2_ptrs, k + 1, item);
      const uint4 d2 = load_item(in_ptrs, in2_ptrs, k + 2, item);
      const uint4 d3 = load_item(in_ptrs, in2_ptrs, k + 3, item);
      horner_step<H>(t, d0);
      horner_step<H>(t, d1);
      horner_step<H>(t, d2);
      horner_step<H>(t, d3);
    }
    for (; k < n_inputs; ++k) horner_step<H>(t, load_item(in_ptrs, in2_ptrs, k, item));
    horner_finish<H>(t, tab, out_ptrs, item, accumulate != 0);
  }
  if (tw) tripwire_leave(tw);
}

#define GF_HORNER(NAME, H)                                                               \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                \
      const unsigned long long* in_ptrs, const unsigned long long* in2_ptrs,             \
      const unsigned long long* out_ptrs, const unsigned int* mtables, int n_inputs,     \
      long long n_items, int accumulate, LetoTripwire* tw) {                             \
    horner_body<H>(in_ptrs, in2_ptrs, out_ptrs, mtables, n_inputs, n_items, accumulate,  \
                   tw);                                                                  \
  }

GF_HORNER(gf_horner_h1, 1)
GF_HORNER(gf_horner_h2, 2)
GF_HORNER(gf_horner_h3, 3)
GF_HORNER(gf_horner_h4, 4)
