// The staging-buffer cache (stage_pool.h).
#include "metamat/stage_pool.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "metamat/check.h"
#include "metamat/stage.h"

namespace metamat {
namespace io {

namespace {

struct Cached {
  StageMemory m;
  int64_t ring_id;
};

struct Pool {
  std::mutex mu;
  std::vector<Cached> free;
  int64_t next_ring = 0;
  int64_t hits = 0, misses = 0;
};

Pool& pool() {
  static Pool* p = new Pool;  // never destroyed (see the header)
  return *p;
}

bool cache_enabled() {
  const char* v = std::getenv("METAMAT_STAGING_CACHE");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

void free_memory(const StageMemory& m) noexcept {
  if (m.p == nullptr) return;
  if (m.pinned)
    pinned_free(m.p);
  else
    std::free(m.p);
}

}  // namespace

StageMemory stage_take(int64_t bytes, bool pinned, int device) {
  const int64_t need = (bytes + 4095) & ~int64_t(4095);
  Pool& P = pool();
  {
    std::lock_guard<std::mutex> lock(P.mu);
    int best = -1;
    for (size_t i = 0; i < P.free.size(); ++i) {
      const StageMemory& m = P.free[i].m;
      if (m.pinned != pinned || (pinned && m.device != device)) continue;
      if (m.bytes < need || m.bytes / 2 > need) continue;  // too small, or over twice the need
      if (best < 0 || m.bytes < P.free[size_t(best)].m.bytes) best = int(i);
    }
    if (best >= 0) {
      const StageMemory m = P.free[size_t(best)].m;
      P.free.erase(P.free.begin() + best);
      ++P.hits;
      return m;
    }
    ++P.misses;
  }
  StageMemory m;
  m.bytes = need;
  m.pinned = pinned;
  m.device = pinned ? device : -1;
  if (pinned) {
    m.p = static_cast<unsigned char*>(pinned_alloc(need, device));  // throws on failure
  } else {
    void* p = nullptr;
    if (posix_memalign(&p, 4096, size_t(need)) != 0 || p == nullptr)
      fail(__FILE__, __LINE__, "cannot allocate a " + std::to_string(need) +
                                   " B staging buffer");
    m.p = static_cast<unsigned char*>(p);
  }
  return m;
}

void stage_give_back(const StageMemory& m, int64_t ring_id) noexcept {
  if (m.p == nullptr) return;
  Pool& P = pool();
  std::vector<StageMemory> drop;  // freed outside the lock (cudaFreeHost can take ms)
  bool kept = false;
  try {
    std::lock_guard<std::mutex> lock(P.mu);
    if (cache_enabled()) {
      // one ring at most: buffers another pipeline gave back go
      for (const Cached& c : P.free)
        if (c.ring_id != ring_id) drop.push_back(c.m);
      std::vector<Cached> same;
      for (const Cached& c : P.free)
        if (c.ring_id == ring_id) same.push_back(c);
      same.push_back({m, ring_id});
      P.free.swap(same);
      kept = true;
    }
  } catch (...) {  // bad_alloc growing a vector: nothing changed; free this buffer only
    drop.clear();
    kept = false;
  }
  if (!kept) free_memory(m);
  for (const StageMemory& d : drop) free_memory(d);
}

int64_t stage_new_ring_id() {
  Pool& P = pool();
  std::lock_guard<std::mutex> lock(P.mu);
  return ++P.next_ring;
}

StagePoolStats stage_pool_stats() {
  Pool& P = pool();
  std::lock_guard<std::mutex> lock(P.mu);
  StagePoolStats s;
  s.cached_buffers = int64_t(P.free.size());
  for (const Cached& c : P.free) s.cached_bytes += c.m.bytes;
  s.hits = P.hits;
  s.misses = P.misses;
  return s;
}

int64_t stage_free_cached() noexcept {
  Pool& P = pool();
  std::vector<Cached> all;
  {
    std::lock_guard<std::mutex> lock(P.mu);
    all.swap(P.free);
  }
  int64_t n = 0;
  for (const Cached& c : all) {
    n += c.m.bytes;
    free_memory(c.m);
  }
  return n;
}

}  // namespace io
}  // namespace metamat
