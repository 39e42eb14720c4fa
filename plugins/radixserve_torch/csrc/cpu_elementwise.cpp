// Fused elementwise ops of a decoder layer on the CPU: RMSNorm with the residual
// add fused in, SiLU-and-mul, and rotary embeddings of q and k, one pass over memory
// each instead of the five to ten torch calls (and as many temporaries) of the
// reference; and the sampler's grammar mask, which writes -inf over the forbidden
// tokens of each constrained row in place of the reference's unpacked [R, V] mask.
//
// They round where the HuggingFace reference rounds (plugins/radixserve_torch/
// elementwise.py): the residual sum in the model dtype, the normalised value in the
// model dtype before the weight multiplies it, silu(gate) in the model dtype before
// it multiplies up, each rotary product and sum in the model dtype; everything in
// between is float32. The mean of squares is summed
// in a different order than torch's reduction, and exp is a polynomial (fast_exp,
// relative error < 2e-7), so results may differ from the reference in the last bit of
// float32 or, rarely, by one unit of the model dtype.
// Registered as torch.ops.radixserve_cpu_elementwise.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu_paged_common.h"

namespace {

using radixserve_cpu_paged::load;
using radixserve_cpu_paged::round_to;
using radixserve_cpu_paged::silu_mul;
using radixserve_cpu_paged::store;

// Rows per parallel task: small inputs (decode) stay on one thread.
int64_t grain_rows(int64_t row_len) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(row_len, 1)); }

// out[r] = weight * round(normalise(src[r])) for row r of `rows` rows of width h.
template <typename T>
void norm_row(const T* src, const T* weight, float eps, int64_t h, T* out) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < h; ++i) {
    const float v = load(src[i]);
    sum += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(h) + eps);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) out[i] = store<T>(load(weight[i]) * round_to<T>(load(src[i]) * inv));
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t a = x.size(0), b = x.size(1), h = x.size(2), sa = x.stride(0), sb = x.stride(1);
  const T* src = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, a * b, grain_rows(h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      norm_row(src + (r / b) * sa + (r % b) * sb, w, static_cast<float>(eps), h, dst + r * h);
  });
}

template <typename T>
void add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), h = x.size(1);
  T* xs = x.data_ptr<T>();
  T* res = residual.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xs + r * h;
      T* rr = res + r * h;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) rr[i] = store<T>(load(xr[i]) + load(rr[i]));
      norm_row(rr, w, static_cast<float>(eps), h, xr);
    }
  });
}

template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), width = out.size(1), sx = x.stride(0);
  const T* src = x.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = src + r * sx;
      const T* up = gate + width;
      T* o = dst + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        o[i] = silu_mul<T>(load(gate[i]), load(up[i]));
      }
    }
  });
}

// Pair (x1, x2) of one head turns to (x1 cos - x2 sin, x2 cos + x1 sin), each
// product rounded to the model dtype and then the sum, as the reference's in-place
// torch ops round. NeoX pairs x[i] with x[i + rot/2]; GPT-J x[2i] with x[2i + 1].
template <typename T>
inline void rotate_head(T* x, const T* cos, const T* sin, int64_t half, bool neox) {
  const int64_t step = neox ? 1 : 2, other = neox ? half : 1;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    T* a = x + i * step;
    const float x1 = load(a[0]), x2 = load(a[other]), c = load(cos[i]), s = load(sin[i]);
    a[0] = store<T>(round_to<T>(x1 * c) - round_to<T>(x2 * s));
    a[other] = store<T>(round_to<T>(x2 * c) + round_to<T>(x1 * s));
  }
}

#if defined(__AVX512BF16__)
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }  // round to nearest even
inline __m512 rounded(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

// rotate_head for bfloat16 NeoX pairs, 16 at a time (half a multiple of 16): the
// same roundings, on vectors.
inline void rotate_head_neox16(c10::BFloat16* x, const c10::BFloat16* cos, const c10::BFloat16* sin, int64_t half) {
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 x1 = load16(x + i), x2 = load16(x + half + i), c = load16(cos + i), s = load16(sin + i);
    const __m512 out1 = _mm512_sub_ps(rounded(_mm512_mul_ps(x1, c)), rounded(_mm512_mul_ps(x2, s)));
    const __m512 out2 = _mm512_add_ps(rounded(_mm512_mul_ps(x2, c)), rounded(_mm512_mul_ps(x1, s)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + i), to_bf16(out1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + half + i), to_bf16(out2));
  }
}
#endif

template <typename T>
inline void rotate_token_head(T* x, const T* cos, const T* sin, int64_t half, bool neox) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (neox && half % 16 == 0) return rotate_head_neox16(x, cos, sin, half);
  }
#endif
  rotate_head(x, cos, sin, half, neox);
}

template <typename T>
void rotary_impl(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cache, bool neox) {
  const int64_t tokens = q.size(0), heads = q.size(1), kv_heads = k.size(1), rot = cache.size(1), half = rot / 2;
  const int64_t sq0 = q.stride(0), sq1 = q.stride(1), sk0 = k.stride(0), sk1 = k.stride(1);
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const T* table = cache.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  at::parallel_for(0, tokens, grain_rows((heads + kv_heads) * rot), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* cos = table + pos[t] * rot;
      for (int64_t h = 0; h < heads; ++h) rotate_token_head(qp + t * sq0 + h * sq1, cos, cos + half, half, neox);
      for (int64_t h = 0; h < kv_heads; ++h) rotate_token_head(kp + t * sk0 + h * sk1, cos, cos + half, half, neox);
    }
  });
}

// The first n (<= 32) logits of a row at out, as raw bits: those whose bit is
// clear in `bits` become `forbidden`. Arguments by value, so that the stores
// cannot alias them and the full word is one vector blend per 16 lanes.
template <typename Bits>
inline void mask_word(Bits* out, uint32_t bits, Bits forbidden, int n) {
  if (n == 32) {
#pragma omp simd
    for (int b = 0; b < 32; ++b) out[b] = (bits >> b) & 1u ? out[b] : forbidden;
  } else {
    for (int b = 0; b < n; ++b)
      if (!((bits >> b) & 1u)) out[b] = forbidden;
  }
}

// Row rows[r] of logits [B, V] keeps token 32w+b where bit b of bitmask[r][w] is
// set and gets -inf elsewhere; words of all ones (free text) are skipped.
template <typename T>
void apply_token_bitmask_impl(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint16_t>;
  static_assert(sizeof(T) == sizeof(Bits));
  const int64_t words = bitmask.size(1), vocab = logits.size(1), row_stride = logits.stride(0);
  const int64_t used = (vocab + 31) / 32;
  Bits* base = reinterpret_cast<Bits*>(logits.data_ptr<T>());
  const int32_t* mask = bitmask.data_ptr<int32_t>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  const T minus_inf = store<T>(-std::numeric_limits<float>::infinity());
  Bits forbidden;
  std::memcpy(&forbidden, &minus_inf, sizeof(Bits));
  at::parallel_for(0, bitmask.size(0) * used, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin / used; r * used < end; ++r) {
      const int64_t first = std::max(begin - r * used, int64_t{0}), last = std::min(end - r * used, used);
      Bits* row = base + row_ids[r] * row_stride;
      const int32_t* row_mask = mask + r * words;
      for (int64_t w = first; w < last; ++w) {
        const uint32_t bits = static_cast<uint32_t>(row_mask[w]);
        if (bits != 0xFFFFFFFFu) mask_word(row + w * 32, bits, forbidden, static_cast<int>(std::min<int64_t>(32, vocab - w * 32)));
      }
    }
  });
}

template <typename F>
void dispatch(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat:
      return f(float{});
    case at::kBFloat16:
      return f(c10::BFloat16{});
    case at::kHalf:
      return f(c10::Half{});
    default:
      TORCH_CHECK(false, "cpu_fused: unsupported dtype ", dtype);
  }
}

void check_weight(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1) &&
                  weight.scalar_type() == x.scalar_type(),
              "cpu_fused: weight must be contiguous [hidden] in x's dtype");
}

// x [A, B, H] (any strides, the last one 1); out [A * B, H] contiguous.
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor out) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "cpu_fused: x must be [A, B, H] with a contiguous last dim");
  check_weight(x, weight);
  TORCH_CHECK(out.is_contiguous() && out.numel() == x.numel() && out.scalar_type() == x.scalar_type(),
              "cpu_fused: out must be contiguous like x");
  dispatch(x.scalar_type(), [&](auto t) { rms_norm_impl<decltype(t)>(x, weight, eps, out); });
}

// x, residual [R, H] contiguous: residual = x + residual, then x = weight * norm(residual).
void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type(),
              "cpu_fused: x and residual must be contiguous [R, H] of one dtype");
  check_weight(x, weight);
  dispatch(x.scalar_type(), [&](auto t) { add_rms_norm_impl<decltype(t)>(x, residual, weight, eps); });
}

// x [R, 2I] (rows may be strided, each row contiguous); out [R, I] contiguous.
void silu_and_mul(const at::Tensor& x, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "cpu_fused: x must be [R, 2I], rows contiguous");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == x.size(0) && out.size(1) * 2 == x.size(1) &&
                  out.scalar_type() == x.scalar_type(),
              "cpu_fused: out must be contiguous [R, I] in x's dtype");
  dispatch(x.scalar_type(), [&](auto t) { silu_and_mul_impl<decltype(t)>(x, out); });
}

// q [T, H, D], k [T, KH, D] (strided, the last dim contiguous), rotated in place
// over their first rot dims; positions [T] int64 index cache [P, rot] (cos then sin).
void rotary(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cache, bool neox) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.size(0) == k.size(0) &&
                  q.size(2) == k.size(2) && q.scalar_type() == k.scalar_type(),
              "cpu_fused: q and k must be [T, heads, D] of one dtype with a contiguous last dim");
  TORCH_CHECK(cache.dim() == 2 && cache.is_contiguous() && cache.scalar_type() == q.scalar_type() &&
                  cache.size(1) % 2 == 0 && cache.size(1) <= q.size(2),
              "cpu_fused: cos_sin_cache must be contiguous [P, rot] in q's dtype, rot even and <= head_dim");
  TORCH_CHECK(positions.dim() == 1 && positions.is_contiguous() && positions.scalar_type() == at::kLong &&
                  positions.size(0) == q.size(0),
              "cpu_fused: positions must be contiguous int64 [T]");
  dispatch(q.scalar_type(), [&](auto t) { rotary_impl<decltype(t)>(q, k, positions, cache, neox); });
}

// logits [B, V] (each row contiguous), bitmask [R, W] int32 contiguous with
// 32W >= V, rows [R] int64 of distinct rows in [0, B).
void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "cpu_fused: logits must be [B, V], rows contiguous");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.is_contiguous() && bitmask.scalar_type() == at::kInt &&
                  bitmask.size(1) * 32 >= logits.size(1),
              "cpu_fused: bitmask must be contiguous int32 [R, W] with 32 W >= the logits' width");
  TORCH_CHECK(rows.dim() == 1 && rows.is_contiguous() && rows.scalar_type() == at::kLong &&
                  rows.size(0) == bitmask.size(0),
              "cpu_fused: rows must be contiguous int64 [R], one per bitmask row");
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows.size(0); ++r)
    TORCH_CHECK(row_ids[r] >= 0 && row_ids[r] < logits.size(0), "cpu_fused: rows[", r, "] = ", row_ids[r],
                " is outside the logits' ", logits.size(0), " rows");
  dispatch(logits.scalar_type(), [&](auto t) { apply_token_bitmask_impl<decltype(t)>(logits, bitmask, rows); });
}

}  // namespace

TORCH_LIBRARY(radixserve_cpu_elementwise, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos_sin_cache, bool neox) -> ()");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve_cpu_elementwise, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
  m.impl("apply_token_bitmask", &apply_token_bitmask);
}
