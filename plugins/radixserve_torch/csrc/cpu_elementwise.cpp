// Fused elementwise ops of a decoder layer on the CPU: RMSNorm with the residual
// add fused in, and SiLU-and-mul, one pass over memory each instead of the five to
// seven torch calls (and as many temporaries) of the reference.
//
// They round where the HuggingFace reference rounds (plugins/radixserve_torch/
// elementwise.py): the residual sum in the model dtype, the normalised value in the
// model dtype before the weight multiplies it, silu(gate) in the model dtype before
// it multiplies up; everything in between is float32. The mean of squares is summed
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

#include "cpu_paged_common.h"

namespace {

using radixserve_cpu_paged::bits_to_float;
using radixserve_cpu_paged::fast_exp;
using radixserve_cpu_paged::float_to_bits;

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
        const float g = load(gate[i]);
        o[i] = store<T>(round_to<T>(g / (1.0f + fast_exp(-g))) * load(up[i]));
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

}  // namespace

TORCH_LIBRARY(radixserve_cpu_elementwise, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve_cpu_elementwise, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
}
