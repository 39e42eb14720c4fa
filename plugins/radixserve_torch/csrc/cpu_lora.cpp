// Batched LoRA on the CPU (the ``cpu_sgmv`` backend, plugins/radixserve_torch/lora.py):
// each token adds its adapter slot's update to a layer's output in place,
// out[t, rows_j] += (x[t] @ a[s, j*r:(j+1)*r].T) @ b[s, rows_j].T (kernels/lora.py).
//
// A decode step of many adapters gives each slot a token or two, so the work is
// reading every slot's A and B once: the shrink walks each slot's A rows once for all
// of its tokens, the expand each slot's B rows once, in one call per layer with no
// gather, padding or scatter in between (the torch backends spend a dozen calls on
// that). The shrink rounds to the model dtype before the expand, as PEFT's
// lora_B(lora_A(x)) does; sums are float32.
// Registered as torch.ops.radixserve_cpu_lora.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_paged_common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

using radixserve_cpu_paged::load;
using radixserve_cpu_paged::round_to;
using radixserve_cpu_paged::store;

constexpr int kTokenBlock = 4;  // tokens sharing one pass over an A row
constexpr int64_t kRowBlock = 8;  // B rows (output features) whose sums are reduced together
constexpr int64_t kMaxRank = 256;

// The tokens of each slot in use, in token order; slots ascending.
struct SlotTokens {
  std::vector<int64_t> slot;
  std::vector<std::vector<int64_t>> tokens;
};

SlotTokens group_by_slot(const at::Tensor& token_slot, int64_t num_slots) {
  const int32_t* ts = token_slot.data_ptr<int32_t>();
  std::vector<std::vector<int64_t>> by_slot(num_slots);
  for (int64_t t = 0; t < token_slot.size(0); ++t) {
    const int32_t s = ts[t];
    if (s < 0) continue;  // a base-model token
    TORCH_CHECK(s < num_slots, "cpu_sgmv: token ", t, " uses slot ", s, " of ", num_slots);
    by_slot[s].push_back(t);
  }
  SlotTokens grouped;
  for (int64_t s = 0; s < num_slots; ++s) {
    if (by_slot[s].empty()) continue;
    grouped.slot.push_back(s);
    grouped.tokens.push_back(std::move(by_slot[s]));
  }
  return grouped;
}

// dst[j * dst_stride] = round(x[tokens[j]] . a_row) for M tokens.
template <typename T, int M>
void shrink_tokens(const T* a_row, const T* x, int64_t x_stride, const int64_t* tokens, int64_t in, float* dst,
                   int64_t dst_stride) {
  static_assert(M >= 1 && M <= 4, "one to four tokens");
  const T* x0 = x + tokens[0] * x_stride;
  const T* x1 = x + tokens[M > 1 ? 1 : 0] * x_stride;
  const T* x2 = x + tokens[M > 2 ? 2 : 0] * x_stride;
  const T* x3 = x + tokens[M > 3 ? 3 : 0] * x_stride;
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t i = 0; i < in; ++i) {
    const float w = load(a_row[i]);
    s0 += w * load(x0[i]);
    if constexpr (M > 1) s1 += w * load(x1[i]);
    if constexpr (M > 2) s2 += w * load(x2[i]);
    if constexpr (M > 3) s3 += w * load(x3[i]);
  }
  const float sums[4] = {s0, s1, s2, s3};
  for (int j = 0; j < M; ++j) dst[j * dst_stride] = round_to<T>(sums[j]);
}

// The shrink of one A row for n tokens, kTokenBlock at a time: the row is read once
// from memory, the tokens' rows stay in cache.
template <typename T>
void shrink_row(const T* a_row, const T* x, int64_t x_stride, const int64_t* tokens, int64_t n, int64_t in, float* dst,
                int64_t dst_stride) {
  int64_t first = 0;
  for (; first + kTokenBlock <= n; first += kTokenBlock)
    shrink_tokens<T, kTokenBlock>(a_row, x, x_stride, tokens + first, in, dst + first * dst_stride, dst_stride);
  const int64_t* rest = tokens + first;
  float* rest_dst = dst + first * dst_stride;
  switch (n - first) {
    case 3:
      return shrink_tokens<T, 3>(a_row, x, x_stride, rest, in, rest_dst, dst_stride);
    case 2:
      return shrink_tokens<T, 2>(a_row, x, x_stride, rest, in, rest_dst, dst_stride);
    case 1:
      return shrink_tokens<T, 1>(a_row, x, x_stride, rest, in, rest_dst, dst_stride);
    default:
      return;
  }
}

// B rows of the expand as float32: float32 rows are read in place, others converted
// into `buffer`.
inline const float* as_float(const float* rows, int64_t, float*) { return rows; }

template <typename T>
const float* as_float(const T* rows, int64_t count, float* buffer) {
  for (int64_t i = 0; i < count; ++i) buffer[i] = load(rows[i]);
  return buffer;
}

#if defined(__AVX2__) && defined(__FMA__)
// Lane i of the result is the sum of v[i]'s eight lanes.
inline __m256 sum_each(const __m256 v[8]) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}
#endif

// sums[i] = s[split[i] * rank : +rank] . w[i * rank : +rank] for the n <= kRowBlock
// rows of one block: each output row takes its own projection's rank columns.
inline void expand_rows(const float* s, const float* w, const int64_t* split, int64_t n, int64_t rank,
                        float* sums) {
#if defined(__AVX2__) && defined(__FMA__)
  if (n == kRowBlock && rank % 8 == 0) {
    __m256 acc[kRowBlock];
    for (int64_t i = 0; i < kRowBlock; ++i) {
      const float* si = s + split[i] * rank;
      const float* wi = w + i * rank;
      acc[i] = _mm256_mul_ps(_mm256_loadu_ps(si), _mm256_loadu_ps(wi));
      for (int64_t kk = 8; kk < rank; kk += 8)
        acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(si + kk), _mm256_loadu_ps(wi + kk), acc[i]);
    }
    _mm256_storeu_ps(sums, sum_each(acc));
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    const float* si = s + split[i] * rank;
    const float* wi = w + i * rank;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t kk = 0; kk < rank; ++kk) acc += si[kk] * wi[kk];
    sums[i] = acc;
  }
}

template <typename T>
void sgmv_impl(const at::Tensor& x, at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
               const SlotTokens& grouped, const std::vector<int64_t>& split_of_row) {
  const int64_t in = x.size(1), k_rows = a.size(1), rank = b.size(2), out_rows = b.size(1);
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t used = static_cast<int64_t>(grouped.slot.size());

  // Each slot's shrink, [its tokens, k_rows] float32 (rounded to T), slot after slot.
  std::vector<int64_t> first_row(used + 1, 0);
  for (int64_t u = 0; u < used; ++u)
    first_row[u + 1] = first_row[u] + static_cast<int64_t>(grouped.tokens[u].size());
  std::vector<float> shrink(static_cast<size_t>(first_row[used] * k_rows));

  at::parallel_for(0, used * k_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t u = item / k_rows, k = item % k_rows;
      const auto& tokens = grouped.tokens[u];
      const T* a_row = ap + (grouped.slot[u] * k_rows + k) * in;
      shrink_row<T>(a_row, xp, x_stride, tokens.data(), static_cast<int64_t>(tokens.size()), in,
                    shrink.data() + first_row[u] * k_rows + k, k_rows);
    }
  });

  const int64_t blocks = (out_rows + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, used * blocks, 8, [&](int64_t begin, int64_t end) {
    float rows_as_float[kRowBlock * kMaxRank];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t u = item / blocks, o = item % blocks * kRowBlock;
      const int64_t n = std::min<int64_t>(kRowBlock, out_rows - o);
      const T* b_rows = bp + (grouped.slot[u] * out_rows + o) * rank;
      const float* w = as_float(b_rows, n * rank, rows_as_float);
      const auto& tokens = grouped.tokens[u];
      for (size_t j = 0; j < tokens.size(); ++j) {
        const float* s = shrink.data() + (first_row[u] + static_cast<int64_t>(j)) * k_rows;
        float sums[kRowBlock];
        expand_rows(s, w, split_of_row.data() + o, n, rank, sums);
        T* dst = op + tokens[j] * out_stride + o;
        for (int64_t i = 0; i < n; ++i) dst[i] = store<T>(load(dst[i]) + round_to<T>(sums[i]));
      }
    }
  });
}

// x [T, in] and out [T, out] (rows strided, each row contiguous), a [S, n * r, in] and
// b [S, out, r] contiguous, all of one dtype; token_slot int32 [T] (-1: no adapter);
// out_splits: the n projections' output rows, summing to out.
void sgmv(const at::Tensor& x, at::Tensor out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& token_slot,
          at::IntArrayRef out_splits) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0),
              "cpu_sgmv: x [T, in] and out [T, out] must have contiguous rows");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.is_contiguous() && b.is_contiguous() && a.size(0) == b.size(0) &&
                  a.size(2) == x.size(1) && b.size(1) == out.size(1),
              "cpu_sgmv: a [S, n*r, in] and b [S, out, r] must be contiguous and fit x and out");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && a.scalar_type() == x.scalar_type() &&
                  b.scalar_type() == x.scalar_type(),
              "cpu_sgmv: x, out, a and b must share one dtype");
  TORCH_CHECK(b.size(2) <= kMaxRank, "cpu_sgmv: rank ", b.size(2), " is above ", kMaxRank);
  TORCH_CHECK(token_slot.dim() == 1 && token_slot.is_contiguous() && token_slot.scalar_type() == at::kInt &&
                  token_slot.size(0) == x.size(0),
              "cpu_sgmv: token_slot must be contiguous int32 [T]");
  const int64_t n = static_cast<int64_t>(out_splits.size());
  TORCH_CHECK(a.size(1) == n * b.size(2), "cpu_sgmv: a has ", a.size(1), " rows, not ", n, " projections x rank ",
              b.size(2));
  std::vector<int64_t> split_of_row;
  split_of_row.reserve(out.size(1));
  for (int64_t j = 0; j < n; ++j) split_of_row.insert(split_of_row.end(), out_splits[j], j);
  TORCH_CHECK(static_cast<int64_t>(split_of_row.size()) == out.size(1), "cpu_sgmv: out_splits sum to ",
              split_of_row.size(), ", not out's ", out.size(1), " columns");

  const SlotTokens grouped = group_by_slot(token_slot, a.size(0));
  if (grouped.slot.empty()) return;
  switch (x.scalar_type()) {
    case at::kFloat:
      return sgmv_impl<float>(x, out, a, b, grouped, split_of_row);
    case at::kBFloat16:
      return sgmv_impl<c10::BFloat16>(x, out, a, b, grouped, split_of_row);
    case at::kHalf:
      return sgmv_impl<c10::Half>(x, out, a, b, grouped, split_of_row);
    default:
      TORCH_CHECK(false, "cpu_sgmv: unsupported dtype ", x.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(radixserve_cpu_lora, m) {
  m.def("sgmv(Tensor x, Tensor(a!) out, Tensor a, Tensor b, Tensor token_slot, int[] out_splits) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve_cpu_lora, CPU, m) { m.impl("sgmv", &sgmv); }
