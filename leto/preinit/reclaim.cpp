// Shadow reclamation on the CUDA caching allocator's cache-miss path (paper §6).
//
// Runs inside the active trainer. Built by reclaim.py in two flavours from this one file:
//  * -DLETO_RECLAIM_CUDA: links c10_cuda and registers a c10::FreeMemoryCallback. The
//    caching allocator runs every registered callback when no cached block fits, *before*
//    it asks the driver for a new segment; so if the callback kills the shadow and waits
//    until its memory is back, the allocator's cudaMalloc that follows succeeds and no
//    OOM is raised.
//  * without it (CPU tests): no torch, no CUDA; the memory probe is injected with
//    leto_reclaim_set_probe and the test calls leto_reclaim_on_cache_miss itself.
//
// Constraints of the callback (FACTS.md "PyTorch allocator and OOM"): it fires on every
// cache miss, under the allocator's mutex, without the GIL — no Python, no allocation
// through the caching allocator, nothing that waits for another allocating thread. It
// does not see the request's size, so it gates on device free memory being below
// reclaim_below (set from Python) rather than on the request failing.
//
// Not covered: several armed shadows at once (one per process), shadows that are not
// a single process (a killed process's children keep their memory).
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <ctime>
#include <mutex>

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifdef LETO_RECLAIM_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>
#endif

#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424  // same number on every Linux architecture
#endif

extern "C" {

typedef int (*leto_probe_fn)(uint64_t* free_bytes);  // 0 on success

enum { LETO_RELEASED = 1, LETO_EXITED = 2, LETO_TIMEOUT = 3, LETO_KILL_FAILED = 4 };

struct leto_reclaim_event {  // mirrored by _Event in reclaim.py
  int64_t wall_ns;     // CLOCK_REALTIME at the cache miss: comparable with time.time()
  int64_t latency_ns;  // kill sent -> wait over (CLOCK_MONOTONIC)
  int64_t exit_ns;     // kill sent -> exit observed; -1: not observed
  uint64_t free_before;
  uint64_t free_after;
  int32_t pid;
  int32_t outcome;  // LETO_*
  int32_t killed;   // 0: it had already exited, no signal was needed
  int32_t pad;
};

struct leto_reclaim_stats {  // mirrored by _Stats in reclaim.py
  uint64_t calls;            // callback runs while armed
  uint64_t pressure_checks;  // of which probed device free memory
  uint64_t reclaims;         // reclamation events recorded
  uint64_t events_dropped;   // events beyond the ring's capacity
  int32_t armed;
  int32_t pad;
};

}  // extern "C"

namespace {

constexpr int kMaxEvents = 256;

// g_mu serializes arm/disarm/reads with the callback. It is never held while taking the
// allocator's mutex, so the callback (which holds the allocator's) cannot deadlock on it.
std::mutex g_mu;
// Read without g_mu first: when no shadow is armed a cache miss costs one atomic load.
std::atomic<int> g_armed{0};
int g_device = 0;
int g_pidfd = -1;  // owned by Python: closed there only after disarm returns
int g_pid = 0;
uint64_t g_reclaim_below = 0;
uint64_t g_expected_release = 0;
int64_t g_timeout_ns = 0, g_settle_ns = 0, g_poll_ns = 0;
leto_probe_fn g_probe = nullptr;
leto_reclaim_stats g_stats = {};
leto_reclaim_event g_events[kMaxEvents];
int g_nevents = 0;

int64_t now_ns(clockid_t clock) {
  timespec ts;
  clock_gettime(clock, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

int probe_free(uint64_t* out) {
  if (g_probe != nullptr) return g_probe(out);
#ifdef LETO_RECLAIM_CUDA
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
    // Clear the error so it does not surface later in an unrelated torch CUDA check.
    (void)cudaGetLastError();
    return -1;
  }
  *out = free_b;
  return 0;
#else
  return -1;
#endif
}

// The pidfd becomes readable once the process has exited (child or not).
bool has_exited(int pidfd) {
  pollfd p = {pidfd, POLLIN, 0};
  return poll(&p, 1, 0) > 0;
}

void record(const leto_reclaim_event& ev) {
  g_stats.reclaims++;
  if (g_nevents < kMaxEvents) {
    g_events[g_nevents++] = ev;
  } else {
    g_stats.events_dropped++;
  }
}

}  // namespace

extern "C" {

int leto_reclaim_arm(int device, int pidfd, int pid, uint64_t reclaim_below,
                     uint64_t expected_release, int64_t timeout_ns, int64_t settle_ns,
                     int64_t poll_ns) {
  if (pidfd < 0 || pid <= 0 || expected_release == 0 || timeout_ns <= 0 || settle_ns < 0 ||
      poll_ns <= 0 || poll_ns >= 1000000000)
    return -1;
  std::lock_guard<std::mutex> lk(g_mu);
  g_device = device;
  g_pidfd = pidfd;
  g_pid = pid;
  g_reclaim_below = reclaim_below;
  g_expected_release = expected_release;
  g_timeout_ns = timeout_ns;
  g_settle_ns = settle_ns;
  g_poll_ns = poll_ns;
  g_armed.store(1, std::memory_order_release);
  return 0;
}

void leto_reclaim_disarm(void) {
  // Taking g_mu waits out a callback in progress: the caller may close the pidfd after.
  std::lock_guard<std::mutex> lk(g_mu);
  g_armed.store(0, std::memory_order_release);
  g_pidfd = -1;
}

// Disarm and forget counters and events (a new run or a test).
void leto_reclaim_reset(void) {
  std::lock_guard<std::mutex> lk(g_mu);
  g_armed.store(0, std::memory_order_release);
  g_pidfd = -1;
  g_stats = leto_reclaim_stats{};
  g_nevents = 0;
}

void leto_reclaim_set_probe(leto_probe_fn fn) {
  std::lock_guard<std::mutex> lk(g_mu);
  g_probe = fn;
}

void leto_reclaim_get_stats(leto_reclaim_stats* out) {
  std::lock_guard<std::mutex> lk(g_mu);
  *out = g_stats;
  out->armed = g_armed.load();
}

int leto_reclaim_event_count(void) {
  std::lock_guard<std::mutex> lk(g_mu);
  return g_nevents;
}

int leto_reclaim_get_event(int i, leto_reclaim_event* out) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (i < 0 || i >= g_nevents) return -1;
  *out = g_events[i];
  return 0;
}

// Returns 1 when device free memory rose (the allocator then searches its cache again;
// it tries a new segment either way).
int leto_reclaim_on_cache_miss(void) {
  if (!g_armed.load(std::memory_order_acquire)) return 0;
  std::lock_guard<std::mutex> lk(g_mu);
  if (!g_armed.load(std::memory_order_relaxed)) return 0;
  g_stats.calls++;
#ifdef LETO_RECLAIM_CUDA
  int dev = -1;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  if (dev != g_device) return 0;  // a miss on another device: not this shadow's memory
#endif
  g_stats.pressure_checks++;
  uint64_t before = 0;
  if (probe_free(&before) != 0 || before >= g_reclaim_below) return 0;

  leto_reclaim_event ev = {};
  ev.wall_ns = now_ns(CLOCK_REALTIME);
  ev.pid = g_pid;
  ev.free_before = before;
  ev.exit_ns = -1;
  const int64_t t0 = now_ns(CLOCK_MONOTONIC);
  bool gone = has_exited(g_pidfd);
  // One shadow, one reclamation: Python arms again for the replacement it launches.
  g_armed.store(0, std::memory_order_release);
  if (!gone) {
    // A pidfd names this process only: a recycled PID can never be hit.
    if (syscall(SYS_pidfd_send_signal, g_pidfd, SIGKILL, nullptr, 0) != 0 && errno != ESRCH) {
      ev.outcome = LETO_KILL_FAILED;
      ev.free_after = before;
      ev.latency_ns = now_ns(CLOCK_MONOTONIC) - t0;
      record(ev);
      return 0;
    }
    ev.killed = 1;
  } else {
    ev.exit_ns = 0;
  }
  // Wait until the memory is really back: free memory rose by the expected footprint,
  // or the process is gone, free memory rose and has stopped changing for settle_ns (the
  // footprint estimate was high), or the timeout passed.
  uint64_t last = before;
  int64_t quiet_since = t0;
  for (;;) {
    const int64_t now = now_ns(CLOCK_MONOTONIC);
    if (!gone && has_exited(g_pidfd)) {
      gone = true;
      ev.exit_ns = now - t0;
      quiet_since = now > quiet_since ? now : quiet_since;
    }
    uint64_t f = 0;
    if (probe_free(&f) == 0 && f != last) {
      last = f;
      quiet_since = now;
    }
    if (last > before && last - before >= g_expected_release) {
      ev.outcome = LETO_RELEASED;
      break;
    }
    // Exited with *some* memory back and no change since: the estimate was high. Exited
    // with nothing back yet keeps waiting: the driver may release after the exit.
    if (gone && last > before && now - quiet_since >= g_settle_ns) {
      ev.outcome = LETO_EXITED;
      break;
    }
    if (now - t0 >= g_timeout_ns) {
      ev.outcome = LETO_TIMEOUT;
      break;
    }
    timespec ts = {0, static_cast<long>(g_poll_ns)};
    nanosleep(&ts, nullptr);
  }
  ev.free_after = last;
  ev.latency_ns = now_ns(CLOCK_MONOTONIC) - t0;
  record(ev);
  return last > before ? 1 : 0;
}

}  // extern "C"

#ifdef LETO_RECLAIM_CUDA
namespace c10 {
namespace {
class LetoShadowReclaim : public FreeMemoryCallback {
 public:
  bool Execute() override { return leto_reclaim_on_cache_miss() != 0; }
};
}  // namespace
// The registry exits the process on a duplicate key: reclaim.py loads one build only.
REGISTER_FREE_MEMORY_CALLBACK(leto_shadow_reclaim, LetoShadowReclaim);
}  // namespace c10
#endif
