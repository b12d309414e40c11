// MpiCommunicator on its own: every operation against hand-built expectations, the traffic
// counters against ThreadCommunicator's rules, and MPI failures turned into MpiError.

#include <doctest/doctest.h>

#include <chrono>
#include <climits>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "seqpar/comm/mpi_communicator.hpp"

using namespace seqpar;

namespace {

/// True on every rank iff `ok` is true on every rank (so all ranks take the same branch).
bool all_ranks(MpiCommunicator& c, bool ok) {
  std::vector<std::int64_t> all(static_cast<std::size_t>(c.size()));
  c.all_gather_host(std::vector<std::int64_t>{ok ? 1 : 0}, all);
  return std::accumulate(all.begin(), all.end(), std::int64_t{0}) == c.size();
}

/// The byte rank `from` puts at offset i of its piece for rank `to`.
std::byte pattern(int from, int to, std::size_t i) { return std::byte((from * 31 + to * 7 + i * 13) & 0xff); }

/// Runs an all_to_all_v where rank r sends count(r, j) bytes to rank j, with displacements
/// padded by `gap` bytes, and checks every byte received and the counters.
template <class Count>
bool check_all_to_all(MpiCommunicator& c, Count count, std::size_t gap) {
  const int P = c.size(), me = c.rank();
  std::vector<std::size_t> sc(P), sd(P), rc(P), rd(P);
  std::size_t so = 0, ro = 0;
  for (int j = 0; j < P; ++j) {
    sc[j] = count(me, j);
    sd[j] = so;
    so += sc[j] + gap;
    rc[j] = count(j, me);
    rd[j] = ro;
    ro += rc[j] + gap;
  }
  std::vector<std::byte> send(so), recv(ro, std::byte{0xee});
  for (int j = 0; j < P; ++j)
    for (std::size_t i = 0; i < sc[j]; ++i) send[sd[j] + i] = pattern(me, j, i);
  const CommStats before = c.stats();
  c.all_to_all_v(send.data(), sc, sd, recv.data(), rc, rd);
  bool ok = true;
  std::uint64_t bytes = 0, messages = 0;
  for (int j = 0; j < P; ++j) {
    for (std::size_t i = 0; i < rc[j]; ++i) ok = ok && recv[rd[j] + i] == pattern(j, me, i);
    for (std::size_t i = rc[j]; i < rc[j] + gap; ++i) ok = ok && recv[rd[j] + i] == std::byte{0xee};
    if (j != me && sc[j] > 0) {
      bytes += sc[j];
      ++messages;
    }
  }
  ok = ok && c.stats().bytes_sent - before.bytes_sent == bytes && c.stats().messages_sent - before.messages_sent == messages &&
       c.stats().all_to_alls - before.all_to_alls == 1;
  return all_ranks(c, ok);
}

}  // namespace

TEST_CASE("MpiCommunicator: rank, size, barrier and the host all-gather") {
  MpiCommunicator c(MPI_COMM_WORLD);
  int rank = -1, size = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  CHECK(c.rank() == rank);
  CHECK(c.size() == size);
  c.barrier();
  const std::vector<std::int64_t> mine{c.rank(), -7 * c.rank(), std::int64_t{1} << 40};
  std::vector<std::int64_t> all(3 * static_cast<std::size_t>(c.size()));
  c.stats().reset();
  c.all_gather_host(mine, all);
  bool ok = true;
  for (int w = 0; w < c.size(); ++w) ok = ok && all[3 * w] == w && all[3 * w + 1] == -7 * w && all[3 * w + 2] == (std::int64_t{1} << 40);
  CHECK(all_ranks(c, ok));
  CHECK(c.stats().host_gathers == 2);  // ours and all_ranks'
  CHECK(c.stats().bytes_sent == 0);
  std::vector<std::int64_t> wrong(2);
  CHECK_THROWS_AS(c.all_gather_host(mine, wrong), ConfigError);
}

TEST_CASE("MpiCommunicator: all_to_all_v delivers variable counts, zero pieces and the self piece") {
  MpiCommunicator c(MPI_COMM_WORLD);
  // Byte-granular (unit 1), with zero-byte pieces, odd sizes and gaps between pieces.
  CHECK(check_all_to_all(c, [](int from, int to) { return static_cast<std::size_t>((from * 5 + to * 3) % 7) * 3; }, 1));
  // Multiples of 256 bytes: travels in 256-byte units.
  CHECK(check_all_to_all(c, [](int from, int to) { return static_cast<std::size_t>(256 * (1 + from + 2 * to)); }, 0));
  // Multiples of 8 with 8-byte gaps: 8-byte units.
  CHECK(check_all_to_all(c, [](int from, int to) { return static_cast<std::size_t>(8 * (from + to)); }, 8));
  std::vector<std::size_t> short_counts(1);
  CHECK_THROWS_AS(c.all_to_all_v(nullptr, short_counts, short_counts, nullptr, short_counts, short_counts), ConfigError);
}

TEST_CASE("MpiCommunicator: ring exchanges arrive in order and count like ThreadCommunicator") {
  MpiCommunicator c(MPI_COMM_WORLD);
  const int P = c.size(), me = c.rank(), next = (me + 1) % P, prev = (me - 1 + P) % P;
  std::vector<std::int64_t> a(1000, me), b(1000, 100 + me), ra(1000, -1), rb(1000, -1);
  c.stats().reset();
  auto r1 = c.start_exchange(reinterpret_cast<const std::byte*>(a.data()), 8000, next, reinterpret_cast<std::byte*>(ra.data()), 8000, prev);
  auto r2 = c.start_exchange(reinterpret_cast<const std::byte*>(b.data()), 4000, next, reinterpret_cast<std::byte*>(rb.data()), 4000, prev);
  c.wait(r1);
  c.wait(r2);
  const bool ok = ra[0] == prev && ra[999] == prev && rb[0] == 100 + prev && rb[499] == 100 + prev && rb[500] == -1;
  CHECK(all_ranks(c, ok));
  CHECK(c.stats().exchanges == 2);
  CHECK(c.stats().bytes_sent == (P > 1 ? 12000u : 0u));  // a rank's exchange with itself is not traffic
  CHECK(c.stats().messages_sent == (P > 1 ? 2u : 0u));
  CHECK_THROWS_AS(c.start_exchange(nullptr, 0, P, nullptr, 0, 0), ConfigError);
}

TEST_CASE("MpiCommunicator: a peer that sends more or fewer bytes than expected is an error, not a hang") {
  // Each failure latches its communicator (a duplicate each): the checks travel on the world.
  MpiCommunicator world(MPI_COMM_WORLD);
  const int P = world.size(), me = world.rank();
  std::vector<std::byte> send(64, std::byte{1}), recv(64);
  MpiCommunicator c = MpiCommunicator::duplicate(MPI_COMM_WORLD);
  auto fewer = c.start_exchange(send.data(), 16, (me + 1) % P, recv.data(), 32, (me - 1 + P) % P);
  std::string what;
  try {
    c.wait(fewer);
  } catch (const CommError& e) {
    what = e.what();
  }
  CHECK(all_ranks(world, what.find("sent 16 bytes") != std::string::npos && what.find("expects 32") != std::string::npos));
  CHECK(c.failed());
  MpiCommunicator d = MpiCommunicator::duplicate(MPI_COMM_WORLD);
  auto more = d.start_exchange(send.data(), 32, (me + 1) % P, recv.data(), 16, (me - 1 + P) % P);
  what.clear();
  try {
    d.wait(more);
  } catch (const MpiError& e) {
    what = e.what();
  }
  INFO(what);
  CHECK(all_ranks(world, what.find("MPI_Waitall") != std::string::npos && what.find("TRUNCATE") != std::string::npos));
  // The likeliest cause in seqpar, and the switch that finds it.
  CHECK(all_ranks(world, what.find("different plans in one call, or different decode batches in one step? With SEQPAR_CHECK_CALLS=1") !=
                             std::string::npos));
  CHECK(d.failed());
}

TEST_CASE("MpiCommunicator: MPI error codes become MpiError naming the call and MPI's message") {
  MpiCommunicator c(MPI_COMM_WORLD);
  std::byte x{};
  // A negative tag is invalid; with MPI_ERRORS_RETURN set on the communicator MPI returns it.
  std::string what;
  try {
    SEQPAR_MPI_CHECK(MPI_Send(&x, 1, MPI_BYTE, 0, -5, c.native()));
  } catch (const MpiError& e) {
    what = e.what();
  }
  INFO(what);
  CHECK(what.find("MPI_Send failed") != std::string::npos);
  CHECK(what.find("MPI_ERR_TAG") != std::string::npos);
  CHECK(what.find("test_mpi_communicator.cpp") != std::string::npos);
}

TEST_CASE("MpiCommunicator: counts beyond an int travel in larger units, or fail clearly") {
  using detail::mpi_count;
  using detail::mpi_unit_bytes;
  const std::vector<std::size_t> big{std::size_t{3} << 30, std::size_t{1} << 33};  // 3 GiB and 8 GiB
  const std::vector<std::size_t> odd{6, 10};
  CHECK(mpi_unit_bytes(big) == 256);
  CHECK(mpi_unit_bytes(odd) == 2);
  CHECK(mpi_unit_bytes(big, odd) == 2);
  CHECK(mpi_unit_bytes(std::vector<std::size_t>{0}) == 256);
  CHECK(mpi_count(std::size_t{3} << 30, 256, "x") == (3 << 22));
  CHECK(mpi_count(std::size_t{INT_MAX}, 1, "x") == INT_MAX);
  std::string what;
  try {
    mpi_count(std::size_t{INT_MAX} + 1, 1, "exchange send");
  } catch (const MpiError& e) {
    what = e.what();
  }
  CHECK(what.find("exchange send: 2147483648 bytes") != std::string::npos);
}

TEST_CASE("MpiCommunicator: split ranks by key, shares the stats, and owns its communicator") {
  MpiCommunicator world(MPI_COMM_WORLD);
  const int P = world.size(), me = world.rank();
  world.stats().reset();
  {
    MpiCommunicator half = world.split(me % 2, -me);  // reversed order inside each color
    const int members = (P - me % 2 + 1) / 2;
    CHECK(half.size() == members);
    CHECK(half.rank() == members - 1 - me / 2);
    MpiCommunicator copy = half;  // a handle: same communicator, same stats
    CHECK(copy.native() == half.native());
    CHECK(check_all_to_all(copy, [](int from, int to) { return static_cast<std::size_t>(4 * (from + to + 1)); }, 0));
    std::uint64_t expected = 0;
    for (int j = 0; j < members; ++j)
      if (j != half.rank()) expected += static_cast<std::uint64_t>(4 * (half.rank() + j + 1));
    CHECK(world.stats().bytes_sent == expected);
    CHECK_THROWS_AS(world.split(-1, 0), ConfigError);
  }
  MpiCommunicator dup = MpiCommunicator::duplicate(MPI_COMM_WORLD);
  CHECK(dup.native() != MPI_COMM_WORLD);
  CHECK(dup.size() == P);
  CHECK(dup.stats().bytes_sent == 0);  // a duplicate has its own counters
  dup.barrier();
}

TEST_CASE("MpiCommunicator: with a time-out every operation takes the polled path and still delivers") {
  using namespace std::chrono_literals;
  MpiCommunicator c = MpiCommunicator::duplicate(MPI_COMM_WORLD);
  CHECK(c.timeout() == 0ms);  // off by default (SEQPAR_COMM_TIMEOUT_MS is not set here)
  c.set_timeout(60000ms);
  MpiCommunicator copy = c;
  CHECK(copy.timeout() == 60000ms);  // copies are the same communicator
  CHECK_THROWS_AS(c.set_timeout(-1ms), ConfigError);
  CHECK(check_all_to_all(c, [](int from, int to) { return static_cast<std::size_t>((from * 5 + to * 3) % 7) * 3; }, 1));
  CHECK(check_all_to_all(c, [](int from, int to) { return static_cast<std::size_t>(256 * (1 + from + 2 * to)); }, 0));
  const int P = c.size(), me = c.rank(), next = (me + 1) % P, prev = (me - 1 + P) % P;
  std::vector<std::int64_t> a(100000, me), ra(100000, -1);  // rendezvous-sized
  auto r = c.start_exchange(reinterpret_cast<const std::byte*>(a.data()), 800000, next,
                            reinterpret_cast<std::byte*>(ra.data()), 800000, prev);
  c.wait(r);
  CHECK(all_ranks(c, ra.front() == prev && ra.back() == prev));
  c.barrier();
  MpiCommunicator sub = c.split(me % 2, me);
  CHECK(sub.timeout() == 60000ms);  // inherited
  sub.barrier();
  // A short message is still checked on the polled path (it latches c: the check goes on the world).
  auto fewer = c.start_exchange(reinterpret_cast<const std::byte*>(a.data()), 16, next,
                                reinterpret_cast<std::byte*>(ra.data()), 32, prev);
  std::string what;
  try {
    c.wait(fewer);
  } catch (const CommError& e) {
    what = e.what();
  }
  MpiCommunicator world(MPI_COMM_WORLD);
  CHECK(all_ranks(world, what.find("sent 16 bytes") != std::string::npos));
}

TEST_CASE("MpiCommunicator: a peer that does not join within the time-out is a CommError naming the operation") {
  using namespace std::chrono_literals;
  MpiCommunicator world(MPI_COMM_WORLD);
  MpiCommunicator c = MpiCommunicator::duplicate(MPI_COMM_WORLD);
  c.set_timeout(300ms);
  // Rank 0 arrives at the barrier 2 s late: every other rank gives up after 300 ms. (A barrier
  // has no buffers, so the late arrival may still complete the others' abandoned request.)
  std::string what;
  const auto start = std::chrono::steady_clock::now();
  if (c.rank() == 0) std::this_thread::sleep_for(2000ms);
  try {
    c.barrier();
  } catch (const CommError& e) {
    what = e.what();
  }
  const auto took = std::chrono::steady_clock::now() - start;
  INFO(what);
  if (c.rank() != 0) {
    CHECK(what.find("MpiCommunicator: barrier: no progress for 300 ms") != std::string::npos);
    CHECK(took >= 300ms);
    CHECK(took < 1900ms);
    // The failure latch: from now on every operation of c, its copies and its splits refuses
    // at once, naming the first error (rank 0 is still asleep: nothing here may wait for it).
    CHECK(c.failed());
    const MpiCommunicator copy = c;
    CHECK(copy.failed());
    const auto refused_at = std::chrono::steady_clock::now();
    std::vector<std::string> refusals;
    auto refusal = [&](auto&& op) {
      try {
        op();
        refusals.push_back("none");
      } catch (const CommError& e) {
        refusals.push_back(e.what());
      }
    };
    std::byte b[8] = {};
    refusal([&] { c.barrier(); });
    std::vector<std::int64_t> one{1}, all(static_cast<std::size_t>(c.size()));
    refusal([&] { MpiCommunicator(copy).all_gather_host(one, all); });
    refusal([&] { (void)c.start_exchange(b, 8, 0, b, 8, 0); });
    refusal([&] { (void)c.split(0, 0); });
    CHECK(std::chrono::steady_clock::now() - refused_at < 100ms);
    const char* ops[] = {"barrier", "all_gather_host", "exchange", "split"};
    for (std::size_t i = 0; i < refusals.size(); ++i) {
      CAPTURE(refusals[i]);
      CHECK(refusals[i].find(std::string("MpiCommunicator: ") + ops[i] +
                             ": a previous call failed part-way on this rank (MpiCommunicator: barrier: no progress "
                             "for 300 ms") != std::string::npos);
      CHECK(refusals[i].find("end the job (MPI_Abort) or make new communicators on every rank") != std::string::npos);
    }
  } else {
    CHECK(what.empty());  // everyone else had arrived (and given up waiting)
    CHECK(!c.failed());
  }
  CHECK(all_ranks(world, c.rank() == 0 ? what.empty() : !what.empty()));
}

TEST_CASE("MpiCommunicator: a message of another call is refused at once, never delivered") {
  using namespace std::chrono_literals;
  MpiCommunicator world(MPI_COMM_WORLD);
  const int P = world.size(), me = world.rank(), next = (me + 1) % P, prev = (me - 1 + P) % P;
  // Exchanges of one call tag arrive as usual.
  {
    MpiCommunicator c = MpiCommunicator::duplicate(MPI_COMM_WORLD);
    c.set_timeout(5000ms);
    std::int64_t mine = 100 + me, got = -1;
    auto r = c.start_exchange(reinterpret_cast<const std::byte*>(&mine), 8, next, reinterpret_cast<std::byte*>(&got),
                              8, prev, call_tag(CallKind::backward, 7));
    c.wait(r);
    CHECK(all_ranks(world, got == 100 + prev));
  }
  // Rank 0 is one call ahead: rank 1 finds rank 0's message (call 1) where it waits for call 0,
  // and rank 0 finds rank P-1's (call 0) where it waits for call 1. Same sizes, so only the tag
  // tells them apart; both must refuse well within the 5 s time-out and leave their buffers.
  MpiCommunicator c = MpiCommunicator::duplicate(MPI_COMM_WORLD);
  c.set_timeout(5000ms);
  const std::uint64_t tag = call_tag(CallKind::forward, me == 0 ? 1 : 0);
  std::int64_t mine = 100 + me, got = -1;
  std::string what;
  const auto start = std::chrono::steady_clock::now();
  try {
    auto r = c.start_exchange(reinterpret_cast<const std::byte*>(&mine), 8, next, reinterpret_cast<std::byte*>(&got), 8,
                              prev, tag);
    c.wait(r);
  } catch (const CommError& e) {
    what = e.what();
  }
  const auto took = std::chrono::steady_clock::now() - start;
  INFO(what);
  if (me == 0 || me == 1) {
    const std::string theirs = me == 1 ? "forward call 1" : "forward call 0", ours = me == 1 ? "forward call 0" : "forward call 1";
    CHECK(what.find("MpiCommunicator: exchange: rank " + std::to_string(prev) + " sent a message of another call (" +
                    theirs) != std::string::npos);
    CHECK(what.find("to rank " + std::to_string(me) + ", which waits for one of " + ours) != std::string::npos);
    CHECK(got == -1);  // nothing delivered
    CHECK(took < 2000ms);
    CHECK(c.failed());
  } else {
    CHECK(what.empty());
    CHECK(got == 100 + prev);
  }
  CHECK(all_ranks(world, true));
}
