/* GF(2^16) matrix product on the host, the contract of leto/erasure/kernels/api.py:
 *
 *   out[r][s] = (accumulate ? out[r][s] : 0)
 *               ^ XOR_k  M[r][col_k] * (in[k][s] ^ xor[k][s])
 *
 * with the product taken from 8-bit split tables (c*d = LO_c[d & 0xFF] ^ HI_c[d >> 8],
 * multiplication being linear over GF(2)), the same tables the NumPy kernel gathers
 * from. Tables: lo/hi[col][row][256] uint16, `table_rows` rows per column. Pages are
 * little-endian 16-bit symbols; outputs never alias inputs (the contract).
 *
 * Symbols are taken in blocks so that a block of every output row stays in cache while
 * each input page's block is applied; one column's tables (rows x 1 KiB) stay in L1.
 * Plain C: the compiler's -O3 schedules the table loads; no intrinsics, so it builds
 * wherever a C compiler does.
 */
#include <stdint.h>
#include <string.h>

#define BLOCK 2048 /* symbols */

void leto_gf_matmul(const uint16_t *lo, const uint16_t *hi, int64_t table_rows,
                    const int64_t *in_ptrs, const int64_t *xor_ptrs, const int64_t *cols,
                    int64_t n_in, const int64_t *out_ptrs, int64_t rows, int64_t n_sym,
                    int accumulate) {
    if (!accumulate) {
        for (int64_t r = 0; r < rows; r++) memset((void *)out_ptrs[r], 0, (size_t)n_sym * 2);
    }
    for (int64_t s0 = 0; s0 < n_sym; s0 += BLOCK) {
        int64_t n = n_sym - s0 < BLOCK ? n_sym - s0 : BLOCK;
        for (int64_t k = 0; k < n_in; k++) {
            const uint16_t *in = (const uint16_t *)in_ptrs[k] + s0;
            const uint16_t *x = xor_ptrs[k] ? (const uint16_t *)xor_ptrs[k] + s0 : 0;
            const uint16_t *lo_k = lo + cols[k] * table_rows * 256;
            const uint16_t *hi_k = hi + cols[k] * table_rows * 256;
            uint8_t l[BLOCK], h[BLOCK];
            for (int64_t i = 0; i < n; i++) {
                uint16_t d = x ? (uint16_t)(in[i] ^ x[i]) : in[i];
                l[i] = (uint8_t)(d & 0xFF);
                h[i] = (uint8_t)(d >> 8);
            }
            for (int64_t r = 0; r < rows; r++) {
                uint16_t *out = (uint16_t *)out_ptrs[r] + s0;
                const uint16_t *lt = lo_k + r * 256, *ht = hi_k + r * 256;
                for (int64_t i = 0; i < n; i++) out[i] ^= (uint16_t)(lt[l[i]] ^ ht[h[i]]);
            }
        }
    }
}
