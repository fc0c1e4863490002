// GF(2^16) helpers shared by the codec's kernels (gf_matmul.cu) and the fused chunk pass
// (leto/update/chunk_pass.cu); FIELD_POLY 0x1002D, symbols little-endian, two to a
// 32-bit word.
//
// * The Horner scheme of the code's parity checks (leto.erasure.horner): a run of
//   columns' sums t_r <- t_r * a^-(b+r) ^ d, b = -((H-1)/2), each step a shift and a
//   conditional XOR (SWAR), then out ^= M * t with M host-built.
// * Table multiplies: gf_matmul.cu's nibble tables ([col][pos 4][pair 8][nib 16], 512
//   words a column), staged compactly (only the NP row pairs used) into shared memory.
#pragma once

#define TAB_WORDS 512  // words per column in the codec's table layout [pos 4][pair 8][nib 16]

// x * a (a = 0x2, FIELD_POLY 0x1002D) for the two 16-bit symbols of a word.
__device__ __forceinline__ unsigned int mul_a(unsigned int w) {
  const unsigned int top = (w >> 15) & 0x00010001u;
  return ((w << 1) & 0xFFFEFFFEu) ^ (top * 0x2Du);
}

// x * a^-1: an even x is x >> 1; an odd one (x ^ 0x1002D) >> 1 = (x >> 1) ^ 0x8016.
__device__ __forceinline__ unsigned int mul_a_inv(unsigned int w) {
  const unsigned int low = w & 0x00010001u;
  return ((w >> 1) & 0x7FFF7FFFu) ^ (low * 0x8016u);
}

// x * a^e (|e| <= 2 for H <= 4; e is a constant once the loops are unrolled).
__device__ __forceinline__ unsigned int mul_a_pow(unsigned int w, int e) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (i < e) w = mul_a(w);
    if (i < -e) w = mul_a_inv(w);
  }
  return w;
}

// One column of the Horner scheme: t_r <- t_r * a^-(b+r) ^ d.
template <int H>
__device__ __forceinline__ void horner_step(unsigned int (&t)[H][4], uint4 d) {
  constexpr int B = -((H - 1) / 2);
#pragma unroll
  for (int r = 0; r < H; ++r) {
    t[r][0] = mul_a_pow(t[r][0], -(B + r)) ^ d.x;
    t[r][1] = mul_a_pow(t[r][1], -(B + r)) ^ d.y;
    t[r][2] = mul_a_pow(t[r][2], -(B + r)) ^ d.z;
    t[r][3] = mul_a_pow(t[r][3], -(B + r)) ^ d.w;
  }
}

template <int NP>
__device__ __forceinline__ void stage(unsigned int* dst, const unsigned int* T, int col0,
                                      int cols) {
  // dst[c][pos][p][nib] <- T[(col0 + c)][pos][p][nib] for the NP row pairs used.
  const int n = cols * 4 * NP * 16;
  for (int w = threadIdx.x; w < n; w += blockDim.x) {
    const int nib = w & 15;
    const int p = (w >> 4) % NP;
    const int pos = (w / (16 * NP)) & 3;
    const int c = w / (64 * NP);
    dst[w] = T[(long long)(col0 + c) * TAB_WORDS + pos * 128 + p * 16 + nib];
  }
}

template <int NP>
__device__ __forceinline__ void gf_accumulate(unsigned int (&acc)[8][NP], uint4 d,
                                              const unsigned int* t) {
  const unsigned int w[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    const unsigned int x = (s & 1) ? (w[s >> 1] >> 16) : (w[s >> 1] & 0xFFFFu);
#pragma unroll
    for (int pos = 0; pos < 4; ++pos) {
      const unsigned int* tp = t + pos * (NP * 16) + ((x >> (4 * pos)) & 15u);
#pragma unroll
      for (int p = 0; p < NP; ++p) acc[s][p] ^= tp[p * 16];
    }
  }
}

// out_r (^)= (M * t)_r, r < H, at 16-byte item `item` of each output page; `tab` holds
// M's H columns staged by stage<(H + 1) / 2>.
template <int H>
__device__ __forceinline__ void horner_finish(const unsigned int (&t)[H][4],
                                              const unsigned int* tab,
                                              const unsigned long long* __restrict__ out_ptrs,
                                              long long item, bool accumulate) {
  constexpr int NP = (H + 1) / 2;
  unsigned int acc[8][NP];
#pragma unroll
  for (int k = 0; k < 8; ++k)
#pragma unroll
    for (int q = 0; q < NP; ++q) acc[k][q] = 0;
#pragma unroll
  for (int r = 0; r < H; ++r)
    gf_accumulate<NP>(acc, make_uint4(t[r][0], t[r][1], t[r][2], t[r][3]),
                      tab + r * (4 * NP * 16));
#pragma unroll
  for (int r = 0; r < H; ++r) {
    uint4* out = reinterpret_cast<uint4*>(out_ptrs[r]) + item;
    unsigned int w[4] = {0, 0, 0, 0};
    if (accumulate) {
      const uint4 o = *out;
      w[0] = o.x, w[1] = o.y, w[2] = o.z, w[3] = o.w;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const unsigned int lo = (acc[2 * k][r >> 1] >> (16 * (r & 1))) & 0xFFFFu;
      const unsigned int hi = (acc[2 * k + 1][r >> 1] >> (16 * (r & 1))) & 0xFFFFu;
      w[k] ^= lo | (hi << 16);
    }
    *out = make_uint4(w[0], w[1], w[2], w[3]);
  }
}
