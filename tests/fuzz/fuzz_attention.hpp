#pragma once
// The attention runner, a template over the kernel and the element type: a run-time switch
// over the policy types (the engine is keyed on its phases, so this instantiates at most three
// engines per kernel and type), every rank on a thread constructing, asking the member
// can_implement, planning, and (when the shapes are small) running forward and backward on
// its rows of the case's global inputs. The checks are analyse_attention's.
#include <algorithm>
#include <chrono>
#include <optional>
#include <span>
#include <stdexcept>
#include <type_traits>

#include "fuzz/fuzz_runners.hpp"
#include "seqpar/seqpar.hpp"

namespace seqpar::fuzz {

/// A kernel without supports_masks (ReferenceKernel's arithmetic, causal masks only): plans
/// with windows, documents or key padding must be refused, and can_implement must say so.
struct CausalOnlyKernel {
  static constexpr bool is_seqpar_kernel = true;  ///< opts in to LocalAttentionKernel
  using memory_space = HostSpace;                 ///< host tensors
  /// ReferenceKernel's forward.
  template <class T, class O, class L>
  void forward(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<O> out,
               TensorView<L> lse, const KernelParams& p) const {
    ReferenceKernel{}.forward(q, k, v, out, lse, p);
  }
  /// ReferenceKernel's backward.
  template <class T, class L, class G>
  void backward(TensorView<const T> dout, TensorView<const T> q, TensorView<const T> k, TensorView<const T> v,
                TensorView<const T> out, TensorView<const L> lse, TensorView<G> dq, TensorView<G> dk, TensorView<G> dv,
                const KernelParams& p) const {
    ReferenceKernel{}.backward(dout, q, k, v, out, lse, dq, dk, dv, p);
  }
};

/// The case's kernel: CpuFlashKernel with its threads and instruction set (automatic when the
/// CPU lacks the one drawn), or a default-constructed one.
template <class Kernel>
Kernel make_kernel(KernelKind kind, int isa) {
  if constexpr (std::is_same_v<Kernel, CpuFlashKernel>) {
    CpuIsa want = isa < 0 ? CpuIsa::automatic : static_cast<CpuIsa>(isa);
    if (want != CpuIsa::automatic && !cpu_isa_supported(want)) want = CpuIsa::automatic;
    return CpuFlashKernel(CpuFlashOptions{.threads = kind == KernelKind::cpu_flash_2 ? 2 : 1, .isa = want});
  } else {
    return Kernel{};
  }
}

/// `policy` with the degrees and placement of `choice` (Unified and Anything of it only).
template <class P>
P with_degrees(P policy, const PolicyChoice& choice) {
  if constexpr (requires { policy.ring_degree; }) {
    policy.ulysses_degree = choice.ulysses_degree;
    policy.ring_degree = choice.ring_degree;
    policy.placement = choice.placement;
  } else if constexpr (requires { policy.inner; }) {
    policy.inner = with_degrees(policy.inner, choice);
  }
  return policy;
}

/// Calls fn(policy) with the policy type of `choice` (the Anything form when it asks).
template <class Base, class Fn>
void with_base(const PolicyChoice& choice, Fn& fn) {
  if (choice.anything) fn(with_degrees(AnythingPolicy<Base>{}, choice));
  else fn(with_degrees(Base{}, choice));
}
template <class Fn>
void with_policy(const PolicyChoice& choice, Fn&& fn) {
  if (choice.kind == PolicyKind::ulysses) return with_base<UlyssesPolicy>(choice, fn);
  auto layout = [&]<class L>(L) {
    if (choice.kind == PolicyKind::ring) with_base<RingPolicy<L>>(choice, fn);
    else with_base<UnifiedPolicy<L>>(choice, fn);
  };
  if (choice.layout == LayoutKind::zigzag) layout(Zigzag{});
  else if (choice.layout == LayoutKind::stripe) layout(Stripe{});
  else layout(Contiguous{});
}

/// Longest a collective may wait in a case (the ranks are threads on a busy machine).
inline constexpr std::chrono::milliseconds rank_timeout{30000};
/// Workspace beyond this for a case whose tensors are small is unbounded allocation.
inline constexpr std::size_t workspace_limit = std::size_t{1} << 30;

/// The rows at positions `pos` of a global [B, S, heads, D] tensor, as T.
template <class T>
std::vector<T> take_rows(const std::vector<double>& g, std::int64_t B, std::int64_t S, std::int64_t heads,
                         std::int64_t D, const PositionMap& pos) {
  const std::int64_t L = pos.size();
  std::vector<T> out(static_cast<std::size_t>(B * L * heads * D));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < L; ++i) {
      const auto from = g.begin() + ((b * S + pos(i)) * heads) * D;
      std::transform(from, from + heads * D, out.begin() + ((b * L + i) * heads) * D,
                     [](double x) { return static_cast<T>(x); });
    }
  return out;
}

/// A vector as doubles.
template <class T>
std::vector<double> as_double(const std::vector<T>& x) {
  return {x.begin(), x.end()};
}

/// An LSE [B, H, L] (TensorView::lse_bhs) as [B, L, H] doubles.
template <class A>
std::vector<double> lse_rows(const std::vector<A>& bhs, std::int64_t B, std::int64_t L, std::int64_t H) {
  std::vector<double> out(bhs.size());
  if (bhs.empty()) return out;  // no LSE asked for
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < L; ++i)
        out[static_cast<std::size_t>((b * L + i) * H + h)] = bhs[static_cast<std::size_t>((b * H + h) * L + i)];
  return out;
}

/// Forward and backward of one rank (twice on one plan and workspace for odd data seeds), with
/// the bytes each sent.
template <class T, class Attn>
void run_rank_data(const AttentionCase& c, const CaseData& d, Attn& attn, RankResult& r, int w) {
  using A = acc_t<T>;
  using CV = TensorView<const T>;
  const Plan& p = r.plan;
  r.qpos = p.q_positions(w);
  r.kvpos = p.kv_positions(w);
  for (const auto& [pos, total] : {std::pair{r.qpos, d.Sq}, std::pair{r.kvpos, d.Skv}})
    if (pos.size() > 0 && (pos.first() < 0 || pos.last() >= total)) {
      r.forward.kind = "other";
      r.forward.what = "rank " + std::to_string(w) + " holds positions outside the sequence";
      throw std::runtime_error(r.forward.what);
    }
  const std::int64_t B = d.B, H = d.H, K = d.K, D = d.D, Dv = d.Dv, Lq = r.qpos.size(), Lkv = r.kvpos.size();
  const std::vector<T> q = take_rows<T>(d.x.q, B, d.Sq, H, D, r.qpos), k = take_rows<T>(d.x.k, B, d.Skv, K, D, r.kvpos),
                       v = take_rows<T>(d.x.v, B, d.Skv, K, Dv, r.kvpos);
  std::vector<T> out(static_cast<std::size_t>(B * Lq * H * Dv));
  std::vector<A> lse(c.problem.with_lse ? static_cast<std::size_t>(B * Lq * H) : 0);
  const std::size_t need = std::max(p.workspace_bytes(), c.backward ? p.backward_workspace_bytes() : 0);
  if (need > workspace_limit) {
    r.forward.kind = "bounded";
    r.forward.what = "workspace_bytes " + std::to_string(p.workspace_bytes()) + ", backward_workspace_bytes " +
                     std::to_string(p.backward_workspace_bytes()) + " for tensors of " +
                     std::to_string((q.size() + k.size() + v.size()) * sizeof(T)) + " bytes";
    throw std::length_error(r.forward.what);
  }
  std::vector<std::byte> ws(need);
  const auto lse_view = c.problem.with_lse ? TensorView<A>::lse_bhs(lse.data(), B, Lq, H) : TensorView<A>{};
  // For odd data seeds a first call on other inputs (the same plan and workspace): nothing of
  // it may leak into the call that is checked.
  const bool twice = (c.data_seed & 1) != 0;
  auto other = [](std::vector<T> x) {
    for (T& e : x) e = static_cast<T>(-0.5) * e;
    return x;
  };
  const std::vector<T> q0 = twice ? other(q) : std::vector<T>{}, k0 = twice ? other(k) : std::vector<T>{},
                       v0 = twice ? other(v) : std::vector<T>{};
  auto& stats = attn.world().stats();
  record(r.forward, [&] {
    for (int call = twice ? 0 : 1; call < 2; ++call) {
      const bool real = call == 1;
      std::fill(out.begin(), out.end(), T(12345));
      std::fill(lse.begin(), lse.end(), A(12345));
      const std::uint64_t bytes = stats.bytes_sent, gathers = stats.host_gathers;
      attn.template forward<T>(p, CV::bshd((real ? q : q0).data(), B, Lq, H, D), CV::bshd((real ? k : k0).data(), B, Lkv, K, D),
                               CV::bshd((real ? v : v0).data(), B, Lkv, K, Dv), TensorView<T>::bshd(out.data(), B, Lq, H, Dv),
                               lse_view, ws);
      r.forward_traffic = {stats.bytes_sent - bytes, p.forward_bytes(w), stats.host_gathers - gathers};
    }
  });
  r.forwarded = true;
  r.out = as_double(out);
  r.lse = lse_rows(lse, B, Lq, H);
  if (!c.backward) return;
  const std::vector<T> dout = take_rows<T>(d.x.dout, B, d.Sq, H, Dv, r.qpos);
  std::vector<T> dq(q.size()), dk(k.size()), dv(v.size());
  // With sinks, the overload that also gives their gradient (this rank's share), now and then
  // the one without (the gradients of Q, K and V must not depend on the choice).
  const bool d_sinks = p.problem().sinks != nullptr && (c.data_seed & 2) == 0;
  std::vector<float> ds(d_sinks ? static_cast<std::size_t>(H) : 0);
  record(r.backward, [&] {
    for (int call = twice ? 0 : 1; call < 2; ++call) {  // backward overwrites dq, dk, dv: a sentinel first
      std::fill(dq.begin(), dq.end(), T(777));
      std::fill(dk.begin(), dk.end(), T(777));
      std::fill(dv.begin(), dv.end(), T(777));
      std::fill(ds.begin(), ds.end(), 777.0f);
      const std::uint64_t bytes = stats.bytes_sent, gathers = stats.host_gathers;
      const auto dq_view = TensorView<T>::bshd(dq.data(), B, Lq, H, D);
      const auto dk_view = TensorView<T>::bshd(dk.data(), B, Lkv, K, D), dv_view = TensorView<T>::bshd(dv.data(), B, Lkv, K, Dv);
      const auto lse_in = TensorView<const A>::lse_bhs(lse.data(), B, Lq, H);
      const CV dout_view = CV::bshd(dout.data(), B, Lq, H, Dv), q_view = CV::bshd(q.data(), B, Lq, H, D),
               k_view = CV::bshd(k.data(), B, Lkv, K, D), v_view = CV::bshd(v.data(), B, Lkv, K, Dv),
               out_view = CV::bshd(out.data(), B, Lq, H, Dv);
      if (d_sinks)
        attn.template backward<T>(p, dout_view, q_view, k_view, v_view, out_view, lse_in, dq_view, dk_view, dv_view,
                                  ds.data(), ws);
      else
        attn.template backward<T>(p, dout_view, q_view, k_view, v_view, out_view, lse_in, dq_view, dk_view, dv_view, ws);
      r.backward_traffic = {stats.bytes_sent - bytes, p.backward_bytes(w), stats.host_gathers - gathers};
    }
  });
  r.backwarded = true;
  r.dq = as_double(dq);
  r.dk = as_double(dk);
  r.dv = as_double(dv);
  r.d_sinks = as_double(ds);
}

/// Every rank of case `c` under `policy` with Kernel and T; the outcomes and outputs.
template <class Kernel, class T, class Policy>
AttentionRun run_attention_ranks(const AttentionCase& c, Policy policy, const CaseData& d) {
  AttentionRun run;
  run.ranks.resize(static_cast<std::size_t>(c.world));
  run.free_verdict = can_implement(policy, problem_of(c, 0), std::span<const LocalLengths>(c.lengths));
  try {
    run_ranks(
        c.world,
        [&](ThreadCommunicator& comm) {
          const int w = comm.rank();
          RankResult& r = run.ranks[static_cast<std::size_t>(w)];
          const Policy mine = w == c.mesh_disagree_rank ? with_degrees(policy, c.other_policy) : policy;
          const AttentionProblem prob = problem_of(c, w);
          std::optional<SequenceParallelAttention<Policy, ThreadCommunicator, Kernel>> attn;
          record(r.construct, [&] { attn.emplace(comm, mine, make_kernel<Kernel>(c.kernel, c.isa)); });
          r.member = attn->can_implement(prob, std::span<const LocalLengths>(c.lengths));
          r.member_asked = true;
          record(r.plan_call, [&] {
            r.plan = c.typed_plan ? attn->template plan<T>(prob, c.lengths[static_cast<std::size_t>(w)])
                                  : attn->plan(prob, c.lengths[static_cast<std::size_t>(w)]);
          });
          r.planned = true;
          if (d.ready) run_rank_data<T>(c, d, *attn, r, w);
        },
        ThreadRunOptions{rank_timeout});
  } catch (const std::exception&) {
    // every rank's outcome is recorded; analyse_attention judges them
  }
  return run;
}

/// Runs and checks an attention case with Kernel (for both element types).
template <class Kernel>
void run_attention_with(const AttentionCase& c, Report& rep) {
  const CaseData d = prepare_attention(c);
  with_policy(c.policy, [&](auto policy) {
    const AttentionRun run = c.f64 ? run_attention_ranks<Kernel, double>(c, policy, d)
                                   : run_attention_ranks<Kernel, float>(c, policy, d);
    analyse_attention(c, d, run, rep);
  });
}

}  // namespace seqpar::fuzz
