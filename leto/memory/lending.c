// Region allocator behind a torch.cuda.MemPool: lends the pool's reusable pages to the
// trainer's activations during the compute phase (paper §5.2, ARCHITECTURE.md §4).
//
// Runs in the trainer, called by PyTorch's caching allocator (under its mutex, without
// the GIL: plain C only). Segments of at least `min_lend_bytes` are carved first-fit
// out of the lent regions; smaller ones (PyTorch's 2 MiB small-block segments, which
// hold scalars such as the loss that outlive the compute phase) and anything that does
// not fit go to the fallback allocator (cuMemAlloc through libcuda by default, so no
// CUDA headers are needed to build this file). Which memory is *live* is PyTorch's
// business: the Python side checks the pool's snapshot before the updater takes the
// regions back.
//
// Not covered: more than LEND_MAX_REGIONS regions or LEND_MAX_BLOCKS pieces.
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>

#define LEND_MAX_REGIONS 8
#define LEND_MAX_BLOCKS 4096

typedef struct {
  uintptr_t addr;
  size_t size;
  int used;
} piece_t;

static piece_t pieces[LEND_MAX_BLOCKS];  // sorted by address, covering every region
static int n_pieces;
static uintptr_t region_lo[LEND_MAX_REGIONS], region_hi[LEND_MAX_REGIONS];
static int n_regions;
static size_t min_lend_bytes = (size_t)4 << 20;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

// Statistics, read by Python through leto_lend_stats.
static size_t lent_in_use, lent_peak, fallback_in_use, fallback_peak;
static uint64_t n_lent, n_fallback, n_failed;

typedef void* (*fb_alloc_t)(size_t);
typedef void (*fb_free_t)(void*);
static fb_alloc_t fb_alloc;
static fb_free_t fb_free;

typedef int (*cu_alloc_t)(uintptr_t*, size_t);
typedef int (*cu_free_t)(uintptr_t);
static cu_alloc_t cu_alloc;
static cu_free_t cu_free;

static void* cuda_alloc(size_t n) {
  if (!cu_alloc) {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) return NULL;
    cu_alloc = (cu_alloc_t)dlsym(lib, "cuMemAlloc_v2");
    cu_free = (cu_free_t)dlsym(lib, "cuMemFree_v2");
    if (!cu_alloc || !cu_free) return NULL;
  }
  uintptr_t p = 0;
  return cu_alloc(&p, n) == 0 ? (void*)p : NULL;
}

static void cuda_free(void* p) {
  if (cu_free) cu_free((uintptr_t)p);
}

// Tests on the CPU build pass malloc/free here; NULL restores the CUDA driver.
void leto_lend_set_fallback(fb_alloc_t a, fb_free_t f) {
  pthread_mutex_lock(&mu);
  fb_alloc = a;
  fb_free = f;
  pthread_mutex_unlock(&mu);
}

// Replace the lent regions. Returns 0, or -1 if a piece of the old regions is still
// handed out (taking memory back from under PyTorch would corrupt its tensors), -2 if
// there are too many regions or they overlap.
int leto_lend_set_regions(const uintptr_t* addrs, const size_t* sizes, int n, size_t min_bytes) {
  pthread_mutex_lock(&mu);
  int rc = 0;
  for (int i = 0; i < n_pieces; i++)
    if (pieces[i].used) rc = -1;
  if (rc == 0 && (n < 0 || n > LEND_MAX_REGIONS)) rc = -2;
  for (int i = 0; rc == 0 && i < n; i++)
    for (int j = 0; j < n; j++)
      if (i != j && addrs[i] < addrs[j] + sizes[j] && addrs[j] < addrs[i] + sizes[i]) rc = -2;
  if (rc == 0) {
    n_regions = n;
    n_pieces = 0;
    for (int i = 0; i < n; i++) {
      region_lo[i] = addrs[i];
      region_hi[i] = addrs[i] + sizes[i];
    }
    // Regions as initial free pieces, in address order (insertion sort: n is tiny).
    for (int i = 0; i < n; i++) {
      int k = n_pieces++;
      while (k > 0 && pieces[k - 1].addr > addrs[i]) {
        pieces[k] = pieces[k - 1];
        k--;
      }
      pieces[k] = (piece_t){addrs[i], sizes[i], 0};
    }
    min_lend_bytes = min_bytes;
  }
  pthread_mutex_unlock(&mu);
  return rc;
}

static int region_of(uintptr_t a) {
  for (int r = 0; r < n_regions; r++)
    if (region_lo[r] <= a && a < region_hi[r]) return r;
  return -1;
}

static void* lend(size_t size) {
  for (int i = 0; i < n_pieces; i++) {
    if (pieces[i].used || pieces[i].size < size) continue;
    if (pieces[i].size > size) {
      if (n_pieces == LEND_MAX_BLOCKS) return NULL;
      memmove(&pieces[i + 2], &pieces[i + 1], (size_t)(n_pieces - i - 1) * sizeof(piece_t));
      pieces[i + 1] = (piece_t){pieces[i].addr + size, pieces[i].size - size, 0};
      pieces[i].size = size;
      n_pieces++;
    }
    pieces[i].used = 1;
    return (void*)pieces[i].addr;
  }
  return NULL;
}

void* leto_lend_alloc(ssize_t size, int device, void* stream) {
  (void)device;
  (void)stream;
  if (size <= 0) return NULL;
  pthread_mutex_lock(&mu);
  void* p = NULL;
  if ((size_t)size >= min_lend_bytes) p = lend((size_t)size);
  if (p) {
    n_lent++;
    lent_in_use += (size_t)size;
    if (lent_in_use > lent_peak) lent_peak = lent_in_use;
  } else {
    p = fb_alloc ? fb_alloc((size_t)size) : cuda_alloc((size_t)size);
    if (p) {
      n_fallback++;
      fallback_in_use += (size_t)size;
      if (fallback_in_use > fallback_peak) fallback_peak = fallback_in_use;
    } else {
      n_failed++;  // PyTorch frees its cache and retries, then raises OutOfMemoryError
    }
  }
  pthread_mutex_unlock(&mu);
  return p;
}

void leto_lend_free(void* ptr, size_t size, int device, void* stream) {
  (void)device;
  (void)stream;
  uintptr_t a = (uintptr_t)ptr;
  pthread_mutex_lock(&mu);
  if (region_of(a) < 0) {
    if (fb_alloc) fb_free(ptr); else cuda_free(ptr);
    fallback_in_use -= size;
    pthread_mutex_unlock(&mu);
    return;
  }
  for (int i = 0; i < n_pieces; i++) {
    if (pieces[i].addr != a || !pieces[i].used) continue;
    lent_in_use -= pieces[i].size;
    pieces[i].used = 0;
    // Coalesce with free neighbours of the same region (regions need not be adjacent).
    int r = region_of(a);
    if (i + 1 < n_pieces && !pieces[i + 1].used && region_of(pieces[i + 1].addr) == r &&
        pieces[i].addr + pieces[i].size == pieces[i + 1].addr) {
      pieces[i].size += pieces[i + 1].size;
      memmove(&pieces[i + 1], &pieces[i + 2], (size_t)(n_pieces - i - 2) * sizeof(piece_t));
      n_pieces--;
    }
    if (i > 0 && !pieces[i - 1].used && region_of(pieces[i - 1].addr) == r &&
        pieces[i - 1].addr + pieces[i - 1].size == pieces[i].addr) {
      pieces[i - 1].size += pieces[i].size;
      memmove(&pieces[i], &pieces[i + 1], (size_t)(n_pieces - i - 1) * sizeof(piece_t));
      n_pieces--;
    }
    break;
  }
  pthread_mutex_unlock(&mu);
}

// lent_in_use, lent_peak, fallback_in_use, fallback_peak, n_lent, n_fallback, n_failed,
// n_pieces
void leto_lend_stats(uint64_t* out) {
  pthread_mutex_lock(&mu);
  out[0] = lent_in_use;
  out[1] = lent_peak;
  out[2] = fallback_in_use;
  out[3] = fallback_peak;
  out[4] = n_lent;
  out[5] = n_fallback;
  out[6] = n_failed;
  out[7] = (uint64_t)n_pieces;
  pthread_mutex_unlock(&mu);
}
