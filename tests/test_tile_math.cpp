// CPU tests of the per-tile math the CUDA kernels share (kernel/tile_math.hpp, merge_row):
// the same __host__ __device__ functions, run here on the host against the exact reference.
// Two emulations replay the kernels' data flow with these functions: the SIMT kernel's row
// loop, and the tensor-core kernel's warp fragments (mma layouts, quad reductions, P fed back
// as operand A), so a wrong index composition fails here before it ever reaches a GPU.

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "seqpar/core/key_span.hpp"
#include "seqpar/core/problem.hpp"
#include "seqpar/kernel/merge_state.hpp"
#include "seqpar/kernel/reference_kernel.hpp"
#include "seqpar/kernel/tile_math.hpp"
#include "support/mask_brute.hpp"

using namespace seqpar;

namespace {

constexpr double inf = std::numeric_limits<double>::infinity();

/// A random attention problem for one (batch, head): q [sq, d], k/v [sk, d], positions.
struct TileCase {
  int sq = 0, sk = 0, dim = 0;
  bool causal = false;
  double scale = 0;
  PositionMap qpos, kpos;
  std::vector<double> q, k, v;
};

TileCase make_case(int sq, int sk, int dim, bool causal, PositionMap qpos, PositionMap kpos, std::uint64_t seed) {
  TileCase c{sq, sk, dim, causal, 1.0 / std::sqrt(double(dim)), qpos, kpos, {}, {}, {}};
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  // Inputs rounded to float so that a float computation sees the reference's exact inputs.
  auto fill = [&](std::vector<double>& x, int n) {
    x.resize(static_cast<std::size_t>(n));
    for (auto& e : x) e = static_cast<double>(static_cast<float>(u(rng) * 3.0));
  };
  fill(c.q, sq * dim);
  fill(c.k, sk * dim);
  fill(c.v, sk * dim);
  return c;
}

/// The exact answer (ReferenceKernel, double) for a case.
void reference(const TileCase& c, std::vector<double>& out, std::vector<double>& lse) {
  out.assign(c.q.size(), 0.0);
  lse.assign(static_cast<std::size_t>(c.sq), 0.0);
  KernelParams p;
  p.scale = c.scale;
  p.causal = c.causal;
  p.q_positions = c.qpos;
  p.k_positions = c.kpos;
  using V = TensorView<const double>;
  ReferenceKernel{}.forward(V::bshd(c.q.data(), 1, c.sq, 1, c.dim), V::bshd(c.k.data(), 1, c.sk, 1, c.dim),
                            V::bshd(c.v.data(), 1, c.sk, 1, c.dim),
                            TensorView<double>::bshd(out.data(), 1, c.sq, 1, c.dim),
                            TensorView<double>::bshd(lse.data(), 1, c.sq, 1, 1), p);
}

/// The mask of a case as the kernels get it: causal or nothing.
MaskView causal_view(bool causal) {
  MaskView m;
  m.causal = causal;
  return m;
}

/// Normwise error of (out, lse) against the reference; -inf LSE must match exactly.
double error_of(const TileCase& c, const std::vector<float>& out, const std::vector<float>& lse) {
  std::vector<double> want, want_lse;
  reference(c, want, want_lse);
  double err = 0, ref = 0, lerr = 0, lref = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(out[i])) return inf;
    err = std::max(err, std::abs(out[i] - want[i]));
    ref = std::max(ref, std::abs(want[i]));
  }
  for (std::size_t i = 0; i < want_lse.size(); ++i) {
    if (std::isinf(want_lse[i])) {
      if (lse[i] != -std::numeric_limits<float>::infinity()) return inf;
      continue;
    }
    lerr = std::max(lerr, std::abs(lse[i] - want_lse[i]));
    lref = std::max(lref, std::abs(want_lse[i]));
  }
  return std::max(ref > 0 ? err / ref : err, lref > 0 ? lerr / lref : lerr);
}

/// The SIMT kernel's loop for each query tile of 32 rows: key tiles of 32, tile classified from
/// the extreme positions (stop at the first hidden one), per-row online softmax in base 2.
void simt_emulation(const TileCase& c, std::vector<float>& out, std::vector<float>& lse) {
  constexpr int bq = 32, bk = 32;
  const MaskView mask_view = causal_view(c.causal);
  auto span = [&](int i) { return row_span<KeySpan32>(mask_view, c.qpos, c.kpos, c.sk, 0, i); };
  const float scale_log2 = static_cast<float>(c.scale) * tile::log2e;
  out.assign(c.q.size(), 0.0f);
  lse.assign(static_cast<std::size_t>(c.sq), 0.0f);
  for (int i0 = 0; i0 < c.sq; i0 += bq) {
    const int nq = std::min(bq, c.sq - i0);
    std::vector<float> m(bq, -INFINITY), l(bq, 0.0f), o(static_cast<std::size_t>(bq * c.dim), 0.0f);
    for (int j0 = 0; j0 < c.sk; j0 += bk) {
      const int nk = std::min(bk, c.sk - j0);
      const TileClass mask = classify_tile(span(i0), span(i0 + nq - 1), j0, j0 + nk - 1);
      if (mask == TileClass::skip) continue;
      for (int r = 0; r < nq; ++r) {
        float s[bk], mx = -INFINITY;
        for (int j = 0; j < bk; ++j) {
          float x = 0;
          for (int d = 0; d < c.dim; ++d)
            x += static_cast<float>(c.q[(i0 + r) * c.dim + d]) * scale_log2 *
                 (j < nk ? static_cast<float>(c.k[(j0 + j) * c.dim + d]) : 0.0f);
          const bool visible = j < nk && (mask != TileClass::cut || span(i0 + r).sees(j0 + j));
          s[j] = visible ? x : -INFINITY;
          mx = std::max(mx, s[j]);
        }
        const float m_new = std::max(m[r], mx);
        const float alpha = tile::rescale_factor(m[r], m_new);
        float sum = 0;
        for (int d = 0; d < c.dim; ++d) o[r * c.dim + d] *= alpha;
        for (int j = 0; j < nk; ++j) {
          const float p = tile::softmax_weight(s[j], m_new);
          sum += p;
          for (int d = 0; d < c.dim; ++d) o[r * c.dim + d] += p * static_cast<float>(c.v[(j0 + j) * c.dim + d]);
        }
        l[r] = l[r] * alpha + sum;
        m[r] = m_new;
      }
    }
    for (int r = 0; r < nq; ++r) {
      const tile::RowFinish f = tile::finish_row(m[r], l[r]);
      for (int d = 0; d < c.dim; ++d) out[(i0 + r) * c.dim + d] = o[r * c.dim + d] * f.inv_sum;
      lse[i0 + r] = f.lse;
    }
  }
}

/// One warp-wide mma.m16n8k16 by its documented layout: every lane's registers (as floats,
/// element i of A at a[lane][i]) gathered into the operand tiles, multiplied, scattered back.
void emulate_mma(std::array<std::array<float, 4>, 32>& c, const std::array<std::array<float, 8>, 32>& a,
                 const std::array<std::array<float, 4>, 32>& b) {
  float A[16][16], B[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 8; ++i) A[tile::mma_a_coord(lane, i).row][tile::mma_a_coord(lane, i).col] = a[lane][i];
    for (int i = 0; i < 4; ++i) B[tile::mma_b_coord(lane, i).row][tile::mma_b_coord(lane, i).col] = b[lane][i];
  }
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      const tile::FragCoord f = tile::mma_c_coord(lane, i);
      float acc = 0;
      for (int k = 0; k < 16; ++k) acc += A[f.row][k] * B[k][f.col];
      c[lane][i] += acc;
    }
}

/// ldmatrix.x4 by its documented semantics: lane l supplies the address `base + offset(l)` of
/// row l % 8 of matrix l / 8; element e of register j of lane t is the element
/// ldmatrix_elem(t, e, trans) of matrix j. Returns [lane][j] = {low, high}.
template <class Offset>
std::array<std::array<std::array<float, 2>, 4>, 32> emulate_ldmatrix(const std::vector<float>& tile, int base,
                                                                      Offset offset, bool trans) {
  std::array<std::array<std::array<float, 2>, 4>, 32> r{};
  for (int lane = 0; lane < 32; ++lane)
    for (int j = 0; j < 4; ++j)
      for (int e = 0; e < 2; ++e) {
        const tile::FragCoord f = tile::ldmatrix_elem(lane, e, trans);
        r[lane][j][e] = tile[static_cast<std::size_t>(base + offset(8 * j + f.row) + f.col)];
      }
  return r;
}

/// Max (or sum) over the four lanes of each quad, as the kernel's two xor-shuffles do.
template <class Op>
void quad_reduce(std::array<float, 32>& x, Op op) {
  for (int mask : {1, 2}) {
    std::array<float, 32> y = x;
    for (int lane = 0; lane < 32; ++lane) y[lane] = op(x[lane], x[lane ^ mask]);
    x = y;
  }
}

/// The tensor-core kernel's data flow for one head: 64-row query tiles of four 16-row warps,
/// 64-key tiles in [64][D + 8] shared tiles, fragments loaded by the layout offsets, S and P V
/// by emulated mma, P's accumulators reused as operand A, row state reduced over quads. With
/// `ldsm`, K and V fragments come from emulated ldmatrix (as the kernel's default variant).
void mma_emulation(const TileCase& c, std::vector<float>& out, std::vector<float>& lse, bool ldsm) {
  constexpr int bq = 64, bk = 64;
  const int D = c.dim, stride = D + 8;
  const MaskView mask_view = causal_view(c.causal);
  auto span = [&](int i) { return row_span<KeySpan32>(mask_view, c.qpos, c.kpos, c.sk, 0, i); };
  const float scale_log2 = static_cast<float>(c.scale) * tile::log2e;
  out.assign(c.q.size(), 0.0f);
  lse.assign(static_cast<std::size_t>(c.sq), 0.0f);
  using Acc = std::array<std::array<float, 4>, 32>;
  using RegA = std::array<std::array<float, 8>, 32>;
  auto load_tile = [&](const std::vector<double>& x, int r0, int n) {
    std::vector<float> t(static_cast<std::size_t>(bk * stride), 12345.0f);  // padding is never read
    for (int r = 0; r < bk; ++r)
      for (int d = 0; d < D; ++d) t[r * stride + d] = r < n ? static_cast<float>(x[(r0 + r) * D + d]) : 0.0f;
    return t;
  };
  for (int i0 = 0; i0 < c.sq; i0 += bq) {
    const int nq = std::min(bq, c.sq - i0);
    const std::vector<float> sq_tile = load_tile(c.q, i0, nq);
    for (int w = 0; w < 4; ++w) {
      std::vector<RegA> qf(static_cast<std::size_t>(D / 16));
      for (int kc = 0; kc < D / 16; ++kc)
        for (int lane = 0; lane < 32; ++lane)
          for (int r = 0; r < 4; ++r) {
            const int off = w * 16 * stride + kc * 16 + tile::mma_a_offset(lane, r, stride);
            qf[kc][lane][2 * r] = sq_tile[off];
            qf[kc][lane][2 * r + 1] = sq_tile[off + 1];
          }
      std::vector<Acc> oacc(static_cast<std::size_t>(D / 8), Acc{});
      std::array<float, 32> m0, m1, l0{}, l1{};
      m0.fill(-INFINITY);
      m1.fill(-INFINITY);
      for (int j0 = 0; j0 < c.sk; j0 += bk) {
        const int nk = std::min(bk, c.sk - j0);
        const TileClass mask = classify_tile(span(i0), span(i0 + nq - 1), j0, j0 + nk - 1);
        if (mask == TileClass::skip) continue;
        const std::vector<float> sk_tile = load_tile(c.k, j0, nk), sv_tile = load_tile(c.v, j0, nk);
        std::vector<Acc> sacc(bk / 8, Acc{});
        for (int kc = 0; kc < D / 16; ++kc)
          for (int nt = 0; nt < bk / 8; ++nt) {
            Acc b{};
            if (ldsm) {
              if (nt % 2) continue;  // n-tiles come in pairs
              const auto r = emulate_ldmatrix(sk_tile, nt * 8 * stride + kc * 16,
                                              [&](int l) { return tile::ldmatrix_k_offset(l, stride); }, false);
              Acc b1{};
              for (int lane = 0; lane < 32; ++lane) {
                b[lane] = {r[lane][0][0], r[lane][0][1], r[lane][1][0], r[lane][1][1]};
                b1[lane] = {r[lane][2][0], r[lane][2][1], r[lane][3][0], r[lane][3][1]};
              }
              emulate_mma(sacc[nt], qf[kc], b);
              emulate_mma(sacc[nt + 1], qf[kc], b1);
              continue;
            }
            for (int lane = 0; lane < 32; ++lane)
              for (int r = 0; r < 2; ++r) {
                const int off = nt * 8 * stride + kc * 16 + tile::mma_b_offset_nk(lane, r, stride);
                b[lane][2 * r] = sk_tile[off];
                b[lane][2 * r + 1] = sk_tile[off + 1];
              }
            emulate_mma(sacc[nt], qf[kc], b);
          }
        std::array<float, 32> mx0, mx1;
        mx0.fill(-INFINITY);
        mx1.fill(-INFINITY);
        for (int lane = 0; lane < 32; ++lane)
          for (int nt = 0; nt < bk / 8; ++nt)
            for (int i = 0; i < 4; ++i) {
              const tile::FragCoord f = tile::mma_c_coord(lane, i);
              const int col = nt * 8 + f.col, row = w * 16 + f.row;
              bool visible = col < nk;
              if (visible && mask == TileClass::cut && row < nq) visible = span(i0 + row).sees(j0 + col);
              const float x = visible ? sacc[nt][lane][i] * scale_log2 : -INFINITY;
              sacc[nt][lane][i] = x;
              (i < 2 ? mx0 : mx1)[lane] = std::max((i < 2 ? mx0 : mx1)[lane], x);
            }
        auto fmax = [](float a, float b) { return std::max(a, b); };
        quad_reduce(mx0, fmax);
        quad_reduce(mx1, fmax);
        for (int lane = 0; lane < 32; ++lane) {
          const float mn0 = std::max(m0[lane], mx0[lane]), mn1 = std::max(m1[lane], mx1[lane]);
          const float a0 = tile::rescale_factor(m0[lane], mn0), a1 = tile::rescale_factor(m1[lane], mn1);
          float s0 = 0, s1 = 0;
          for (int nt = 0; nt < bk / 8; ++nt)
            for (int i = 0; i < 4; ++i) {
              float& x = sacc[nt][lane][i];
              x = tile::softmax_weight(x, i < 2 ? mn0 : mn1);
              (i < 2 ? s0 : s1) += x;
            }
          l0[lane] = l0[lane] * a0 + s0;
          l1[lane] = l1[lane] * a1 + s1;
          m0[lane] = mn0;
          m1[lane] = mn1;
          for (auto& n : oacc) {
            n[lane][0] *= a0;
            n[lane][1] *= a0;
            n[lane][2] *= a1;
            n[lane][3] *= a1;
          }
        }
        for (int kc = 0; kc < bk / 16; ++kc) {
          RegA pa{};
          for (int lane = 0; lane < 32; ++lane)
            for (int i = 0; i < 8; ++i)
              pa[lane][i] = sacc[2 * kc + tile::a_from_c_tile(i)][lane][tile::a_from_c_elem(i)];
          for (int n = 0; n < D / 8; ++n) {
            Acc b{};
            if (ldsm) {
              if (n % 2) continue;
              const auto r = emulate_ldmatrix(sv_tile, kc * 16 * stride + n * 8,
                                              [&](int l) { return tile::ldmatrix_v_offset(l, stride); }, true);
              Acc b1{};
              for (int lane = 0; lane < 32; ++lane) {
                b[lane] = {r[lane][0][0], r[lane][0][1], r[lane][1][0], r[lane][1][1]};
                b1[lane] = {r[lane][2][0], r[lane][2][1], r[lane][3][0], r[lane][3][1]};
              }
              emulate_mma(oacc[n], pa, b);
              emulate_mma(oacc[n + 1], pa, b1);
              continue;
            }
            for (int lane = 0; lane < 32; ++lane)
              for (int i = 0; i < 4; ++i)
                b[lane][i] = sv_tile[kc * 16 * stride + n * 8 + tile::mma_b_offset_kn(lane, i, stride)];
            emulate_mma(oacc[n], pa, b);
          }
        }
      }
      auto fsum = [](float a, float b) { return a + b; };
      quad_reduce(l0, fsum);
      quad_reduce(l1, fsum);
      for (int lane = 0; lane < 32; ++lane) {
        const tile::RowFinish f0 = tile::finish_row(m0[lane], l0[lane]), f1 = tile::finish_row(m1[lane], l1[lane]);
        for (int n = 0; n < D / 8; ++n)
          for (int i = 0; i < 4; ++i) {
            const tile::FragCoord f = tile::mma_c_coord(lane, i);
            const int row = w * 16 + f.row;
            if (row < nq) out[(i0 + row) * D + n * 8 + f.col] = oacc[n][lane][i] * (i < 2 ? f0.inv_sum : f1.inv_sum);
          }
        const int row0 = w * 16 + tile::mma_c_coord(lane, 0).row, row1 = w * 16 + tile::mma_c_coord(lane, 2).row;
        if (row0 < nq) lse[i0 + row0] = f0.lse;
        if (row1 < nq) lse[i0 + row1] = f1.lse;
      }
    }
  }
}

/// A uniform integer in [lo, hi].
std::int64_t pick(std::mt19937_64& rng, std::int64_t lo, std::int64_t hi) {
  return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
}

/// A random increasing PositionMap inside [0, total) (total >= 1): one or two runs, strides 1
/// to 3, a gap between the runs.
PositionMap random_map(std::int64_t total, std::mt19937_64& rng) {
  const std::int64_t stride = pick(rng, 1, 3), start = pick(rng, 0, total - 1);
  PositionMap m = PositionMap::run(pick(rng, 1, (total - 1 - start) / stride + 1), start, stride);
  const std::int64_t next = m.last() + 1 + pick(rng, 0, 4);
  if (next < total && pick(rng, 0, 1)) {
    const std::int64_t s2 = pick(rng, 1, 3);
    m.seg[m.segments++] = {pick(rng, 1, (total - 1 - next) / s2 + 1), next, s2};
  }
  return m;
}

/// One call under a random mask: every family on or off, S_q and S_kv, the call's query
/// positions (global, unshifted) and key positions, and the mask as kernels get it.
struct SpanCase {
  AttentionProblem pr;
  std::int64_t sq = 0, skv = 0;
  PositionMap q, k, diagonals;  // diagonals: q shifted by S_kv - S_q under bottom-right alignment
  MaskTables tables;

  /// The mask with causal merged in, pointing into `tables`.
  MaskView view() const { return tables.view(pr.causal, pr.window); }
  /// Key k(j) visible to query q(i) of batch element b, by the definition (mask_brute.hpp).
  bool visible(std::int64_t b, std::int64_t i, std::int64_t j) const {
    return test::visible_by_definition(pr, sq, skv, b, q(i), k(j));
  }
};

SpanCase random_span_case(std::mt19937_64& rng) {
  SpanCase c;
  c.pr.batch = 2;
  c.pr.causal = pick(rng, 0, 1) == 1;
  c.skv = pick(rng, 1, 60);
  const bool documents = pick(rng, 0, 2) == 0;  // they need S_q == S_kv
  c.sq = documents ? c.skv : pick(rng, 1, 60);
  c.pr.causal_align = pick(rng, 0, 1) ? CausalAlign::bottom_right : CausalAlign::top_left;
  if (pick(rng, 0, 1)) c.pr.window = {pick(rng, -1, 12), pick(rng, -1, 12)};
  if (documents)
    for (std::int64_t b = 0, lists = pick(rng, 1, 2); b < lists; ++b) {
      c.pr.documents.emplace_back();
      for (std::int64_t left = c.skv, len = 0; left > 0; left -= len)
        c.pr.documents.back().push_back(len = pick(rng, 1, std::min<std::int64_t>(left, 15)));
    }
  if (pick(rng, 0, 2) == 0) c.pr.kv_valid = {pick(rng, 0, c.skv), pick(rng, 0, c.skv)};
  c.q = random_map(c.sq, rng);
  c.k = random_map(c.skv, rng);
  c.diagonals = c.q;
  if (c.pr.causal_align == CausalAlign::bottom_right)
    for (int s = 0; s < c.diagonals.segments; ++s) c.diagonals.seg[s].start += c.skv - c.sq;
  c.tables = MaskTables(c.pr.documents, c.pr.kv_valid);
  return c;
}

/// Position maps of the shapes the layouts produce: contiguous, zigzag (two runs), stripe.
std::vector<std::pair<PositionMap, PositionMap>> position_cases(int sq, int sk) {
  PositionMap zq = PositionMap::run((sq + 1) / 2, 3);
  zq.seg[zq.segments++] = {sq / 2, 3 + 5 * sq, 1};
  return {
      {PositionMap::run(sq, 0), PositionMap::run(sk, 0)},
      {PositionMap::run(sq, sk - sq), PositionMap::run(sk, 0)},  // queries at the end (decode-like)
      {zq, PositionMap::run(sk, 2 * sq)},                         // two runs, partly hidden
      {PositionMap::run(sq, 1, 3), PositionMap::run(sk, 0, 2)},   // strides
  };
}

}  // namespace

TEST_CASE("tile math: HeadMap matches KernelParams") {
  KernelParams kp;
  kp.group_size = 4;
  kp.q_head_begin = 6;
  kp.kv_head_begin = 1;
  const tile::HeadMap hm = tile::HeadMap::from(kp);
  for (std::int64_t h = 0; h < 6; ++h) CHECK(hm.kv_head(h) == kp.kv_head(h));
}

TEST_CASE("key spans: keys_below counts the keys below a position, across runs and strides") {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 500; ++trial) {
    const PositionMap k = random_map(pick(rng, 1, 80), rng);
    for (std::int64_t x = -2; x <= k.last() + 3; ++x) {
      std::int64_t below = 0;
      for (std::int64_t j = 0; j < k.size(); ++j) below += k(j) < x;
      CHECK(keys_below(k, x) == below);
    }
  }
}

TEST_CASE("key spans: a row's span is exactly the keys the definition shows it, and its ends never decrease") {
  std::mt19937_64 rng(12);
  for (int trial = 0; trial < 400; ++trial) {
    const SpanCase c = random_span_case(rng);
    const MaskView m = c.view();
    // What a kernel gets: causal apart from the other families.
    KernelParams p;
    p.causal = c.pr.causal;
    p.mask = c.tables.view(false, c.pr.window);
    p.q_positions = c.diagonals;
    p.k_positions = c.k;
    const std::int64_t sk = c.k.size();
    for (std::int64_t b = 0; b < c.pr.batch; ++b) {
      KeySpan prev{std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::min()};
      std::int64_t wrong = 0;
      for (std::int64_t i = 0; i < c.q.size(); ++i) {
        const KeySpan s = row_span(m, c.diagonals, c.k, sk, b, i);
        for (std::int64_t j = 0; j < sk; ++j) wrong += s.sees(j) != c.visible(b, i, j);
        CHECK(s.first >= prev.first);
        CHECK(s.last >= prev.last);
        CHECK(s.first >= 0);
        CHECK(s.last < sk);
        prev = s;
        const KeySpan from_params = p.row_span(b, i, sk);
        const KeySpan32 narrow = row_span<KeySpan32>(m, c.diagonals, c.k, sk, b, i);
        CHECK((from_params.first == s.first && from_params.last == s.last));
        CHECK((narrow.first == s.first && narrow.last == s.last));
      }
      CHECK(wrong == 0);
    }
  }
}

TEST_CASE("key spans: classify_tile skips only unseen tiles and calls visible exactly the tiles every row sees") {
  std::mt19937_64 rng(13);
  for (int trial = 0; trial < 300; ++trial) {
    const SpanCase c = random_span_case(rng);
    const MaskView m = c.view();
    const std::int64_t sq = c.q.size(), sk = c.k.size();
    for (int tile = 0; tile < 40; ++tile) {
      const std::int64_t b = pick(rng, 0, 1), i0 = pick(rng, 0, sq - 1), i1 = pick(rng, i0, sq - 1);
      const std::int64_t j0 = pick(rng, 0, sk - 1), j1 = pick(rng, j0, sk - 1);
      std::int64_t seen = 0;
      for (std::int64_t i = i0; i <= i1; ++i)
        for (std::int64_t j = j0; j <= j1; ++j) seen += c.visible(b, i, j);
      const KeySpan top = row_span(m, c.diagonals, c.k, sk, b, i0), bottom = row_span(m, c.diagonals, c.k, sk, b, i1);
      const TileClass t = classify_tile(top, bottom, j0, j1);
      if (t == TileClass::skip) CHECK(seen == 0);
      CHECK((t == TileClass::visible) == (seen == (i1 - i0 + 1) * (j1 - j0 + 1)));
      // The kernels' compact spans decide alike.
      const TileClass narrow = classify_tile(row_span<KeySpan32>(m, c.diagonals, c.k, sk, b, i0),
                                             row_span<KeySpan32>(m, c.diagonals, c.k, sk, b, i1), j0, j1);
      CHECK(narrow == t);
    }
  }
}

TEST_CASE("key spans: the plan's work count and ring-step skips (visible_pairs, any_visible) match the definition") {
  std::mt19937_64 rng(14);
  for (int trial = 0; trial < 400; ++trial) {
    const SpanCase c = random_span_case(rng);
    for (std::int64_t b = 0; b < c.pr.batch; ++b) {
      std::int64_t pairs = 0;
      for (std::int64_t i = 0; i < c.q.size(); ++i)
        for (std::int64_t j = 0; j < c.k.size(); ++j) pairs += c.visible(b, i, j);
      CHECK(visible_pairs(c.view(), b, c.diagonals, c.k) == pairs);
      CHECK(any_visible(c.view(), b, c.diagonals, c.k) == (pairs > 0));
    }
  }
  CHECK(visible_pairs(MaskView{}, 0, PositionMap::run(3, 0), PositionMap::run(5, 0)) == 15);
  CHECK(!any_visible(MaskView{}, 0, PositionMap::run(3, 0), PositionMap{}));
}

TEST_CASE("key spans: visible_pairs counts causal masks and windows in closed form, equal to the rows' spans") {
  // Runs of thousands of positions, strided (stripe-like) or not, diagonals shifted below 0
  // (bottom-right alignment), windows from 0 to past every key: the closed form against the
  // sum of the rows' spans.
  std::mt19937_64 rng(15);
  auto random_map = [&](std::int64_t lo) {
    const std::int64_t stride = pick(rng, 1, 5);
    PositionMap m = PositionMap::run(pick(rng, 0, 3000), pick(rng, lo, 4000), stride);
    if (m.segments == 1 && pick(rng, 0, 1) == 1) {
      m.seg[1] = {pick(rng, 1, 3000), m.last() + pick(rng, 1, 3000), pick(rng, 1, 5)};
      m.segments = 2;
    }
    return m;
  };
  const std::int64_t sides[] = {-1, 0, 1, 7, 100, 2999, 100000, std::int64_t{1} << 60, std::numeric_limits<std::int64_t>::max()};
  for (int trial = 0; trial < 300; ++trial) {
    const PositionMap q = random_map(-5000), k = random_map(0);
    MaskView m;
    m.causal = pick(rng, 0, 1) == 1;
    m.window_left = sides[pick(rng, 0, 8)];
    m.window_right = sides[pick(rng, 0, 8)];
    if (!m.any()) m.causal = true;
    std::int64_t rows = 0;
    for (std::int64_t i = 0; i < q.size(); ++i) {
      const KeySpan span = row_span(m, q, k, k.size(), 0, i);
      if (!span.empty()) rows += span.last + 1 - span.first;
    }
    CAPTURE(m.causal);
    CAPTURE(m.window_left);
    CAPTURE(m.window_right);
    CHECK(visible_pairs(m, 0, q, k) == rows);
  }
  // 2^30 queries and keys, causal: half the square and the diagonal, at once.
  MaskView causal;
  causal.causal = true;
  const std::int64_t n = std::int64_t{1} << 30;
  CHECK(visible_pairs(causal, 0, PositionMap::run(n, 0), PositionMap::run(n, 0)) == n * (n + 1) / 2);
}

TEST_CASE("tile math: a row that sees nothing stays finite and ends at O = 0, LSE = -inf") {
  const float ninf = -INFINITY;
  CHECK(tile::softmax_offset(ninf) == 0.0f);
  CHECK(tile::rescale_factor(ninf, ninf) == 0.0f);
  CHECK(tile::softmax_weight(ninf, ninf) == 0.0f);
  CHECK(tile::rescale_factor(ninf, 3.0f) == 0.0f);
  CHECK(tile::rescale_factor(1.0f, 3.0f) == doctest::Approx(0.25f));
  const tile::RowFinish none = tile::finish_row(ninf, 0.0f);
  CHECK(none.inv_sum == 0.0f);
  CHECK(none.lse == ninf);
  // LSE in natural log from the base-2 state: m = 1 (log2 units), l = 2 -> (1 + 1) ln 2.
  CHECK(tile::finish_row(1.0f, 2.0f).lse == doctest::Approx(2.0f * tile::ln2));
  CHECK(tile::finish_row(1.0f, 2.0f).inv_sum == 0.5f);
  // A row that saw a NaN score keeps it: NaN output and LSE, not "saw nothing".
  const tile::RowFinish nan_row = tile::finish_row(1.0f, NAN);
  CHECK(std::isnan(nan_row.inv_sum));
  CHECK(std::isnan(nan_row.lse));
}

TEST_CASE("tile math: zero_nonfinite_pair zeroes exactly the NaN and Inf halves of a 16-bit pair") {
  // half: +-Inf 0x7c00 / 0xfc00, NaNs 0x7e00 / 0x7c01 / 0xffff; largest finite 0x7bff, 0xfbff.
  for (std::uint32_t x : {0x7c00u, 0xfc00u, 0x7e00u, 0x7c01u, 0xffffu}) {
    CHECK(tile::nonfinite16(x, tile::half_exponent));
    CHECK(tile::zero_nonfinite_pair(x | 0x3c000000u, tile::half_exponent) == 0x3c000000u);  // hi: 1.0
    CHECK(tile::zero_nonfinite_pair((x << 16) | 0x0001u, tile::half_exponent) == 0x0001u);  // lo: subnormal
    CHECK(tile::zero_nonfinite_pair(x | (x << 16), tile::half_exponent) == 0u);
  }
  for (std::uint32_t x : {0x7bffu, 0xfbffu, 0x0000u, 0x8000u, 0x03ffu, 0x3c00u, 0x3f80u}) {
    CHECK_FALSE(tile::nonfinite16(x, tile::half_exponent));
    CHECK(tile::zero_nonfinite_pair(x | (x << 16), tile::half_exponent) == (x | (x << 16)));
  }
  // bf16: +-Inf 0x7f80 / 0xff80, NaNs 0x7fc0 / 0x7f81; largest finite 0x7f7f; 0x7c00 is finite.
  for (std::uint32_t x : {0x7f80u, 0xff80u, 0x7fc0u, 0x7f81u, 0xffffu}) {
    CHECK(tile::nonfinite16(x, tile::bf16_exponent));
    CHECK(tile::zero_nonfinite_pair(x | 0x3f800000u, tile::bf16_exponent) == 0x3f800000u);
    CHECK(tile::zero_nonfinite_pair(x << 16 | 0x8001u, tile::bf16_exponent) == 0x8001u);
  }
  for (std::uint32_t x : {0x7f7fu, 0xff7fu, 0x0000u, 0x7c00u, 0x3f80u}) {
    CHECK_FALSE(tile::nonfinite16(x, tile::bf16_exponent));
    CHECK(tile::zero_nonfinite_pair(x | (x << 16), tile::bf16_exponent) == (x | (x << 16)));
  }
}

TEST_CASE("tile math: the mma fragment layouts are bijections and P's accumulators form operand A") {
  std::set<std::pair<int, int>> a, b, c;
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 8; ++i) a.insert({tile::mma_a_coord(lane, i).row, tile::mma_a_coord(lane, i).col});
    for (int i = 0; i < 4; ++i) b.insert({tile::mma_b_coord(lane, i).row, tile::mma_b_coord(lane, i).col});
    for (int i = 0; i < 4; ++i) c.insert({tile::mma_c_coord(lane, i).row, tile::mma_c_coord(lane, i).col});
    // Register pairs are adjacent columns (A) or adjacent k (B): one 32-bit access each.
    for (int r = 0; r < 4; ++r)
      CHECK(tile::mma_a_coord(lane, 2 * r + 1).col == tile::mma_a_coord(lane, 2 * r).col + 1);
    for (int r = 0; r < 2; ++r)
      CHECK(tile::mma_b_coord(lane, 2 * r + 1).row == tile::mma_b_coord(lane, 2 * r).row + 1);
    // A-element i of a 16-column block is the accumulator of n-tile a_from_c_tile(i).
    for (int i = 0; i < 8; ++i) {
      const tile::FragCoord fa = tile::mma_a_coord(lane, i);
      const tile::FragCoord fc = tile::mma_c_coord(lane, tile::a_from_c_elem(i));
      CHECK(fa.row == fc.row);
      CHECK(fa.col == 8 * tile::a_from_c_tile(i) + fc.col);
    }
    // The four lanes of a quad own the same two accumulator rows (the shuffle reductions rely on it).
    for (int i = 0; i < 4; ++i)
      for (int x : {1, 2, 3}) CHECK(tile::mma_c_coord(lane ^ x, i).row == tile::mma_c_coord(lane, i).row);
  }
  CHECK(a.size() == 256);
  CHECK(b.size() == 128);
  CHECK(c.size() == 128);
}

TEST_CASE("tile math: the SIMT kernel's row loop matches the exact reference") {
  int seed = 1;
  for (bool causal : {false, true})
    for (const std::array<int, 3>& shape : {std::array{1, 1, 8}, std::array{37, 70, 16}, std::array{64, 33, 40}, std::array{90, 129, 64}})
      for (const auto& [qpos, kpos] : position_cases(shape[0], shape[1])) {
        const int sq = shape[0], sk = shape[1], dim = shape[2];  // plain ints: CAPTURE takes them into a lambda
        CAPTURE(causal);
        CAPTURE(sq);
        CAPTURE(sk);
        CAPTURE(dim);
        const TileCase c = make_case(sq, sk, dim, causal, qpos, kpos, static_cast<std::uint64_t>(seed++));
        std::vector<float> out, lse;
        simt_emulation(c, out, lse);
        CHECK(error_of(c, out, lse) <= 1e-5);
      }
}

TEST_CASE("tile math: the tensor-core kernel's fragment flow matches the exact reference") {
  int seed = 100;
  for (bool ldsm : {true, false})
    for (bool causal : {false, true})
      for (const std::array<int, 3>& shape : {std::array{64, 64, 64}, std::array{70, 150, 64}, std::array{33, 65, 128}})
        for (const auto& [qpos, kpos] : position_cases(shape[0], shape[1])) {
          const int sq = shape[0], sk = shape[1], dim = shape[2];  // plain ints: CAPTURE takes them into a lambda
          CAPTURE(causal);
          CAPTURE(sq);
          CAPTURE(sk);
          CAPTURE(dim);
          CAPTURE(ldsm);
          const TileCase c = make_case(sq, sk, dim, causal, qpos, kpos, static_cast<std::uint64_t>(seed++));
          std::vector<float> out, lse;
          mma_emulation(c, out, lse, ldsm);
          CHECK(error_of(c, out, lse) <= 1e-5);
        }
}

TEST_CASE("tile math: merge_row of two disjoint key blocks equals attention over both") {
  // Keys split into two blocks; block results merged row by row as the ring (and the device
  // merge kernel, one column at a time) does. Causal queries early in the sequence see nothing
  // of the second block: their L2 is -inf and the merge must keep the first block's result.
  const int sq = 24, sk = 40, dim = 12, split = 17;
  for (bool causal : {false, true})
    for (int per_column : {0, 1}) {
      CAPTURE(causal);
      CAPTURE(per_column);
      const TileCase c = make_case(sq, sk, dim, causal, PositionMap::run(sq, 2 * split - sq), PositionMap::run(sk, 0), 5);
      auto part = [&](int j0, int n, std::vector<double>& o, std::vector<double>& l) {
        TileCase p = c;
        p.sk = n;
        p.kpos = PositionMap::run(n, j0);
        p.k.assign(c.k.begin() + j0 * dim, c.k.begin() + (j0 + n) * dim);
        p.v.assign(c.v.begin() + j0 * dim, c.v.begin() + (j0 + n) * dim);
        reference(p, o, l);
      };
      std::vector<double> o1, l1, o2, l2;
      part(0, split, o1, l1);
      part(split, sk - split, o2, l2);
      std::vector<float> o(o1.begin(), o1.end()), l(l1.begin(), l1.end());
      for (int i = 0; i < sq; ++i) {
        std::vector<float> b(o2.begin() + i * dim, o2.begin() + (i + 1) * dim);
        const float lb = static_cast<float>(l2[i]);
        if (per_column) {
          for (int d = 0; d < dim; ++d) {
            float li = l[i];
            merge_row(&o[i * dim + d], li, &b[d], lb, 1);
          }
          merge_row<float, float>(nullptr, l[i], nullptr, lb, 0);
        } else {
          merge_row(&o[i * dim], l[i], b.data(), lb, dim);
        }
      }
      CHECK(error_of(c, o, l) <= 1e-5);
    }
  // Both sides empty: nothing changes, nothing becomes NaN.
  float o[2] = {0, 0}, l = -INFINITY;
  const float o2[2] = {0, 0};
  merge_row(o, l, o2, -INFINITY, 2);
  CHECK(l == -INFINITY);
  CHECK(o[0] == 0.0f);
  CHECK(o[1] == 0.0f);
}

namespace {

/// Three partials with LSEs `lses` (each set far apart: past exp's range), merged with
/// merge_row in accumulation type A in every order, against the exact merge in double:
/// O = sum_i exp(L_i - L) O_i, L = log sum_i exp(L_i). exp overflows past 88.7 in float and
/// 709.8 in double: a merge that forms exp(l2 - l1) without taking the larger LSE out first
/// turns the LSE into +inf when a later partial's LSE is that much larger, and every block
/// merged after it is dropped.
template <class A>
void merge_far_apart(const std::vector<std::array<double, 3>>& lses) {
  constexpr double tol = std::is_same_v<A, float> ? 1e-5 : 1e-12;
  constexpr int dim = 5;
  std::mt19937_64 rng(31);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (const auto& lse : lses) {
    std::array<std::array<double, dim>, 3> o{};
    for (auto& row : o)
      for (double& x : row) x = static_cast<A>(u(rng));
    const double top = *std::max_element(lse.begin(), lse.end());
    double sum = 0;
    for (double l : lse) sum += std::exp(l - top);
    const double want_l = top + std::log(sum);
    std::array<double, dim> want_o{};
    for (int i = 0; i < 3; ++i)
      for (int d = 0; d < dim; ++d) want_o[d] += std::exp(lse[i] - want_l) * o[i][d];
    std::array<int, 3> order{0, 1, 2};
    do {
      CAPTURE(lse[order[0]]);
      CAPTURE(lse[order[1]]);
      CAPTURE(lse[order[2]]);
      A acc[dim], l = static_cast<A>(lse[order[0]]);
      for (int d = 0; d < dim; ++d) acc[d] = static_cast<A>(o[order[0]][d]);
      for (int n = 1; n < 3; ++n) {
        A part[dim];
        for (int d = 0; d < dim; ++d) part[d] = static_cast<A>(o[order[n]][d]);
        merge_row(acc, l, part, static_cast<A>(lse[order[n]]), dim);
      }
      double err = 0, ref = 0;
      for (int d = 0; d < dim; ++d) {
        err = std::max(err, std::abs(double(acc[d]) - want_o[d]));
        ref = std::max(ref, std::abs(want_o[d]));
      }
      CHECK(std::isfinite(double(l)));
      CHECK(err / ref <= tol);
      CHECK(std::abs(double(l) - want_l) / std::abs(want_l) <= tol);
    } while (std::next_permutation(order.begin(), order.end()));
  }
}

}  // namespace

TEST_CASE("tile math: merge_row of float partials whose LSEs lie 100-1000 apart loses no block") {
  merge_far_apart<float>({{-300, 0, 1.5}, {-100, 2, -1000}, {0, 120, 119}});
}

TEST_CASE("tile math: merge_row of double partials whose LSEs lie 720-3000 apart loses no block") {
  merge_far_apart<double>({{-1000, 0, 1.5}, {-720, 2, -3000}, {0, 800, 799}});
}
