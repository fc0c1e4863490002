/* The state manager's loss scan of one mapped range: which of its pages are unmapped.
 *
 * One driver query per page (cuPointerGetAttribute(MAPPED)), looped here rather than
 * from Python: at 5 B parameters a pool has ~38,500 pages and the Python loop through
 * cuda.bindings was most of localization's time on the recovery path. The query is
 * passed in as a function pointer (libcuda's, looked up by the caller), so this file
 * needs no CUDA headers to build and the loop can be tested without a GPU.
 *
 * Returns the number of unmapped pages written to out[0..], or -1 on another driver
 * error: *error_page and *error_code then say which page and which CUresult.
 */
#include <stdint.h>

/* CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) */
typedef int (*leto_get_attribute)(void *data, int attribute, uint64_t ptr);

#define LETO_CUDA_SUCCESS 0
#define LETO_CUDA_ERROR_INVALID_VALUE 1 /* an address in a reservation, nothing mapped */

int64_t leto_unmapped_pages(leto_get_attribute query, int attribute, uint64_t base,
                            uint64_t page_bytes, int64_t n_pages, int64_t *out,
                            int64_t *error_page, int *error_code) {
    int64_t found = 0;
    for (int64_t i = 0; i < n_pages; i++) {
        uint64_t mapped = 0; /* the driver writes a bool here: any width reads as 0 or not */
        int err = query(&mapped, attribute, base + (uint64_t)i * page_bytes);
        if (err == LETO_CUDA_ERROR_INVALID_VALUE || (err == LETO_CUDA_SUCCESS && !mapped)) {
            out[found++] = i;
        } else if (err != LETO_CUDA_SUCCESS) {
            *error_page = i;
            *error_code = err;
            return -1;
        }
    }
    return found;
}
