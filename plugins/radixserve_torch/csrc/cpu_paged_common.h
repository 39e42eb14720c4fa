// Shared pieces of the cpu_paged attention kernels (decode: cpu_paged_decode.cpp;
// extend and cascade decode over shared prefixes: cpu_paged_extend.cpp; argument
// checks and op registration: cpu_paged_ops.cpp).
#pragma once

// Only ATen and the op registry: including <torch/extension.h> (pybind and the
// whole C++ API) made the first build four times slower.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace radixserve_cpu_paged {

#if defined(__AVX512BW__)
// The 32 16-bit words of x, halves interleaved: word 2j of the result is word j
// of x, word 2j + 1 is word 16 + j. Pairs two keys' bfloat16 values (or
// probabilities) lane by lane for vdpbf16ps.
inline __m512i interleave_halves(__m512i x) {
  static const uint16_t kOrder[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_permutexvar_epi16(_mm512_loadu_si512(kOrder), x);
}
#endif

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// exp(x) in plain arithmetic (vectorisable): 2^n * e^r with r = x - n ln2 in
// [-ln2/2, ln2/2] and a degree-6 Taylor polynomial (relative error < 2e-7).
// Inputs are clamped to [-87, 87]: below, (including -inf) about 1e-38, which is
// 0 for every weight it multiplies; above, about 6e37.
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 87.0f ? 87.0f : x);
  const float t = x * 1.44269504088896341f;
  const float big = t + 12582912.0f;  // 1.5 * 2^23: rounds t to the nearest integer
  const float n = big - 12582912.0f;
  const int32_t ni = static_cast<int32_t>(float_to_bits(big)) - 0x4B400000;
  const float r = x - n * 0.693147180559945309f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * bits_to_float(static_cast<uint32_t>(ni + 127) << 23);
}

#if defined(__AVX512F__)
// fast_exp on 16 lanes: the same clamp, reduction and polynomial, with 2^n applied
// by vscalefps (no integer exponent arithmetic).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945309f), x);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// fast_exp on 8 lanes (AVX2): the same clamp, reduction and polynomial, with 2^n
// built in the exponent bits as fast_exp does.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693147180559945309f), x);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
#endif

// tanh(x) = 1 - 2 / (e^2x + 1), from fast_exp: saturates to +-1 through its clamp;
// absolute error about 1e-7 (float32's rounding near 1), so a capped score
// cap * tanh(s / cap) is off by about cap * 1e-7, as its own float32 rounding is.
inline float fast_tanh(float x) { return 1.0f - 2.0f / (fast_exp(2.0f * x) + 1.0f); }

#if defined(__AVX512F__)
inline __m512 tanh16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = exp16(_mm512_add_ps(x, x));
  return _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
}
#endif

// The logit cap on n scores: s = outer * tanh(inner * s). On scaled scores inner =
// 1 / cap and outer = cap; on unscaled ones that are scaled later by `scale`,
// inner = scale / cap and outer = cap / scale. Not inlined: the score loops keep
// their register allocation whether or not their layer is capped.
__attribute__((noinline)) inline void cap_scores(float* s, int64_t n, float inner, float outer) {
#if defined(__AVX512F__)
  const __m512 in = _mm512_set1_ps(inner), out = _mm512_set1_ps(outer);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(s + i, _mm512_mul_ps(out, tanh16(_mm512_mul_ps(_mm512_loadu_ps(s + i), in))));
  if (i < n) {
    const __mmask16 rest = static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 x = _mm512_maskz_loadu_ps(rest, s + i);
    _mm512_mask_storeu_ps(s + i, rest, _mm512_mul_ps(out, tanh16(_mm512_mul_ps(x, in))));
  }
#else
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) s[i] = outer * fast_tanh(inner * s[i]);
#endif
}

// One row of head_dim values as float32: bfloat16 by a shift, half by its
// conversion, float32 without a copy.

// Convert n values to float32 into dst.
// Model-dtype values as float32 and back, rounding to nearest even like torch.
inline float load(float v) { return v; }
inline float load(c10::BFloat16 v) { return bits_to_float(static_cast<uint32_t>(v.x) << 16); }
inline float load(c10::Half v) { return static_cast<float>(v); }

template <typename T>
inline T store(float f);

template <>
inline float store<float>(float f) {
  return f;
}

template <>
inline c10::BFloat16 store<c10::BFloat16>(float f) {
  const uint32_t u = float_to_bits(f);
  c10::BFloat16 out;
  if (std::isnan(f)) {
    out.x = 0x7FC0;
  } else {
    out.x = static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  }
  return out;
}

template <>
inline c10::Half store<c10::Half>(float f) {
  return c10::Half(f);
}

// Round a float32 value to the model dtype and back (float32: unchanged).
template <typename T>
inline float round_to(float f) {
  return load(store<T>(f));
}

// silu(gate) * up of two model-dtype values (as float32), rounded where the
// reference rounds: silu(gate) to the model dtype, then the product. Shared by the
// elementwise op and the GEMM's fused gate/up epilogue, so both give the same bits.
template <typename T>
inline T silu_mul(float gate, float up) {
  return store<T>(round_to<T>(gate / (1.0f + fast_exp(-gate))) * up);
}

template <typename T>
inline void as_float_into(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void as_float_into<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = bits_to_float(static_cast<uint32_t>(s[i]) << 16);
}

// Shapes a kernel needs: H query heads in groups of G per KV head, head dim D,
// a pool row (one slot, all KV heads) of row_len = KVH * D elements.
struct Dims {
  int64_t heads, group, d, row_len;
};

// The (query, KV pool) dtype pairs served: the pool in the compute dtype, or a
// float32 model over a bfloat16/float16 pool (--kv-cache-dtype).
template <typename F>
void dispatch_dtypes(at::ScalarType q_dtype, at::ScalarType kv_dtype, F&& f) {
  using BF = c10::BFloat16;
  using HF = c10::Half;
  if (q_dtype == at::kFloat && kv_dtype == at::kFloat) return f(float{}, float{});
  if (q_dtype == at::kBFloat16 && kv_dtype == at::kBFloat16) return f(BF{}, BF{});
  if (q_dtype == at::kHalf && kv_dtype == at::kHalf) return f(HF{}, HF{});
  if (q_dtype == at::kFloat && kv_dtype == at::kBFloat16) return f(float{}, BF{});
  if (q_dtype == at::kFloat && kv_dtype == at::kHalf) return f(float{}, HF{});
  TORCH_CHECK(false, "cpu_paged: queries in ", q_dtype, " over a ", kv_dtype, " KV pool are not supported");
}

// A layer's sliding window and logit cap. window > 0: a query at position p sees only
// keys p - window + 1 .. p (0: all keys up to p). softcap > 0: scaled scores become
// softcap * tanh(score / softcap) before the softmax (0: no cap).
struct ScoreOptions {
  int64_t window = 0;
  float softcap = 0.0f;
};

// Decode: one query per request (q [N, H, D]; rows/lens [N]); with lse (not null) also
// each (query, head)'s log-sum-exp of its scaled (and capped) scores, lse[n * H + h].
// A windowed query's key range starts at its window's first key.
void decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                      const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& lens, double scaling,
                      ScoreOptions opts, at::Tensor& out, float* lse = nullptr);

// Extend: request b's queries are q[q_starts[b] : q_starts[b + 1]], with kv_lens[b] keys in all.
void extend_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                      const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& q_starts,
                      const at::Tensor& kv_lens, double scaling, ScoreOptions opts, at::Tensor& out);

// Decode over shared prefixes: queries group_starts[g] .. group_starts[g + 1] - 1 share
// their first shared_lens[g] keys (the same pool slots, those of row rows[group_starts[g]]);
// suffix_out/suffix_lse hold each query's attention over its own keys after the prefix
// (from decode_attention); out gets the attention over all of them. softcap as in
// ScoreOptions; no window (a windowed layer's decode never shares its prefix).
void cascade_decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                              const at::Tensor& req_to_token, const at::Tensor& rows,
                              const at::Tensor& group_starts, const at::Tensor& shared_lens,
                              const at::Tensor& suffix_out, const at::Tensor& suffix_lse, double scaling,
                              float softcap, at::Tensor& out);

}  // namespace radixserve_cpu_paged
