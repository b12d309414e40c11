// ThreadCommunicator and run_ranks: variable-count all-to-all, paired exchanges, the host
// metadata channel, split, the traffic counters, and failure handling (a rank that throws
// wakes the others; nothing hangs). Every multi-rank call runs under a watchdog.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "support/attention_check.hpp"
#include "support/rank_outcomes.hpp"
#include "support/scoped_env.hpp"

using namespace seqpar;
using namespace std::chrono_literals;

namespace {

/// Runs `fn` on `ranks` threads with a time-out, under a watchdog.
template <class Fn>
void ranks_with_watchdog(int ranks, Fn&& fn, std::chrono::milliseconds timeout = 30000ms) {
  test::within(timeout + 30000ms, [&] { run_ranks(ranks, fn, ThreadRunOptions{timeout}); }, "run_ranks");
}

/// The byte rank `from` puts at offset `i` of the piece it sends to rank `to`.
std::byte pattern(int from, int to, std::size_t i) {
  return static_cast<std::byte>((from * 37 + to * 11 + static_cast<int>(i) * 3 + 1) & 0xff);
}

/// Uneven piece sizes, zero for some pairs (the piece to self included sometimes).
std::size_t piece_bytes(int from, int to) { return static_cast<std::size_t>((from * 5 + to * 3) % 7); }

}  // namespace

TEST_CASE("thread comm: all_to_all_v with uneven counts, zero pieces and gaps") {
  for (int P : {1, 2, 3, 5, 8}) {
    CAPTURE(P);
    ranks_with_watchdog(P, [P](ThreadCommunicator& c) {
      const int me = c.rank();
      REQUIRE(c.size() == P);
      std::vector<std::size_t> sc(P), sd(P), rc(P), rd(P);
      // Send pieces in reverse peer order, with a one-byte gap, to test displacements.
      std::size_t off = 0;
      for (int j = P - 1; j >= 0; --j) {
        sc[j] = piece_bytes(me, j);
        sd[j] = off;
        off += sc[j] + 1;
      }
      std::vector<std::byte> send(off + 1, std::byte{0xEE});
      for (int j = 0; j < P; ++j)
        for (std::size_t i = 0; i < sc[j]; ++i) send[sd[j] + i] = pattern(me, j, i);
      std::size_t roff = 0;
      for (int j = 0; j < P; ++j) {
        rc[j] = piece_bytes(j, me);
        rd[j] = roff;
        roff += rc[j] + 2;
      }
      std::vector<std::byte> recv(roff + 1, std::byte{0xAA});
      c.stats().reset();
      c.all_to_all_v(send.data(), sc, sd, recv.data(), rc, rd);
      for (int j = 0; j < P; ++j) {
        for (std::size_t i = 0; i < rc[j]; ++i) REQUIRE(recv[rd[j] + i] == pattern(j, me, i));
        // The gap after each piece is untouched.
        REQUIRE(recv[rd[j] + rc[j]] == std::byte{0xAA});
      }
      // Counters: bytes and non-empty pieces to others; the piece to self is not traffic.
      std::uint64_t bytes = 0, msgs = 0;
      for (int j = 0; j < P; ++j)
        if (j != me && piece_bytes(me, j) > 0) {
          bytes += piece_bytes(me, j);
          ++msgs;
        }
      CHECK(c.stats().bytes_sent == bytes);
      CHECK(c.stats().messages_sent == msgs);
      CHECK(c.stats().all_to_alls == 1);
      CHECK(c.stats().host_gathers == 0);
    });
  }
}

TEST_CASE("thread comm: all_to_all_v reused many times in a row (buffers are not overwritten early)") {
  // Back-to-back calls with the same buffers: a rank may not refill its send buffer while a
  // slower peer still copies from it.
  ranks_with_watchdog(4, [](ThreadCommunicator& c) {
    const int P = c.size(), me = c.rank();
    std::vector<std::size_t> counts(P, sizeof(int)), displs(P);
    for (int j = 0; j < P; ++j) displs[j] = j * sizeof(int);
    std::vector<int> send(P), recv(P);
    for (int it = 0; it < 200; ++it) {
      for (int j = 0; j < P; ++j) send[j] = it * 1000 + me * 10 + j;
      c.all_to_all_v(reinterpret_cast<const std::byte*>(send.data()), counts, displs,
                     reinterpret_cast<std::byte*>(recv.data()), counts, displs);
      for (int j = 0; j < P; ++j) REQUIRE(recv[j] == it * 1000 + j * 10 + me);
    }
  });
}

TEST_CASE("thread comm: all_to_all_v count mismatch throws CommError on the ranks, nothing hangs") {
  CHECK_THROWS_AS(ranks_with_watchdog(3,
                                      [](ThreadCommunicator& c) {
                                        const int P = c.size();
                                        std::vector<std::size_t> counts(P, 4), displs(P, 0), rcounts(P, 4);
                                        if (c.rank() == 1) rcounts[0] = 8;  // expects more than rank 0 sends
                                        std::vector<std::byte> buf(64);
                                        for (int j = 0; j < P; ++j) displs[j] = 8 * j;
                                        c.all_to_all_v(buf.data(), counts, displs, buf.data() + 32, rcounts, displs);
                                      }),
                  CommError);
}

TEST_CASE("thread comm: exchange around a ring, messages of different sizes, in order") {
  for (int P : {1, 2, 3, 7}) {
    CAPTURE(P);
    ranks_with_watchdog(P, [P](ThreadCommunicator& c) {
      const int me = c.rank(), next = (me + 1) % P, prev = (me - 1 + P) % P;
      // Rank r's block has r + 1 ints; it travels the whole ring in P - 1 steps.
      std::vector<int> cur(me + 1), nxt(P + 1);
      for (int i = 0; i <= me; ++i) cur[i] = me * 100 + i;
      int holder = me;  // whose block `cur` holds
      c.stats().reset();
      std::uint64_t sent = 0;
      for (int s = 0; s + 1 < P; ++s) {
        const int incoming = (holder - 1 + P) % P;
        auto req = c.start_exchange(reinterpret_cast<const std::byte*>(cur.data()), cur.size() * sizeof(int), next,
                                    reinterpret_cast<std::byte*>(nxt.data()), (incoming + 1) * sizeof(int), prev);
        sent += cur.size() * sizeof(int);
        c.wait(req);
        cur.assign(nxt.begin(), nxt.begin() + incoming + 1);
        holder = incoming;
        for (int i = 0; i <= holder; ++i) REQUIRE(cur[i] == holder * 100 + i);
      }
      CHECK(c.stats().bytes_sent == sent);
      CHECK(c.stats().messages_sent == static_cast<std::uint64_t>(P - 1));
      CHECK(c.stats().exchanges == static_cast<std::uint64_t>(P - 1));
    });
  }
  SUBCASE("two exchanges to one peer started before waiting arrive in order") {
    ranks_with_watchdog(2, [](ThreadCommunicator& c) {
      const int other = 1 - c.rank();
      const int a = 10 + c.rank(), b = 20 + c.rank();
      int ra = 0, rb = 0;
      auto r1 = c.start_exchange(reinterpret_cast<const std::byte*>(&a), sizeof a, other,
                                 reinterpret_cast<std::byte*>(&ra), sizeof ra, other);
      auto r2 = c.start_exchange(reinterpret_cast<const std::byte*>(&b), sizeof b, other,
                                 reinterpret_cast<std::byte*>(&rb), sizeof rb, other);
      c.wait(r1);
      c.wait(r2);
      CHECK(ra == 10 + other);
      CHECK(rb == 20 + other);
    });
  }
  SUBCASE("an exchange with oneself is a copy and not traffic") {
    ranks_with_watchdog(1, [](ThreadCommunicator& c) {
      const double x = 3.5;
      double y = 0;
      auto r = c.start_exchange(reinterpret_cast<const std::byte*>(&x), sizeof x, 0, reinterpret_cast<std::byte*>(&y),
                                sizeof y, 0);
      c.wait(r);
      CHECK(y == 3.5);
      CHECK(c.stats().bytes_sent == 0);
    });
  }
}

TEST_CASE("thread comm: many exchanges in flight to one peer, waited in start order, random sizes") {
  // More sends outstanding on one pair than the reused message slots hold at first, with
  // waits and new starts interleaved, so the slots wrap around and grow while in use.
  for (int P : {2, 3}) {
    CAPTURE(P);
    ranks_with_watchdog(P, [P](ThreadCommunicator& c) {
      const int me = c.rank(), next = (me + 1) % P, prev = (me + P - 1) % P;
      // Message m of rank r: size and bytes from a generator seeded by (r, m).
      auto message = [](int from, int m) {
        std::mt19937 gen(static_cast<unsigned>(from * 100003 + m));
        std::vector<std::byte> v(gen() % 300);
        for (auto& b : v) b = static_cast<std::byte>(gen() & 0xff);
        return v;
      };
      constexpr int total = 60;
      std::vector<std::vector<std::byte>> sent(total), got(total);
      std::deque<std::pair<int, ThreadCommunicator::request_type>> live;
      std::mt19937 pace(static_cast<unsigned>(me + 7));
      for (int m = 0; m < total; ++m) {
        sent[m] = message(me, m);
        got[m].resize(message(prev, m).size());
        live.emplace_back(m, c.start_exchange(sent[m].data(), sent[m].size(), next, got[m].data(), got[m].size(), prev));
        // Wait for the oldest ones now and then (up to 9 stay in flight).
        while (live.size() > 9 || (!live.empty() && pace() % 3 == 0)) {
          c.wait(live.front().second);
          REQUIRE(got[live.front().first] == message(prev, live.front().first));
          live.pop_front();
        }
      }
      for (auto& [m, req] : live) {
        c.wait(req);
        REQUIRE(got[m] == message(prev, m));
      }
    });
  }
}

TEST_CASE("thread comm: requests not started, moved, or reused after completion") {
  ranks_with_watchdog(2, [](ThreadCommunicator& c) {
    const int other = 1 - c.rank();
    ThreadCommunicator::request_type none;
    c.wait(none);  // not started: returns at once
    int x = 40 + c.rank(), y = 0;
    auto first = c.start_exchange(reinterpret_cast<const std::byte*>(&x), sizeof x, other,
                                  reinterpret_cast<std::byte*>(&y), sizeof y, other);
    ThreadCommunicator::request_type moved = std::move(first);
    c.wait(first);  // moved from: nothing to do
    c.wait(moved);
    CHECK(y == 40 + other);
    // Assigning over a completed request, as a ring loop does every step.
    x = 50 + c.rank();
    moved = c.start_exchange(reinterpret_cast<const std::byte*>(&x), sizeof x, other, reinterpret_cast<std::byte*>(&y),
                             sizeof y, other);
    c.wait(moved);
    CHECK(y == 50 + other);
  });
}

TEST_CASE("thread comm: a request dropped without waiting fails the group, nothing hangs") {
  // The peer would otherwise wait forever for a message its sender gave up.
  const auto start = std::chrono::steady_clock::now();
  std::atomic<int> aborted{0};
  CHECK_THROWS_WITH_AS(ranks_with_watchdog(2,
                                           [&](ThreadCommunicator& c) {
                                             const int other = 1 - c.rank();
                                             std::vector<std::byte> s(64, std::byte{1}), r(64);
                                             try {
                                               if (c.rank() == 0) {
                                                 (void)c.start_exchange(s.data(), 64, other, r.data(), 64, other);
                                                 c.barrier();
                                               } else {
                                                 auto req = c.start_exchange(s.data(), 64, other, r.data(), 64, other);
                                                 c.wait(req);
                                               }
                                             } catch (const CommAborted&) {
                                               ++aborted;
                                               throw;
                                             }
                                           }),
                       doctest::Contains("rank 0 dropped an exchange (to rank 1) without waiting for it"),
                       CommAborted);
  CHECK(aborted == 2);
  CHECK(std::chrono::steady_clock::now() - start < 20s);
}

TEST_CASE("thread comm: exchange size mismatch throws CommError, nothing hangs") {
  CHECK_THROWS_AS(ranks_with_watchdog(2,
                                      [](ThreadCommunicator& c) {
                                        const int other = 1 - c.rank();
                                        std::vector<std::byte> s(16), r(16);
                                        const std::size_t expect = c.rank() == 0 ? 8 : 16;
                                        auto req = c.start_exchange(s.data(), 16, other, r.data(), expect, other);
                                        c.wait(req);
                                      }),
                  CommError);
}

TEST_CASE("thread comm: all_gather_host and barrier") {
  ranks_with_watchdog(5, [](ThreadCommunicator& c) {
    const std::int64_t mine[3] = {c.rank(), c.rank() * c.rank(), -7};
    std::vector<std::int64_t> all(15);
    c.all_gather_host(mine, all);
    for (int j = 0; j < 5; ++j) {
      CHECK(all[3 * j] == j);
      CHECK(all[3 * j + 1] == j * j);
      CHECK(all[3 * j + 2] == -7);
    }
    CHECK(c.stats().host_gathers == 1);
    CHECK(c.stats().bytes_sent == 0);  // the metadata channel is not payload traffic
    for (int i = 0; i < 50; ++i) c.barrier();
  });
  SUBCASE("an output of the wrong size is a ConfigError") {
    ranks_with_watchdog(1, [](ThreadCommunicator& c) {
      const std::int64_t mine[2] = {1, 2};
      std::vector<std::int64_t> all(3);
      CHECK_THROWS_AS(c.all_gather_host(mine, all), ConfigError);
    });
  }
  SUBCASE("ranks giving different counts throw, nothing hangs") {
    CHECK_THROWS_AS(ranks_with_watchdog(3,
                                        [](ThreadCommunicator& c) {
                                          const int n = c.rank() == 2 ? 2 : 1;
                                          std::vector<std::int64_t> mine(n, 1), all(3 * n);
                                          c.all_gather_host(mine, all);
                                        }),
                    CommError);
  }
}

TEST_CASE("thread comm: split by color and key; stats are shared with the parent") {
  ranks_with_watchdog(6, [](ThreadCommunicator& world) {
    const int me = world.rank();
    // Colors by parity; keys reverse the order inside a color.
    ThreadCommunicator sub = world.split(me % 2, -me);
    CHECK(sub.size() == 3);
    const int expect_rank = me % 2 == 0 ? (4 - me) / 2 : (5 - me) / 2;
    CHECK(sub.rank() == expect_rank);
    // The split is not metadata traffic of a forward call.
    CHECK(world.stats().host_gathers == 0);
    // Members of a color see each other's world ranks.
    const std::int64_t mine[1] = {me};
    std::vector<std::int64_t> all(3);
    world.stats().reset();
    sub.all_gather_host(mine, all);
    for (int j = 0; j < 3; ++j) {
      CHECK(all[j] % 2 == me % 2);
      CHECK(all[j] == (me % 2 == 0 ? 4 - 2 * j : 5 - 2 * j));
    }
    CHECK(world.stats().host_gathers == 1);  // counted on the shared counters
    // Traffic on the sub-communicator is visible on the world's stats.
    std::vector<std::size_t> counts(3, 10), displs{0, 10, 20};
    std::vector<std::byte> s(30), r(30);
    sub.all_to_all_v(s.data(), counts, displs, r.data(), counts, displs);
    CHECK(world.stats().bytes_sent == 20);
    CHECK(&world.stats() == &sub.stats());
    // Equal keys fall back to the parent rank order; a second split is independent.
    ThreadCommunicator halves = world.split(me / 3, 0);
    CHECK(halves.size() == 3);
    CHECK(halves.rank() == me % 3);
    halves.barrier();
    sub.barrier();
    // Splitting a split.
    ThreadCommunicator single = sub.split(sub.rank(), 0);
    CHECK(single.size() == 1);
    CHECK(single.rank() == 0);
  });
}

TEST_CASE("run_ranks: a rank's exception is rethrown and the blocked ranks are woken") {
  // Ranks 0, 2 and 3 wait in collectives (barrier, all-to-all, exchange) that rank 1 never
  // joins; rank 1 throws. Without a time-out configured, only the wake-up can end the run.
  const auto start = std::chrono::steady_clock::now();
  std::atomic<int> aborted{0};
  bool rethrown = false;
  test::within(
      60000ms,
      [&] {
        try {
          run_ranks(4, [&](ThreadCommunicator& c) {
            try {
              if (c.rank() == 1) {
                std::this_thread::sleep_for(50ms);
                throw std::runtime_error("rank 1 fails on purpose");
              }
              if (c.rank() == 0) c.barrier();
              if (c.rank() == 2) {
                std::vector<std::size_t> z(4, 0);
                std::byte b{};
                c.all_to_all_v(&b, z, z, &b, z, z);
              }
              if (c.rank() == 3) {
                std::byte s{}, r{};
                auto req = c.start_exchange(&s, 1, 1, &r, 1, 1);
                c.wait(req);
              }
            } catch (const CommAborted&) {
              ++aborted;
              throw;
            }
          });
        } catch (const std::runtime_error& e) {
          // The original failure, not the CommAborted it caused on the others.
          rethrown = dynamic_cast<const CommAborted*>(&e) == nullptr &&
                     std::string(e.what()) == "rank 1 fails on purpose";
        }
      },
      "run_ranks with a failing rank");
  CHECK(rethrown);
  CHECK(aborted == 3);
  CHECK(std::chrono::steady_clock::now() - start < 20s);
}

TEST_CASE("run_ranks: a peer that never arrives times out with CommAborted") {
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(test::within(60000ms,
                                    [] {
                                      run_ranks(
                                          2,
                                          [](ThreadCommunicator& c) {
                                            if (c.rank() == 0) c.barrier();  // rank 1 returns without it
                                          },
                                          ThreadRunOptions{200ms});
                                    }),
                       doctest::Contains("time-out"), CommAborted);
  CHECK(std::chrono::steady_clock::now() - start < 20s);
}

TEST_CASE("run_ranks: rejects zero ranks; a single rank runs inline semantics") {
  CHECK_THROWS_AS(run_ranks(0, [](ThreadCommunicator&) {}), ConfigError);
  int calls = 0;
  run_ranks(1, [&](ThreadCommunicator& c) {
    ++calls;
    CHECK(c.size() == 1);
    c.barrier();
  });
  CHECK(calls == 1);
}

TEST_CASE("thread comm: bad peer ranks are ConfigErrors") {
  ranks_with_watchdog(2, [](ThreadCommunicator& c) {
    std::byte b{};
    CHECK_THROWS_AS(c.start_exchange(&b, 1, 2, &b, 1, 0), ConfigError);
    CHECK_THROWS_AS(c.start_exchange(&b, 1, 0, &b, 1, -1), ConfigError);
    std::vector<std::size_t> wrong(3, 0);
    CHECK_THROWS_AS(c.all_to_all_v(&b, wrong, wrong, &b, wrong, wrong), ConfigError);
  });
}

namespace {

/// One call of a blocking operation on `c`, the same on every rank.
void block_in(ThreadCommunicator& c, const std::string& op) {
  const auto n = static_cast<std::size_t>(c.size());
  std::vector<std::byte> send(4 * n, std::byte{1}), recv(4 * n);
  std::vector<std::size_t> counts(n, 4), displs(n);
  for (std::size_t j = 0; j < n; ++j) displs[j] = 4 * j;
  if (op == "all_to_all_v") c.all_to_all_v(send.data(), counts, displs, recv.data(), counts, displs);
  if (op == "barrier") c.barrier();
  if (op == "all_gather_host") {
    const std::int64_t mine[1] = {c.rank()};
    std::vector<std::int64_t> all(n);
    c.all_gather_host(mine, all);
  }
  if (op == "exchange") {
    auto req = c.start_exchange(send.data(), 4, (c.rank() + 1) % c.size(), recv.data(), 4,
                                (c.rank() + c.size() - 1) % c.size());
    c.wait(req);
  }
}

using test::ScopedEnv;

}  // namespace

TEST_CASE("time-out: a rank that returned without calling the operation is named by its peers") {
  for (const std::string op : {"all_to_all_v", "barrier", "all_gather_host", "exchange"}) {
    CAPTURE(op);
    const auto start = std::chrono::steady_clock::now();
    // Rank 2 returns at once; ranks 0 and 1 block in `op` until the time-out.
    const auto out = test::rank_outcomes(
        3,
        [&](ThreadCommunicator& c) {
          if (c.rank() != 2) block_in(c, op);
        },
        300ms);
    INFO(test::describe(out));
    CHECK(out[2].kind == "none");
    // The exchange of rank 0 receives from rank 2; rank 1's waits for rank 0 and is woken.
    const std::string named = "rank 2, which returned from its rank function without calling it";
    int naming = 0;
    for (int r : {0, 1}) {
      CHECK(out[r].kind == "CommAborted");  // a CommError
      CHECK(out[r].what.find("time-out after 300 ms in " + op) != std::string::npos);
      naming += out[r].what.find(named) != std::string::npos;
    }
    CHECK(naming == 2);  // the time-out's message reaches every waiting rank
    CHECK(std::chrono::steady_clock::now() - start < 10s);
  }
}

TEST_CASE("time-out: in a split group the peer is named by group and world rank") {
  const auto out = test::rank_outcomes(
      4,
      [](ThreadCommunicator& world) {
        ThreadCommunicator sub = world.split(world.rank() % 2, world.rank());  // {0, 2} and {1, 3}
        if (world.rank() != 3) sub.barrier();
      },
      300ms);
  INFO(test::describe(out));
  CHECK(out[1].kind == "CommAborted");
  CHECK(out[1].what.find("time-out after 300 ms in barrier (waiting for rank 1 (world rank 3), which returned "
                         "from its rank function without calling it)") != std::string::npos);
}

TEST_CASE("time-out: a peer that is still alive but elsewhere is named, not called returned") {
  const auto out = test::rank_outcomes(
      2,
      [](ThreadCommunicator& c) {
        std::byte s{}, r{};
        if (c.rank() == 0) {
          auto req = c.start_exchange(&s, 1, 1, &r, 1, 1);
          c.wait(req);
        } else {
          c.barrier();  // a different operation: both wait until the time-out
        }
      },
      300ms);
  INFO(test::describe(out));
  bool exchange_named = false;
  for (const auto& o : out) {
    CHECK(o.kind == "CommAborted");
    CHECK(o.what.find("returned from its rank function") == std::string::npos);
    exchange_named = exchange_named || o.what.find("in exchange (receive) (waiting for rank 1)") != std::string::npos ||
                     o.what.find("in barrier (waiting for rank 0)") != std::string::npos;
  }
  CHECK(exchange_named);
}

TEST_CASE("time-out: SEQPAR_COMM_TIMEOUT_MS applies when run_ranks sets none") {
  const auto start = std::chrono::steady_clock::now();
  {
    ScopedEnv env("SEQPAR_COMM_TIMEOUT_MS", "250");
    CHECK_THROWS_WITH_AS(run_ranks(2, [](ThreadCommunicator& c) { if (c.rank() == 0) c.barrier(); }),
                         doctest::Contains("time-out after 250 ms in barrier (waiting for rank 1, which returned"),
                         CommAborted);
    // An explicit option wins over the environment.
    CHECK_THROWS_WITH_AS(run_ranks(
                             2, [](ThreadCommunicator& c) { if (c.rank() == 0) c.barrier(); },
                             ThreadRunOptions{100ms}),
                         doctest::Contains("time-out after 100 ms"), CommAborted);
  }
  CHECK(std::chrono::steady_clock::now() - start < 10s);
  {
    ScopedEnv env("SEQPAR_COMM_TIMEOUT_MS", "soon");
    CHECK_THROWS_WITH_AS(run_ranks(1, [](ThreadCommunicator&) {}), doctest::Contains("SEQPAR_COMM_TIMEOUT_MS"),
                         ConfigError);
  }
  {
    ScopedEnv env("SEQPAR_COMM_TIMEOUT_MS", "0");  // off
    CHECK(comm_timeout_from_env() == 0ms);
  }
  CHECK(comm_timeout_from_env() == 0ms);  // unset: off
}

TEST_CASE("stats: communicators sharing counters count from several threads without a race") {
  // Each rank drives two split groups (sharing the rank's counters) from two threads at once.
  constexpr int iters = 200;
  ranks_with_watchdog(2, [](ThreadCommunicator& world) {
    ThreadCommunicator a = world.split(0, world.rank());
    ThreadCommunicator b = world.split(0, world.rank());
    world.stats().reset();
    auto drive = [](ThreadCommunicator& c) {
      const int other = 1 - c.rank();
      std::vector<std::size_t> counts{8, 8}, displs{0, 8};
      std::vector<std::byte> s(16, std::byte{3}), r(16);
      const std::int64_t mine[1] = {c.rank()};
      std::vector<std::int64_t> all(2);
      for (int i = 0; i < iters; ++i) {
        c.all_to_all_v(s.data(), counts, displs, r.data(), counts, displs);
        auto req = c.start_exchange(s.data(), 16, other, r.data(), 16, other);
        c.wait(req);
        c.all_gather_host(mine, all);
      }
    };
    std::thread second([&] { drive(b); });
    drive(a);
    second.join();
    const CommStats got = world.stats().snapshot();
    CHECK(got.all_to_alls == 2 * iters);
    CHECK(got.exchanges == 2 * iters);
    CHECK(got.host_gathers == 2 * iters);
    CHECK(got.messages_sent == 4 * iters);
    CHECK(got.bytes_sent == 2 * iters * (8 + 16));
  });
}
