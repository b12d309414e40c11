// ThreadCommunicator's fast paths allocate nothing: once warmed up, ring exchanges (several
// in flight to one peer), all-to-alls and barriers on 2..5 ranks, and whole forward and
// backward calls of every policy, perform no heap allocation inside the communicator. This
// program replaces the global operator new to count allocations, so it is its own test
// program; the results are still checked against exact references.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "support/backward_check.hpp"
#include "support/decode_check.hpp"
#include "support/paged_check.hpp"

namespace {

/// While set, allocations on every thread count in `allocations` (pool workers included).
std::atomic<bool> count_everywhere{false};
/// Allocations on any thread while count_everywhere was set.
std::atomic<std::uint64_t> allocations{0};
/// While positive, allocations on this thread count in `here`.
thread_local int count_here = 0;
/// This thread's allocations while count_here was positive.
thread_local std::uint64_t here = 0;

void* counted_alloc(std::size_t bytes, std::size_t align) {
  if (count_here > 0) ++here;
  if (count_everywhere.load(std::memory_order_relaxed)) ++allocations;
  if (bytes == 0) bytes = 1;
  void* p = align > alignof(std::max_align_t) ? std::aligned_alloc(align, (bytes + align - 1) / align * align)
                                              : std::malloc(bytes);
  if (!p) throw std::bad_alloc();
  return p;
}

/// Out of line, so that GCC does not pair the inlined malloc with a visible free and warn
/// (-Wmismatched-new-delete) about what is a matched replacement pair.
[[gnu::noinline]] void counted_free(void* p) noexcept { std::free(p); }

}  // namespace

void* operator new(std::size_t n) { return counted_alloc(n, 0); }
void* operator new[](std::size_t n) { return counted_alloc(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) { return counted_alloc(n, static_cast<std::size_t>(a)); }
void* operator new[](std::size_t n, std::align_val_t a) { return counted_alloc(n, static_cast<std::size_t>(a)); }
void operator delete(void* p) noexcept { counted_free(p); }
void operator delete[](void* p) noexcept { counted_free(p); }
void operator delete(void* p, std::size_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::size_t) noexcept { counted_free(p); }
void operator delete(void* p, std::align_val_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { counted_free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { counted_free(p); }

using namespace seqpar;

namespace {

/// Counts this thread's allocations while alive.
struct CountHere {
  CountHere() { ++count_here; }
  ~CountHere() { --count_here; }
  CountHere(const CountHere&) = delete;
  CountHere& operator=(const CountHere&) = delete;
};

/// Byte `i` of the message `from` sends to `to` in round `round` (checkable without storage).
std::byte payload(int round, int from, int to, std::size_t i) {
  return static_cast<std::byte>((round * 131 + from * 37 + to * 11 + static_cast<int>(i) * 7 + 5) & 0xff);
}

/// Size of that message: varies with the round, zero now and then.
std::size_t message_bytes(int round, int from, int to) {
  return static_cast<std::size_t>((round * 977 + from * 613 + to * 389) % 1500);
}

/// Fills `buf` with the message `from` sends to `to`; returns its size.
std::size_t fill(std::vector<std::byte>& buf, int round, int from, int to) {
  const std::size_t n = message_bytes(round, from, to);
  for (std::size_t i = 0; i < n; ++i) buf[i] = payload(round, from, to, i);
  return n;
}

/// True when `buf` holds the message `from` sent to `to`.
bool holds(const std::vector<std::byte>& buf, int round, int from, int to) {
  for (std::size_t i = 0; i < message_bytes(round, from, to); ++i)
    if (buf[i] != payload(round, from, to, i)) return false;
  return true;
}

/// One round on `c`: three exchanges in flight to the next rank (and from the previous one)
/// plus one the other way, waited in start order; an all-to-all of uneven pieces; a barrier.
/// Round 0 posts every exchange before any rank waits, so that the message queues reach
/// their deepest in the warm-up. Returns whether every byte arrived as sent.
bool traffic_round(ThreadCommunicator& c, int round, std::vector<std::vector<std::byte>>& send,
                   std::vector<std::vector<std::byte>>& recv, std::vector<std::byte>& a2a_send,
                   std::vector<std::byte>& a2a_recv) {
  const int P = c.size(), me = c.rank(), next = (me + 1) % P, prev = (me + P - 1) % P;
  constexpr int forward_hops = 3;
  ThreadCommunicator::request_type reqs[forward_hops + 1];
  for (int h = 0; h <= forward_hops; ++h) {
    const bool back = h == forward_hops;  // the last one runs the other way round the ring
    const int to = back ? prev : next, from = back ? next : prev, r = round * 8 + h;
    const std::size_t n = fill(send[h], r, me, to);
    reqs[h] = c.start_exchange(send[h].data(), n, to, recv[h].data(), message_bytes(r, from, me), from,
                               call_tag(CallKind::other, static_cast<std::uint64_t>(round)));  // tags cost nothing
  }
  if (round == 0) c.barrier();
  bool ok = true;
  for (int h = 0; h <= forward_hops; ++h) {
    c.wait(reqs[h]);
    ok = ok && holds(recv[h], round * 8 + h, h == forward_hops ? next : prev, me);
  }
  std::size_t sc[5], sd[5], rc[5], rd[5];
  std::size_t off = 0, roff = 0;
  for (int j = 0; j < P; ++j) {
    sc[j] = message_bytes(round, me, j) / 4;
    sd[j] = off;
    for (std::size_t i = 0; i < sc[j]; ++i) a2a_send[off + i] = payload(round, me, j, i);
    off += sc[j];
    rc[j] = message_bytes(round, j, me) / 4;
    rd[j] = roff;
    roff += rc[j];
  }
  c.all_to_all_v(a2a_send.data(), {sc, sc + P}, {sd, sd + P}, a2a_recv.data(), {rc, rc + P}, {rd, rd + P});
  for (int j = 0; j < P; ++j)
    for (std::size_t i = 0; i < rc[j]; ++i) ok = ok && a2a_recv[rd[j] + i] == payload(round, j, me, i);
  c.barrier();
  return ok;
}

}  // namespace

TEST_CASE("thread comm alloc: warmed-up exchanges, all-to-alls and barriers allocate nothing") {
  for (int P = 2; P <= 5; ++P) {
    CAPTURE(P);
    std::atomic<std::uint64_t> warm_up{0}, steady{0};
    std::atomic<bool> all_ok{true};
    test::within(std::chrono::seconds(60), [&] {
      run_ranks(P, [&](ThreadCommunicator& c) {
        std::vector<std::vector<std::byte>> send(4, std::vector<std::byte>(1500)), recv = send;
        std::vector<std::byte> a2a_send(5 * 1500), a2a_recv(5 * 1500);
        bool ok = true;
        const std::uint64_t before = here;
        {
          CountHere counting;
          ok = traffic_round(c, 0, send, recv, a2a_send, a2a_recv);
        }
        warm_up += here - before;
        const std::uint64_t start = here;
        {
          CountHere counting;
          for (int round = 1; round <= 100; ++round) ok = traffic_round(c, round, send, recv, a2a_send, a2a_recv) && ok;
        }
        steady += here - start;
        if (!ok) all_ok = false;
      });
    });
    CHECK(all_ok);
    MESSAGE("P = ", P, ": ", warm_up.load(), " allocations in the first round (all ranks), ", steady.load(),
            " in the next 100");
    CHECK(steady == 0);
  }
}

namespace {

/// ThreadCommunicator that counts the allocations made inside its calls on the calling
/// thread: what the communicator itself allocates, apart from the kernel and the policy.
struct CountingComm {
  static constexpr bool is_seqpar_communicator = true;       ///< opts in to the Communicator concept
  using memory_space = ThreadCommunicator::memory_space;   ///< host
  using request_type = ThreadCommunicator::request_type;   ///< the inner request

  ThreadCommunicator inner;  ///< the communicator measured

  /// This rank.
  int rank() const { return inner.rank(); }
  /// Ranks in the group.
  int size() const { return inner.size(); }
  /// The inner all-to-all, counted.
  void all_to_all_v(const std::byte* s, std::span<const std::size_t> sc, std::span<const std::size_t> sd, std::byte* r,
                    std::span<const std::size_t> rc, std::span<const std::size_t> rd) {
    CountHere counting;
    inner.all_to_all_v(s, sc, sd, r, rc, rd);
  }
  /// The inner start_exchange with the engine's call tag, counted (the tag and the failure
  /// latch are on the path the engine takes, so their checks are counted too).
  request_type start_exchange(const std::byte* s, std::size_t sb, int dest, std::byte* r, std::size_t rb, int src,
                              std::uint64_t tag = untagged_exchange) {
    CountHere counting;
    return inner.start_exchange(s, sb, dest, r, rb, src, tag);
  }
  /// The inner failure latch.
  void fail(std::string_view reason) noexcept { inner.fail(reason); }
  /// The inner failure latch.
  bool failed() const noexcept { return inner.failed(); }
  /// The inner wait, counted.
  void wait(request_type& req) {
    CountHere counting;
    inner.wait(req);
  }
  /// The inner all-gather (made only when planning; counted all the same).
  void all_gather_host(std::span<const std::int64_t> mine, std::span<std::int64_t> all) {
    CountHere counting;
    inner.all_gather_host(mine, all);
  }
  /// The inner barrier, counted.
  void barrier() {
    CountHere counting;
    inner.barrier();
  }
  /// Splits the inner communicator (construction time: not counted).
  CountingComm split(int color, int key) { return {inner.split(color, key)}; }
  /// The inner counters.
  const CommStats& stats() const { return inner.stats(); }
  /// The inner counters.
  CommStats& stats() { return inner.stats(); }
};
static_assert(Communicator<CountingComm>);
static_assert(detail::has_tagged_exchange<CountingComm> && detail::has_failure_latch<CountingComm>);

/// Allocations of warmed-up calls, summed over the ranks.
struct StepAllocations {
  std::uint64_t in_comm = 0;   ///< inside communicator calls
  std::uint64_t forward = 0;   ///< anywhere during the forward calls (kernel, policy, pool workers)
  std::uint64_t backward = 0;  ///< anywhere during the backward calls
};

/// Counts every thread's allocations while `calls` runs on every rank of `world` (between
/// barriers, so no rank counts another's work outside the window); returns them on rank 0.
template <class Calls>
std::uint64_t count_everywhere_during(ThreadCommunicator& world, Calls&& calls) {
  world.barrier();
  if (world.rank() == 0) count_everywhere = true;
  world.barrier();
  const std::uint64_t before = allocations;
  calls();
  world.barrier();
  if (world.rank() == 0) count_everywhere = false;
  world.barrier();
  return allocations - before;
}

/// Runs `Policy` with `kernel` on 4 ranks: a warm-up forward + backward (unless `warm_up` is
/// false: then the counted calls are the first after the plan), then three more of each,
/// counted. Checks the last ones against the exact reference.
template <class Policy, class Kernel>
StepAllocations count_steps(Policy policy, Kernel kernel = {}, bool warm_up = true) {
  using T = float;
  const test::GlobalShape c = test::make_case(48, 4, 2, 16, true, 5);
  const auto g = test::make_global_as<T>(c);
  const auto gr = test::make_global_grads(g);
  StepAllocations res;
  std::mutex mu;
  test::GradErrors grad_err;
  test::ErrorStats out_err;
  test::within(std::chrono::seconds(60), [&] {
    run_ranks(4, [&](ThreadCommunicator& world) {
      CountingComm comm{world};
      const int w = comm.rank();
      SequenceParallelAttention<Policy, CountingComm, Kernel> attn(comm, policy, kernel);
      const Plan plan = attn.plan(c.problem<T>(true), {12, -1});
      const PositionMap qp = plan.q_positions(w), kp = plan.kv_positions(w);
      const auto B = c.batch, H = c.heads, K = c.kv_heads, D = c.head_dim, lq = qp.size(), lk = kp.size();
      test::LocalSlices<T> x = test::local_slices<T>(g, qp, kp);
      const auto& q = x.q;
      const auto& k = x.k;
      const auto& v = x.v;
      std::vector<T>& out = x.out;
      const auto dout = test::take_rows<T>(g.dout, B, c.seq_q, H, D, qp);
      std::vector<T> dq(q.size()), dk(k.size()), dv(v.size());
      std::vector<acc_t<T>> lse(static_cast<std::size_t>(B * lq * H));
      std::vector<std::byte> ws(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
      using CV = TensorView<const T>;
      using MV = TensorView<T>;
      const auto lse_view = TensorView<acc_t<T>>::lse_bhs(lse.data(), B, lq, H);
      auto forward = [&] {
        attn.template forward<T>(plan, CV::bshd(q.data(), B, lq, H, D), CV::bshd(k.data(), B, lk, K, D),
                                 CV::bshd(v.data(), B, lk, K, D), MV::bshd(out.data(), B, lq, H, D), lse_view, ws);
      };
      auto backward = [&] {
        attn.template backward<T>(plan, CV::bshd(dout.data(), B, lq, H, D), CV::bshd(q.data(), B, lq, H, D),
                                  CV::bshd(k.data(), B, lk, K, D), CV::bshd(v.data(), B, lk, K, D),
                                  CV::bshd(out.data(), B, lq, H, D), lse_view, MV::bshd(dq.data(), B, lq, H, D),
                                  MV::bshd(dk.data(), B, lk, K, D), MV::bshd(dv.data(), B, lk, K, D), ws);
      };
      if (warm_up) {
        forward();
        backward();
      }
      const std::uint64_t comm_before = here;
      const std::uint64_t fwd = count_everywhere_during(world, [&] {
        for (int i = 0; i < 3; ++i) forward();
      });
      const std::uint64_t bwd = count_everywhere_during(world, [&] {
        for (int i = 0; i < 3; ++i) backward();
      });
      std::lock_guard lock(mu);
      res.in_comm += here - comm_before;
      if (w == 0) {
        res.forward = fwd;
        res.backward = bwd;
      }
      out_err.merge(test::compare(out, test::take_rows<double>(g.out, B, c.seq_q, H, D, qp)));
      grad_err.merge(test::compare_grads(dq, dk, dv, gr, c, qp, kp));
    });
  });
  CHECK(out_err.rel() <= 1e-5);
  CHECK(grad_err.worst() <= 1e-4);
  CHECK_FALSE(grad_err.nan());
  return res;
}

}  // namespace

TEST_CASE("thread comm alloc: warmed-up forward and backward allocate nothing in the communicator") {
  // The communicator must allocate nothing with any kernel. CpuFlashKernel and the policies
  // promise the same for the whole call; ReferenceKernel (a plain exact reference) allocates
  // its row buffers per call, which is only reported.
  auto check = [](const std::string& what, StepAllocations a, bool whole_call) {
    MESSAGE(what, ": over 3 calls on 4 ranks, ", a.in_comm, " allocations in the communicator; ", a.forward,
            " in all during the forwards, ", a.backward, " during the backwards");
    CHECK(a.in_comm == 0);
    if (whole_call) {
      CHECK(a.forward == 0);
      CHECK(a.backward == 0);
    }
  };
  check("Ring, CpuFlashKernel", count_steps<RingPolicy<Zigzag>, CpuFlashKernel>({}), true);
  check("Ulysses, CpuFlashKernel", count_steps<UlyssesPolicy, CpuFlashKernel>({}), true);
  check("Unified 2x2, CpuFlashKernel", count_steps<UnifiedPolicy<>, CpuFlashKernel>({2, 2}), true);
  check("Ring, ReferenceKernel", count_steps<RingPolicy<>, ReferenceKernel>({}), false);
  check("Ulysses, ReferenceKernel", count_steps<UlyssesPolicy, ReferenceKernel>({}), false);
  check("Unified 2x2, ReferenceKernel", count_steps<UnifiedPolicy<>, ReferenceKernel>({2, 2}), false);
}

TEST_CASE("thread comm alloc: the first forward and backward after plan allocate nothing, threaded kernel included") {
  // plan sizes every buffer (the kernel's through reserve: its turn counters and decode
  // partials), so not even the first call allocates, with 1 or 2 kernel threads.
  for (int threads : {1, 2}) {
    CAPTURE(threads);
    for (const StepAllocations a : {count_steps<RingPolicy<Zigzag>>({}, CpuFlashKernel(threads), false),
                                    count_steps<UlyssesPolicy>({}, CpuFlashKernel(threads), false),
                                    count_steps<UnifiedPolicy<>>({2, 2}, CpuFlashKernel(threads), false)}) {
      CHECK(a.in_comm == 0);
      CHECK(a.forward == 0);
      CHECK(a.backward == 0);
    }
  }
}

TEST_CASE("thread comm alloc: warmed-up decode steps allocate nothing at all") {
  // An inference engine calls step once per generated token: after the first step (the
  // kernel's and the communicator's buffers warm), a step allocates nothing anywhere. The
  // outputs are still checked against the double reference.
  using E = DecodeExchange;
  for (const test::DecodeCase& c : {test::DecodeCase{4, {3000, 517}, 16, 1, 4, 2, E::all_gather, 4},
                                    test::DecodeCase{3, {61, 300}, 0, 4, 6, 3, E::heads, 4}}) {
    CAPTURE(static_cast<int>(c.exchange));
    std::atomic<std::uint64_t> counted{0};
    const double err = test::run_decode_case<CpuFlashKernel>(c, [&](ThreadCommunicator& world, int s, auto&& step) {
      if (s == 0) return step();
      const std::uint64_t n = count_everywhere_during(world, step);
      if (world.rank() == 0) counted += n;
    });
    CHECK(err < 1e-5);
    CHECK(counted == 0);
  }
}

TEST_CASE("thread comm alloc: paged decode steps allocate nothing, from the first step on, threaded kernel included") {
  // Continuous batching changes the batch, its rows and every block table each step, and the
  // plan's maxima still size every buffer: no step allocates, not even the first. Prompts long
  // enough that the two kernel threads split a sequence's keys (its partials were sized at
  // plan by reserve).
  const test::PagedCase c{.ranks = 3, .interleave = 16, .page_size = 16, .heads = 8, .kv_heads = 2,
                          .exchange = DecodeExchange::all_gather, .steps = 8, .max_prompt = 3500};
  const test::Schedule sch(c);
  std::atomic<std::uint64_t> counted{0};
  std::vector<double> err(static_cast<std::size_t>(c.ranks));
  run_ranks(c.ranks, [&](ThreadCommunicator& world) {
    auto counting = [&](auto& dec, PagedDecodePlan& plan, const DecodeBatch& batch, const std::vector<float>& q,
                        const test::RankPool& pool, std::vector<float>& out, std::span<std::byte> ws) {
      std::int64_t rows = 0;
      const std::uint64_t n =
          count_everywhere_during(world, [&] { rows = test::HostStep{}(dec, plan, batch, q, pool, out, ws); });
      if (world.rank() == 0) counted += n;
      return rows;
    };
    err[static_cast<std::size_t>(world.rank())] =
        test::paged_rank_error(world, c, sch, counting, DType::f32, CpuFlashKernel(CpuFlashOptions{.threads = 2}));
  });
  CHECK(*std::max_element(err.begin(), err.end()) < 1e-5);
  CHECK(counted == 0);
}
