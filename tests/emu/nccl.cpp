// The NCCL subset NcclCommunicator calls, emulated for ranks that are threads of one process
// on the emulated device (runtime.cpp), so NcclCommunicator runs and is tested without GPUs.
//
// Model: like the emulated CUDA work (streams.hpp), transfers are queued on their stream and
// run when something synchronises with it. ncclGroupEnd pairs each send with the receive its
// peer posts for it (in posting order per pair of ranks, as NCCL matches them) and queues
// both: the send's work copies the send buffer aside when the sender's stream reaches it, the
// receive's work, when the receiver's stream reaches it, first runs the sender's stream up to
// that send, then copies. A receive whose byte count differs from its send fails the group
// end that pairs them (ncclInvalidUsage, explained by ncclGetLastError); one whose send never
// comes fails its stream's synchronisation after SEQPAR_EMU_NCCL_TIMEOUT_S (default 60)
// instead of hanging.

#include <nccl.h>

#include "streams.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace {

/// A send: its bytes, set aside when the sender's stream runs it.
struct Message {
  std::size_t bytes;
  std::vector<std::byte> staging;
  seqpar_emu::Stream* stream = nullptr;  // the sender's stream ...
  std::uint64_t count = 0;               // ... has copied the bytes aside once it has run this much
};

/// A receive, and the send paired with it (null until the peer posts it).
struct Slot {
  std::shared_ptr<Message> send;
  std::size_t bytes;
  int from, to;
};

/// The ranks of one communicator: unpaired sends and receives per pair of ranks (under
/// seqpar_emu::queue_mutex), and the split in progress (under mu).
struct World {
  explicit World(int n)
      : size(n), sends(static_cast<std::size_t>(n) * n), recvs(static_cast<std::size_t>(n) * n) {}
  int size;
  std::vector<std::deque<std::shared_ptr<Message>>> sends;  // [dest * size + source]
  std::vector<std::deque<std::shared_ptr<Slot>>> recvs;     // [dest * size + source]
  std::mutex mu;
  std::condition_variable cv;

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
  cudaStream_t stream;
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

/// Pairs a receive with its send (under queue_mutex); the error when their sizes differ.
std::string pair_up(Slot& slot, std::shared_ptr<Message> send) {
  std::string error;
  if (send->bytes != slot.bytes)
    error = "rank " + std::to_string(slot.to) + " receives " + std::to_string(slot.bytes) + " bytes from rank " +
            std::to_string(slot.from) + ", which sends " + std::to_string(send->bytes);
  slot.send = std::move(send);
  seqpar_emu::queue_cv().notify_all();
  return error;
}

/// Queues the group's sends, then its receives (see the file comment).
ncclResult_t run_group(std::vector<Op> ops) {
  std::string error;
  auto note = [&](std::string e) {
    if (error.empty()) error = std::move(e);
  };
  for (const Op& op : ops) {  // sends first: they never wait
    if (!op.send) continue;
    World& w = *op.comm->world;
    auto m = std::make_shared<Message>();
    m->bytes = op.bytes;
    seqpar_emu::Stream* s = seqpar_emu::stream_of(op.stream);
    const void* buf = op.buf;
    const std::uint64_t n = seqpar_emu::enqueue(s, [m, buf] {
      const auto* p = static_cast<const std::byte*>(buf);
      m->staging.assign(p, p + m->bytes);
      return cudaSuccess;
    });
    std::lock_guard lock(seqpar_emu::queue_mutex());
    m->stream = s;
    m->count = n;
    const auto pair = static_cast<std::size_t>(op.peer * w.size + op.comm->rank);
    if (!w.recvs[pair].empty()) {
      note(pair_up(*w.recvs[pair].front(), m));
      w.recvs[pair].pop_front();
    } else {
      w.sends[pair].push_back(m);
    }
  }
  for (const Op& op : ops) {
    if (op.send) continue;
    World& w = *op.comm->world;
    auto slot = std::make_shared<Slot>(Slot{nullptr, op.bytes, op.peer, op.comm->rank});
    {
      std::lock_guard lock(seqpar_emu::queue_mutex());
      const auto pair = static_cast<std::size_t>(op.comm->rank * w.size + op.peer);
      if (!w.sends[pair].empty()) {
        note(pair_up(*slot, w.sends[pair].front()));
        w.sends[pair].pop_front();
      } else {
        w.recvs[pair].push_back(slot);
      }
    }
    void* buf = op.buf;
    seqpar_emu::enqueue(seqpar_emu::stream_of(op.stream), [slot, buf]() -> cudaError_t {
      std::shared_ptr<Message> m;
      {
        std::unique_lock lock(seqpar_emu::queue_mutex());
        if (!seqpar_emu::queue_cv().wait_until(lock, std::chrono::steady_clock::now() + timeout(),
                                               [&] { return slot->send != nullptr; })) {
          std::fprintf(stderr, "seqpar_emu: NCCL: rank %d waited %lld s for a send from rank %d that never came\n",
                       slot->to, static_cast<long long>(timeout().count()), slot->from);
          return cudaErrorLaunchTimeout;
        }
        m = slot->send;
      }
      if (m->bytes != slot->bytes) return cudaErrorInvalidValue;  // reported when paired
      if (const cudaError_t rc = seqpar_emu::run_until(m->stream, m->count); rc != cudaSuccess) return rc;
      if (slot->bytes) std::memcpy(buf, m->staging.data(), slot->bytes);
      return cudaSuccess;
    });
  }
  return error.empty() ? ncclSuccess : fail(ncclInvalidUsage, error);
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

ncclResult_t ncclSend(const void* buf, std::size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return enqueue({true, const_cast<void*>(buf), count * type_size(type), peer, comm, stream});
}
ncclResult_t ncclRecv(void* buf, std::size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return enqueue({false, buf, count * type_size(type), peer, comm, stream});
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
