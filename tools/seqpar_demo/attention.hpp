#pragma once
/// \file
/// From the command line to the library's compile-time types: with_policy turns the options'
/// policy, layout and --anything into one of 14 policy types, and DemoAttention puts them
/// behind one interface, so that the runs (forward_run.hpp, decode_run.hpp) compile once per
/// element type and communicator.

#include <atomic>
#include <cstddef>
#include <cstdio>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>

#include "options.hpp"
#include "seqpar/seqpar.hpp"

namespace seqpar_demo {

/// Set once this process's plan is made: from then on a ConfigError (from forward or backward)
/// is this rank's alone, not collective.
inline std::atomic<bool> g_planned{false};

/// Calls `run(policy)` with `base` or AnythingPolicy<base>, as the options say.
template <class Base, class F>
auto with_anything(const Options& o, Base base, F& run) {
  if (o.anything) return run(AnythingPolicy<Base>{base});
  return run(base);
}

/// Calls `run(policy)` with P<layout> for the layout the options name, configured by `configure`.
template <template <class> class P, class Configure, class F>
auto with_layout(const Options& o, Configure configure, F& run) {
  switch (o.layout) {
    case LayoutKind::contiguous: return with_anything(o, configure(P<Contiguous>{}), run);
    case LayoutKind::zigzag: return with_anything(o, configure(P<Zigzag>{}), run);
    case LayoutKind::stripe: return with_anything(o, configure(P<Stripe>{}), run);
  }
  throw UsageError("--layout: unknown layout");
}

/// The one switch from the command line to the compile-time policy types.
template <class F>
auto with_policy(const Options& o, int world, F run) {
  switch (o.policy) {
    case PolicyKind::ulysses: return with_anything(o, UlyssesPolicy{}, run);
    case PolicyKind::ring: return with_layout<RingPolicy>(o, [](auto p) { return p; }, run);
    case PolicyKind::unified:
      return with_layout<UnifiedPolicy>(o, [&](auto p) {
        p.ulysses_degree = o.ulysses_degree;
        p.ring_degree = o.ring_degree;
        p.placement = o.placement;
        if (!p.ulysses_degree && !p.ring_degree)  // default: the squarest mesh, Ulysses side smaller
          for (int d = 1; d * d <= world; ++d)
            if (world % d == 0) p.ulysses_degree = d;
        return p;
      }, run);
  }
  throw UsageError("--policy: unknown policy");
}

/// Builds the kernel with the requested thread count when the kernel can use one.
template <class Kernel>
Kernel make_kernel(const Options& o, bool print) {
  if constexpr (std::is_constructible_v<Kernel, int>) {
    if (o.threads > 0) return Kernel(o.threads);
  } else {
    if (o.threads > 1 && print) std::fprintf(stderr, "seqpar_demo: --threads: this kernel is single-threaded; ignored\n");
  }
  return Kernel{};
}

/// The calls the demo makes on its attention object, behind one interface: run_rank and
/// prefill_rank then compile once per element type and communicator instead of once per policy
/// (14 of them), which halves the demo's build, the README's first command. The library's own
/// engine is already shared between policies with the same phases (policy_phases_of).
template <class T>
class DemoAttention {
 public:
  using CV = TensorView<const T>;  ///< an input tensor
  using V = TensorView<T>;         ///< an output tensor
  virtual ~DemoAttention() = default;
  /// The resolved mesh.
  virtual const MeshConfig& mesh() const = 0;
  /// SequenceParallelAttention::plan.
  virtual Plan plan(const AttentionProblem& problem, LocalLengths lengths) = 0;
  /// SequenceParallelAttention::forward (lse may be absent).
  virtual void forward(const Plan& p, CV q, CV k, CV v, V out, TensorView<acc_t<T>> lse, std::span<std::byte> ws) = 0;
  /// SequenceParallelAttention::backward (d_sinks: null, or this rank's share of the sinks' gradient).
  virtual void backward(const Plan& p, CV dout, CV q, CV k, CV v, CV out, TensorView<const acc_t<T>> lse, V dq, V dk,
                        V dv, float* d_sinks, std::span<std::byte> ws) = 0;
  /// SequenceParallelAttention::set_profile.
  virtual void set_profile(PhaseProfile* profile) = 0;
};

/// DemoAttention over SequenceParallelAttention<Policy, Comm, CpuFlashKernel>.
template <class T, class Policy, class Comm>
class PolicyAttention final : public DemoAttention<T> {
  using typename DemoAttention<T>::CV;
  using typename DemoAttention<T>::V;

 public:
  PolicyAttention(Comm& comm, Policy policy, CpuFlashKernel kernel) : attn_(comm, policy, std::move(kernel)) {}
  const MeshConfig& mesh() const override { return attn_.mesh(); }
  Plan plan(const AttentionProblem& problem, LocalLengths lengths) override { return attn_.plan(problem, lengths); }
  void forward(const Plan& p, CV q, CV k, CV v, V out, TensorView<acc_t<T>> lse, std::span<std::byte> ws) override {
    attn_.template forward<T>(p, q, k, v, out, lse, ws);
  }
  void backward(const Plan& p, CV dout, CV q, CV k, CV v, CV out, TensorView<const acc_t<T>> lse, V dq, V dk, V dv,
                float* d_sinks, std::span<std::byte> ws) override {
    attn_.template backward<T>(p, dout, q, k, v, out, lse, dq, dk, dv, d_sinks, ws);
  }
  void set_profile(PhaseProfile* profile) override { attn_.set_profile(profile); }

 private:
  SequenceParallelAttention<Policy, Comm, CpuFlashKernel> attn_;
};

/// Collective: the options' policy on `comm`, with element type T.
template <class T, class Comm>
std::unique_ptr<DemoAttention<T>> make_attention(Comm& comm, const Options& o) {
  return with_policy(o, comm.size(), [&](auto policy) -> std::unique_ptr<DemoAttention<T>> {
    return std::make_unique<PolicyAttention<T, decltype(policy), Comm>>(comm, policy,
                                                                       make_kernel<CpuFlashKernel>(o, comm.rank() == 0));
  });
}

}  // namespace seqpar_demo
