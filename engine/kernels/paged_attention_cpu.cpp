// Paged decode attention for CPU, float32: one new query token per sequence, attending over that
// sequence's keys and values where they lie in the paged KV cache. No gather: each key and value is
// read once from its block, which is what the pure-PyTorch path (index_select + SDPA) pays three
// times for. Built on first use by engine/kernels/__init__.py (torch.utils.cpp_extension).
//
// query        [N, Hq, D]            float32, contiguous
// kv_cache     [2, NB, BS, Hkv, D]   float32, contiguous; index 0 keys, 1 values
// block_tables [N, MB]               int64: block ids of each sequence, in order
// seq_lens     [N]                   int64: tokens in the cache for each sequence (this step's included)
// returns      [N, Hq, D]            float32
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;  // one AVX2 register of floats; the compiler vectorises the lane loops

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int64_t j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

// exp(x) for x <= 0 (scores minus their maximum), Cephes' single-precision polynomial (relative error
// about 2e-7). No libm call and no branch, so the loop over a row of scores vectorises; std::exp was
// about a third of the kernel's time.
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;                        // exp(-87) ~ 1.6e-38: still a normal float
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // x - n ln2, in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& kv_cache,
                                     const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                                     double scale) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(query.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat,
              "paged_decode_attention: float32 only");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode_attention: int64 block_tables and seq_lens");
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2 && block_tables.dim() == 2 &&
                  seq_lens.dim() == 1, "paged_decode_attention: bad ranks");
  TORCH_CHECK(query.is_contiguous() && kv_cache.is_contiguous() && block_tables.is_contiguous() &&
                  seq_lens.is_contiguous(), "paged_decode_attention: contiguous tensors only");
  const int64_t n_seqs = query.size(0), n_heads = query.size(1), head_dim = query.size(2);
  const int64_t n_blocks = kv_cache.size(1), block_size = kv_cache.size(2), n_kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == head_dim, "paged_decode_attention: head_dim differs");
  TORCH_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "paged_decode_attention: Hq % Hkv != 0");
  TORCH_CHECK(block_tables.size(0) == n_seqs && seq_lens.size(0) == n_seqs,
              "paged_decode_attention: one block table and length per query");
  const int64_t max_blocks = block_tables.size(1);
  const int64_t group = n_heads / n_kv_heads;

  const float* q = query.data_ptr<float>();
  const float* keys = kv_cache.data_ptr<float>();
  const float* values = keys + n_blocks * block_size * n_kv_heads * head_dim;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t n = 0; n < n_seqs; ++n) {  // validate before any thread reads through them
    TORCH_CHECK(lens[n] >= 1 && lens[n] <= max_blocks * block_size, "paged_decode_attention: bad seq_len");
    for (int64_t b = 0; b < (lens[n] + block_size - 1) / block_size; ++b) {
      const int64_t id = tables[n * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < n_blocks, "paged_decode_attention: block id out of range");
    }
  }
  auto out = torch::empty_like(query);
  float* o = out.data_ptr<float>();
  const int64_t token_stride = n_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  const float fscale = static_cast<float>(scale);

  // One work item per (sequence, kv head): its `group` query heads share every key and value read.
  // Tokens are visited block by block (no division per token); per-item state lives on the stack.
  at::parallel_for(0, n_seqs * n_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(group * head_dim);
    std::vector<float> maxes(group), sums(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / n_kv_heads, h = item % n_kv_heads;
      const int64_t len = lens[n];
      const int64_t* table = tables + n * max_blocks;
      const float* qh = q + (n * n_heads + h * group) * head_dim;
      scores.resize(group * len);
      float* sc = scores.data();
      std::fill(maxes.begin(), maxes.end(), -std::numeric_limits<float>::infinity());
      for (int64_t start = 0, b = 0; start < len; start += block_size, ++b) {
        const float* k = keys + table[b] * block_stride + h * head_dim;
        const int64_t stop = std::min(block_size, len - start);
        for (int64_t i = 0; i < stop; ++i, k += token_stride) {
          for (int64_t g = 0; g < group; ++g) {
            const float s = dot(qh + g * head_dim, k, head_dim) * fscale;
            sc[g * len + start + i] = s;
            maxes[g] = std::max(maxes[g], s);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* row = sc + g * len;
        const float m = maxes[g];
        for (int64_t t = 0; t < len; ++t) row[t] = exp_nonpositive(row[t] - m);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) sum += row[t];
        sums[g] = sum;
      }
      float* a = acc.data();
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0, b = 0; start < len; start += block_size, ++b) {
        const float* v = values + table[b] * block_stride + h * head_dim;
        const int64_t stop = std::min(block_size, len - start);
        for (int64_t i = 0; i < stop; ++i, v += token_stride) {
          for (int64_t g = 0; g < group; ++g) axpy(a + g * head_dim, sc[g * len + start + i], v, head_dim);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* dst = o + (n * n_heads + h * group + g) * head_dim;
        const float inv = 1.f / sums[g];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = a[g * head_dim + d] * inv;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention over a [2, blocks, block_size, kv_heads, head_dim] float32 KV cache (CPU)");
}
