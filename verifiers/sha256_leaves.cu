// verifiers.digest on the GPU: the SHA-256 of every 64 KiB leaf of a tensor's raw bytes,
// one thread per leaf (FIPS 180-4; the host hashes the leaf digests into the root). The
// same digests hashlib gives on the host, so a trace's digest does not depend on where
// it was taken.

__constant__ unsigned int K[64] = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u, 0xab1c5ed5u,
    0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu, 0x9bdc06a7u, 0xc19bf174u,
    0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu, 0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau,
    0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u, 0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u,
    0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu, 0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u,
    0xa2bfe8a1u, 0xa81a664bu, 0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u,
    0x19a4c116u, 0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u, 0xc67178f2u};

__device__ __forceinline__ unsigned int rotr(unsigned int x, int n) {
  return __funnelshift_r(x, x, n);
}

// One 64-byte block of message words w (big-endian, consumed) into state h.
__device__ __forceinline__ void compress(unsigned int h[8], unsigned int w[16]) {
  unsigned int a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
#pragma unroll
  for (int t = 0; t < 64; ++t) {
    if (t >= 16) {  // w[t & 15] holds W[t-16]: W[t] = s1(W[t-2]) + W[t-7] + s0(W[t-15]) + W[t-16]
      unsigned int w15 = w[(t + 1) & 15], w2 = w[(t + 14) & 15];
      unsigned int s0 = rotr(w15, 7) ^ rotr(w15, 18) ^ (w15 >> 3);
      unsigned int s1 = rotr(w2, 17) ^ rotr(w2, 19) ^ (w2 >> 10);
      w[t & 15] += s0 + w[(t + 9) & 15] + s1;
    }
    unsigned int t1 = k + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + K[t] + w[t & 15];
    unsigned int t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    k = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
  }
  h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += k;
}

extern "C" __global__ void sha256_leaves(const unsigned char* __restrict__ data,
                                         unsigned long long n, unsigned long long leaf,
                                         unsigned char* __restrict__ out) {
  unsigned long long leaves = (n + leaf - 1) / leaf;
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= leaves) return;
  unsigned long long start = i * leaf;
  unsigned long long len = n - start < leaf ? n - start : leaf;
  const unsigned char* p = data + start;
  unsigned int h[8] = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
                       0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
  unsigned int w[16];
  unsigned long long full = len >> 6;
  // Leaves start at multiples of 64 KiB from the tensor's first byte: its alignment.
  bool vec = (reinterpret_cast<unsigned long long>(p) & 15) == 0;
  for (unsigned long long blk = 0; blk < full; ++blk) {
    const unsigned char* q = p + (blk << 6);
    if (vec) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint4 v = __ldg(reinterpret_cast<const uint4*>(q) + j);
        w[4 * j] = __byte_perm(v.x, 0, 0x0123);
        w[4 * j + 1] = __byte_perm(v.y, 0, 0x0123);
        w[4 * j + 2] = __byte_perm(v.z, 0, 0x0123);
        w[4 * j + 3] = __byte_perm(v.w, 0, 0x0123);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j)
        w[j] = ((unsigned int)q[4 * j] << 24) | ((unsigned int)q[4 * j + 1] << 16) |
               ((unsigned int)q[4 * j + 2] << 8) | (unsigned int)q[4 * j + 3];
    }
    compress(h, w);
  }
  // The padding: the last rem bytes, 0x80, zeros, the length in bits (big-endian) in the
  // last 8 bytes — a second block when fewer than 9 bytes are left in the first.
  unsigned int rem = (unsigned int)(len & 63);
  const unsigned char* q = p + (full << 6);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    unsigned int x = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      unsigned int pos = 4 * j + b;
      x = (x << 8) | (pos < rem ? (unsigned int)q[pos] : (pos == rem ? 0x80u : 0u));
    }
    w[j] = x;
  }
  unsigned long long bits = len << 3;
  if (rem >= 56) {
    compress(h, w);
#pragma unroll
    for (int j = 0; j < 14; ++j) w[j] = 0;
  }
  w[14] = (unsigned int)(bits >> 32);
  w[15] = (unsigned int)bits;
  compress(h, w);
  unsigned char* o = out + i * 32;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    o[4 * j] = (unsigned char)(h[j] >> 24);
    o[4 * j + 1] = (unsigned char)(h[j] >> 16);
    o[4 * j + 2] = (unsigned char)(h[j] >> 8);
    o[4 * j + 3] = (unsigned char)h[j];
  }
}
