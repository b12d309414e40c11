// Everything CpuFlashKernel runs, for ONE instruction set: included once per level by
// kernel/cpu/isa_kernels.hpp, inside that level's namespace and function-level target, with
// SEQPAR_ISA_BYTES and SEQPAR_ISA_REGISTERS defined (no include guard on purpose).

#include "seqpar/kernel/cpu/isa/simd.inl"
#include "seqpar/kernel/cpu/isa/forward.inl"
#include "seqpar/kernel/cpu/isa/decode.inl"
#include "seqpar/kernel/cpu/isa/backward.inl"
#if SEQPAR_ISA_BYTES == 64 && SEQPAR_CPU_ISA_BF16_DOT
/// 1 in the copy that holds the AVX512-BF16 forward and backward (the AVX-512 one, where compiled).
#define SEQPAR_ISA_HAS_BF16_DOT 1
#if SEQPAR_CPU_ISA_DISPATCH && SEQPAR_CPU_ISA_AMX
SEQPAR_TARGET_PUSH(SEQPAR_TARGET_AVX512 ",avx512bf16,amx-tile,amx-bf16")
#elif SEQPAR_CPU_ISA_DISPATCH
SEQPAR_TARGET_PUSH(SEQPAR_TARGET_AVX512 ",avx512bf16")
#endif
#include "seqpar/kernel/cpu/isa/forward_bf16.inl"
#include "seqpar/kernel/cpu/isa/backward_bf16.inl"
#if SEQPAR_CPU_ISA_DISPATCH
SEQPAR_TARGET_POP()
#endif
#else
/// 0: this copy has no AVX512-BF16 forward.
#define SEQPAR_ISA_HAS_BF16_DOT 0
#endif

/// `Chains` independent chains of `rounds` vector FMAs (IsaKernels::fma_burst). A fold
/// expression over the chain index keeps each chain a named register value.
template <class A, int Chains>
A fma_chains(std::int64_t rounds, A seed) {
  using V = simd_t<A>;
  return [&]<int... C>(std::integer_sequence<int, C...>) {
    V acc[Chains] = {simd_splat(seed * A(C + 1))...};
    const V mul = simd_splat(A(0.999999)), add = simd_splat(A(1e-7));
    for (std::int64_t n = 0; n < rounds; ++n) ((acc[C] = simd_fma(acc[C], mul, add)), ...);
    A s = 0;
    for (int c = 0; c < Chains; ++c)
      for (int l = 0; l < Simd<A>::width; ++l) s += acc[c][l];
    return s;
  }(std::make_integer_sequence<int, Chains>{});
}

/// The level's entry points, as static members so that a dispatcher can take the level as a
/// type (see dispatch_cpu_isa).
struct IsaKernels {
  /// Bits of a vector at this level.
  static constexpr int vector_bits = simd_bytes * 8;
  /// Independent FMA chains of fma_burst: enough to cover latency x throughput on current
  /// cores (4-cycle latency, 2 pipes) without spilling on 16-register levels.
  static constexpr int burst_chains = simd_registers >= 32 ? 16 : 12;

  /// rounds x burst_chains vector FMAs at this level's width, the ceiling the kernels are
  /// quoted against (2 * lanes * burst_chains * rounds flops); returns a value that depends
  /// on every lane so that nothing is optimised away.
  [[gnu::noinline]] static float fma_burst(std::int64_t rounds, float seed) { return fma_chains<float, burst_chains>(rounds, seed); }

  /// Soft-caps the `n` values at `x` in place as every kernel path does (x = cap * tanh(x),
  /// vector by vector; a tail shorter than a vector goes through a padded copy): the entry the
  /// tests measure the vector tanh through.
  template <class A>
  [[gnu::noinline]] static void softcap(A* x, std::int64_t n, A cap) {
    constexpr int W = Simd<A>::width;
    const std::int64_t whole = n / W * W;
    softcap_scores(x, whole, cap);
    if (whole == n) return;
    A tail[W] = {};
    std::copy(x + whole, x + n, tail);
    softcap_scores(tail, W, cap);
    std::copy(tail, tail + (n - whole), x + whole);
  }

  /// Query lanes of forward's panels (ConvertedProducts): its query blocks are whole panels.
  template <class A>
  static constexpr std::int64_t forward_panel = forward_vectors<A> * FlashTile<A>::width;

  /// Query lanes of the bf16 products' panels (forward_bf16_dot, forward_amx).
  static constexpr std::int64_t bf16_panel = FlashTile<float>::panel;

  /// See forward_query_block (with ConvertedProducts).
  template <class T, class O, class A>
  static void forward(TensorView<const T> q, TensorView<const T> k, TensorView<const T> v, TensorView<O> out,
                      TensorView<A> lse, const KernelParams& p, std::int64_t b, std::int64_t h, std::int64_t i0,
                      std::int64_t bq, const ForwardScratch<A>& s) {
    ConvertedProducts<T, A> products{k, v, b, p.kv_head(h), q.dim(), v.dim(), score_scale<A>(p), s};
    forward_query_block<T, O, A>(q, k, v, out, lse, p, b, h, i0, bq, s, products);
  }

  /// Whether this copy has forward_bf16_dot (the AVX-512 copy, where compiled: see
  /// SEQPAR_CPU_ISA_BF16_DOT).
  static constexpr bool bf16_dot = SEQPAR_ISA_HAS_BF16_DOT;
#if SEQPAR_ISA_HAS_BF16_DOT
  /// See forward_query_block (with Bf16DotProducts): bf16 inputs, products by vdpbf16ps.
  template <class O>
  static void forward_bf16_dot(TensorView<const bf16> q, TensorView<const bf16> k, TensorView<const bf16> v,
                               TensorView<O> out, TensorView<float> lse, const KernelParams& p, std::int64_t b,
                               std::int64_t h, std::int64_t i0, std::int64_t bq, const ForwardScratch<float>& s) {
    Bf16DotProducts products{{k, v, b, p.kv_head(h), q.dim(), v.dim(), score_scale<float>(p), s}};
    forward_query_block<bf16, O, float>(q, k, v, out, lse, p, b, h, i0, bq, s, products);
  }
#endif
  /// Whether this copy has forward_amx (the AVX-512 copy, where SEQPAR_CPU_ISA_AMX).
  static constexpr bool amx = SEQPAR_ISA_HAS_BF16_DOT && SEQPAR_CPU_ISA_AMX;
#if SEQPAR_ISA_HAS_BF16_DOT && SEQPAR_CPU_ISA_AMX
  /// See forward_query_block (with AmxProducts): bf16 inputs, products on AMX tiles; head dims
  /// that are whole tiles only (amx_fits). The tile configuration is loaded for the
  /// call and released after it.
  template <class O>
  static void forward_amx(TensorView<const bf16> q, TensorView<const bf16> k, TensorView<const bf16> v,
                          TensorView<O> out, TensorView<float> lse, const KernelParams& p, std::int64_t b,
                          std::int64_t h, std::int64_t i0, std::int64_t bq, const ForwardScratch<float>& s) {
    AmxProducts products{{{k, v, b, p.kv_head(h), q.dim(), v.dim(), score_scale<float>(p), s}}};
    const AmxTiles tiles;
    forward_query_block<bf16, O, float>(q, k, v, out, lse, p, b, h, i0, bq, s, products);
  }
#endif

  /// See decode_task.
  template <class T, class O, class A>
  static void decode(const FlashDecode<T, O, A>& job, std::int64_t task, const ForwardScratch<A>& s) {
    decode_task<T, O, A>(job, task, s);
  }

  /// See backward_delta_task.
  template <class T, class A>
  static void backward_deltas(const FlashBackward<T, A>& job, std::int64_t t) {
    backward_delta_task(job, t);
  }
  /// See backward_task (with ConvertedBackward).
  template <class T, class A>
  static void backward(const FlashBackward<T, A>& job, std::int64_t t, const BackwardScratch<A>& s,
                       std::int32_t* turns) {
    backward_task<ConvertedBackward<T, A>>(job, t, s, turns);
  }
#if SEQPAR_ISA_HAS_BF16_DOT
  /// See backward_task (with Bf16DotBackward): bf16 inputs, products by vdpbf16ps.
  static void backward_bf16_dot(const FlashBackward<bf16, float>& job, std::int64_t t, const BackwardScratch<float>& s,
                                std::int32_t* turns) {
    backward_task<Bf16DotBackward>(job, t, s, turns);
  }
#endif
#if SEQPAR_ISA_HAS_BF16_DOT && SEQPAR_CPU_ISA_AMX
  /// See backward_task (with AmxBackward): bf16 inputs, products on AMX tiles; head dims that
  /// suit them only (amx_backward_fits). The tile configuration is loaded for the task and
  /// released after it.
  static void backward_amx(const FlashBackward<bf16, float>& job, std::int64_t t, const BackwardScratch<float>& s,
                           std::int32_t* turns) {
    const AmxTiles tiles;
    backward_task<AmxBackward>(job, t, s, turns);
  }
#endif
};
#undef SEQPAR_ISA_HAS_BF16_DOT
