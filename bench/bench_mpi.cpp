/// \file
/// MPI strong scaling: one policy's forward over MPI processes, timed as the median of
/// several calls on one plan and workspace (each call between two barriers). bench/run.sh
/// runs it under mpirun with 1 and 2 ranks at the same global shape and compares.
///
/// usage: seqpar_bench_mpi --policy ulysses|ring [--seq S] [--heads H] [--head-dim D]
///                         [--causal] [--iters N]
/// The last line printed (rank 0) is
///   RESULT policy=... ranks=... seq=... heads=... head_dim=... causal=... bytes_sent_per_rank=...
///   time_ms_per_iter=... time_ms_min=...

#include <chrono>
#include <cstdio>
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
  if (o.policy != "ring" && o.policy != "ulysses")
    throw ConfigError("--policy: expected ring or ulysses, got '" + o.policy + "'");
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

}  // namespace

int main(int argc, char** argv) {
  MpiSession session(argc, argv);
  MpiCommunicator world(MPI_COMM_WORLD);
  try {
    const Options o = parse(argc, argv);
    return o.policy == "ring" ? run<RingPolicy<Contiguous>>(world, o) : run<UlyssesPolicy>(world, o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "seqpar_bench_mpi: rank %d: %s\n", world.rank(), e.what());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  return 2;
}
