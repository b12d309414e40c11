// CudaFlashKernel on the features of today's models, forward (O, LSE) against the exact double
// brute force of tests/support (scores, soft-cap, D_v and masks from their definitions, not
// from the kernels' code) and backward (dQ, dK, dV) against ReferenceKernel in double: logit
// soft-capping, a head dimension D_v of V and O other than D (DeepSeek's MLA: 192/128 prefill
// and 576/512 decode with MQA on the tensor cores), odd pairs on SIMT, both features together,
// under masks, with NaN and Inf at keys some rows do not see, for half, bf16 and float; and
// TensorOps<CudaSpace>'s attention-sink ops against TensorOps<HostSpace>'s.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "support/gpu_check.hpp"
#include "support/kernel_check.hpp"

using namespace seqpar;
using namespace seqpar::gpu_test;

namespace {

/// One kernel call over a whole problem: shapes, features and mask by their definitions.
struct FeatureCase {
  const char* name;
  std::int64_t batch, sq, skv, heads, kv_heads, dim, dim_v;
  double softcap = 0.0;
  bool causal = false;  // bottom-right aligned: the last query sees the last key (decode)
  Window window{};
  std::vector<std::vector<std::int64_t>> documents{};
  std::vector<std::int64_t> kv_valid{};
  // Poison (every batch element and head; -1: none): NaN in V at this key, +Inf in K at this
  // key, NaN in Q and dO at this query row.
  std::int64_t nan_v_key = -1, inf_k_key = -1, nan_q_row = -1;

  bool poisoned() const { return nan_v_key >= 0 || inf_k_key >= 0 || nan_q_row >= 0; }
  AttentionProblem problem() const {
    return {.batch = batch, .heads = heads, .kv_heads = kv_heads, .head_dim = dim, .head_dim_v = dim_v,
            .causal = causal, .causal_align = CausalAlign::bottom_right, .window = window, .documents = documents,
            .kv_valid = kv_valid, .softcap = softcap};
  }
};

/// KernelParams of the call as the engine builds them (MaskView over `tables`; the diagonal
/// of query i at i + S_kv - S_q).
KernelParams params_of(const FeatureCase& c, const AttentionProblem& pr, const MaskTables& tables) {
  KernelParams p;
  p.scale = pr.softmax_scale();
  p.softcap = c.softcap;
  p.causal = c.causal;
  p.group_size = c.heads / c.kv_heads;
  p.q_positions = PositionMap::run(c.sq, c.skv - c.sq);
  p.k_positions = PositionMap::run(c.skv, 0);
  p.mask = tables.view(false, c.window);
  return p;
}

/// The downloaded results of a forward.
struct ForwardResult {
  std::vector<double> out, lse;
};

/// `kernel`'s forward of (q, k, v) on `stream` into buffers poisoned with NaN (every element
/// must be written): O [B, S_q, H, D_v] and the LSE.
template <class T>
ForwardResult run_forward(const CudaFlashKernel& kernel, Stream& stream, const Tensor<T>& q, const Tensor<T>& k,
                          const Tensor<T>& v, const KernelParams& p) {
  const std::int64_t B = q.b, Sq = q.s, H = q.h, Dv = v.d;
  DeviceBuffer<T> out(static_cast<std::size_t>(B * Sq * H * Dv));
  DeviceBuffer<float> lse(static_cast<std::size_t>(B * Sq * H));
  out.poison();
  lse.poison();
  kernel.forward(q.view(), k.view(), v.view(), TensorView<T, CudaSpace>::bshd(out.data(), B, Sq, H, Dv),
                 TensorView<float, CudaSpace>::bshd(lse.data(), B, Sq, H, 1), p);
  stream.sync();
  return {out.download(), lse.download()};
}

/// How a case is run: the kernel's options.
struct PathChoice {
  bool tensor_cores = true;
  int query_tile = 64;
  bool ldmatrix = true;
  bool backward = true;
};

/// Whether the tensor-core kernels take (D, D_v) = (d, dv), as the kernel's doc comment lists
/// them: prefill (forward and backward), or MLA decode (forward only); the MLA pairs only where
/// they are compiled in (SEQPAR_CUDA_MLA_KERNELS).
bool prefill_mma_dims(std::int64_t d, std::int64_t dv) {
  return (d == 64 && dv == 64) || (d == 128 && dv == 128) || (CudaFlashKernel::mla_kernels && d == 192 && dv == 128);
}
bool decode_mma_dims(std::int64_t d, std::int64_t dv) { return CudaFlashKernel::mla_kernels && d == 576 && dv == 512; }

/// Forward and backward of `c` in element type T through the path `how` selects, against the
/// brute force: O within tolerance<T> (half 5e-3, bf16 2.5e-2, float 1e-5) and the LSE within
/// 1e-5, normwise; gradients on tensor cores within twice T's unit roundoff (P and dS are
/// rounded to T as mma operands), on SIMT within 1e-4 (float math on T inputs), as the
/// kernel's other tests. The backward starts from the brute force's O (rounded to T) and LSE.
/// Poisoned cases: the same over the entries the reference keeps finite, and NaN (or Inf)
/// exactly where it has them (check_poisoned).
template <class T>
void check_case(const FeatureCase& c, PathChoice how = {}) {
  const bool tc = how.tensor_cores && !std::is_same_v<T, float> && tensor_core_device();
  const bool fwd_mma = tc && (prefill_mma_dims(c.dim, c.dim_v) || decode_mma_dims(c.dim, c.dim_v));
  const std::string name = c.name, type = type_name<T>(), fwd_path = fwd_mma ? "mma" : "simt",
                    bwd_path = tc && prefill_mma_dims(c.dim, c.dim_v) ? "mma" : "simt";
  CAPTURE(name);
  CAPTURE(type);
  CAPTURE(fwd_path);
  CAPTURE(bwd_path);
  CAPTURE(how.query_tile);
  CAPTURE(how.ldmatrix);
  const AttentionProblem pr = c.problem();
  const MaskTables tables(c.documents, c.kv_valid);
  const KernelParams p = params_of(c, pr, tables);
  const std::int64_t B = c.batch, Sq = c.sq, Sk = c.skv, H = c.heads, K = c.kv_heads, D = c.dim, Dv = c.dim_v;
  std::mt19937_64 rng(static_cast<std::uint64_t>(Sq * 1009 + Sk * 31 + D * 7 + Dv));
  // Wider than [-1, 1]: scores of a few units, so that a soft-cap of a few units bends them.
  Tensor<T> q(B, Sq, H, D, 0, rng, -2.0, 2.0), k(B, Sk, K, D, 0, rng, -2.0, 2.0), v(B, Sk, K, Dv, 0, rng),
      dout(B, Sq, H, Dv, 0, rng);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  if (c.nan_v_key >= 0) v.set_token(c.nan_v_key, nan);
  if (c.inf_k_key >= 0) k.set_token(c.inf_k_key, std::numeric_limits<double>::infinity());
  if (c.nan_q_row >= 0) {
    q.set_token(c.nan_q_row, nan);
    dout.set_token(c.nan_q_row, nan);
  }
  // `got` against `want` within `tol` (rows of `row_len` elements, for the messages).
  auto compare = [&](const char* what, const std::vector<double>& got, const std::vector<double>& want, double tol,
                     std::int64_t row_len) {
    if (c.poisoned())
      CHECK(check_poisoned(what, got, want, tol, nullptr, row_len) > 0);
    else
      CHECK(rel_error(got, want) <= tol);
  };
  const test::BruteProblem x{pr, Sq, Sk, q.host, k.host, v.host};
  const test::GlobalOutput want = test::brute_force_forward(x);

  Stream stream;
  CudaFlashKernel kernel(stream);
  kernel.set_tensor_cores(how.tensor_cores);
  kernel.set_query_tile(how.query_tile);
  kernel.set_ldmatrix(how.ldmatrix);
  CHECK(kernel.forward_path<T>(q.view(), k.view(), v.view()) == fwd_path);
  const ForwardResult got = run_forward(kernel, stream, q, k, v, p);
  compare("O", got.out, want.out, tolerance<T>, H * Dv);
  compare("LSE", got.lse, want.lse, 1e-5, H);
  if (!how.backward) return;

  std::vector<double> out_t = want.out;
  for (auto& e : out_t) e = to_double(from_double<T>(e));
  DeviceBuffer<T> out_d(out_t.size());
  out_d.upload(out_t);
  DeviceBuffer<float> lse_d(want.lse.size());
  lse_d.upload(want.lse);
  DeviceBuffer<float> dq(q.host.size()), dk(k.host.size()), dv(v.host.size());
  for (auto* g : {&dq, &dk, &dv}) g->upload(std::vector<double>(g->size(), 0.0));
  CHECK(kernel.backward_path<T>(dout.view(), q.view(), k.view(), v.view()) == bwd_path);
  using G = TensorView<float, CudaSpace>;
  kernel.backward(dout.view(), q.view(), k.view(), v.view(),
                  TensorView<const T, CudaSpace>::bshd(out_d.data(), B, Sq, H, Dv),
                  TensorView<const float, CudaSpace>::bshd(lse_d.data(), B, Sq, H, 1), G::bshd(dq.data(), B, Sq, H, D),
                  G::bshd(dk.data(), B, Sk, K, D), G::bshd(dv.data(), B, Sk, K, Dv), p);
  stream.sync();
  // The exact gradients given what the kernel was given, O rounded to T (D_i = rowsum(dO O)
  // takes it): ReferenceKernel, whose soft-capped and D_v gradients test_model_features holds
  // to finite differences.
  std::vector<double> want_dq(q.host.size()), want_dk(k.host.size()), want_dv(v.host.size());
  using HV = TensorView<const double>;
  ReferenceKernel{}.backward(dout.host_view(), q.host_view(), k.host_view(), v.host_view(),
                             HV::bshd(out_t.data(), B, Sq, H, Dv), HV::bshd(want.lse.data(), B, Sq, H, 1),
                             TensorView<double>::bshd(want_dq.data(), B, Sq, H, D),
                             TensorView<double>::bshd(want_dk.data(), B, Sk, K, D),
                             TensorView<double>::bshd(want_dv.data(), B, Sk, K, Dv), p);
  const double unit_roundoff = std::is_same_v<T, __half> ? 0x1p-11 : 0x1p-8;
  const double tol = bwd_path == "mma" ? 2 * unit_roundoff : 1e-4;
  compare("dQ", dq.download(), want_dq, tol, H * D);
  compare("dK", dk.download(), want_dk, tol, K * D);
  compare("dV", dv.download(), want_dv, tol, K * Dv);
}

/// `c` in every element type on its default path.
void check_all_types(const FeatureCase& c) {
  check_case<__half>(c);
  check_case<__nv_bfloat16>(c);
  check_case<float>(c);
}

}  // namespace

TEST_CASE("CudaFlashKernel soft-caps the scores, forward and backward") {
  // Scores of a few units against caps of 2 and 5: most of them bent well away from linear.
  check_all_types({"softcap 64/64 causal", 1, 70, 70, 2, 1, 64, 64, 2.0, true});
  check_all_types({"softcap 40/40 window", 1, 45, 45, 2, 2, 40, 40, 5.0, true, {20, -1}});
}

TEST_CASE("CudaFlashKernel with D_v != D: MLA prefill (192, 128) on tensor cores, any pair on SIMT") {
  check_all_types({"MLA prefill 192/128 causal", 1, 70, 70, 2, 1, 192, 128, 0.0, true});
  const FeatureCase mla{"MLA prefill 192/128", 1, 70, 70, 2, 2, 192, 128};
  // The 128-row tile and plain shared loads are options of (64, 64) and (128, 128) only: asked
  // for at (192, 128), the tensor cores still run it (the one variant there).
  check_case<__nv_bfloat16>(mla, {.query_tile = 128, .ldmatrix = false, .backward = false});
  check_case<__half>(mla, {.tensor_cores = false});  // SIMT
  // Odd pairs: D past one 256-column chunk with a narrow D_v, and the reverse (two output slices).
  check_case<float>({"odd 270/20", 1, 40, 40, 2, 1, 270, 20, 0.0, true});
  check_case<__nv_bfloat16>({"odd 20/270", 1, 40, 40, 2, 1, 20, 270, 0.0, true});
}

TEST_CASE("CudaFlashKernel with both: MLA decode (576, 512) with MQA, and soft-capped MLA under masks") {
  // Decode: 5 and 1 new query rows per sequence, the query heads sharing one latent K/V head (MQA).
  check_all_types({"MLA decode 576/512 MQA", 2, 5, 150, 8, 1, 576, 512, 0.0, true, {}, {}, {150, 97}});
  check_case<__nv_bfloat16>({"MLA decode 576/512 GQA", 1, 2, 70, 12, 2, 576, 512, 0.0, true});
  // 40 heads of one token: a block of 32 packed rows and one of 8.
  check_case<__half>({"MLA decode 576/512, one row", 1, 1, 100, 40, 1, 576, 512, 0.0, true});
  check_case<__half>({"MLA decode 576/512 softcap", 1, 3, 70, 16, 1, 576, 512, 4.0, true}, {.tensor_cores = false});
  check_case<__nv_bfloat16>({"MLA decode 576/512 softcap", 1, 3, 70, 16, 1, 576, 512, 4.0, true});
  check_all_types({"MLA 192/128 softcap, documents", 1, 80, 80, 2, 1, 192, 128, 5.0, true, {}, {{30, 50}}});
  check_case<float>({"odd 24/40 softcap, padding", 2, 40, 40, 2, 1, 24, 40, 3.0, false, {}, {}, {40, 17}});
}

/// MLA decode's forward on a rank's share of the heads, as Ulysses leaves them: query heads
/// 5-10 of 16 (local 0-5) over both K/V heads of 2 (groups of 8), so each local K/V head has
/// part of its group (local heads 0-2 and 3-5), against ReferenceKernel on the same params.
template <class T>
void check_decode_head_share() {
  const std::int64_t B = 1, Sq = 3, Sk = 80, H = 6, K = 2, D = 576, Dv = 512;
  std::mt19937_64 rng(5);
  Tensor<T> q(B, Sq, H, D, 0, rng), k(B, Sk, K, D, 0, rng), v(B, Sk, K, Dv, 0, rng);
  KernelParams p;
  p.scale = 1.0 / std::sqrt(double(D));
  p.causal = true;
  p.group_size = 8;
  p.q_head_begin = 5;
  p.q_positions = PositionMap::run(Sq, Sk - Sq);
  p.k_positions = PositionMap::run(Sk, 0);
  Stream stream;
  CudaFlashKernel kernel(stream);
  CHECK(std::string(kernel.forward_path<T>(q.view(), k.view(), v.view())) ==
        (tensor_core_device() && decode_mma_dims(D, Dv) ? "mma" : "simt"));
  const ForwardResult got = run_forward(kernel, stream, q, k, v, p);
  std::vector<double> want(got.out.size()), want_lse(got.lse.size());
  ReferenceKernel{}.forward(q.host_view(), k.host_view(), v.host_view(),
                            TensorView<double>::bshd(want.data(), B, Sq, H, Dv),
                            TensorView<double>::bshd(want_lse.data(), B, Sq, H, 1), p);
  CHECK(rel_error(got.out, want) <= tolerance<T>);
  CHECK(rel_error(got.lse, want_lse) <= 1e-5);
}

TEST_CASE("CudaFlashKernel MLA decode on part of the heads of each K/V head (a Ulysses rank's share)") {
  check_decode_head_share<__half>();
  check_decode_head_share<__nv_bfloat16>();
}

TEST_CASE("CudaFlashKernel with D_v != D: a NaN or Inf reaches only the rows and gradients that depend on it") {
  // Window 63: V[66] is hidden from rows 64 and 65 of the query tile that meets it, K[100]
  // from the rows before 100; row 127 (NaN in Q and dO) sees keys 64-127, whole key tiles of
  // either path, and none of keys 0-63, which its query tile meets: their dK and dV must stay
  // finite (a NaN row that sees part of a key tile reaches that tile's dK and dV, by design).
  const FeatureCase prefill{.name = "MLA prefill 192/128 poisoned", .batch = 1, .sq = 128, .skv = 128, .heads = 2,
                            .kv_heads = 1, .dim = 192, .dim_v = 128, .softcap = 4.0, .causal = true,
                            .window = {63, -1}, .nan_v_key = 66, .inf_k_key = 100, .nan_q_row = 127};
  check_case<__half>(prefill);
  check_case<__nv_bfloat16>(prefill);
  check_case<float>(prefill);
  // Decode: V[147] is seen by tokens 2-4 of batch element 0 only, K[149] by token 4; batch
  // element 1 sees neither (key padding).
  const FeatureCase decode{.name = "MLA decode 576/512 poisoned", .batch = 2, .sq = 5, .skv = 150, .heads = 8,
                           .kv_heads = 1, .dim = 576, .dim_v = 512, .causal = true, .kv_valid = {150, 97},
                           .nan_v_key = 147, .inf_k_key = 149};
  check_case<__half>(decode);
  check_case<__nv_bfloat16>(decode);
}

TEST_CASE("TensorOps<CudaSpace>::join_sinks matches TensorOps<HostSpace>") {
  std::mt19937_64 rng(17);
  const std::int64_t B = 2, S = 5, H = 3, D = 24;
  Stream stream;
  TensorOps<CudaSpace> ops;
  ops.set_stream(stream);
  Tensor<float> o(B, S, H, D, 0, rng), l(B, S, H, 1, 0, rng, -3.0, 3.0), sinks(1, 1, H, 1, 0, rng, -2.0, 2.0);
  std::vector<double> lh = l.host, oh = o.host;
  lh[1] = -INFINITY;  // a row that saw no key: O = 0, LSE = the sink
  for (std::int64_t d = 0; d < D; ++d) oh[1 * D + d] = 0.0;
  lh[4] = std::numeric_limits<double>::quiet_NaN();  // a NaN row stays NaN
  o.dev.upload(oh);
  l.dev.upload(lh);
  ops.join_sinks(o.mut_view(), l.mut_view(), sinks.dev.data());
  // Half outputs: the same rule, converted on the way in and out.
  Tensor<__half> oh16(B, S, H, D, 0, rng);
  DeviceBuffer<float> l16(lh.size());
  l16.upload(lh);
  ops.join_sinks(oh16.mut_view(), TensorView<float, CudaSpace>::bshd(l16.data(), B, S, H, 1), sinks.dev.data());
  stream.sync();

  std::vector<float> of(oh.begin(), oh.end()), lf(lh.begin(), lh.end()), sf(sinks.host.begin(), sinks.host.end());
  TensorOps<HostSpace>::join_sinks(TensorView<float>::bshd(of.data(), B, S, H, D),
                                   TensorView<float>::bshd(lf.data(), B, S, H, 1), sf.data());
  std::vector<__half> o16(oh16.host.size());
  std::vector<float> l16h(lh.begin(), lh.end());
  for (std::size_t i = 0; i < o16.size(); ++i) o16[i] = from_double<__half>(oh16.host[i]);
  TensorOps<HostSpace>::join_sinks(TensorView<__half>::bshd(o16.data(), B, S, H, D),
                                   TensorView<float>::bshd(l16h.data(), B, S, H, 1), sf.data());
  const std::vector<double> got_o = o.values(), got_l = l.values(), got_o16 = oh16.values(), got_l16 = l16.download();
  for (std::size_t r = 0; r < lf.size(); ++r) {
    CAPTURE(r);
    if (std::isnan(lf[r])) {
      CHECK(std::isnan(got_l[r]));
      CHECK(std::isnan(got_l16[r]));
      continue;
    }
    CHECK(got_l[r] == doctest::Approx(lf[r]).epsilon(1e-6));
    CHECK(got_l16[r] == doctest::Approx(lf[r]).epsilon(1e-6));
  }
  CHECK(got_l[1] == doctest::Approx(sf[1]).epsilon(1e-6));
  for (std::size_t i = 0; i < of.size(); ++i) {
    CAPTURE(i);
    if (std::isnan(of[i])) {
      CHECK(std::isnan(got_o[i]));
      continue;
    }
    CHECK(std::abs(got_o[i] - of[i]) <= 1e-6);
    CHECK(std::abs(got_o16[i] - to_double(o16[i])) <= 1e-3);  // one half rounding at most apart
  }
  for (std::int64_t d = 0; d < D; ++d) CHECK(got_o[1 * D + d] == 0.0);
}

TEST_CASE("TensorOps<CudaSpace>::sink_grads matches TensorOps<HostSpace>, overwrites, and repeats its bits") {
  std::mt19937_64 rng(23);
  const std::int64_t B = 2, S = 300, H = 3, D = 20;  // more rows per head than threads per block
  Stream stream;
  TensorOps<CudaSpace> ops;
  ops.set_stream(stream);
  Tensor<__nv_bfloat16> dout(B, S, H, D, 0, rng), out(B, S, H, D, 0, rng);
  Tensor<float> l(B, S, H, 1, 0, rng, -1.0, 2.0), sinks(1, 1, H, 1, 0, rng, -1.0, 1.0);
  std::vector<double> lh = l.host;
  lh[7] = -INFINITY;  // a row that saw nothing and has no sink term: adds 0
  l.dev.upload(lh);
  DeviceBuffer<float> d_sinks(static_cast<std::size_t>(H));
  auto run = [&] {
    d_sinks.poison();  // NaN: every entry must be overwritten
    ops.sink_grads(dout.view(), out.view(), l.view(), sinks.dev.data(), d_sinks.data());
    stream.sync();
    return d_sinks.download();
  };
  const std::vector<double> first = run(), second = run();
  CHECK(std::memcmp(first.data(), second.data(), first.size() * sizeof(double)) == 0);

  std::vector<__nv_bfloat16> gh(dout.host.size()), oh(out.host.size());
  for (std::size_t i = 0; i < gh.size(); ++i) {
    gh[i] = from_double<__nv_bfloat16>(dout.host[i]);
    oh[i] = from_double<__nv_bfloat16>(out.host[i]);
  }
  std::vector<float> lf(lh.begin(), lh.end()), sf(sinks.host.begin(), sinks.host.end());
  std::vector<float> want(static_cast<std::size_t>(H));
  TensorOps<HostSpace>::sink_grads(TensorView<const __nv_bfloat16>::bshd(gh.data(), B, S, H, D),
                                   TensorView<const __nv_bfloat16>::bshd(oh.data(), B, S, H, D),
                                   TensorView<const float>::bshd(lf.data(), B, S, H, 1), sf.data(), want.data());
  // The same terms in another order: float sums of 600 terms, a few units of 1e-7 apart.
  for (std::int64_t h = 0; h < H; ++h) {
    CAPTURE(h);
    CHECK(std::abs(first[h] - want[h]) <= 1e-5 * std::max(1.0, std::abs(double(want[h]))));
  }
}
