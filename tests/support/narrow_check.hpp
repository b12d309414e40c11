#pragma once
// Checks shared by the tests of the host's 2-byte element types (bf16, f16): inputs drawn in
// the type with their exact double values, CpuFlashKernel's forward and backward against the
// double reference, a policy end to end over thread ranks with 2-byte messages, and one
// forward of any shape and mask.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/attention_check.hpp"

namespace seqpar::test {

/// Every one of E's 65,536 bit patterns goes to float and double and back to the same bits
/// (NaN to a NaN).
template <class E>
void check_round_trips() {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const E x = E::from_bits(static_cast<std::uint16_t>(b));
    const float f = static_cast<float>(x);
    if (std::isnan(f)) {
      CHECK(std::isnan(static_cast<float>(E(f))));
      CHECK(std::isnan(static_cast<float>(E(static_cast<double>(x)))));
    } else {
      CHECK(E(f).bits == b);
      CHECK(E(static_cast<double>(x)).bits == b);
    }
  }
}

/// The inputs of one kernel call, in the 2-byte type E and exactly as double.
template <class E>
struct KernelInputs {
  std::int64_t S, H, K, D;
  std::vector<E> q, k, v, dout;
  std::vector<double> qd, kd, vd, doutd;
  KernelInputs(std::int64_t s, std::int64_t h, std::int64_t kh, std::int64_t d) : S(s), H(h), K(kh), D(d) {
    std::mt19937_64 rng(5);
    std::normal_distribution<double> n(0, 1);
    auto fill = [&](std::vector<E>& x, std::vector<double>& xd, std::int64_t count) {
      for (std::int64_t i = 0; i < count; ++i) {
        x.push_back(E(n(rng)));
        xd.push_back(static_cast<double>(x.back()));
      }
    };
    fill(q, qd, S * H * D);
    fill(k, kd, S * K * D);
    fill(v, vd, S * K * D);
    fill(dout, doutd, S * H * D);
  }
  template <class T>
  TensorView<const T> view(const std::vector<T>& x, std::int64_t heads) const {
    return TensorView<const T>::bshd(x.data(), 1, S, heads, D);
  }
};

/// Normwise error of `got` against `want`: max |got - want| / max |want|.
template <class G>
double rel_error(const std::vector<G>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(got[i]);
    num = std::isnan(g) ? std::numeric_limits<double>::infinity() : std::max(num, std::abs(g - want[i]));
    den = std::max(den, std::abs(want[i]));
  }
  return num / den;
}

/// Whether the backward of E on level `isa` at head dims (dim, dim_v) forms its products from
/// bf16 pairs, rounding P and dS to bf16 (the AVX512-BF16 level, and the AMX level at head
/// dims its tiles take): its gradients are then held to 8e-3 (see test_bf16), else to 1e-5
/// (exact products accumulated in float).
template <class E>
bool backward_rounds_to_bf16(CpuIsa isa, std::int64_t dim, std::int64_t dim_v) {
  return std::is_same_v<E, bf16> &&
         (isa == CpuIsa::avx512_bf16 || (isa == CpuIsa::amx_bf16 && detail::amx_backward_fits(dim, dim_v)));
}

/// CpuFlashKernel's forward and backward in E (causal, GQA 4/2, S 333, D 64, 1 and 2 threads)
/// against the double reference on the same inputs: O (rounded to E) within `out_tolerance`,
/// the LSE within 1e-6 and the float gradients within 1e-5 (accumulated in float; 8e-3 where
/// bf16's products round P and dS to bf16: backward_rounds_to_bf16).
template <class E>
void check_kernel_narrow(double out_tolerance) {
  const KernelInputs<E> in(333, 4, 2, 64);  // causal, GQA 4/2, an odd length
  KernelParams p;
  p.scale = 0.125;
  p.causal = true;
  p.group_size = 2;
  p.q_positions = PositionMap::run(in.S, 0);
  p.k_positions = PositionMap::run(in.S, 0);
  const auto n = static_cast<std::size_t>(in.S * in.H * in.D), l = static_cast<std::size_t>(in.S * in.H);
  std::vector<double> want_o(n), want_l(l);
  ReferenceKernel{}.forward(in.view(in.qd, in.H), in.view(in.kd, in.K), in.view(in.vd, in.K),
                            TensorView<double>::bshd(want_o.data(), 1, in.S, in.H, in.D),
                            TensorView<double>::bshd(want_l.data(), 1, in.S, in.H, 1), p);
  // The automatic level, with both thread counts; for bf16 also the AVX512-BF16 products where
  // the CPU has them (automatic takes them only where they are faster, see bf16_dot_pays).
  std::vector<CpuFlashOptions> runs{{.threads = 1}, {.threads = 2}};
  if (std::is_same_v<E, bf16> && cpu_isa_supported(CpuIsa::avx512_bf16))
    runs.push_back({.threads = 2, .isa = CpuIsa::avx512_bf16});
  for (const CpuFlashOptions& options : runs) {
    CAPTURE(options.threads);
    CAPTURE(cpu_isa_name(options.isa));
    CpuFlashKernel kernel(options);
    std::vector<E> out(n);
    std::vector<float> lse(l);
    kernel.forward(in.view(in.q, in.H), in.view(in.k, in.K), in.view(in.v, in.K),
                   TensorView<E>::bshd(out.data(), 1, in.S, in.H, in.D),
                   TensorView<float>::bshd(lse.data(), 1, in.S, in.H, 1), p);
    CHECK(rel_error(out, want_o) < out_tolerance);
    CHECK(rel_error(lse, want_l) < 1e-6);

    // Backward from this output (as E, what a training engine keeps), both kernels alike.
    std::vector<double> outd(out.size());
    for (std::size_t i = 0; i < out.size(); ++i) outd[i] = static_cast<double>(out[i]);
    const auto kv = static_cast<std::size_t>(in.S * in.K * in.D);
    std::vector<double> wq(n), wk(kv), wv(kv);
    std::vector<float> gq(n), gk(kv), gv(kv);
    std::vector<double> lsed(lse.begin(), lse.end());
    ReferenceKernel{}.backward(in.view(in.doutd, in.H), in.view(in.qd, in.H), in.view(in.kd, in.K),
                               in.view(in.vd, in.K), in.view(outd, in.H),
                               TensorView<const double>::bshd(lsed.data(), 1, in.S, in.H, 1),
                               TensorView<double>::bshd(wq.data(), 1, in.S, in.H, in.D),
                               TensorView<double>::bshd(wk.data(), 1, in.S, in.K, in.D),
                               TensorView<double>::bshd(wv.data(), 1, in.S, in.K, in.D), p);
    kernel.backward(in.view(in.dout, in.H), in.view(in.q, in.H), in.view(in.k, in.K), in.view(in.v, in.K),
                    in.view(out, in.H), TensorView<const float>::bshd(lse.data(), 1, in.S, in.H, 1),
                    TensorView<float>::bshd(gq.data(), 1, in.S, in.H, in.D),
                    TensorView<float>::bshd(gk.data(), 1, in.S, in.K, in.D),
                    TensorView<float>::bshd(gv.data(), 1, in.S, in.K, in.D), p);
    const double grad_tolerance = backward_rounds_to_bf16<E>(kernel.isa(), in.D, in.D) ? 8e-3 : 1e-5;
    CHECK(rel_error(gq, wq) < grad_tolerance);
    CHECK(rel_error(gk, wk) < grad_tolerance);
    CHECK(rel_error(gv, wv) < grad_tolerance);
  }
}

/// `Policy` over thread ranks holding `lengths` tokens each, in the 2-byte type E with
/// CpuFlashKernel: O within `out_tolerance`, the LSE within 1e-6, and every rank's bytes the
/// analytic count with 2-byte elements.
template <class E, class Policy>
void check_policy_narrow(double out_tolerance, Policy policy, const GlobalShape& c, MeshShape mesh,
                       const std::vector<std::int64_t>& lengths) {
  const auto g = make_global_as<E>(c);
  RunOptions opt;
  opt.lengths_q = opt.lengths_kv = lengths;
  const int ranks = static_cast<int>(lengths.size());
  const auto r = run_policy<E>(ranks, policy, g, opt);
  CHECK(!r.err.nan);
  CHECK(r.err.rel() < out_tolerance);
  CHECK(r.err.lse_rel() < 1e-6);
  const auto want = analytic_forward_bytes(c, mesh, lengths, lengths, sizeof(E), sizeof(float), true);
  for (int w = 0; w < ranks; ++w) CHECK(r.bytes_sent[w] == want[w]);
}

/// Appends `count` draws of N(0, 1.5^2) rounded to E to `x`, and their exact values to `xd`.
template <class E>
void draw_as(std::mt19937_64& rng, std::int64_t count, std::vector<E>& x, std::vector<double>& xd) {
  std::normal_distribution<double> n(0, 1.5);
  for (std::int64_t i = 0; i < count; ++i) {
    x.push_back(E(n(rng)));
    xd.push_back(static_cast<double>(x.back()));
  }
}

/// Normwise error of `got` against `want` (rel_error) where a NaN wanted must be NaN and one not
/// wanted is an infinite error.
template <class G>
double nan_aware_error(const std::vector<G>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(got[i]);
    if (std::isnan(want[i])) {
      if (!std::isnan(g)) num = std::numeric_limits<double>::infinity();
      continue;
    }
    num = std::isnan(g) ? std::numeric_limits<double>::infinity() : std::max(num, std::abs(g - want[i]));
    den = std::max(den, std::abs(want[i]));
  }
  return num / den;
}

/// A forward of E (bf16, f16) Q [S_q, H, D], K [S_k, KH, D], V [S_k, KH, D_v] with `p`, on `kernel`,
/// against the double reference on the same inputs: {normwise error of O, of the LSE}. The keys
/// `nan_keys` hold NaN in V: the rows that see one must come out NaN, as the reference's do, and
/// every other row exact.
template <class E>
std::pair<double, double> narrow_case(CpuFlashKernel& kernel, std::int64_t sq, std::int64_t sk, std::int64_t h,
                                   std::int64_t kh, std::int64_t d, std::int64_t dv, const KernelParams& p,
                                   const std::vector<std::int64_t>& nan_keys, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto draw = [&](std::int64_t count, std::vector<E>& x, std::vector<double>& xd) { draw_as(rng, count, x, xd); };
  std::vector<E> q, k, v;
  std::vector<double> qd, kd, vd;
  draw(sq * h * d, q, qd);
  draw(sk * kh * d, k, kd);
  draw(sk * kh * dv, v, vd);
  for (std::int64_t j : nan_keys)
    for (std::int64_t i = 0; i < kh * dv; ++i) {
      v[j * kh * dv + i] = E(std::numeric_limits<float>::quiet_NaN());
      vd[j * kh * dv + i] = std::numeric_limits<double>::quiet_NaN();
    }
  std::vector<double> want_o(sq * h * dv), want_l(sq * h);
  ReferenceKernel{}.forward(TensorView<const double>::bshd(qd.data(), 1, sq, h, d),
                            TensorView<const double>::bshd(kd.data(), 1, sk, kh, d),
                            TensorView<const double>::bshd(vd.data(), 1, sk, kh, dv),
                            TensorView<double>::bshd(want_o.data(), 1, sq, h, dv),
                            TensorView<double>::bshd(want_l.data(), 1, sq, h, 1), p);
  std::vector<float> out(want_o.size()), lse(want_l.size());
  kernel.forward(TensorView<const E>::bshd(q.data(), 1, sq, h, d), TensorView<const E>::bshd(k.data(), 1, sk, kh, d),
                 TensorView<const E>::bshd(v.data(), 1, sk, kh, dv), TensorView<float>::bshd(out.data(), 1, sq, h, dv),
                 TensorView<float>::bshd(lse.data(), 1, sq, h, 1), p);
  double lse_err = 0;  // rows that see nothing: -inf on both sides
  for (std::size_t i = 0; i < lse.size(); ++i)
    if (!(std::isinf(want_l[i]) && lse[i] == static_cast<float>(want_l[i])))
      lse_err = std::max(lse_err, std::abs(lse[i] - want_l[i]) / std::max(1.0, std::abs(want_l[i])));
  return {nan_aware_error(out, want_o), lse_err};
}

/// A backward of E (bf16, f16) with `p` on a CpuFlashKernel of level `isa` (shapes as
/// narrow_case), from the reference's
/// O rounded to E and its LSE in float, against the double reference's backward from the same
/// O and LSE: the largest normwise error of dQ, dK and dV (nan_aware_error: a gradient the
/// reference makes NaN must be NaN). The keys `nan_keys` hold NaN in K and V and the rows
/// `nan_rows` NaN in Q and dO (a row that sees no key adds nothing; one that sees keys makes
/// NaN its dQ and the gradients of exactly those keys, as in the reference); the run on two
/// threads must give the same bits as on one.
template <class E>
double narrow_backward_case(CpuIsa isa, std::int64_t sq, std::int64_t sk, std::int64_t h, std::int64_t kh, std::int64_t d,
                            std::int64_t dv, const KernelParams& p, const std::vector<std::int64_t>& nan_keys,
                            const std::vector<std::int64_t>& nan_rows, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto draw = [&](std::int64_t count, std::vector<E>& x, std::vector<double>& xd) { draw_as(rng, count, x, xd); };
  std::vector<E> q, k, v, dout;
  std::vector<double> qd, kd, vd, doutd;
  draw(sq * h * d, q, qd);
  draw(sk * kh * d, k, kd);
  draw(sk * kh * dv, v, vd);
  draw(sq * h * dv, dout, doutd);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  auto poison = [&](std::vector<E>& x, std::vector<double>& xd, std::int64_t row, std::int64_t width) {
    for (std::int64_t i = row * width; i < (row + 1) * width; ++i) {
      x[i] = E(nan);
      xd[i] = nan;
    }
  };
  for (std::int64_t j : nan_keys) {
    poison(k, kd, j, kh * d);
    poison(v, vd, j, kh * dv);
  }
  for (std::int64_t i : nan_rows) {
    poison(q, qd, i, h * d);
    poison(dout, doutd, i, h * dv);
  }
  using CD = TensorView<const double>;
  std::vector<double> o(sq * h * dv), l(sq * h);
  ReferenceKernel{}.forward(CD::bshd(qd.data(), 1, sq, h, d), CD::bshd(kd.data(), 1, sk, kh, d),
                            CD::bshd(vd.data(), 1, sk, kh, dv), TensorView<double>::bshd(o.data(), 1, sq, h, dv),
                            TensorView<double>::bshd(l.data(), 1, sq, h, 1), p);
  std::vector<E> out(o.size());
  std::vector<float> lse(l.begin(), l.end());
  for (std::size_t i = 0; i < o.size(); ++i) {
    out[i] = E(o[i]);
    o[i] = static_cast<double>(out[i]);
  }
  std::vector<double> wq(q.size()), wk(k.size()), wv(v.size()), ld(lse.begin(), lse.end());
  ReferenceKernel{}.backward(CD::bshd(doutd.data(), 1, sq, h, dv), CD::bshd(qd.data(), 1, sq, h, d),
                             CD::bshd(kd.data(), 1, sk, kh, d), CD::bshd(vd.data(), 1, sk, kh, dv),
                             CD::bshd(o.data(), 1, sq, h, dv), CD::bshd(ld.data(), 1, sq, h, 1),
                             TensorView<double>::bshd(wq.data(), 1, sq, h, d), TensorView<double>::bshd(wk.data(), 1, sk, kh, d),
                             TensorView<double>::bshd(wv.data(), 1, sk, kh, dv), p);
  using CE = TensorView<const E>;
  std::vector<float> gq[2], gk[2], gv[2];
  for (int threads : {1, 2}) {
    CpuFlashKernel kernel(CpuFlashOptions{.threads = threads, .isa = isa});
    auto &dq = gq[threads - 1], &dk = gk[threads - 1], &dvv = gv[threads - 1];
    dq.assign(q.size(), 0.0f);
    dk.assign(k.size(), 0.0f);
    dvv.assign(v.size(), 0.0f);
    kernel.backward(CE::bshd(dout.data(), 1, sq, h, dv), CE::bshd(q.data(), 1, sq, h, d), CE::bshd(k.data(), 1, sk, kh, d),
                    CE::bshd(v.data(), 1, sk, kh, dv), CE::bshd(out.data(), 1, sq, h, dv),
                    TensorView<const float>::bshd(lse.data(), 1, sq, h, 1), TensorView<float>::bshd(dq.data(), 1, sq, h, d),
                    TensorView<float>::bshd(dk.data(), 1, sk, kh, d), TensorView<float>::bshd(dvv.data(), 1, sk, kh, dv), p);
  }
  auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
    return std::equal(a.begin(), a.end(), b.begin(), [](float x, float y) { return std::memcmp(&x, &y, sizeof x) == 0; });
  };
  CHECK(same_bits(gq[0], gq[1]));
  CHECK(same_bits(gk[0], gk[1]));
  CHECK(same_bits(gv[0], gv[1]));
  return std::max({nan_aware_error(gq[0], wq), nan_aware_error(gk[0], wk), nan_aware_error(gv[0], wv)});
}

}  // namespace seqpar::test
