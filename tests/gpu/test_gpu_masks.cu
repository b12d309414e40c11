// CudaFlashKernel under every mask family: bottom-right causal with S_q != S_kv, sliding
// windows (causal and not), packed documents (uneven, shorter than a tile), key padding (a
// batch element with every key hidden) and a combination, on both paths (tensor cores and
// SIMT) and every element type, forward (O, LSE) and backward (dQ, dK, dV) against a double
// reference written from the definitions (not from MaskView); NaN in K and V at hidden keys,
// and in Q and dO of rows that see no key (or none of a key tile); the device mask tables
// uploaded once per plan; and Ring Zigzag and Ulysses with a mask.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "support/gpu_check.hpp"
#include "support/mask_brute.hpp"

using namespace seqpar;
using namespace seqpar::gpu_test;

namespace {

/// A masked attention problem by its definitions (global lengths, the families of
/// AttentionProblem), and which global positions a kernel call gets.
struct Spec {
  const char* name;
  std::int64_t sq, skv;  // global lengths
  bool causal = false;
  CausalAlign align = CausalAlign::top_left;
  Window window{};
  std::vector<std::vector<std::int64_t>> documents{};
  std::vector<std::int64_t> kv_valid{};
  PositionMap q_global{}, k_global{};  // the call's rows (empty: the whole sequence)
  bool poison = false;       // NaN in K and V at every key past kv_valid (hidden from every row)
  bool poison_seen = false;  // NaN in V at local key 100 and K at key 30 of batch element 0 (some rows see them)
  bool nan_blind = false;    // NaN in Q and dO of every row that sees no key
  std::int64_t nan_row = -1; // NaN in Q and dO of this local row of batch element 0 (every head)

  std::int64_t batch = 2, heads = 2, kv_heads = 1, dim = 64;
  PositionMap qpos() const { return q_global.size() ? q_global : PositionMap::run(sq, 0); }
  PositionMap kpos() const { return k_global.size() ? k_global : PositionMap::run(skv, 0); }
  double scale() const { return 1.0 / std::sqrt(static_cast<double>(dim)); }
  /// The global problem these definitions describe.
  AttentionProblem problem(DType dtype = DType::f32, bool with_lse = false) const {
    return {.batch = batch, .heads = heads, .kv_heads = kv_heads, .head_dim = dim, .causal = causal, .dtype = dtype,
            .with_lse = with_lse, .causal_align = align, .window = window, .documents = documents,
            .kv_valid = kv_valid};
  }
};

/// Key j visible to query i (global positions) of batch element b, from the definitions
/// (tests/support/mask_brute.hpp): visibility(s)(b, i, j).
auto visibility(const Spec& s) {
  return [pr = s.problem(), sq = s.sq, skv = s.skv](std::int64_t b, std::int64_t i, std::int64_t j) {
    return test::visible_by_definition(pr, sq, skv, b, i, j);
  };
}

/// Per (batch element, local query row), b * S_q + i: whether the row sees no key of the call.
std::vector<char> blind_rows(const Spec& s) {
  const auto visible = visibility(s);
  const PositionMap qp = s.qpos(), kp = s.kpos();
  std::vector<char> blind(static_cast<std::size_t>(s.batch * qp.size()), 1);
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t i = 0; i < qp.size(); ++i)
      for (std::int64_t j = 0; j < kp.size() && blind[static_cast<std::size_t>(b * qp.size() + i)]; ++j)
        if (visible(b, qp(i), kp(j))) blind[static_cast<std::size_t>(b * qp.size() + i)] = 0;
  return blind;
}

/// The call's inputs in double ([B, S, H, D] contiguous), rounded to T.
struct Inputs {
  std::vector<double> q, k, v, dout;
};

/// Reference forward from the definitions: out and lse ([B, S, H]) for the rows at global
/// positions qp against the keys at kp. A row that sees no key: O = 0, LSE = -inf.
void reference_forward(const Spec& s, const PositionMap& qp, const PositionMap& kp, const Inputs& x,
                       std::vector<double>& out, std::vector<double>& lse) {
  const std::int64_t B = s.batch, H = s.heads, K = s.kv_heads, D = s.dim, Sq = qp.size(), Sk = kp.size();
  const auto visible = visibility(s);
  out.assign(static_cast<std::size_t>(B * Sq * H * D), 0.0);
  lse.assign(static_cast<std::size_t>(B * Sq * H), -std::numeric_limits<double>::infinity());
  std::vector<double> sc(static_cast<std::size_t>(Sk));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < Sq; ++i)
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t kh = h / (H / K);
        const double* qr = &x.q[static_cast<std::size_t>(((b * Sq + i) * H + h) * D)];
        double m = -std::numeric_limits<double>::infinity();
        bool any = false;
        for (std::int64_t j = 0; j < Sk; ++j) {
          if (!visible(b, qp(i), kp(j))) continue;
          const double* kr = &x.k[static_cast<std::size_t>(((b * Sk + j) * K + kh) * D)];
          double dot = 0;
          for (std::int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
          sc[static_cast<std::size_t>(j)] = dot * s.scale();
          m = std::isnan(dot) || m < sc[static_cast<std::size_t>(j)] ? sc[static_cast<std::size_t>(j)] : m;
          any = true;
        }
        if (!any) continue;
        double sum = 0;
        double* o = &out[static_cast<std::size_t>(((b * Sq + i) * H + h) * D)];
        for (std::int64_t j = 0; j < Sk; ++j) {
          if (!visible(b, qp(i), kp(j))) continue;
          const double p = std::exp(sc[static_cast<std::size_t>(j)] - m);
          sum += p;
          const double* vr = &x.v[static_cast<std::size_t>(((b * Sk + j) * K + kh) * D)];
          for (std::int64_t d = 0; d < D; ++d) o[d] += p * vr[d];
        }
        for (std::int64_t d = 0; d < D; ++d) o[d] /= sum;
        lse[static_cast<std::size_t>((b * Sq + i) * H + h)] = m + std::log(sum);
      }
}

/// Reference backward from the definitions: adds this call's dQ, dK, dV to dq, dk, dv, with
/// P recomputed from `lse` (the forward's) and D_i = rowsum(dO * O).
void reference_backward(const Spec& s, const PositionMap& qp, const PositionMap& kp, const Inputs& x,
                        const std::vector<double>& out, const std::vector<double>& lse, std::vector<double>& dq,
                        std::vector<double>& dk, std::vector<double>& dv) {
  const std::int64_t B = s.batch, H = s.heads, K = s.kv_heads, D = s.dim, Sq = qp.size(), Sk = kp.size();
  const auto visible = visibility(s);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < Sq; ++i)
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t kh = h / (H / K);
        const std::size_t row = static_cast<std::size_t>(((b * Sq + i) * H + h) * D);
        double di = 0;
        for (std::int64_t d = 0; d < D; ++d) di += x.dout[row + d] * out[row + d];
        for (std::int64_t j = 0; j < Sk; ++j) {
          if (!visible(b, qp(i), kp(j))) continue;
          const std::size_t kr = static_cast<std::size_t>(((b * Sk + j) * K + kh) * D);
          double dot = 0, dp = 0;
          for (std::int64_t d = 0; d < D; ++d) {
            dot += x.q[row + d] * x.k[kr + d];
            dp += x.dout[row + d] * x.v[kr + d];
          }
          const double p = std::exp(dot * s.scale() - lse[static_cast<std::size_t>((b * Sq + i) * H + h)]);
          const double ds = p * (dp - di);
          for (std::int64_t d = 0; d < D; ++d) {
            dq[row + d] += s.scale() * ds * x.k[kr + d];
            dk[kr + d] += s.scale() * ds * x.q[row + d];
            dv[kr + d] += p * x.dout[row + d];
          }
        }
      }
}

/// Random values in [-1, 1] rounded to T.
template <class T>
std::vector<double> random_values(std::size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<double> x(n);
  for (auto& e : x) e = to_double(from_double<T>(u(rng)));
  return x;
}

/// The call's inputs, NaN where s.poison and s.poison_seen say.
template <class T>
Inputs make_inputs(const Spec& s, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::int64_t B = s.batch, H = s.heads, K = s.kv_heads, D = s.dim, Sq = s.qpos().size(), Sk = s.kpos().size();
  Inputs x{random_values<T>(static_cast<std::size_t>(B * Sq * H * D), rng),
           random_values<T>(static_cast<std::size_t>(B * Sk * K * D), rng),
           random_values<T>(static_cast<std::size_t>(B * Sk * K * D), rng),
           random_values<T>(static_cast<std::size_t>(B * Sq * H * D), rng)};
  const double nan = std::numeric_limits<double>::quiet_NaN();
  auto set = [&](std::vector<double>& t, std::int64_t b, std::int64_t j) {
    for (std::int64_t d = 0; d < K * D; ++d) t[static_cast<std::size_t>((b * Sk + j) * K * D + d)] = nan;
  };
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t j = 0; j < Sk; ++j)
      if (s.poison && !s.kv_valid.empty() && s.kpos()(j) >= s.kv_valid[static_cast<std::size_t>(b)]) {
        set(x.k, b, j);
        set(x.v, b, j);
      }
  if (s.poison_seen) {
    set(x.v, 0, 100);
    set(x.k, 0, 30);
  }
  auto set_row = [&](std::int64_t b, std::int64_t i) {
    for (std::int64_t d = 0; d < H * D; ++d) {
      x.q[static_cast<std::size_t>((b * Sq + i) * H * D + d)] = nan;
      x.dout[static_cast<std::size_t>((b * Sq + i) * H * D + d)] = nan;
    }
  };
  if (s.nan_blind) {
    const std::vector<char> blind = blind_rows(s);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t i = 0; i < Sq; ++i)
        if (blind[static_cast<std::size_t>(b * Sq + i)]) set_row(b, i);
  }
  if (s.nan_row >= 0) set_row(0, s.nan_row);
  return x;
}

/// `got` against `want` (the reference on the same inputs): every finite reference entry is
/// finite in `got`, within `tol` normwise over those entries; every NaN entry is NaN (an Inf
/// entry NaN or Inf); -inf (an LSE of a row that sees nothing) exactly -inf.
void check_close(const char* what, const std::vector<double>& got, const std::vector<double>& want, double tol) {
  REQUIRE(got.size() == want.size());
  std::size_t leaked = 0, lost = 0, finite = 0;
  double err = 0, ref = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isfinite(want[i])) {
      ++finite;
      if (!std::isfinite(got[i])) {
        ++leaked;
        continue;
      }
      err = std::max(err, std::abs(got[i] - want[i]));
      ref = std::max(ref, std::abs(want[i]));
    } else if (std::isnan(want[i]) ? !std::isnan(got[i]) : (want[i] < 0 ? got[i] != want[i] : std::isfinite(got[i]))) {
      ++lost;
    }
  }
  INFO(std::string(what) << ": " << finite << " finite of " << got.size() << ", max error " << err << " of " << ref);
  CHECK(leaked == 0);
  CHECK(lost == 0);
  CHECK((ref > 0 ? err / ref : err) <= tol);
}

/// KernelParams of a call as the engine builds them: MaskView over `tables` (the plan's).
KernelParams kernel_params(const Spec& s, const MaskTables& tables) {
  KernelParams p;
  p.scale = s.scale();
  p.causal = s.causal;
  p.group_size = s.heads / s.kv_heads;
  p.q_positions = s.qpos();
  if (s.align == CausalAlign::bottom_right)
    for (int g = 0; g < p.q_positions.segments; ++g) p.q_positions.seg[g].start += s.skv - s.sq;
  p.k_positions = s.kpos();
  p.mask = tables.view(false, s.window);
  return p;
}

/// Forward and backward of one case through one path of CudaFlashKernel against the reference.
/// Tolerances: O as the causal tests (tolerance<T>: half 5e-3, bf16 2.5e-2, float 1e-5), the
/// LSE 1e-5; gradients on tensor cores twice T's unit roundoff (P and dS are rounded to T as
/// mma operands), on SIMT 1e-4 (float math on T inputs).
template <class T>
void check_case(const Spec& s, bool tensor_cores) {
  const char* want_path = tensor_cores && !std::is_same_v<T, float> ? "mma" : "simt";
  // As strings: doctest prints a const char* as its address.
  const std::string name = s.name, type = type_name<T>(), path = want_path;
  CAPTURE(name);
  CAPTURE(type);
  CAPTURE(path);
  CAPTURE(s.dim);
  const std::int64_t B = s.batch, H = s.heads, K = s.kv_heads, D = s.dim, Sq = s.qpos().size(), Sk = s.kpos().size();
  const Inputs x = make_inputs<T>(s, static_cast<std::uint64_t>(Sq * 31 + Sk));
  const MaskTables tables(s.documents, s.kv_valid);
  const KernelParams p = kernel_params(s, tables);

  DeviceBuffer<T> q(x.q.size()), k(x.k.size()), v(x.v.size()), dout(x.dout.size()), out(x.q.size());
  q.upload(x.q);
  k.upload(x.k);
  v.upload(x.v);
  dout.upload(x.dout);
  DeviceBuffer<float> lse(static_cast<std::size_t>(B * Sq * H));
  out.poison();
  lse.poison();
  using CV = TensorView<const T, CudaSpace>;
  const CV qv = CV::bshd(q.data(), B, Sq, H, D), kv = CV::bshd(k.data(), B, Sk, K, D), vv = CV::bshd(v.data(), B, Sk, K, D);
  Stream stream;
  CudaFlashKernel kernel(stream);
  kernel.set_tensor_cores(tensor_cores);
  CHECK(std::string(kernel.forward_path<T>(qv, kv, vv)) == want_path);
  kernel.forward(qv, kv, vv, TensorView<T, CudaSpace>::bshd(out.data(), B, Sq, H, D),
                 TensorView<float, CudaSpace>::lse_bhs(lse.data(), B, Sq, H), p);
  stream.sync();
  std::vector<double> want, want_lse;
  reference_forward(s, s.qpos(), s.kpos(), x, want, want_lse);
  const std::vector<double> got_out = out.download();
  check_close("O", got_out, want, tolerance<T>);
  // A row that sees no key gets O = 0 exactly, whatever its Q holds (the LSE's -inf is exact in
  // check_close); `moved_rows` counts the elements of such rows of `t` ([B, S_q, H, D]) that
  // differ from `base`'s.
  const std::vector<char> blind = blind_rows(s);
  auto moved_rows = [&](const std::vector<double>& t, const std::vector<double>& base) {
    std::size_t n = 0;
    for (std::size_t r = 0; r < blind.size(); ++r)
      for (std::int64_t e = 0; e < H * D && blind[r]; ++e)
        n += t[r * static_cast<std::size_t>(H * D) + static_cast<std::size_t>(e)] !=
             base[r * static_cast<std::size_t>(H * D) + static_cast<std::size_t>(e)];
    return n;
  };
  CHECK(moved_rows(got_out, std::vector<double>(got_out.size(), 0.0)) == 0);
  // The kernel's LSE is [B, H, S]; the reference's [B, S, H].
  std::vector<double> got_lse = lse.download(), lse_bhs(want_lse.size());
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < Sq; ++i)
      for (std::int64_t h = 0; h < H; ++h)
        lse_bhs[static_cast<std::size_t>((b * H + h) * Sq + i)] = want_lse[static_cast<std::size_t>((b * Sq + i) * H + h)];
  check_close("LSE", got_lse, lse_bhs, 1e-5);

  // Backward from the reference's forward (O rounded to T), onto random gradients.
  std::vector<double> out_t = want;
  for (auto& e : out_t) e = to_double(from_double<T>(e));
  DeviceBuffer<T> out_d(out_t.size());
  out_d.upload(out_t);
  DeviceBuffer<float> lse_d(want_lse.size());
  lse_d.upload(want_lse);
  std::mt19937_64 rng(7);
  std::vector<double> dq = random_values<float>(x.q.size(), rng), dk = random_values<float>(x.k.size(), rng),
                      dv = random_values<float>(x.k.size(), rng);
  DeviceBuffer<float> dq_d(dq.size()), dk_d(dk.size()), dv_d(dv.size());
  dq_d.upload(dq);
  dk_d.upload(dk);
  dv_d.upload(dv);
  CHECK(std::string(kernel.backward_path<T>(CV::bshd(dout.data(), B, Sq, H, D), qv, kv, vv)) == want_path);
  using G = TensorView<float, CudaSpace>;
  kernel.backward(CV::bshd(dout.data(), B, Sq, H, D), qv, kv, vv, CV::bshd(out_d.data(), B, Sq, H, D),
                  TensorView<const float, CudaSpace>::bshd(lse_d.data(), B, Sq, H, 1), G::bshd(dq_d.data(), B, Sq, H, D),
                  G::bshd(dk_d.data(), B, Sk, K, D), G::bshd(dv_d.data(), B, Sk, K, D), p);
  stream.sync();
  const std::vector<double> got_dk = dk_d.download(), got_dv = dv_d.download();
  std::vector<double> want_dq = dq, want_dk = dk, want_dv = dv;
  reference_backward(s, s.qpos(), s.kpos(), x, out_t, want_lse, want_dq, want_dk, want_dv);
  const double unit_roundoff = std::is_same_v<T, __half> ? 0x1p-11 : 0x1p-8;
  const double tol = std::string(want_path) == "mma" ? 2 * unit_roundoff : 1e-4;
  const std::vector<double> got_dq = dq_d.download();
  check_close("dQ", got_dq, want_dq, tol);
  // ... and adds exactly 0 to its dQ (dq holds float values: the download is exact).
  CHECK(moved_rows(got_dq, dq) == 0);
  check_close("dK", got_dk, want_dk, tol);
  check_close("dV", got_dv, want_dv, tol);
  // A key no row sees gets exactly 0 added: its dK and dV keep their starting values.
  const auto visible = visibility(s);
  std::size_t hidden = 0, moved = 0;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t j = 0; j < Sk; ++j) {
      bool seen = false;
      for (std::int64_t i = 0; i < Sq && !seen; ++i) seen = visible(b, s.qpos()(i), s.kpos()(j));
      if (seen) continue;
      ++hidden;
      for (std::int64_t e = 0; e < K * D; ++e) {
        const auto at = static_cast<std::size_t>((b * Sk + j) * K * D + e);
        moved += got_dk[at] != static_cast<double>(static_cast<float>(dk[at])) ||
                 got_dv[at] != static_cast<double>(static_cast<float>(dv[at]));
      }
    }
  INFO(hidden << " keys no row sees");
  CHECK(moved == 0);
}

/// Zigzag-like positions of a ring step: local tokens 0..n/2-1 at 0.., the rest at 3n/2...
PositionMap two_runs(std::int64_t n) {
  PositionMap m = PositionMap::run(n / 2, 0);
  m.seg[m.segments++] = {n - n / 2, 3 * n / 2, 1};
  return m;
}

/// Every family (and one combination), at sizes that give several 64-key (tensor cores) and
/// 32-key (SIMT) tiles, each of the kinds: hidden, cut, whole.
std::vector<Spec> mask_specs() {
  std::vector<Spec> v;
  v.push_back({.name = "bottom-right causal, S_q < S_kv", .sq = 100, .skv = 170, .causal = true,
               .align = CausalAlign::bottom_right});
  v.push_back({.name = "bottom-right causal, S_q > S_kv (rows that see no key)", .sq = 170, .skv = 100, .causal = true,
               .align = CausalAlign::bottom_right});
  v.push_back({.name = "causal window 37, zigzag-like positions", .sq = 400, .skv = 400, .causal = true,
               .window = {37, -1}, .q_global = two_runs(200), .k_global = two_runs(200)});
  v.push_back({.name = "window {20, 45}, not causal", .sq = 200, .skv = 200, .window = {20, 45}});
  v.push_back({.name = "documents per batch element, uneven, shorter than a tile", .sq = 200, .skv = 200,
               .documents = {{5, 60, 3, 90, 42}, {130, 70}}});
  v.push_back({.name = "key padding, one batch element fully padded, poisoned", .sq = 120, .skv = 200,
               .kv_valid = {137, 0}, .poison = true});
  v.push_back({.name = "documents + causal + window + key padding, poisoned", .sq = 200, .skv = 200, .causal = true,
               .window = {50, -1}, .documents = {{5, 60, 3, 90, 42}}, .kv_valid = {190, 150}, .poison = true, .poison_seen = true});
  return v;
}

/// Rows holding NaN in Q and dO that see no key (leading rows, trailing rows, a document whose
/// keys are all padding, a whole padded batch element) or none of a key tile, at head_dim
/// `dim`: they must add nothing to the dK, dV of those keys (0 x NaN = NaN), nor anything to
/// their own dQ, and get O = 0, LSE = -inf. The backward's query tiles start at the first row
/// that reaches their key tile, so the rows that need the care are those after it.
std::vector<Spec> nan_row_specs(std::int64_t dim) {
  std::vector<Spec> v;
  v.push_back({.name = "bottom-right causal, S_q > S_kv, NaN in the leading rows (they see no key)", .sq = 90,
               .skv = 40, .causal = true, .align = CausalAlign::bottom_right, .nan_blind = true});
  v.push_back({.name = "causal window 10 + key padding {25, 0}, S_q > S_kv, NaN in the trailing rows (they see no key)",
               .sq = 70, .skv = 40, .causal = true, .window = {10, -1}, .kv_valid = {25, 0}, .nan_blind = true});
  v.push_back({.name = "documents {20, 50, 58} + key padding {60, 128}, NaN in the last document (its keys are padding)",
               .sq = 128, .skv = 128, .documents = {{20, 50, 58}}, .kv_valid = {60, 128}, .nan_blind = true});
  // Row 127 sees keys 64..127 exactly (whole key tiles of both paths, so the reference's NaN
  // fills them all); the rows before it in its query tile see keys up to 63 too, so that tile
  // meets the keys 0..63, of which row 127 sees none.
  v.push_back({.name = "causal window 63, NaN in a row that sees none of the key tile its query tile meets", .sq = 128,
               .skv = 128, .causal = true, .window = {63, -1}, .nan_row = 127});
  for (Spec& s : v) s.dim = dim;
  return v;
}

/// Every case through `tensor_cores`'s path for T.
template <class T>
void mask_suite(bool tensor_cores) {
  for (const Spec& s : mask_specs()) check_case<T>(s, tensor_cores);
}

/// Errors of a policy run's rows against the reference: normwise max error over finite entries.
struct RunErrors {
  std::mutex mu;
  double out = 0, lse = 0, grad = 0;
  bool nonfinite = false;
  void add(double& worst, const std::vector<double>& got, const std::vector<double>& want) {
    double err = 0, ref = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      if (std::isinf(want[i]) && got[i] == want[i]) continue;
      if (!std::isfinite(got[i])) nonfinite = true;
      err = std::max(err, std::abs(got[i] - want[i]));
      ref = std::max(ref, std::abs(want[i]));
    }
    std::lock_guard lock(mu);
    worst = std::max(worst, ref > 0 ? err / ref : err);
  }
};

/// `policy` on `ranks` ranks (CudaThreadCommunicator, a stream each) on the global problem of
/// `s`, forward and backward, every rank's rows against the global reference.
template <class T, class Policy>
void check_policy(int ranks, Policy policy, const Spec& s) {
  const std::string name = s.name, type = type_name<T>();
  CAPTURE(name);
  CAPTURE(type);
  CAPTURE(ranks);
  const std::int64_t B = s.batch, H = s.heads, K = s.kv_heads, D = s.dim, S = s.sq;
  const Inputs x = make_inputs<T>(s, 99);
  const PositionMap all = PositionMap::run(S, 0);
  std::vector<double> want, want_lse;
  reference_forward(s, all, all, x, want, want_lse);
  std::vector<double> out_t = want;
  for (auto& e : out_t) e = to_double(from_double<T>(e));
  std::vector<double> want_dq(x.q.size(), 0.0), want_dk(x.k.size(), 0.0), want_dv(x.v.size(), 0.0);
  // The engine's backward starts from the forward it ran (output in T), as this reference does.
  reference_backward(s, all, all, x, out_t, want_lse, want_dq, want_dk, want_dv);
  const AttentionProblem problem = s.problem(dtype_v<T>, true);
  int device = 0;
  SEQPAR_CUDA_CHECK(cudaGetDevice(&device));
  RunErrors e;
  run_ranks<CudaSpace>(
      ranks,
      [&](CudaThreadCommunicator& comm) {
        SEQPAR_CUDA_CHECK(cudaSetDevice(device));
        Stream stream;
        SequenceParallelAttention<Policy, CudaThreadCommunicator, CudaFlashKernel> attn(comm, policy);
        use_stream(attn, stream);
        const Plan plan = attn.plan(problem, {S / ranks});
        const PositionMap qp = plan.q_positions(comm.rank()), kp = plan.kv_positions(comm.rank());
        const std::int64_t lq = qp.size(), lk = kp.size();
        auto q = rows_on_device<T>(x.q, B, S, H, D, qp), g = rows_on_device<T>(x.dout, B, S, H, D, qp);
        auto k = rows_on_device<T>(x.k, B, S, K, D, kp), v = rows_on_device<T>(x.v, B, S, K, D, kp);
        DeviceBuffer<T> out(static_cast<std::size_t>(B * lq * H * D));
        DeviceBuffer<float> lse(static_cast<std::size_t>(B * lq * H));
        DeviceBuffer<T> dq(q.size()), dk(k.size()), dv(v.size());  // the engine's gradients are in T
        DeviceBuffer<std::byte> ws(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
        using CV = TensorView<const T, CudaSpace>;
        using G = TensorView<float, CudaSpace>;
        const CV qv = CV::bshd(q.data(), B, lq, H, D), kv = CV::bshd(k.data(), B, lk, K, D),
                 vv = CV::bshd(v.data(), B, lk, K, D);
        const G lv = G::lse_bhs(lse.data(), B, lq, H);
        const std::span<std::byte> w(ws.data(), ws.size());
        attn.template forward<T>(plan, qv, kv, vv, TensorView<T, CudaSpace>::bshd(out.data(), B, lq, H, D), lv, w);
        attn.template backward<T>(plan, CV::bshd(g.data(), B, lq, H, D), qv, kv, vv,
                                  CV::bshd(out.data(), B, lq, H, D), TensorView<const float, CudaSpace>(lv),
                                  TensorView<T, CudaSpace>::bshd(dq.data(), B, lq, H, D),
                                  TensorView<T, CudaSpace>::bshd(dk.data(), B, lk, K, D),
                                  TensorView<T, CudaSpace>::bshd(dv.data(), B, lk, K, D), w);
        stream.sync();
        e.add(e.out, out.download(), test::take_rows<double>(want, B, S, H, D, qp));
        // LSE: the kernel's [B, H, lq] against the reference's rows [B, lq, H].
        const std::vector<double> wl = test::take_rows<double>(want_lse, B, S, H, 1, qp);
        std::vector<double> wl_bhs(wl.size());
        for (std::int64_t b = 0; b < B; ++b)
          for (std::int64_t i = 0; i < lq; ++i)
            for (std::int64_t h = 0; h < H; ++h)
              wl_bhs[static_cast<std::size_t>((b * H + h) * lq + i)] = wl[static_cast<std::size_t>((b * lq + i) * H + h)];
        e.add(e.lse, lse.download(), wl_bhs);
        e.add(e.grad, dq.download(), test::take_rows<double>(want_dq, B, S, H, D, qp));
        e.add(e.grad, dk.download(), test::take_rows<double>(want_dk, B, S, K, D, kp));
        e.add(e.grad, dv.download(), test::take_rows<double>(want_dv, B, S, K, D, kp));
      },
      ThreadRunOptions{std::chrono::milliseconds(120000)});
  CHECK(!e.nonfinite);
  CHECK(e.out <= tolerance<T>);
  CHECK(e.lse <= 1e-5);
  CHECK(e.grad <= grad_tolerance<T>);
}

}  // namespace

TEST_CASE("CudaFlashKernel masks: every family, tensor cores, half") { mask_suite<__half>(true); }
TEST_CASE("CudaFlashKernel masks: every family, tensor cores, bf16") { mask_suite<__nv_bfloat16>(true); }
TEST_CASE("CudaFlashKernel masks: every family, SIMT, float") { mask_suite<float>(false); }
TEST_CASE("CudaFlashKernel masks: every family, SIMT, half and bf16") {
  mask_suite<__half>(false);
  mask_suite<__nv_bfloat16>(false);
}

TEST_CASE("CudaFlashKernel masks: NaN in Q and dO of rows that see no key adds nothing, tensor cores") {
  for (std::int64_t dim : {64, 128})
    for (const Spec& s : nan_row_specs(dim)) {
      check_case<__half>(s, true);
      check_case<__nv_bfloat16>(s, true);
    }
}
TEST_CASE("CudaFlashKernel masks: NaN in Q and dO of rows that see no key adds nothing, SIMT") {
  for (std::int64_t dim : {64, 33})
    for (const Spec& s : nan_row_specs(dim)) check_case<float>(s, false);
}

TEST_CASE("CudaFlashKernel masks: new tables in the same kernel object are uploaded, the same ones reused") {
  // One kernel object, three calls: key padding {60, 20}, then other contents at the same host
  // address, then the first contents again from another table object.
  Spec s{.name = "key padding", .sq = 80, .skv = 80, .causal = true, .kv_valid = {60, 20}};
  s.batch = 2;
  const Inputs x = make_inputs<__half>(s, 5);
  const std::int64_t B = s.batch, H = s.heads, K = s.kv_heads, D = s.dim, S = s.sq;
  DeviceBuffer<__half> q(x.q.size()), k(x.k.size()), v(x.v.size()), out(x.q.size());
  q.upload(x.q);
  k.upload(x.k);
  v.upload(x.v);
  DeviceBuffer<float> lse(static_cast<std::size_t>(B * S * H));
  using CV = TensorView<const __half, CudaSpace>;
  Stream stream;
  CudaFlashKernel kernel(stream);
  std::vector<std::int64_t> valid = {60, 20};
  auto run = [&](const std::vector<std::int64_t>& kv_valid, const std::int64_t* table) {
    s.kv_valid = kv_valid;
    KernelParams p = kernel_params(s, MaskTables({}, {}));
    p.mask.kv_valid = table;
    out.poison();
    kernel.forward(CV::bshd(q.data(), B, S, H, D), CV::bshd(k.data(), B, S, K, D), CV::bshd(v.data(), B, S, K, D),
                   TensorView<__half, CudaSpace>::bshd(out.data(), B, S, H, D),
                   TensorView<float, CudaSpace>::lse_bhs(lse.data(), B, S, H), p);
    stream.sync();
    std::vector<double> want, want_lse;
    reference_forward(s, s.qpos(), s.kpos(), x, want, want_lse);
    check_close("O", out.download(), want, tolerance<__half>);
  };
  run(valid, valid.data());
  valid = {33, 80};
  run(valid, valid.data());
  const std::vector<std::int64_t> again = {60, 20};
  run(again, again.data());
  // A copy of the kernel object has its own tables.
  CudaFlashKernel copy = kernel;
  std::swap(kernel, copy);
  run(valid, valid.data());
}

TEST_CASE("GPU: Ring Zigzag and Ulysses with masks match the reference, forward and backward") {
  const Spec docs{.name = "documents + causal + window", .sq = 256, .skv = 256, .causal = true, .window = {40, -1},
                  .documents = {{20, 100, 7, 129}}};
  const Spec padding{.name = "key padding + causal", .sq = 192, .skv = 192, .causal = true, .kv_valid = {150, 61}};
  check_policy<__half>(4, RingPolicy<Zigzag>{}, docs);
  check_policy<__half>(2, UlyssesPolicy{}, docs);
  check_policy<float>(4, RingPolicy<Zigzag>{}, padding);
  check_policy<__nv_bfloat16>(2, UlyssesPolicy{}, padding);
}
