// Thread-pool executor for checkpoint read plans: validate, cut into tasks (io_tasks.cpp), run.
// See io_reader.h; the per-thread read primitive is io_piece.cpp, file handling io_file.cpp.
#include "metamat/io_reader.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>

#include "io_fault.h"
#include "metamat/io_file.h"
#include "io_piece.h"
#include "io_tasks.h"
#include "io_verify.h"
#include "metamat/detail/thread_group.h"

namespace metamat {
namespace io {

namespace {

struct Pool {
  ReadShared& shared;
  const ReadOp* ops;
  const FileTable& files;
  const std::vector<Task>& tasks;
  // Verified reads: the tasks are blocks instead.
  const VerifyBlock* blocks = nullptr;
  const VerifyPlan* vplan = nullptr;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> hashed{0}, reread{0};
  std::mutex mu;
  std::string error;
  int64_t failed_op = -1;
  int64_t bad_block = -1;
  uint64_t bad_got = 0;

  Pool(ReadShared& s, const ReadOp* o, const FileTable& f, const std::vector<Task>& t)
      : shared(s), ops(o), files(f), tasks(t) {}

  int64_t count() const {
    return vplan != nullptr ? int64_t(vplan->order.size()) : int64_t(tasks.size());
  }

  void fail_block(int64_t k, const std::string& msg, bool mismatch, uint64_t got) {
    std::lock_guard<std::mutex> lock(mu);
    if (!shared.cancel.exchange(true)) {
      const auto& bops = vplan->ops_of[size_t(k)];
      failed_op = bops.empty() ? -1 : bops[0];
      error = mismatch ? mismatch_message(files.path(blocks[k].file_index), blocks[k], got)
                       : "file " + files.path(blocks[k].file_index) + ", verify block at offset " +
                             std::to_string(blocks[k].offset) + ": " + msg;
      if (mismatch) {
        bad_block = k;
        bad_got = got;
      }
    }
  }

  // One task of a verified read; false when the pool must stop.
  bool run_block(OpReader& reader, int64_t i) {
    const int64_t k = vplan->order[size_t(i)];
    BlockOutcome out;
    std::string e;
    try {
      e = read_verified_block(reader, shared, ops, blocks[k], vplan->ops_of[size_t(k)], &out);
    } catch (const std::exception& ex) {
      e = ex.what();
    }
    hashed += out.hashed;
    reread += out.reread;
    if (!e.empty() || out.mismatch) {
      fail_block(k, e, e.empty(), out.got);
      return false;
    }
    return true;
  }

  void fail(int64_t op, const std::string& msg) {
    std::lock_guard<std::mutex> lock(mu);
    if (!shared.cancel.exchange(true)) {
      failed_op = op;
      error = op_error(files, ops, op, msg);
    }
  }

  // work() with nothing escaping (a thread's function must not throw; bad_alloc while
  // building an error message would otherwise be std::terminate). `init_error`: the thread's
  // reader could not be set up (its bounce buffer): the call fails with it.
  void safe_work(OpReader& reader, const std::string& init_error) noexcept {
    try {
      if (!init_error.empty()) {
        fail(tasks.empty() ? -1 : tasks[0].op, init_error);  // (op -1 names no file)
        return;
      }
      work(reader);
    } catch (const std::exception& e) {
      try {
        fail(-1, std::string("reader thread failed: ") + e.what());
      } catch (...) {
        shared.cancel = true;
      }
    } catch (...) {
      shared.cancel = true;
    }
    reader.idle();
  }

  void work(OpReader& reader) {
    std::string e;
    // Pipelined direct reads: a thread claims its next task before reading the current one,
    // so the helper can read the next task's first window while this one is copied out.
    const bool ahead = vplan == nullptr && reader.pipelined();
    int64_t i = next.fetch_add(1);
    for (;;) {
      if (shared.cancel.load(std::memory_order_relaxed)) return;
      if (i >= count()) return;
      if (vplan != nullptr) {
        if (!run_block(reader, i)) return;
        i = next.fetch_add(1);
        continue;
      }
      const Task& t = tasks[size_t(i)];
      if (ahead) {
        i = next.fetch_add(1);
        if (i < count()) {
          const Task& u = tasks[size_t(i)];
          reader.expect(&ops[u.op], u.byte0, u.bytes);
        } else {
          reader.expect(nullptr, 0, 0);
        }
      }
      try {
        e = reader.read(ops[t.op], t.row0, t.rows, t.byte0, t.bytes);
      } catch (const std::exception& ex) {
        e = ex.what();
      }
      if (!e.empty()) {
        fail(t.op, e);
        return;
      }
      if (!ahead) i = next.fetch_add(1);
    }
  }
};

}  // namespace

bool same_options(const ReadOptions& a, const ReadOptions& b) {
  if (a.identities.size() != b.identities.size()) return false;
  for (size_t i = 0; i < a.identities.size(); ++i) {
    const FileIdentity &x = a.identities[i], &y = b.identities[i];
    if (x.dev != y.dev || x.ino != y.ino || x.size != y.size || x.mtime_ns != y.mtime_ns)
      return false;
  }
  return a.threads == b.threads && a.task_bytes == b.task_bytes &&
         a.bounce_bytes == b.bounce_bytes && a.coalesce_gap == b.coalesce_gap &&
         a.max_open_files == b.max_open_files && a.io == b.io &&
         a.auto_direct_min == b.auto_direct_min;
}

// ---- the crew ------------------------------------------------------------------------------

namespace {
std::atomic<int64_t> g_helpers_started{0};
}  // namespace

int64_t reader_threads_started() { return g_helpers_started.load(); }

struct ReadCrew::Impl {
  ReadOptions opt;
  Fault fault;
  FileTable files;
  ReadShared shared;
  // Helpers wait for an open job (generation moves), join it (active), run it, leave. The
  // caller closes the job when it finds no task left and waits only for the helpers that
  // joined: one that wakes late skips the job instead of holding the caller up.
  std::mutex mu;
  std::condition_variable work_cv, done_cv;
  Pool* job = nullptr;
  int64_t generation = 0;
  bool open = false;
  int active = 0;
  bool stop = false;
  ThreadGroup group;  // last but the caller's reader: joined (by ~ReadCrew) first
  std::unique_ptr<OpReader> own;  // the calling thread's reader
  std::string own_error;

  Impl(const std::vector<std::string>& paths, const ReadOptions& o)
      : opt(o), files(paths, opt.identities, opt.max_open_files, &fault),
        shared(files, opt, fault) {}

  // A helper whose reader cannot be set up (no memory for its bounce buffer) sits calls out
  // and tries again at the next one: the call is done by the others, as when a thread cannot
  // start. (The calling thread's own failure fails the call.)
  void helper() {
    OpReader reader(shared);
    bool ready = reader.init().empty();
    int64_t seen = 0;
    for (;;) {
      Pool* p = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu);
        work_cv.wait(lock, [&] { return stop || (open && generation != seen); });
        if (stop) return;
        seen = generation;
        if (ready) {
          p = job;
          ++active;
        }
      }
      if (p == nullptr) {
        ready = reader.init().empty();
        continue;
      }
      p->safe_work(reader, std::string());
      std::lock_guard<std::mutex> lock(mu);
      if (--active == 0 && !open) done_cv.notify_all();
    }
  }

  void shutdown() noexcept {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    work_cv.notify_all();
    group.join();
  }
};

ReadCrew::ReadCrew(const std::vector<std::string>& paths, const ReadOptions& opt)
    : files_(paths), impl_(new Impl(paths, opt)) {}

const ReadOptions& ReadCrew::options() const { return impl_->opt; }

ReadCrew::~ReadCrew() { impl_->shutdown(); }

ReadResult ReadCrew::run(const ReadOp* ops, int64_t n, const VerifyBlock* blocks,
                         int64_t nblocks) noexcept {
  bool published = false;
  try {
    return run_impl(ops, n, blocks, nblocks, &published);
  } catch (const std::exception& e) {
    // Out of memory building the plan or the report. Before publishing nothing was written;
    // after it the helpers were done (the job was closed and waited for) before this throw.
    ReadResult res;
    res.ok = false;
    res.wrote = published;
    try {
      res.error = std::string("reader: ") + e.what();
    } catch (...) {
    }
    return res;
  }
}

ReadResult ReadCrew::run_impl(const ReadOp* ops, int64_t n, const VerifyBlock* blocks,
                              int64_t nblocks, bool* published) {
  Impl& c = *impl_;
  ReadResult res;
  // Per call, as before the crew: the fault plan is read and counted per call, the cancel
  // flag and counters start clean. Helpers are idle here (the last call waited for them).
  c.fault.mode = FaultMode::kNone;
  c.fault.nth = 0;
  c.fault.calls = 0;
  c.fault.from_env();
  c.shared.cancel = false;
  c.shared.bytes_read = 0;
  FileTable& files = c.files;
  const ReadOptions& opt = c.opt;
  auto bad = [&](int64_t i, const std::string& msg) {
    res.ok = false;
    res.failed_op = i;
    res.error = op_error(files, ops, i, msg);
    return res;
  };
  if (n < 0 || (n > 0 && ops == nullptr)) return bad(-1, "bad op array");
  if (!opt.identities.empty() && opt.identities.size() != size_t(files.count()))
    return bad(-1, "identities: " + std::to_string(opt.identities.size()) + " given for " +
                       std::to_string(files.count()) + " files");

  // 1. Validate every op (and every file it names) before any byte is written.
  for (int64_t i = 0; i < n; ++i) {
    const std::string e = validate_op(files, ops[i]);
    if (!e.empty()) return bad(i, e);
  }

  // 2. Cut the ops into tasks (verified reads: one task per block, planned and checked here).
  const bool verify = nblocks >= 0;
  VerifyPlan vplan;
  if (verify) {
    int64_t op = -1;
    const std::string e = plan_verify(files, ops, n, blocks, nblocks, &vplan, &op);
    if (!e.empty()) return bad(op, e);
  }
  const std::vector<Task> tasks = verify ? std::vector<Task>() : make_tasks(ops, n, opt);
  Pool pool(c.shared, ops, files, tasks);
  if (verify) {
    pool.blocks = blocks;
    pool.vplan = &vplan;
  }
  if (pool.count() == 0) return res;

  // Bytes per file before this call (the report is this call's).
  std::vector<int64_t> buffered0(size_t(files.count())), direct0(size_t(files.count()));
  for (int64_t f = 0; f < files.count(); ++f) {
    buffered0[size_t(f)] = files.bytes_buffered(f);
    direct0[size_t(f)] = files.bytes_direct(f);
  }

  // 3. Run them: helper threads (started on first need, kept for later calls) and this one.
  res.wrote = true;
  const int want =
      int(std::max<int64_t>(1, std::min<int64_t>(opt.threads, pool.count()))) - 1;
  // Fewer threads than asked when some cannot start: the others and this one still finish
  // the work (workers take tasks from a shared counter).
  for (int t = int(c.group.started()); t < want; ++t)
    if (c.group.spawn([&c] { c.helper(); })) g_helpers_started.fetch_add(1);
  const int helpers = int(c.group.started());
  if (!c.own) {  // before the job is published (set up fully, then kept)
    std::unique_ptr<OpReader> own(new OpReader(c.shared));
    std::string e = own->init();
    c.own = std::move(own);
    c.own_error = std::move(e);
  } else if (!c.own_error.empty()) {
    c.own_error = c.own->init();  // (the bounce buffer only: init failed before anything else)
  }
  // From publishing to closing, helpers use `pool`: nothing may leave this function meanwhile
  // (a throw there terminates instead of freeing the job under them).
  [&]() noexcept {
    {
      std::lock_guard<std::mutex> lock(c.mu);
      c.job = &pool;
      c.open = true;
      ++c.generation;
    }
    *published = true;
    if (helpers > 0) c.work_cv.notify_all();
    pool.safe_work(*c.own, c.own_error);  // returns when no task is left or on failure
    std::unique_lock<std::mutex> lock(c.mu);
    c.open = false;
    c.done_cv.wait(lock, [&] { return c.active == 0; });
    c.job = nullptr;
  }();
  res.threads = 1 + helpers;
  res.tasks = pool.count();
  res.bytes_read = c.shared.bytes_read.load();
  res.files.resize(size_t(files.count()));
  for (int64_t f = 0; f < files.count(); ++f) {
    FileReport& r = res.files[size_t(f)];
    r.bytes_buffered = files.bytes_buffered(f) - buffered0[size_t(f)];
    r.bytes_direct = files.bytes_direct(f) - direct0[size_t(f)];
    r.direct_refused = files.direct_refused(f);
    r.refuse_reason = files.refuse_reason(f);
  }
  res.bytes_hashed = pool.hashed.load();
  res.bytes_reread = pool.reread.load();
  if (c.shared.cancel.load()) {
    res.ok = false;
    res.error = pool.error.empty() ? "reader thread failed" : pool.error;
    res.failed_op = pool.failed_op;
    if (pool.bad_block >= 0) {
      const VerifyBlock& b = blocks[pool.bad_block];
      res.mismatch = true;
      res.mismatch_file = b.file_index;
      res.mismatch_offset = b.offset;
      res.mismatch_length = b.length;
      res.mismatch_expected = b.digest;
      res.mismatch_got = pool.bad_got;
    }
  }
  return res;
}

ReadResult execute_reads(const std::vector<std::string>& paths, const ReadOp* ops, int64_t n,
                         const ReadOptions& opt, const VerifyBlock* blocks, int64_t nblocks) {
  ReadCrew crew(paths, opt);
  return crew.run(ops, n, blocks, nblocks);
}

}  // namespace io
}  // namespace metamat
