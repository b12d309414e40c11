// The NCCL subset NcclCommunicator calls, emulated for ranks that are threads of one process
// on the emulated device (runtime.cpp), so NcclCommunicator runs and is tested without GPUs.
//
// Model: emulated streams complete work before the call returns, so ncclGroupEnd does the
// group's transfers itself: it posts every send to its peer's mailbox, then takes each receive
// from the mailbox its peer posts to (in order, as NCCL matches a pair of ranks), copies, and
// returns once its own sends have been taken. A receive whose byte count differs from the
// matching send, or a peer that never posts one within SEQPAR_EMU_NCCL_TIMEOUT_S (default 60),
// fails the call with an explanation in ncclGetLastError instead of hanging.

#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace {

/// A posted send, waiting for its receive.
struct Message {
  const void* data;
  std::size_t bytes;
  bool taken = false;
};

/// The ranks of one communicator: their mailboxes and the split in progress.
struct World {
  explicit World(int n) : size(n), boxes(static_cast<std::size_t>(n) * n) {}
  int size;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::deque<std::shared_ptr<Message>>> boxes;  // [dest * size + source]

  /// One ncclCommSplit call across the ranks.
  struct Split {
    std::vector<int> color, key;
    int arrived = 0;
    std::vector<std::shared_ptr<World>> child;  // per rank (null: NCCL_SPLIT_NOCOLOR)
    std::vector<int> child_rank;
    bool done = false;
  };
  std::shared_ptr<Split> split;
};

thread_local std::string tls_last_error;

}  // namespace

struct ncclComm {
  std::shared_ptr<World> world;
  int rank;
};

namespace {

struct Op {
  bool send;
  void* buf;
  std::size_t bytes;
  int peer;
  ncclComm_t comm;
};
thread_local int tls_group_depth = 0;
thread_local std::vector<Op> tls_ops;

std::chrono::seconds timeout() {
  const char* e = std::getenv("SEQPAR_EMU_NCCL_TIMEOUT_S");
  return std::chrono::seconds(e ? std::atoi(e) : 60);
}

ncclResult_t fail(ncclResult_t rc, std::string why) {
  tls_last_error = "emulated NCCL: " + why;
  return rc;
}

std::size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
  }
}

/// Runs the queued group (see the file comment).
ncclResult_t run_group(std::vector<Op> ops) {
  std::vector<std::pair<World*, std::shared_ptr<Message>>> posted;
  for (const Op& op : ops) {
    if (!op.send) continue;
    World& w = *op.comm->world;
    auto m = std::make_shared<Message>(Message{op.buf, op.bytes});
    {
      std::lock_guard lock(w.mu);
      w.boxes[static_cast<std::size_t>(op.peer * w.size + op.comm->rank)].push_back(m);
    }
    w.cv.notify_all();
    posted.emplace_back(&w, std::move(m));
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout();
  for (const Op& op : ops) {
    if (op.send) continue;
    World& w = *op.comm->world;
    std::unique_lock lock(w.mu);
    auto& box = w.boxes[static_cast<std::size_t>(op.comm->rank * w.size + op.peer)];
    if (!w.cv.wait_until(lock, deadline, [&] { return !box.empty(); }))
      return fail(ncclSystemError, "rank " + std::to_string(op.comm->rank) + " timed out waiting for a send from rank " +
                                       std::to_string(op.peer));
    std::shared_ptr<Message> m = box.front();
    box.pop_front();
    if (m->bytes != op.bytes) {
      m->taken = true;  // release the sender; it reports nothing, as NCCL would not
      w.cv.notify_all();
      return fail(ncclInvalidUsage, "rank " + std::to_string(op.comm->rank) + " receives " + std::to_string(op.bytes) +
                                        " bytes from rank " + std::to_string(op.peer) + ", which sends " +
                                        std::to_string(m->bytes));
    }
    if (op.bytes) std::memcpy(op.buf, m->data, op.bytes);
    m->taken = true;
    lock.unlock();
    w.cv.notify_all();
  }
  for (auto& [w, m] : posted) {
    std::unique_lock lock(w->mu);
    if (!w->cv.wait_until(lock, deadline, [&] { return m->taken; }))
      return fail(ncclSystemError, "a send was never received");
  }
  return ncclSuccess;
}

ncclResult_t enqueue(Op op) {
  if (!op.comm) return fail(ncclInvalidArgument, "null communicator");
  if (op.peer < 0 || op.peer >= op.comm->world->size) return fail(ncclInvalidArgument, "peer out of range");
  if (op.peer == op.comm->rank) return fail(ncclInvalidUsage, "send/recv to itself");
  tls_ops.push_back(op);
  if (tls_group_depth == 0) {
    std::vector<Op> ops;
    ops.swap(tls_ops);
    return run_group(std::move(ops));
  }
  return ncclSuccess;
}

/// Communicators being created: unique id -> world.
struct Registry {
  std::mutex mu;
  std::map<std::string, std::pair<std::shared_ptr<World>, int>> pending;  // id -> (world, joined)
  std::atomic<std::uint64_t> next_id{1};
};
Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

extern "C" {

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id, 0, sizeof *id);
  const std::uint64_t n = registry().next_id++;
  std::memcpy(id->internal, "seqpar-emu", 10);
  std::memcpy(id->internal + 16, &n, sizeof n);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  if (nranks < 1 || rank < 0 || rank >= nranks) return fail(ncclInvalidArgument, "rank or nranks out of range");
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  auto& [world, joined] = r.pending[std::string(id.internal, sizeof id.internal)];
  if (!world) world = std::make_shared<World>(nranks);
  if (world->size != nranks) return fail(ncclInvalidUsage, "ranks disagree on nranks");
  *comm = new ncclComm{world, rank};
  if (++joined == nranks) r.pending.erase(std::string(id.internal, sizeof id.internal));
  return ncclSuccess;
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t*) {
  World& w = *comm->world;
  std::unique_lock lock(w.mu);
  if (!w.split) {
    w.split = std::make_shared<World::Split>();
    w.split->color.assign(static_cast<std::size_t>(w.size), 0);
    w.split->key.assign(static_cast<std::size_t>(w.size), 0);
  }
  std::shared_ptr<World::Split> s = w.split;
  s->color[static_cast<std::size_t>(comm->rank)] = color;
  s->key[static_cast<std::size_t>(comm->rank)] = key;
  if (++s->arrived == w.size) {
    s->child.resize(static_cast<std::size_t>(w.size));
    s->child_rank.assign(static_cast<std::size_t>(w.size), -1);
    std::map<int, std::vector<int>> members;
    for (int i = 0; i < w.size; ++i)
      if (s->color[static_cast<std::size_t>(i)] != NCCL_SPLIT_NOCOLOR) members[s->color[static_cast<std::size_t>(i)]].push_back(i);
    for (auto& [c, m] : members) {
      std::stable_sort(m.begin(), m.end(), [&](int a, int b) { return s->key[static_cast<std::size_t>(a)] < s->key[static_cast<std::size_t>(b)]; });
      auto child = std::make_shared<World>(static_cast<int>(m.size()));
      for (std::size_t i = 0; i < m.size(); ++i) {
        s->child[static_cast<std::size_t>(m[i])] = child;
        s->child_rank[static_cast<std::size_t>(m[i])] = static_cast<int>(i);
      }
    }
    s->done = true;
    w.split.reset();
    w.cv.notify_all();
  } else if (!w.cv.wait_until(lock, std::chrono::steady_clock::now() + timeout(), [&] { return s->done; })) {
    return fail(ncclSystemError, "ncclCommSplit: not every rank called it");
  }
  const auto me = static_cast<std::size_t>(comm->rank);
  *newcomm = s->child[me] ? new ncclComm{s->child[me], s->child_rank[me]} : nullptr;
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}
ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  *count = comm->world->size;
  return ncclSuccess;
}
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  *rank = comm->rank;
  return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
  ++tls_group_depth;
  return ncclSuccess;
}
ncclResult_t ncclGroupEnd() {
  if (tls_group_depth == 0) return fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--tls_group_depth > 0) return ncclSuccess;
  std::vector<Op> ops;
  ops.swap(tls_ops);
  return run_group(std::move(ops));
}

ncclResult_t ncclSend(const void* buf, std::size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t) {
  return enqueue({true, const_cast<void*>(buf), count * type_size(type), peer, comm});
}
ncclResult_t ncclRecv(void* buf, std::size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t) {
  return enqueue({false, buf, count * type_size(type), peer, comm});
}

const char* ncclGetErrorString(ncclResult_t rc) {
  switch (rc) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    default: return "unknown result code";
  }
}
const char* ncclGetLastError(ncclComm_t) { return tls_last_error.c_str(); }

}  // extern "C"
