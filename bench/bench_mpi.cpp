/// \file
/// MPI strong scaling: one policy's forward over MPI processes, timed as the median of
/// several calls on one plan and workspace (each call between two barriers). bench/run.sh
/// runs it under mpirun with 1 and 2 ranks at the same global shape and compares.
///
/// usage: seqpar_bench_mpi --policy ulysses|ring|exchange-forms [--seq S] [--heads H]
///                         [--head-dim D] [--causal] [--iters N]
/// The last line printed (rank 0) is
///   RESULT policy=... ranks=... seq=... heads=... head_dim=... causal=... bytes_sent_per_rank=...
///   time_ms_per_iter=... time_ms_min=...
/// `exchange-forms` times, with MPI alone, three ways to move a Ulysses forward's Q, K and V
/// (f32, [S/P, H, D] per rank, each member its H/P heads): what UlyssesExchange does (pack
/// each tensor's pieces, then one all-to-all per tensor), one all-to-all of all three (packed
/// together), and one strided all-to-all per tensor (MPI_Alltoallw with vector types: MPI
/// reads the heads from the tensor, no pack). It prints one line per round, rounds
/// alternating the forms, and the medians.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <cstdlib>
#include <string>
#include <string_view>

#include "bench_common.hpp"
#include "seqpar/comm/mpi_communicator.hpp"

namespace {

using namespace seqpar;

struct Options {
  std::string policy = "ring";
  std::int64_t seq = 16384, heads = 4, head_dim = 64;
  bool causal = false;
  int iters = 5;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto value = [&] {
      if (i + 1 >= argc) throw ConfigError(std::string(a) + ": missing value");
      return std::string(argv[++i]);
    };
    if (a == "--policy") o.policy = value();
    else if (a == "--seq") o.seq = std::stoll(value());
    else if (a == "--heads") o.heads = std::stoll(value());
    else if (a == "--head-dim") o.head_dim = std::stoll(value());
    else if (a == "--iters") o.iters = std::stoi(value());
    else if (a == "--causal") o.causal = true;
    else throw ConfigError("unknown option '" + std::string(a) + "'");
  }
  if (o.policy != "ring" && o.policy != "ulysses" && o.policy != "exchange-forms")
    throw ConfigError("--policy: expected ring, ulysses or exchange-forms, got '" + o.policy + "'");
  return o;
}

template <class Policy>
int run(MpiCommunicator& world, const Options& o) {
  SequenceParallelAttention<Policy, MpiCommunicator, CpuFlashKernel> attn(world, Policy{});
  AttentionProblem pr;
  pr.heads = o.heads;
  pr.head_dim = o.head_dim;
  pr.causal = o.causal;
  const std::int64_t len = split_sequence(o.seq, attn.mesh())[std::size_t(world.rank())];
  const Plan plan = attn.plan(pr, {len});
  const std::size_t n = std::size_t(len * pr.heads * pr.head_dim);
  const auto q = bench::random_values<float>(n, 1 + world.rank()), k = bench::random_values<float>(n, 2 + world.rank()),
             v = bench::random_values<float>(n, 3 + world.rank());
  std::vector<float> out(n);
  std::vector<std::byte> workspace(plan.workspace_bytes());
  using CV = TensorView<const float>;
  auto forward = [&] {
    attn.forward(plan, CV::bshd(q.data(), 1, len, pr.heads, pr.head_dim), CV::bshd(k.data(), 1, len, pr.heads, pr.head_dim),
                 CV::bshd(v.data(), 1, len, pr.heads, pr.head_dim), TensorView<float>::bshd(out.data(), 1, len, pr.heads, pr.head_dim),
                 std::span<std::byte>(workspace));
  };
  forward();  // warm-up
  std::vector<double> times;
  std::uint64_t bytes = 0;
  for (int i = 0; i < o.iters; ++i) {
    world.barrier();
    const std::uint64_t before = world.stats().bytes_sent;
    const auto t0 = std::chrono::steady_clock::now();
    forward();
    world.barrier();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    bytes = world.stats().bytes_sent - before;
  }
  if (world.rank() == 0)
    std::printf("RESULT policy=%s ranks=%d seq=%lld heads=%lld head_dim=%lld causal=%d bytes_sent_per_rank=%llu "
                "time_ms_per_iter=%.3f time_ms_min=%.3f\n",
                o.policy.c_str(), world.size(), static_cast<long long>(o.seq), static_cast<long long>(o.heads),
                static_cast<long long>(o.head_dim), int(o.causal), static_cast<unsigned long long>(bytes),
                bench::median(times) * 1e3, *std::min_element(times.begin(), times.end()) * 1e3);
  return 0;
}

/// The exchange-forms comparison (see the file comment): medians over `o.iters` rounds of 20
/// calls each, the forms alternating within a round.
int exchange_forms(const MpiCommunicator& world, const Options& o) {
  const int P = world.size();
  if (o.heads % P != 0 || o.seq % P != 0) throw ConfigError("exchange-forms: --heads and --seq must divide by the ranks");
  const std::size_t L = std::size_t(o.seq / P), H = std::size_t(o.heads), D = std::size_t(o.head_dim),
                    hp = H / std::size_t(P), n = L * H * D, piece = L * hp * D;
  std::array<std::vector<float>, 3> x, recv;
  for (int t = 0; t < 3; ++t) {
    x[t] = bench::random_values<float>(n, 1 + 3 * world.rank() + t);
    recv[t].resize(n);
  }
  std::vector<float> send(3 * n), together(3 * n);
  // Byte counts: one tensor's piece for each member, or all three tensors' pieces together.
  std::vector<int> one(P, int(piece * sizeof(float))), one_at(P), three(P, int(3 * piece * sizeof(float))), three_at(P);
  for (int m = 0; m < P; ++m) {
    one_at[m] = m * one[m];
    three_at[m] = m * three[m];
  }
  // Member m's heads of the tensor: L rows of hp x D floats, H x D apart, from head m x hp.
  MPI_Datatype heads;
  MPI_Type_vector(int(L), int(hp * D), int(H * D), MPI_FLOAT, &heads);
  MPI_Type_commit(&heads);
  std::vector<int> ones(P, 1), heads_at(P);
  for (int m = 0; m < P; ++m) heads_at[m] = int(std::size_t(m) * hp * D * sizeof(float));
  std::vector<MPI_Datatype> strided(P, heads), bytes(P, MPI_BYTE);
  auto pack = [&](const std::vector<float>& src, float* dst, std::size_t member_stride) {
    for (std::size_t m = 0; m < std::size_t(P); ++m)
      for (std::size_t s = 0; s < L; ++s)
        std::memcpy(dst + m * member_stride + s * hp * D, src.data() + s * H * D + m * hp * D, hp * D * sizeof(float));
  };
  auto per_tensor = [&] {
    for (int t = 0; t < 3; ++t) {
      pack(x[t], send.data(), piece);
      MPI_Alltoallv(send.data(), one.data(), one_at.data(), MPI_BYTE, recv[t].data(), one.data(), one_at.data(), MPI_BYTE,
                    MPI_COMM_WORLD);
    }
  };
  auto all_three = [&] {
    for (int t = 0; t < 3; ++t) pack(x[t], send.data() + std::size_t(t) * piece, 3 * piece);
    MPI_Alltoallv(send.data(), three.data(), three_at.data(), MPI_BYTE, together.data(), three.data(), three_at.data(),
                  MPI_BYTE, MPI_COMM_WORLD);
  };
  auto by_type = [&] {
    for (int t = 0; t < 3; ++t)
      MPI_Alltoallw(x[t].data(), ones.data(), heads_at.data(), strided.data(), recv[t].data(), one.data(),
                    one_at.data(), bytes.data(), MPI_COMM_WORLD);
  };
  auto time_ms = [&](auto&& form) {
    std::vector<double> calls;
    for (int i = 0; i < 20; ++i) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      form();
      calls.push_back((MPI_Wtime() - t0) * 1e3);
    }
    return bench::median(calls);
  };
  // The three forms must deliver the same pieces (else the comparison times different work).
  per_tensor();
  const auto expected = recv;
  by_type();
  all_three();
  bool same = recv == expected;
  for (std::size_t m = 0; m < std::size_t(P); ++m)
    for (std::size_t t = 0; t < 3; ++t)
      same = same && std::equal(expected[t].begin() + std::ptrdiff_t(m * piece), expected[t].begin() + std::ptrdiff_t((m + 1) * piece),
                                together.begin() + std::ptrdiff_t((3 * m + t) * piece));
  if (!same) throw std::runtime_error("exchange-forms: the forms delivered different pieces");
  std::array<std::vector<double>, 3> rounds;
  for (int r = 0; r < std::max(o.iters, 1); ++r) {
    const double a = time_ms(per_tensor), b = time_ms(all_three), c = time_ms(by_type);
    rounds[0].push_back(a);
    rounds[1].push_back(b);
    rounds[2].push_back(c);
    if (world.rank() == 0)
      std::printf("round %d: pack + all-to-all per tensor %.3f ms, one all-to-all of Q|K|V %.3f ms, strided "
                  "all-to-all per tensor %.3f ms\n", r, a, b, c);
  }
  MPI_Type_free(&heads);
  if (world.rank() == 0)
    std::printf("RESULT policy=exchange-forms ranks=%d seq=%lld heads=%lld head_dim=%lld bytes_per_member=%zu "
                "per_tensor_ms=%.3f all_three_ms=%.3f strided_ms=%.3f\n",
                P, static_cast<long long>(o.seq), static_cast<long long>(o.heads), static_cast<long long>(o.head_dim),
                3 * piece * sizeof(float), bench::median(rounds[0]), bench::median(rounds[1]), bench::median(rounds[2]));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  seqpar::bench::refuse_if_compile_only("seqpar_bench_mpi");
  MpiSession session(argc, argv);
  MpiCommunicator world(MPI_COMM_WORLD);
  try {
    const Options o = parse(argc, argv);
    if (o.policy == "exchange-forms") return exchange_forms(world, o);
    return o.policy == "ring" ? run<RingPolicy<Contiguous>>(world, o) : run<UlyssesPolicy>(world, o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "seqpar_bench_mpi: rank %d: %s\n", world.rank(), e.what());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  return 2;
}
