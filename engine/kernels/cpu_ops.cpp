// The engine's CPU kernels for float32 and bfloat16 models, built on first use by engine/kernels/__init__.py
// (torch.utils.cpp_extension). Each replaces a chain of PyTorch ops that would each make a pass over
// memory; all are checked against the PyTorch path in tests/engine/test_kernels.py and, through the
// model, against transformers in tests/engine/test_models.py.
//
// paged_decode_attention: one new query token per sequence, attending over that sequence's keys and
// values where they lie in the paged KV cache. No gather: each key and value is read once from its
// block, which is what the pure-PyTorch path (index_select + SDPA) pays three times for.
//
// query        [N, Hq, D]            float32 or bfloat16, contiguous
// kv_cache     [2, NB, BS, Hkv, D]   float32, float16 or bfloat16, contiguous; index 0 keys, 1 values
// block_tables [N, MB]               int64: block ids of each sequence, in order
// seq_lens     [N]                   int64: tokens in the cache for each sequence (this step's included)
// returns      [N, Hq, D]            the query's dtype
//
// bfloat16 tensors (the default dtype on CPUs with AVX512-BF16 / AMX) are computed in float32: each row
// is widened as it is read and rounded to nearest-even once, when the result is stored. On CPUs with AMX a
// bfloat16 query and cache take the AMX path (see SLUICE_AMX below): scores by tile products.
//
// paged_prefill_attention (AMX only): the new tokens of each prefill sequence, causal over the keys of its
// cached context and of themselves, all of a step's sequences in one call over the paged cache; query
// [T, Hq, D] bfloat16 with query_start [S + 1] marking each sequence's rows, seq_lens [S] its keys.
#include <torch/extension.h>
#if defined(__AVX2__) && defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx.h"

namespace {

constexpr int64_t kLanes = 8;  // one AVX2 register of floats; the compiler vectorises the lane loops

// An element as float: the KV cache holds float32, float16 (--kv-cache-dtype float16) or bfloat16;
// activations are float32 or bfloat16.
inline float to_float(float x) { return x; }
inline float to_float(at::Half x) { return static_cast<float>(x); }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

// A row of n elements widened to float (a bfloat16 is the high half of a float32: a shift, vectorised).
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// A row of floats stored as T: copied for float32, rounded to nearest-even (NaN kept) for bfloat16.
inline void store_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(const float* src, at::BFloat16* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
    std::memcpy(dst + i, &v, sizeof(v));
  }
#endif
  for (; i < n; ++i) dst[i] = at::BFloat16(src[i]);  // c10 rounds to nearest-even
}

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float acc[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += a[i + j] * to_float(b[i + j]);
  }
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * to_float(b[i]);
  for (int64_t j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

// exp(x), Cephes' single-precision polynomial (relative error about 2e-7), for x clamped to
// [-87, 88] (exp(-87) ~ 1.6e-38 is still a normal float; exp(88) ~ 1.7e38 still finite). No libm
// call and no branch, so loops over rows vectorise: std::exp was about a third of the attention
// kernel's time and most of silu_and_mul's.
inline float exp_clamped(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
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

#if defined(__AVX2__) && defined(__FMA__)
#define SLUICE_AVX2 1
// exp_clamped on 8 lanes: the same polynomial and clamping (g++ does not vectorise the scalar one).
inline __m256 exp_clamped8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const at::BFloat16* p) {  // zero-extend to 32 bits, shift into the high half
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Dot products of one query with 8 keys `stride` floats apart (8 consecutive tokens of a block), as one
// vector of 8 scores: one horizontal reduction per 8 tokens instead of one per token. n % 8 == 0.
template <typename T>
inline __m256 dot_8_keys(const float* q, const T* k, int64_t stride, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t d = 0; d < n; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(qv, load8(k + d), a0);
    a1 = _mm256_fmadd_ps(qv, load8(k + stride + d), a1);
    a2 = _mm256_fmadd_ps(qv, load8(k + 2 * stride + d), a2);
    a3 = _mm256_fmadd_ps(qv, load8(k + 3 * stride + d), a3);
    a4 = _mm256_fmadd_ps(qv, load8(k + 4 * stride + d), a4);
    a5 = _mm256_fmadd_ps(qv, load8(k + 5 * stride + d), a5);
    a6 = _mm256_fmadd_ps(qv, load8(k + 6 * stride + d), a6);
    a7 = _mm256_fmadd_ps(qv, load8(k + 7 * stride + d), a7);
  }
  // hadd pairs within 128-bit lanes, then add the two lanes: [sum a0, ..., sum a7].
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__FMA__)
#define SLUICE_AVX512 1
// 16 keys or values as float (the cache's float32, float16 or bfloat16 widened).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// exp_clamped on 16 lanes (the same polynomial and clamping).
inline __m512 exp_clamped16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// out[d] = silu(gate[d]) * up[d] for a bfloat16 row, 16 lanes at a time (the same arithmetic as silu_mul_row's),
// widened as read and rounded once; returns how many of the n it did (a multiple of 16).
inline int64_t silu_mul_row16(const at::BFloat16* gate, const at::BFloat16* up, at::BFloat16* out, int64_t n) {
  int64_t d = 0;
#if defined(__AVX512BF16__)
  const __m512 one = _mm512_set1_ps(1.f);
  for (; d + 16 <= n; d += 16) {
    const __m512 g = load16(gate + d);
    const __m512 e = exp_clamped16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 r = _mm512_div_ps(_mm512_mul_ps(g, load16(up + d)), _mm512_add_ps(one, e));
    const __m256bh b = _mm512_cvtneps_pbh(r);
    std::memcpy(out + d, &b, sizeof(b));
  }
#endif
  return d;
}

// Lane sums of 16 vectors: out[t] = sum of the 16 lanes of a[t], by a transpose-and-add tree (four rounds of
// shuffles and adds, 16 -> 8 -> 4 -> 2 -> 1 vectors) instead of a horizontal reduction per vector.
inline __m512 lane_sums16(__m512 a[16]) {
  __m512 b[8], c[4], d[2];
  // round 1: pairs (2k, 2k+1): per 128-bit lane [x0+x2, y0+y2, x1+x3, y1+y3]
  for (int k = 0; k < 8; ++k)
    b[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
  // round 2: per 128-bit lane [x, y, z, w] sums of vectors (4k .. 4k+3) within that lane
  for (int k = 0; k < 4; ++k) {
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * k]), _mm512_castps_pd(b[2 * k + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * k]), _mm512_castps_pd(b[2 * k + 1]));
    c[k] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // c[k] lane L (128-bit) holds the partial sums of vectors 4k..4k+3 over that 128-bit lane.
  // round 3: fold 128-bit lanes: [c0.L0 c1.L0 c0.L2 c1.L2] + [c0.L1 c1.L1 c0.L3 c1.L3]
  for (int k = 0; k < 2; ++k) {
    const __m512 x = _mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0x88);  // lanes 0,2 of each
    const __m512 y = _mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0xDD);  // lanes 1,3 of each
    d[k] = _mm512_add_ps(x, y);  // [c0(L0+L1), c0(L2+L3), c1(L0+L1), c1(L2+L3)]
  }
  // round 4: [d0.0 d0.2 d1.0 d1.2] + [d0.1 d0.3 d1.1 d1.3] = [v0..3, v4..7, v8..11, v12..15]
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

// The scores of one block's `stop` tokens for one kv head and all G query heads of its group (GQA):
// row[g * len + i] = scale * q_g . k_i. Each key row (NV x 16 values) is loaded and widened once for the
// whole group; the group's queries stay in registers; 16 keys' dot products are summed across lanes at once.
template <int G, int NV, typename T>
inline void group_scores16(const float* q, int64_t head_dim, const T* k, int64_t token_stride, int64_t stop,
                           float* row, int64_t len, float scale) {
  __m512 qv[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) qv[g][j] = _mm512_loadu_ps(q + g * head_dim + 16 * j);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < stop; i += 16) {
    const int64_t n = std::min<int64_t>(16, stop - i);
    __m512 acc[G][16];
    for (int64_t t = 0; t < 16; ++t) {
      if (t >= n) {
        for (int g = 0; g < G; ++g) acc[g][t] = _mm512_setzero_ps();
        continue;
      }
      const T* kt = k + (i + t) * token_stride;
      __m512 kv[NV];
      for (int j = 0; j < NV; ++j) kv[j] = load16(kt + 16 * j);
      for (int g = 0; g < G; ++g) {
        __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int j = 1; j < NV; ++j) a = _mm512_fmadd_ps(qv[g][j], kv[j], a);
        acc[g][t] = a;
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 sums = _mm512_mul_ps(lane_sums16(acc[g]), vscale);
      _mm512_mask_storeu_ps(row + g * len + i, static_cast<__mmask16>((1u << n) - 1), sums);
    }
  }
}

// acc[g * head_dim + d] += sum_i p[g * len + i] * v_i[d] over one block's `stop` tokens for one kv head and its
// G query heads: each value row is widened once and the G x NV accumulators stay in registers.
template <int G, int NV, typename T>
inline void group_values16(const float* p, int64_t len, const T* v, int64_t token_stride, int64_t stop, float* acc,
                           int64_t head_dim) {
  __m512 a[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) a[g][j] = _mm512_loadu_ps(acc + g * head_dim + 16 * j);
  for (int64_t i = 0; i < stop; ++i, v += token_stride) {
    __m512 vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load16(v + 16 * j);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * len + i]);
      for (int j = 0; j < NV; ++j) a[g][j] = _mm512_fmadd_ps(w, vv[j], a[g][j]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + g * head_dim + 16 * j, a[g][j]);
}

// The AVX-512 loops for one GQA shape: groups of 1-4 query heads per kv head with head_dim 64, 1-2 with
// head_dim 128 (the accumulators fit the 32 vector registers). Null for other shapes (the AVX2 loops).
template <typename T>
struct Group16 {
  void (*scores)(const float*, int64_t, const T*, int64_t, int64_t, float*, int64_t, float) = nullptr;
  void (*values)(const float*, int64_t, const T*, int64_t, int64_t, float*, int64_t) = nullptr;
};

template <typename T>
Group16<T> group16_for(int64_t group, int64_t head_dim) {
  Group16<T> f;
#define SLUICE_G16(G, NV)                                                 \
  if (group == G && head_dim == 16 * NV) {                                \
    f.scores = &group_scores16<G, NV, T>;                                 \
    f.values = &group_values16<G, NV, T>;                                 \
  }
  SLUICE_G16(1, 4) SLUICE_G16(2, 4) SLUICE_G16(3, 4) SLUICE_G16(4, 4) SLUICE_G16(1, 8) SLUICE_G16(2, 8)
#undef SLUICE_G16
  return f;
}
#endif

// Prefetches `rows` rows of `n` floats, `stride` floats apart, into L1.
template <typename T>
inline void prefetch_rows(const T* p, int64_t rows, int64_t stride, int64_t n) {
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line
  for (int64_t r = 0; r < rows; ++r, p += stride) {
    for (int64_t d = 0; d < n; d += kLine) __builtin_prefetch(p + d, 0, 3);
  }
}

template <typename T>
inline void axpy(float* y, float a, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * to_float(x[i]);
}

// row[t] = exp(row[t] - shift); returns the sum of the results.
inline float exp_shifted_sum(float* row, int64_t n, float shift) {
  int64_t t = 0;
  float sum = 0.f;
#ifdef SLUICE_AVX2
  const __m256 vs = _mm256_set1_ps(shift);
  __m256 vsum = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp_clamped8(_mm256_sub_ps(_mm256_loadu_ps(row + t), vs));
    _mm256_storeu_ps(row + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, vsum);
  for (float v : lanes) sum += v;
#endif
  for (; t < n; ++t) {
    row[t] = exp_clamped(row[t] - shift);
    sum += row[t];
  }
  return sum;
}

// out[d] = silu(gate[d]) * up[d] = gate / (1 + exp(-gate)) * up.
inline void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  int64_t d = 0;
#ifdef SLUICE_AVX2
  const __m256 one = _mm256_set1_ps(1.f);
  for (; d + 8 <= n; d += 8) {
    const __m256 g = _mm256_loadu_ps(gate + d);
    const __m256 e = exp_clamped8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(out + d, _mm256_div_ps(_mm256_mul_ps(g, _mm256_loadu_ps(up + d)), _mm256_add_ps(one, e)));
  }
#endif
  for (; d < n; ++d) out[d] = gate[d] / (1.f + exp_clamped(-gate[d])) * up[d];
}


#if defined(SLUICE_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#define SLUICE_AMX 1
// Decode attention for a bfloat16 query and cache on CPUs with AMX (Sapphire Rapids on): the scores of 16 keys
// by AMX tiles loaded straight from the cache rows (bfloat16 products summed in float32: the float32 loops'
// result up to the order of the sums), the softmax on 16 query heads at once, the values by AVX-512 FMAs over
// whole value rows (rows_values16). At 128 sequences of 192 tokens (SmolLM2's 3 kv heads, 16-token blocks)
// about 2.1 -> 1.2 ms per layer from memory (benchmarks/decode_attention.py). Tried and slower: AVX512-BF16 dot
// products for the values (probabilities rounded to bfloat16), value rows staged through AMX tiles.


std::atomic<bool> amx_attention_on{true};

// The tiles of the scores: tmm0 C = 16 keys x G scores (float32); tmm1, tmm2 A = 16 key rows x 32 dims, taken
// in turn; tmm3.. B = 32 dims x G query heads as bfloat16 pairs (VNNI), one per 32 dims of head_dim (<= 4).
struct ScoreTiles : AmxTileConfig {
  explicit ScoreTiles(int64_t group) {
    for (int t = 0; t < 7; ++t) {
      rows[t] = 16;
      colsb[t] = static_cast<uint16_t>(t == 1 || t == 2 ? 64 : group * 4);
    }
  }
};

// One kv head's group of G queries (rows of head_dim, `q_stride` apart) as B tiles:
// qt[(c * 16 + r) * G + g] = (q_g[32c + 2r], q_g[32c + 2r + 1]).
inline void vnni_queries(const uint16_t* q, int64_t q_stride, int64_t group, int64_t head_dim, uint32_t* qt) {
  for (int64_t c = 0; c < head_dim / 32; ++c)
    for (int64_t r = 0; r < 16; ++r)
      for (int64_t g = 0; g < group; ++g) {
        const uint16_t* x = q + g * q_stride + 32 * c + 2 * r;
        qt[(c * 16 + r) * group + g] = static_cast<uint32_t>(x[0]) | static_cast<uint32_t>(x[1]) << 16;
      }
}

// sc[i * sc_stride + g] = q_g . k_i for 16 key rows of one kv head (`k_stride` bytes apart): head_dim / 32
// tile products. Tile numbers are immediates, hence the unrolled chunks.
inline void amx_scores16(const at::BFloat16* k, int64_t k_stride, const uint32_t* qt, int64_t group, int64_t chunks,
                         float* sc, int64_t sc_stride) {
  const int64_t b_stride = group * 4, b_size = 16 * group;
  _tile_zero(0);
  _tile_loadd(3, qt, b_stride);
  _tile_loadd(1, k, k_stride);
  _tile_dpbf16ps(0, 1, 3);
  if (chunks > 1) {
    _tile_loadd(4, qt + b_size, b_stride);
    _tile_loadd(2, k + 32, k_stride);
    _tile_dpbf16ps(0, 2, 4);
  }
  if (chunks > 2) {
    _tile_loadd(5, qt + 2 * b_size, b_stride);
    _tile_loadd(1, k + 64, k_stride);
    _tile_dpbf16ps(0, 1, 5);
  }
  if (chunks > 3) {
    _tile_loadd(6, qt + 3 * b_size, b_stride);
    _tile_loadd(2, k + 96, k_stride);
    _tile_dpbf16ps(0, 2, 6);
  }
  _tile_stored(0, sc, sc_stride * 4);
}

// In place over token-major scores sc[t * stride + h] (t < len; stride a multiple of 16, lanes past the heads
// hold garbage and get garbage): sc = exp((sc - max_h) * scale); sums[h] = the sum over t. Whole rows of 16
// lanes: masked stores overlapping the next row's load made every load wait for the store before it.
inline void softmax_token_major(float* sc, int64_t len, int64_t stride, float scale, float* sums) {
  for (int64_t h0 = 0; h0 < stride; h0 += 16) {
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < len; ++t) m = _mm512_max_ps(m, _mm512_loadu_ps(sc + t * stride + h0));
    const __m512 vs = _mm512_set1_ps(scale);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; ++t) {
      float* row = sc + t * stride + h0;
      const __m512 e = exp_clamped16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row), m), vs));
      _mm512_storeu_ps(row, e);
      sum = _mm512_add_ps(sum, e);
    }
    _mm512_storeu_ps(sums + h0, sum);
  }
}

// acc[q * D + d] += sum_i p[i * p_token + q] * v_i[(q / G) * D + d] (D = 16 NV) over one block's `stop` tokens, for
// H kv heads side by side in each row and G query heads each: token by token, so each value row is read front
// to back (per kv head, a row's slices are 384 bytes apart and the loads waited on memory: 10 % slower at 128
// sequences). The H x G x NV accumulators stay in registers, or nearly: at most 36 of them.
template <int H, int G, int NV>
void rows_values16(const float* p, int64_t p_token, const at::BFloat16* v, int64_t token_stride, int64_t stop,
                   float* acc) {
  constexpr int64_t D = 16 * NV;
  __m512 a[H * G][NV];
  for (int q = 0; q < H * G; ++q)
    for (int j = 0; j < NV; ++j) a[q][j] = _mm512_loadu_ps(acc + q * D + 16 * j);
  for (int64_t i = 0; i < stop; ++i, v += token_stride, p += p_token) {
    for (int h = 0; h < H; ++h) {
      __m512 vv[NV];
      for (int j = 0; j < NV; ++j) vv[j] = load16(v + h * D + 16 * j);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(p[h * G + g]);
        for (int j = 0; j < NV; ++j) a[h * G + g][j] = _mm512_fmadd_ps(w, vv[j], a[h * G + g][j]);
      }
    }
  }
  for (int q = 0; q < H * G; ++q)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + q * D + 16 * j, a[q][j]);
}

using RowsValues = void (*)(const float*, int64_t, const at::BFloat16*, int64_t, int64_t, float*);

constexpr int rows_heads(int g, int nv) { return std::min(8, 36 / (g * nv)); }  // kv heads per rows_values16 call

template <int G, int NV, int H = 1>
RowsValues rows_values_for(int64_t heads) {
  if constexpr (H > rows_heads(G, NV)) {
    return nullptr;
  } else {
    return heads == H ? &rows_values16<H, G, NV> : rows_values_for<G, NV, H + 1>(heads);
  }
}

// rows_values16 for 1..most kv heads at once (most = 0: a shape it does not cover, see group16_for).
struct RowsPlan {
  int64_t most = 0;
  RowsValues fns[9] = {};

  RowsPlan(int64_t group, int64_t head_dim) {
#define SLUICE_ROWS(G, NV)                                                       \
    if (group == G && head_dim == 16 * NV) {                                   \
      most = rows_heads(G, NV);                                                \
      for (int64_t h = 1; h <= most; ++h) fns[h] = rows_values_for<G, NV>(h);  \
    }
    SLUICE_ROWS(1, 4) SLUICE_ROWS(2, 4) SLUICE_ROWS(3, 4) SLUICE_ROWS(4, 4) SLUICE_ROWS(1, 8) SLUICE_ROWS(2, 8)
#undef SLUICE_ROWS
  }
};

// Per-thread buffers of the AMX path.
struct AmxScratch {
  std::vector<uint32_t> qt;   // the item's queries as B tiles, kv head by kv head
  std::vector<float> scores;  // token-major, then the probabilities
  std::vector<float> acc;
  std::vector<float> sums;
};

// One work item (sequence n, kv heads h0..h1) of the AMX path; out gets its heads' rows (float32).
void amx_decode_item(const at::BFloat16* keys, const at::BFloat16* values, const uint16_t* q, const int64_t* table,
                     int64_t len, int64_t h0, int64_t h1, int64_t group, int64_t head_dim, int64_t block_size,
                     int64_t token_stride, int64_t block_stride, float scale, const RowsPlan& plan, float* out,
                     AmxScratch& s) {
  const int64_t heads = (h1 - h0) * group;
  const int64_t stride = (heads + 15) / 16 * 16;       // token rows of whole 16-lane vectors
  const int64_t rows = (len + 15) / 16 * 16;           // scores are stored 16 keys at a time
  const int64_t chunks = head_dim / 32, per_head = chunks * 16 * group;
  s.qt.resize((h1 - h0) * per_head);
  s.scores.resize(rows * stride);
  s.acc.assign(heads * head_dim, 0.f);
  s.sums.resize(stride);
  float* sc = s.scores.data();
  for (int64_t h = h0; h < h1; ++h) {
    vnni_queries(q + (h - h0) * group * head_dim, head_dim, group, head_dim, s.qt.data() + (h - h0) * per_head);
  }
  for (int64_t start = 0, b = 0; start < len; start += block_size, ++b) {
    const at::BFloat16* kb = keys + table[b] * block_stride;
    for (int64_t t = start; t < std::min(start + block_size, len); t += 16) {
      for (int64_t h = h0; h < h1; ++h) {
        amx_scores16(kb + (t - start) * token_stride + h * head_dim, token_stride * 2,
                     s.qt.data() + (h - h0) * per_head, group, chunks, sc + t * stride + (h - h0) * group, stride);
      }
    }
  }
  softmax_token_major(sc, len, stride, scale, s.sums.data());
  for (int64_t start = 0, b = 0; start < len; start += block_size, ++b) {
    const int64_t stop = std::min(block_size, len - start);
    if (start + block_size < len) {  // the next block's value rows (2-6 % at 32-128 sequences; keys: no gain)
      prefetch_rows(values + table[b + 1] * block_stride + h0 * head_dim,
                    std::min(block_size, len - start - block_size), token_stride, (h1 - h0) * head_dim);
    }
    for (int64_t h = h0, hn = 1; h < h1; h += hn) {
      const at::BFloat16* vb = values + table[b] * block_stride + h * head_dim;
      const int64_t q0 = (h - h0) * group;
      if (plan.most > 0) {
        hn = std::min(plan.most, h1 - h);
        plan.fns[hn](sc + start * stride + q0, stride, vb, token_stride, stop, s.acc.data() + q0 * head_dim);
        continue;
      }
      for (int64_t i = 0; i < stop; ++i) {
        for (int64_t qi = q0; qi < q0 + group; ++qi) {
          axpy(s.acc.data() + qi * head_dim, sc[(start + i) * stride + qi], vb + i * token_stride, head_dim);
        }
      }
    }
  }
  for (int64_t qi = 0; qi < heads; ++qi) {
    const float* a = s.acc.data() + qi * head_dim;
    const float inv = 1.f / s.sums[qi];
    for (int64_t d = 0; d < head_dim; ++d) out[qi * head_dim + d] = a[d] * inv;
  }
}

// Prefill attention (the new tokens of a sequence, with or without cached context before them) for a bfloat16
// query and cache on AMX. The values of each (sequence, kv head) are packed once as V^T tiles; then, per 16
// query positions of one query head: S^T = K Q^T by tile products (16 keys x 16 queries, the key rows loaded
// from the cache as in decode), the causal mask, the softmax down each query's column (token-major, as in
// decode), the probabilities as bfloat16 pairs and O^T = V^T P^T by tile products. Every tile is 16 rows x 64
// bytes (ScoreTiles(16)): tmm0-6 for the scores as in amx_scores16, then tmm0-3 O^T, tmm4 V^T, tmm5 P^T.

// vt[((kc * (D / 16) + dc) * 16 + d) * 32 + k] = v[32 kc + k][16 dc + d] of kv head h: A tiles of 16 dims x 32
// keys, zero past the sequence's `len` keys (whatever the cache holds there never reaches a product).
void pack_values_t(const at::BFloat16* values, const int64_t* table, int64_t len, int64_t h, int64_t head_dim,
                   int64_t block_size, int64_t token_stride, int64_t block_stride, uint16_t* vt) {
  const int64_t kchunks = (len + 31) / 32, dchunks = head_dim / 16;
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int32_t>(token_stride / 2)));
  // 16 keys at a time (never straddling a block): dims (2p, 2p + 1) of each as one gathered 32-bit lane, whose
  // low halves are row 2p of the tile and high halves row 2p + 1; keys past `len` are masked to zero.
  for (int64_t kc = 0; kc < kchunks; ++kc) {
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t key = 32 * kc + 16 * half;
      const int64_t count = std::clamp<int64_t>(len - key, 0, 16);
      const __mmask16 live = static_cast<__mmask16>((1u << count) - 1);
      const auto* row = count == 0 ? nullptr
                                   : reinterpret_cast<const int*>(values + table[key / block_size] * block_stride +
                                                                  (key % block_size) * token_stride + h * head_dim);
      for (int64_t pair = 0; pair < head_dim / 2; ++pair) {
        const __m512i both = count == 0 ? _mm512_setzero_si512()
                                        : _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows,
                                                                      row + pair, 4);
        const int64_t d = 2 * pair;
        uint16_t* dst = vt + ((kc * dchunks + d / 16) * 16 + d % 16) * 32 + 16 * half;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(both));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32), _mm512_cvtepi32_epi16(_mm512_srli_epi32(both, 16)));
      }
    }
  }
}

// 2^y for y <= 0 (clamped at -100), a degree-4 fit of 2^f on f in [-0.5, 0.5] (relative error 2.7e-6) scaled
// by 2^n: 8 vector operations against exp_clamped16's 17. For probabilities that are rounded to bfloat16
// (relative error 2^-9) right after. The clamp keeps results normal: at -126 the masked entries came out
// denormal, and each such vscalefps took a microcode assist (a third of the kernel's samples at 128-token
// prompts, where many entries are masked).
inline __m512 exp2_nonpositive16(__m512 y) {
  y = _mm512_max_ps(y, _mm512_set1_ps(-100.f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.00956051021f), f, _mm512_set1_ps(0.0559170392f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.240249811f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693121968f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.999999191f));
  return _mm512_scalef_ps(p, n);
}

struct PrefillScratch {
  std::vector<uint32_t> qt;   // the tile's queries as B tiles
  std::vector<float> scores;  // token-major [keys][16], then the probabilities
  std::vector<uint16_t> pt;   // P^T as B tiles: [32-key chunk][16 key pairs][16 queries x 2]
  std::vector<uint16_t> pt_lo;  // what rounding P^T to bfloat16 left out, as B tiles too
  float ot[4][16][16];        // O^T tiles of one pass
  float sums[16];
};

// One query head's `valid` (<= 16) queries at positions p0.. of a sequence over kv head h: out rows (bfloat16,
// `out_stride` apart) get softmax(q k^T * scale) v over keys 0..position.
void amx_prefill_tile(const at::BFloat16* keys, const int64_t* table, const uint16_t* q, int64_t q_stride,
                      int64_t valid, int64_t p0, int64_t h, int64_t head_dim, int64_t block_size, int64_t token_stride,
                      int64_t block_stride, float scale, const uint16_t* vt, at::BFloat16* out, int64_t out_stride,
                      PrefillScratch& s) {
  const int64_t chunks = head_dim / 32, dchunks = head_dim / 16;
  const int64_t last = p0 + valid - 1;              // the tile's last position: it sees keys 0..last
  const int64_t kend = (last + 16) / 16 * 16;       // score rows, whole tiles of 16 keys
  const int64_t kchunks = (kend + 31) / 32;         // 32-key chunks of the values
  // qt[(c * 16 + r) * 16 + j] = dims (32 c + 2 r, + 1) of query j as one 32-bit lane, gathered; zero past `valid`.
  s.qt.resize(chunks * 256);
  const __m512i query_rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int32_t>(q_stride / 2)));
  const __mmask16 live = static_cast<__mmask16>((1u << valid) - 1);
  for (int64_t r = 0; r < chunks * 16; ++r) {
    _mm512_storeu_si512(s.qt.data() + r * 16, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, query_rows,
                                                                          reinterpret_cast<const int*>(q) + r, 4));
  }
  s.scores.resize(kend * 16);
  float* sc = s.scores.data();
  // Lane j sits at position p0 + j (a padding lane past `valid` at the last one) and sees keys up to it. Rows
  // up to p0 are seen by every lane; later ones (including rows past the sequence, whatever the cache held
  // there) are masked before the maximum and zeroed after the exponential.
  const __m512i lane_pos = _mm512_min_epi32(
      _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(p0)),
                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
      _mm512_set1_epi32(static_cast<int32_t>(last)));
  const auto visible = [&](int64_t t) {
    return _mm512_cmp_epi32_mask(lane_pos, _mm512_set1_epi32(static_cast<int32_t>(t)), _MM_CMPINT_NLT);
  };
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // Scores, 16 keys per tile product, and each lane's maximum while the rows are in L1: over the rows of the
  // tile before, whose store has completed (a vector load of a tile store still in flight waits for it).
  __m512 m = minus_inf;
  const auto mask_and_max = [&](int64_t t) {
    float* rows = sc + t * 16;
    for (int64_t i = 0; i < 16; ++i) {
      __m512 x = _mm512_loadu_ps(rows + i * 16);
      if (t + i > p0) {
        x = _mm512_mask_mov_ps(minus_inf, visible(t + i), x);
        _mm512_storeu_ps(rows + i * 16, x);
      }
      m = _mm512_max_ps(m, x);
    }
  };
  for (int64_t t = 0; t < kend; t += 16) {  // 16 keys never straddle a block: block_size % 16 == 0
    const at::BFloat16* k = keys + table[t / block_size] * block_stride + (t % block_size) * token_stride +
                            h * head_dim;
    amx_scores16(k, token_stride * 2, s.qt.data(), 16, chunks, sc + t * 16, 16);
    if (t > 0) mask_and_max(t - 16);
  }
  mask_and_max(kend - 16);
  // exp((s - max) * scale), summed per lane and written as P^T bfloat16 pairs in one pass:
  // pt[(kc * 16 + r) * 32 + 2 j + e] = p[32 kc + 2 r + e][j]; rows past kend are zero.
  s.pt.resize(kchunks * 512);
  s.pt_lo.resize(kchunks * 512);
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  // exp((s - max) * scale) = 2^(s * c - max * c) with c = scale * log2(e): one fused multiply-subtract.
  const __m512 c = _mm512_set1_ps(scale * 1.44269504088896341f), mc = _mm512_mul_ps(m, c);
  __m512 sum = _mm512_setzero_ps();
  const auto prob = [&](int64_t t) {
    if (t >= kend) return _mm512_setzero_ps();
    const __m512 e = exp2_nonpositive16(_mm512_fmsub_ps(_mm512_loadu_ps(sc + t * 16), c, mc));
    return t > p0 ? _mm512_maskz_mov_ps(visible(t), e) : e;
  };
  // The probabilities as two bfloat16 parts, p = hi + lo to about 2^-17: P^T V then sums float32 products of
  // float32-exact probabilities with the bfloat16 values (rounding p itself to bfloat16, as SDPA's flash kernel
  // does, moved the default model's first answer token off a near-tie with float32).
  const auto widen = [](__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); };
  for (int64_t i = 0; i < kchunks * 16; ++i) {
    const __m512 e0 = prob(2 * i), e1 = prob(2 * i + 1);
    sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
    const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
    const __m512 lo0 = _mm512_sub_ps(e0, widen(_mm512_castsi512_si256(hi)));
    const __m512 lo1 = _mm512_sub_ps(e1, widen(_mm512_extracti64x4_epi64(hi, 1)));
    _mm512_storeu_si512(s.pt.data() + i * 32, _mm512_permutexvar_epi16(pairs, hi));
    _mm512_storeu_si512(s.pt_lo.data() + i * 32,
                        _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(lo1, lo0)));
  }
  _mm512_storeu_ps(s.sums, sum);
  for (int64_t d0 = 0; d0 < dchunks; d0 += 4) {
    const int64_t nd = std::min<int64_t>(4, dchunks - d0);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kc = 0; kc < kchunks; ++kc) {
      _tile_loadd(5, s.pt.data() + kc * 512, 64);
      _tile_loadd(6, s.pt_lo.data() + kc * 512, 64);
      const uint16_t* v = vt + (kc * dchunks + d0) * 512;
      _tile_loadd(4, v, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(0, 4, 6);
      if (nd > 1) {
        _tile_loadd(4, v + 512, 64);
        _tile_dpbf16ps(1, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (nd > 2) {
        _tile_loadd(4, v + 1024, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_dpbf16ps(2, 4, 6);
      }
      if (nd > 3) {
        _tile_loadd(4, v + 1536, 64);
        _tile_dpbf16ps(3, 4, 5);
        _tile_dpbf16ps(3, 4, 6);
      }
    }
    _tile_stored(0, s.ot[0], 64);
    _tile_stored(1, s.ot[1], 64);
    _tile_stored(2, s.ot[2], 64);
    _tile_stored(3, s.ot[3], 64);
    // out[j][16 (d0 + i) + d] = ot[i][d][j] / sum_j: query j's column of each O^T tile, gathered.
    const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(16));
    for (int64_t j = 0; j < valid; ++j) {
      const __m512 inv = _mm512_set1_ps(1.f / s.sums[j]);
      at::BFloat16* o = out + j * out_stride + 16 * d0;
      for (int64_t i = 0; i < nd; ++i) {
        const __m512 x = _mm512_i32gather_ps(column, &s.ot[i][0][j], 4);
        const __m256bh b = _mm512_cvtneps_pbh(_mm512_mul_ps(x, inv));
        std::memcpy(o + 16 * i, &b, sizeof(b));
      }
    }
  }
}
#endif

}  // namespace

// ``first_positions`` [N] int64 (optional): a sliding window's first key of each sequence; the keys before it are
// not read (their blocks may be given back: table entries -1), and those sharing its block are masked out.
torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& kv_cache,
                                     const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                                     double scale, const c10::optional<torch::Tensor>& first_positions) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK((query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16) &&
                  (kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kHalf ||
                   kv_cache.scalar_type() == at::kBFloat16),
              "paged_decode_attention: float32 or bfloat16 query, float32, float16 or bfloat16 KV cache");
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

  // A bfloat16 query is widened once (N x Hq x D: a few KB) and the result rounded back at the end.
  const torch::Tensor query_f = query.scalar_type() == at::kFloat ? query : query.to(at::kFloat);
  const float* q = query_f.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* firsts = nullptr;
  if (first_positions.has_value()) {
    TORCH_CHECK(first_positions->scalar_type() == at::kLong && first_positions->dim() == 1 &&
                    first_positions->size(0) == n_seqs && first_positions->is_contiguous() &&
                    first_positions->device().is_cpu(),
                "paged_decode_attention: first_positions is a contiguous int64 [N] CPU tensor");
    firsts = first_positions->data_ptr<int64_t>();
  }
  for (int64_t n = 0; n < n_seqs; ++n) {  // validate before any thread reads through them
    TORCH_CHECK(lens[n] >= 1 && lens[n] <= max_blocks * block_size, "paged_decode_attention: bad seq_len");
    const int64_t first = firsts != nullptr ? firsts[n] : 0;
    TORCH_CHECK(first >= 0 && first < lens[n], "paged_decode_attention: bad first position");
    for (int64_t b = first / block_size; b < (lens[n] + block_size - 1) / block_size; ++b) {
      const int64_t id = tables[n * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < n_blocks, "paged_decode_attention: block id out of range");
    }
  }
  auto out = torch::empty_like(query_f);
  float* o = out.data_ptr<float>();
  const int64_t token_stride = n_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  const float fscale = static_cast<float>(scale);
#ifdef SLUICE_AMX
  // bfloat16 query and cache: the AMX path, for blocks of whole 16-row tiles, head_dim a multiple of 32 up to
  // 128 and groups of up to 16 query heads per kv head.
  // (A sliding window runs on the loops below: the tile path reads whole contexts.)
  const bool amx = query.scalar_type() == at::kBFloat16 && kv_cache.scalar_type() == at::kBFloat16 &&
                   block_size % 16 == 0 && head_dim % 32 == 0 && head_dim <= 128 && group <= 16 &&
                   firsts == nullptr && amx_attention_on.load(std::memory_order_relaxed) && amx_permitted();
  const uint16_t* q16 = amx ? reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>()) : nullptr;
#endif

  // Keys and values are read as float32 or converted from float16 (F16C) or bfloat16 (a shift) as they are
  // loaded: the same loops.
  const auto run = [&](const auto* keys) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(keys)>>;
    const T* values = keys + n_blocks * block_size * n_kv_heads * head_dim;
#ifdef SLUICE_AVX512
    const Group16<T> g16 = group16_for<T>(group, head_dim);  // AVX-512 loops for common GQA shapes
#endif
    // One work item per sequence, or per (sequence, kv head) when there are too few sequences to keep every
    // thread busy. An item walks its blocks in order and, in each block, does the work of all its kv heads
    // (whose `group` query heads share every key and value read): a block's token rows are contiguous, so
    // an item with all heads reads whole blocks front to back, which the hardware prefetchers follow (one
    // head's slice of each row they did not: this kernel ran at 13 GB/s of keys and values, now ~20).
    // Two passes: every score first (then the softmax per query head), then the values.
    // Threads take items from a shared counter rather than fixed shares: sequences differ in length, and a
    // thread the OS preempts for another process on these cores leaves its items to the others.
    const int64_t head_items = n_seqs >= 4 * at::get_num_threads() ? 1 : n_kv_heads;
    const int64_t items = n_seqs * head_items;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), items), 1, [&](int64_t, int64_t) {
      std::vector<float> scores;
      std::vector<float> acc;
      std::vector<float> sums;
#ifdef SLUICE_AMX
      AmxScratch amx_scratch;
      const RowsPlan rows(amx ? group : 0, head_dim);
      if (amx) {
        const ScoreTiles tiles(group);
        _tile_loadconfig(&tiles);
      }
#endif
      for (int64_t item = next.fetch_add(1, std::memory_order_relaxed); item < items;
           item = next.fetch_add(1, std::memory_order_relaxed)) {
        const int64_t n = item / head_items;
        const int64_t h0 = head_items == 1 ? 0 : item % head_items, h1 = head_items == 1 ? n_kv_heads : h0 + 1;
        const int64_t heads = (h1 - h0) * group;  // query heads of this item, from h0 * group on
        const int64_t len = lens[n];
        // Blocks from b0 on are read (a window's first block; 0 without one); in it, keys before `first` are
        // masked. Score rows keep absolute positions: row[t] is key t's.
        const int64_t first = firsts != nullptr ? firsts[n] : 0;
        const int64_t b0 = first / block_size, s0 = b0 * block_size;
        const int64_t* table = tables + n * max_blocks;
        const float* qn = q + (n * n_heads + h0 * group) * head_dim;
#ifdef SLUICE_AMX
        if constexpr (std::is_same_v<T, at::BFloat16>) {
          if (amx) {
            const int64_t first = (n * n_heads + h0 * group) * head_dim;
            amx_decode_item(keys, values, q16 + first, table, len, h0, h1, group, head_dim, block_size, token_stride,
                            block_stride, fscale, rows, o + first, amx_scratch);
            continue;
          }
        }
#endif
        scores.resize(heads * len);
        acc.assign(heads * head_dim, 0.f);
        sums.resize(heads);
        float* sc = scores.data();
        float* a = acc.data();
        // This item's rows of block b + 1 of `base` (keys or values), when the sequence goes on past block b.
        const auto prefetch_next = [&](const T* base, int64_t b, int64_t start) {
          if (start + block_size < len) {
            prefetch_rows(base + table[b + 1] * block_stride + h0 * head_dim,
                          std::min(block_size, len - start - block_size), token_stride, (h1 - h0) * head_dim);
          }
        };

        for (int64_t start = s0, b = b0; start < len; start += block_size, ++b) {
          const int64_t stop = std::min(block_size, len - start);
          prefetch_next(keys, b, start);  // the next block's keys, while this one's are multiplied
          for (int64_t h = h0; h < h1; ++h) {
            const T* kb = keys + table[b] * block_stride + h * head_dim;
#ifdef SLUICE_AVX512
            if (g16.scores != nullptr) {
              const int64_t q0 = (h - h0) * group;
              g16.scores(qn + q0 * head_dim, head_dim, kb, token_stride, stop, sc + q0 * len + start, len, fscale);
              continue;
            }
#endif
            for (int64_t g = 0; g < group; ++g) {
              const int64_t qi = (h - h0) * group + g;
              const float* qh = qn + qi * head_dim;
              float* row = sc + qi * len + start;
              const T* k = kb;
              int64_t i = 0;
#ifdef SLUICE_AVX2
              if (head_dim % 8 == 0) {
                const __m256 vscale = _mm256_set1_ps(fscale);
                for (; i + 8 <= stop; i += 8, k += 8 * token_stride) {
                  _mm256_storeu_ps(row + i, _mm256_mul_ps(dot_8_keys(qh, k, token_stride, head_dim), vscale));
                }
              }
#endif
              for (; i < stop; ++i, k += token_stride) row[i] = dot(qh, k, head_dim) * fscale;
            }
          }
        }
        for (int64_t qi = 0; qi < heads; ++qi) {
          float* row = sc + qi * len;
          for (int64_t t = s0; t < first; ++t) row[t] = 0.f;  // outside the window: no weight
          float m = -std::numeric_limits<float>::infinity();
          for (int64_t t = first; t < len; ++t) m = std::max(m, row[t]);
          sums[qi] = exp_shifted_sum(row + first, len - first, m);
        }

        for (int64_t start = s0, b = b0; start < len; start += block_size, ++b) {
          const int64_t stop = std::min(block_size, len - start);
          prefetch_next(values, b, start);
          for (int64_t h = h0; h < h1; ++h) {
            const T* vb = values + table[b] * block_stride + h * head_dim;
#ifdef SLUICE_AVX512
            if (g16.values != nullptr) {
              const int64_t q0 = (h - h0) * group;
              g16.values(sc + q0 * len + start, len, vb, token_stride, stop, a + q0 * head_dim, head_dim);
              continue;
            }
#endif
            for (int64_t g = 0; g < group; ++g) {
              const int64_t qi = (h - h0) * group + g;
              const float* p = sc + qi * len + start;
              float* ah = a + qi * head_dim;
              int64_t dc = 0;
#ifdef SLUICE_AVX2
              // 64-wide slices of the output: 8 accumulators in registers over the block's tokens.
              for (; dc + 64 <= head_dim; dc += 64) {
                __m256 c0 = _mm256_loadu_ps(ah + dc), c1 = _mm256_loadu_ps(ah + dc + 8);
                __m256 c2 = _mm256_loadu_ps(ah + dc + 16), c3 = _mm256_loadu_ps(ah + dc + 24);
                __m256 c4 = _mm256_loadu_ps(ah + dc + 32), c5 = _mm256_loadu_ps(ah + dc + 40);
                __m256 c6 = _mm256_loadu_ps(ah + dc + 48), c7 = _mm256_loadu_ps(ah + dc + 56);
                const T* v = vb + dc;
                for (int64_t i = 0; i < stop; ++i, v += token_stride) {
                  const __m256 w = _mm256_set1_ps(p[i]);
                  c0 = _mm256_fmadd_ps(w, load8(v), c0);
                  c1 = _mm256_fmadd_ps(w, load8(v + 8), c1);
                  c2 = _mm256_fmadd_ps(w, load8(v + 16), c2);
                  c3 = _mm256_fmadd_ps(w, load8(v + 24), c3);
                  c4 = _mm256_fmadd_ps(w, load8(v + 32), c4);
                  c5 = _mm256_fmadd_ps(w, load8(v + 40), c5);
                  c6 = _mm256_fmadd_ps(w, load8(v + 48), c6);
                  c7 = _mm256_fmadd_ps(w, load8(v + 56), c7);
                }
                _mm256_storeu_ps(ah + dc, c0);
                _mm256_storeu_ps(ah + dc + 8, c1);
                _mm256_storeu_ps(ah + dc + 16, c2);
                _mm256_storeu_ps(ah + dc + 24, c3);
                _mm256_storeu_ps(ah + dc + 32, c4);
                _mm256_storeu_ps(ah + dc + 40, c5);
                _mm256_storeu_ps(ah + dc + 48, c6);
                _mm256_storeu_ps(ah + dc + 56, c7);
              }
#endif
              if (dc < head_dim) {
                const T* v = vb + dc;
                for (int64_t i = 0; i < stop; ++i, v += token_stride) axpy(ah + dc, p[i], v, head_dim - dc);
              }
            }
          }
        }
        for (int64_t qi = 0; qi < heads; ++qi) {
          float* dst = o + (n * n_heads + h0 * group + qi) * head_dim;
          const float inv = 1.f / sums[qi];
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = a[qi * head_dim + d] * inv;
        }
      }
#ifdef SLUICE_AMX
      if (amx) _tile_release();  // no tile state left for the OS to save at every context switch
#endif
    });
  };
  if (kv_cache.scalar_type() == at::kHalf) {
    run(kv_cache.data_ptr<at::Half>());
  } else if (kv_cache.scalar_type() == at::kBFloat16) {
    run(kv_cache.data_ptr<at::BFloat16>());
  } else {
    run(kv_cache.data_ptr<float>());
  }
  return query.scalar_type() == at::kFloat ? out : out.to(query.scalar_type());
}

// Whether this build and process can run bfloat16 decode attention on AMX tiles (built for a CPU with
// AMX-BF16, and Linux granted the tile state).
bool has_amx_attention() {
#ifdef SLUICE_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// Allows (the default) or forbids the AMX path of paged_decode_attention; returns the previous setting. For
// A/B runs and tests: without it the same attention runs on the AVX-512 / AVX2 loops in float32.
bool set_amx_attention(bool on) {
#ifdef SLUICE_AMX
  return amx_attention_on.exchange(on);
#else
  return false;
#endif
}

// Causal attention of prefill tokens over a bfloat16 paged KV cache on AMX (see amx_prefill_tile): query
// [T, Hq, D] bfloat16, the tokens of sequence i at rows query_start[i]..query_start[i + 1] and positions
// seq_lens[i] - n_i.., their keys and values already in the cache (block_tables[i]). Returns [T, Hq, D].
// Needs has_amx_attention(), block_size % 16 == 0 and head_dim a multiple of 32 up to 128 (the caller checks).
torch::Tensor paged_prefill_attention(const torch::Tensor& query, const torch::Tensor& kv_cache,
                                      const torch::Tensor& block_tables, const torch::Tensor& query_start,
                                      const torch::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), "paged_prefill_attention: CPU tensors only");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && kv_cache.scalar_type() == at::kBFloat16,
              "paged_prefill_attention: bfloat16 query and KV cache");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && query_start.scalar_type() == at::kLong &&
                  seq_lens.scalar_type() == at::kLong, "paged_prefill_attention: int64 tables, starts and lengths");
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2 && block_tables.dim() == 2 &&
                  query_start.dim() == 1 && seq_lens.dim() == 1, "paged_prefill_attention: bad ranks");
  TORCH_CHECK(query.is_contiguous() && kv_cache.is_contiguous() && block_tables.is_contiguous() &&
                  query_start.is_contiguous() && seq_lens.is_contiguous(),
              "paged_prefill_attention: contiguous tensors only");
  const int64_t tokens = query.size(0), n_heads = query.size(1), head_dim = query.size(2);
  const int64_t n_blocks = kv_cache.size(1), block_size = kv_cache.size(2), n_kv_heads = kv_cache.size(3);
  const int64_t n_seqs = seq_lens.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(kv_cache.size(4) == head_dim, "paged_prefill_attention: head_dim differs");
  TORCH_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "paged_prefill_attention: Hq % Hkv != 0");
  TORCH_CHECK(block_size % 16 == 0 && head_dim % 32 == 0 && head_dim <= 128,
              "paged_prefill_attention: block_size % 16 == 0 and head_dim a multiple of 32 up to 128");
  TORCH_CHECK(block_tables.size(0) == n_seqs && query_start.size(0) == n_seqs + 1,
              "paged_prefill_attention: one block table and length per sequence, n + 1 starts");
#ifdef SLUICE_AMX
  TORCH_CHECK(amx_permitted(), "paged_prefill_attention: no AMX tile state on this CPU");
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[n_seqs] == tokens, "paged_prefill_attention: starts must run 0..tokens");
  const int64_t group = n_heads / n_kv_heads, dchunks = head_dim / 16;
  std::vector<int64_t> vt_offset(n_seqs + 1, 0);
  for (int64_t i = 0; i < n_seqs; ++i) {  // validate before any thread reads through them
    const int64_t n = starts[i + 1] - starts[i];
    TORCH_CHECK(n >= 1 && lens[i] >= n && lens[i] <= max_blocks * block_size,
                "paged_prefill_attention: bad query_start or seq_len");
    for (int64_t b = 0; b < (lens[i] + block_size - 1) / block_size; ++b) {
      const int64_t id = tables[i * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < n_blocks, "paged_prefill_attention: block id out of range");
    }
    vt_offset[i + 1] = vt_offset[i] + n_kv_heads * ((lens[i] + 31) / 32) * dchunks * 512;
  }
  const int64_t token_stride = n_kv_heads * head_dim, block_stride = block_size * token_stride;
  const auto* keys = kv_cache.data_ptr<at::BFloat16>();
  const at::BFloat16* values = keys + n_blocks * block_stride;
  std::vector<uint16_t> vt(vt_offset[n_seqs]);
  const int64_t threads = at::get_num_threads();
  // The values of every (sequence, kv head) as V^T tiles, once: every query head of the group and every tile
  // of the sequence's queries reads them.
  at::parallel_for(0, n_seqs * n_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / n_kv_heads, h = item % n_kv_heads;
      const int64_t per_head = (lens[i] + 31) / 32 * dchunks * 512;
      pack_values_t(values, tables + i * max_blocks, lens[i], h, head_dim, block_size, token_stride, block_stride,
                    vt.data() + vt_offset[i] + h * per_head);
    }
  });
  // Work items: 16 queries of one query head; within a (sequence, head) the last tiles (the most keys) first,
  // taken from a shared counter so that threads even out.
  struct Item {
    int64_t seq, head, tile;
  };
  std::vector<Item> items;
  for (int64_t i = 0; i < n_seqs; ++i) {
    const int64_t tiles = (starts[i + 1] - starts[i] + 15) / 16;
    for (int64_t t = tiles - 1; t >= 0; --t)
      for (int64_t hq = 0; hq < n_heads; ++hq) items.push_back({i, hq, t});
  }
  auto out = torch::empty_like(query);
  auto* o = out.data_ptr<at::BFloat16>();
  const auto* q16 = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  const float fscale = static_cast<float>(scale);
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min<int64_t>(threads, n_items), 1, [&](int64_t, int64_t) {
    const ScoreTiles tiles(16);
    _tile_loadconfig(&tiles);
    PrefillScratch scratch;
    for (int64_t k = next.fetch_add(1, std::memory_order_relaxed); k < n_items;
         k = next.fetch_add(1, std::memory_order_relaxed)) {
      const Item& it = items[k];
      const int64_t n = starts[it.seq + 1] - starts[it.seq], ctx = lens[it.seq] - n;
      const int64_t first = starts[it.seq] + 16 * it.tile, valid = std::min<int64_t>(16, n - 16 * it.tile);
      const int64_t h = it.head / group;
      const int64_t per_head = (lens[it.seq] + 31) / 32 * dchunks * 512;
      amx_prefill_tile(keys, tables + it.seq * max_blocks, q16 + (first * n_heads + it.head) * head_dim,
                       n_heads * head_dim, valid, ctx + 16 * it.tile, h, head_dim, block_size, token_stride,
                       block_stride, fscale, vt.data() + vt_offset[it.seq] + h * per_head,
                       o + (first * n_heads + it.head) * head_dim, n_heads * head_dim, scratch);
    }
    _tile_release();
  });
  return out;
#else
  TORCH_CHECK(false, "paged_prefill_attention: built without AMX");
#endif
}

// bf16_prefill_attention: paged_prefill_attention's operator for CPUs with AVX512-BF16 but no AMX (AMD Zen 4/5).
// A flash-attention loop per work item (a sequence, a kv head, the `group` query heads of that kv head at up to
// kBf16Positions consecutive positions: rows r = position * group + head): 64 keys at a time, scores by
// vdpbf16ps (query dimension pairs broadcast against 16 keys' pairs, packed once per sequence and kv head, so
// no horizontal sums), an online softmax in float32 (exp_clamped16), and P V by float32 FMAs of the exact
// probabilities with the values widened from the cache rows (as many instructions as the two bfloat16 halves of
// P that the AMX kernel multiplies, and no rounding of P).
namespace {

#if defined(SLUICE_AVX512) && defined(__AVX512BF16__)
#define SLUICE_BF16_PREFILL 1

constexpr int64_t kBf16KeyChunk = 64;  // keys per flash step
constexpr int64_t kBf16Rows = 48;      // query rows per work item (positions x group), before padding
constexpr int64_t kBf16RowPad = 24;    // rows are padded to a multiple: the score (8) and value (6, 3) blocks

// s[r * s_stride + t] = scale * q_r . k_t for NR rows and the 32 keys of two packed 16-key chunks: kp holds
// [pair][16 keys] 32-bit lanes (dimensions 2p, 2p + 1 of each key), q[r] a query row's dimension pairs.
template <int NR>
inline void bf16_scores32(const uint32_t* const* q, const uint32_t* kp, int64_t pairs, float* s, int64_t s_stride,
                          __m512 scale) {
  __m512 a0[NR], a1[NR];
  for (int r = 0; r < NR; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  const uint32_t* kp1 = kp + pairs * 16;
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + p * 16);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp1 + p * 16);
    for (int r = 0; r < NR; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r][p]));
      a0[r] = _mm512_dpbf16_ps(a0[r], qb, k0);
      a1[r] = _mm512_dpbf16_ps(a1[r], qb, k1);
    }
  }
  for (int r = 0; r < NR; ++r) {
    _mm512_storeu_ps(s + r * s_stride, _mm512_mul_ps(a0[r], scale));
    _mm512_storeu_ps(s + r * s_stride + 16, _mm512_mul_ps(a1[r], scale));
  }
}

// o[r] = o[r] * alpha[r] + sum_t p[r][t] v_t for RV rows (o rows `head_dim` floats apart, p rows `p_stride`)
// over n keys whose value rows (bfloat16, NV x 16 dimensions) are at v[t].
template <int RV, int NV>
inline void bf16_values(const float* p, int64_t p_stride, const at::BFloat16* const* v, int64_t n,
                        const float* alpha, float* o, int64_t head_dim) {
  __m512 acc[RV][NV];
  for (int r = 0; r < RV; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_mul_ps(_mm512_loadu_ps(o + r * head_dim + 16 * j), a);
  }
  for (int64_t t = 0; t < n; ++t) {
    __m512 vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load16(v[t] + 16 * j);
    for (int r = 0; r < RV; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * p_stride + t]);
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_fmadd_ps(w, vv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < RV; ++r)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(o + r * head_dim + 16 * j, acc[r][j]);
}

// P V over all `rows` (a multiple of kBf16RowPad) for head_dim 32, 64, 96 or 128.
inline void bf16_values_rows(const float* p, int64_t p_stride, const at::BFloat16* const* v, int64_t n,
                             const float* alpha, float* o, int64_t rows, int64_t head_dim) {
  for (int64_t r = 0; r < rows;) {
    switch (head_dim) {
      case 32: bf16_values<8, 2>(p + r * p_stride, p_stride, v, n, alpha + r, o + r * head_dim, head_dim); r += 8; break;
      case 64: bf16_values<6, 4>(p + r * p_stride, p_stride, v, n, alpha + r, o + r * head_dim, head_dim); r += 6; break;
      case 96: bf16_values<4, 6>(p + r * p_stride, p_stride, v, n, alpha + r, o + r * head_dim, head_dim); r += 4; break;
      default: bf16_values<3, 8>(p + r * p_stride, p_stride, v, n, alpha + r, o + r * head_dim, head_dim); r += 3; break;
    }
  }
}

struct Bf16PrefillScratch {
  std::vector<float> s, o, m, l, alpha;
  std::vector<const uint32_t*> q;
  std::vector<const at::BFloat16*> v;
  std::vector<uint32_t> zeros;  // the padding rows' query
};

// Packs the keys 0..len of one sequence and kv head as [16-key chunk][pair][16] 32-bit lanes (dimensions 2p,
// 2p + 1 of each key), zero past len, chunks up to a multiple of 32 keys. 16 keys never straddle a block.
void bf16_pack_keys(const at::BFloat16* keys, const int64_t* table, int64_t len, int64_t h, int64_t head_dim,
                    int64_t block_size, int64_t token_stride, int64_t block_stride, uint32_t* kp) {
  const int64_t pairs = head_dim / 2, chunks = (len + 31) / 32 * 2;
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int32_t>(token_stride / 2)));
  for (int64_t c = 0; c < chunks; ++c, kp += pairs * 16) {
    const int64_t key = 16 * c, count = std::clamp<int64_t>(len - key, 0, 16);
    if (count == 0) {
      std::memset(kp, 0, pairs * 16 * sizeof(uint32_t));
      continue;
    }
    const __mmask16 live = static_cast<__mmask16>((1u << count) - 1);
    const auto* row = reinterpret_cast<const int*>(keys + table[key / block_size] * block_stride +
                                                   (key % block_size) * token_stride + h * head_dim);
    for (int64_t p = 0; p < pairs; ++p)
      _mm512_storeu_si512(kp + p * 16, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows, row + p, 4));
  }
}

// One work item: query rows r = j * group + g (position p0 + j, query head h * group + g) for j < positions,
// over keys 0..p0 + positions - 1 of kv head h. out rows as the query's.
void bf16_prefill_item(const at::BFloat16* query, int64_t q_row0, int64_t n_heads, const uint32_t* kp,
                       const at::BFloat16* values, const int64_t* table, int64_t p0, int64_t positions, int64_t h,
                       int64_t group, int64_t head_dim, int64_t block_size, int64_t token_stride,
                       int64_t block_stride, float scale, at::BFloat16* out, Bf16PrefillScratch& s) {
  const int64_t real = positions * group, rows = (real + kBf16RowPad - 1) / kBf16RowPad * kBf16RowPad;
  const int64_t last = p0 + positions - 1, pairs = head_dim / 2;
  s.s.resize(rows * kBf16KeyChunk);
  s.o.assign(rows * head_dim, 0.f);
  s.m.assign(rows, -std::numeric_limits<float>::infinity());
  s.l.assign(rows, 0.f);
  s.alpha.resize(rows);
  s.q.resize(rows);
  s.v.resize(kBf16KeyChunk);
  s.zeros.assign(pairs, 0);
  for (int64_t r = 0; r < rows; ++r) {
    s.q[r] = r < real ? reinterpret_cast<const uint32_t*>(
                            query + ((q_row0 + r / group) * n_heads + h * group + r % group) * head_dim)
                      : s.zeros.data();
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  float* sc = s.s.data();
  for (int64_t k0 = 0; k0 <= last; k0 += kBf16KeyChunk) {
    const int64_t n = std::min<int64_t>(kBf16KeyChunk, last + 1 - k0);  // keys of this step
    const int64_t n32 = (n + 31) / 32 * 32;
    for (int64_t c = 0; c < n32; c += 32) {
      const uint32_t* k = kp + (k0 + c) / 16 * pairs * 16;
      for (int64_t r = 0; r < rows; r += 8)
        bf16_scores32<8>(s.q.data() + r, k, pairs, sc + r * kBf16KeyChunk + c, kBf16KeyChunk, vscale);
    }
    // The online softmax: each row's keys past its position (and past the step's n) masked out.
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = r < real ? p0 + r / group : last;
      float* row = sc + r * kBf16KeyChunk;
      __m512 mx = minus_inf;
      __mmask16 vis[kBf16KeyChunk / 16];
      for (int64_t c = 0; c < n32; c += 16) {
        vis[c / 16] = _mm512_cmp_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(k0 + c))),
                                            _mm512_set1_epi32(static_cast<int32_t>(pos)), _MM_CMPINT_LE);
        mx = _mm512_max_ps(mx, _mm512_mask_mov_ps(minus_inf, vis[c / 16], _mm512_loadu_ps(row + c)));
      }
      const float m_old = s.m[r], m_new = std::max(m_old, _mm512_reduce_max_ps(mx));
      if (m_new == -std::numeric_limits<float>::infinity()) {  // sees none of these keys (nor earlier: never)
        s.alpha[r] = 1.f;
        for (int64_t c = 0; c < n32; c += 16) _mm512_storeu_ps(row + c, _mm512_setzero_ps());
        continue;
      }
      const __m512 shift = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = 0; c < n32; c += 16) {
        const __m512 e = _mm512_maskz_mov_ps(vis[c / 16], exp_clamped16(_mm512_sub_ps(_mm512_loadu_ps(row + c), shift)));
        _mm512_storeu_ps(row + c, e);
        sum = _mm512_add_ps(sum, e);
      }
      const float alpha = m_old == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m_old - m_new);
      s.alpha[r] = alpha;
      s.m[r] = m_new;
      s.l[r] = s.l[r] * alpha + _mm512_reduce_add_ps(sum);
    }
    for (int64_t t = 0; t < n; ++t) {
      const int64_t key = k0 + t;
      s.v[t] = values + table[key / block_size] * block_stride + (key % block_size) * token_stride + h * head_dim;
    }
    bf16_values_rows(sc, kBf16KeyChunk, s.v.data(), n, s.alpha.data(), s.o.data(), rows, head_dim);
  }
  for (int64_t r = 0; r < real; ++r) {
    const float inv = 1.f / s.l[r];
    float* o = s.o.data() + r * head_dim;
    for (int64_t d = 0; d < head_dim; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(inv)));
    store_row(o, out + ((q_row0 + r / group) * n_heads + h * group + r % group) * head_dim, head_dim);
  }
}
#endif

}  // namespace

// Whether this build and CPU run bf16_prefill_attention: built with AVX512-BF16 (-march=native on such a CPU)
// and the CPU reports it.
bool has_bf16_attention() {
#ifdef SLUICE_BF16_PREFILL
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// paged_prefill_attention's operator and arguments on AVX512-BF16 (see bf16_prefill_item): query [T, Hq, D]
// bfloat16, the tokens of sequence i at rows query_start[i]..query_start[i + 1] and positions seq_lens[i] - n_i..,
// their keys and values already in the cache (block_tables[i]). Returns [T, Hq, D]. Needs has_bf16_attention(),
// block_size % 16 == 0 and head_dim a multiple of 32 up to 128.
torch::Tensor bf16_prefill_attention(const torch::Tensor& query, const torch::Tensor& kv_cache,
                                     const torch::Tensor& block_tables, const torch::Tensor& query_start,
                                     const torch::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), "bf16_prefill_attention: CPU tensors only");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && kv_cache.scalar_type() == at::kBFloat16,
              "bf16_prefill_attention: bfloat16 query and KV cache");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && query_start.scalar_type() == at::kLong &&
                  seq_lens.scalar_type() == at::kLong, "bf16_prefill_attention: int64 tables, starts and lengths");
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2 && block_tables.dim() == 2 &&
                  query_start.dim() == 1 && seq_lens.dim() == 1, "bf16_prefill_attention: bad ranks");
  TORCH_CHECK(query.is_contiguous() && kv_cache.is_contiguous() && block_tables.is_contiguous() &&
                  query_start.is_contiguous() && seq_lens.is_contiguous(),
              "bf16_prefill_attention: contiguous tensors only");
  const int64_t tokens = query.size(0), n_heads = query.size(1), head_dim = query.size(2);
  const int64_t n_blocks = kv_cache.size(1), block_size = kv_cache.size(2), n_kv_heads = kv_cache.size(3);
  const int64_t n_seqs = seq_lens.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(kv_cache.size(4) == head_dim, "bf16_prefill_attention: head_dim differs");
  TORCH_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "bf16_prefill_attention: Hq % Hkv != 0");
  TORCH_CHECK(block_size % 16 == 0 && head_dim % 32 == 0 && head_dim <= 128,
              "bf16_prefill_attention: block_size % 16 == 0 and head_dim a multiple of 32 up to 128");
  TORCH_CHECK(block_tables.size(0) == n_seqs && query_start.size(0) == n_seqs + 1,
              "bf16_prefill_attention: one block table and length per sequence, n + 1 starts");
#ifdef SLUICE_BF16_PREFILL
  TORCH_CHECK(has_bf16_attention(), "bf16_prefill_attention: this CPU lacks AVX512-BF16");
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[n_seqs] == tokens, "bf16_prefill_attention: starts must run 0..tokens");
  const int64_t group = n_heads / n_kv_heads;
  std::vector<int64_t> kp_offset(n_seqs + 1, 0);
  for (int64_t i = 0; i < n_seqs; ++i) {  // validate before any thread reads through them
    const int64_t n = starts[i + 1] - starts[i];
    TORCH_CHECK(n >= 1 && lens[i] >= n && lens[i] <= max_blocks * block_size,
                "bf16_prefill_attention: bad query_start or seq_len");
    for (int64_t b = 0; b < (lens[i] + block_size - 1) / block_size; ++b) {
      const int64_t id = tables[i * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < n_blocks, "bf16_prefill_attention: block id out of range");
    }
  }
  const auto per_head = [&](int64_t i) { return (lens[i] + 31) / 32 * 32 * (head_dim / 2); };
  for (int64_t i = 0; i < n_seqs; ++i) kp_offset[i + 1] = kp_offset[i] + n_kv_heads * per_head(i);
  const int64_t token_stride = n_kv_heads * head_dim, block_stride = block_size * token_stride;
  const auto* keys = kv_cache.data_ptr<at::BFloat16>();
  const at::BFloat16* values = keys + n_blocks * block_stride;
  std::vector<uint32_t> kp(kp_offset[n_seqs]);
  // The keys of every (sequence, kv head) packed once: every query row of the group and every tile reads them.
  at::parallel_for(0, n_seqs * n_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / n_kv_heads, h = item % n_kv_heads;
      bf16_pack_keys(keys, tables + i * max_blocks, lens[i], h, head_dim, block_size, token_stride, block_stride,
                     kp.data() + kp_offset[i] + h * per_head(i));
    }
  });
  // Work items: kBf16Rows query rows (positions x group) of one kv head; the last tiles of a sequence (the most
  // keys) first, taken from a shared counter so that threads even out when one is slowed.
  const int64_t positions = std::max<int64_t>(1, kBf16Rows / group);
  struct Item {
    int64_t seq, head, tile;
  };
  std::vector<Item> items;
  for (int64_t i = 0; i < n_seqs; ++i) {
    const int64_t tiles = (starts[i + 1] - starts[i] + positions - 1) / positions;
    for (int64_t t = tiles - 1; t >= 0; --t)
      for (int64_t h = 0; h < n_kv_heads; ++h) items.push_back({i, h, t});
  }
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return lens[a.seq] - (starts[a.seq + 1] - starts[a.seq]) + a.tile * positions >
           lens[b.seq] - (starts[b.seq + 1] - starts[b.seq]) + b.tile * positions;
  });
  auto out = torch::empty_like(query);
  auto* o = out.data_ptr<at::BFloat16>();
  const auto* q = query.data_ptr<at::BFloat16>();
  const float fscale = static_cast<float>(scale);
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n_items), 1, [&](int64_t, int64_t) {
    Bf16PrefillScratch scratch;
    for (int64_t k = next.fetch_add(1, std::memory_order_relaxed); k < n_items;
         k = next.fetch_add(1, std::memory_order_relaxed)) {
      const Item& it = items[k];
      const int64_t n = starts[it.seq + 1] - starts[it.seq], ctx = lens[it.seq] - n;
      const int64_t first = starts[it.seq] + positions * it.tile;
      const int64_t valid = std::min<int64_t>(positions, n - positions * it.tile);
      bf16_prefill_item(q, first, n_heads, kp.data() + kp_offset[it.seq] + it.head * per_head(it.seq), values,
                        tables + it.seq * max_blocks, ctx + positions * it.tile, valid, it.head, group, head_dim,
                        block_size, token_stride, block_stride, fscale, o, scratch);
    }
  });
  return out;
#else
  TORCH_CHECK(false, "bf16_prefill_attention: built without AVX512-BF16");
#endif
}

namespace {

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), name,
              ": float32 or bfloat16 CPU tensor expected");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": [rows, features] with contiguous rows expected");
}

// A norm weight of H values: float32, or the activations' own dtype.
void check_weight(const torch::Tensor& weight, const torch::Tensor& x, const char* name) {
  TORCH_CHECK(weight.device().is_cpu() && weight.is_contiguous() && weight.numel() == x.size(1) &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == x.scalar_type()),
              name, ": weight must be [H], float32 or the input's dtype");
}

// Calls f with null pointers of the activation type T and the weight type W (float or at::BFloat16).
template <typename F>
void dispatch_rows(const torch::Tensor& x, const torch::Tensor& weight, F&& f) {
  const bool wf = weight.scalar_type() == at::kFloat;
  if (x.scalar_type() == at::kFloat) {
    f(static_cast<float*>(nullptr), static_cast<const float*>(nullptr));
  } else if (wf) {
    f(static_cast<at::BFloat16*>(nullptr), static_cast<const float*>(nullptr));
  } else {
    f(static_cast<at::BFloat16*>(nullptr), static_cast<const at::BFloat16*>(nullptr));
  }
}

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for one row of `n` floats.
inline void rms_norm_row(const float* x, const float* weight, float* out, int64_t n, float eps) {
  const float ss = dot(x, x, n);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t d = 0; d < n; ++d) out[d] = weight[d] * (x[d] * inv);
}

// The same for any T / W: float rows go straight through; other rows are widened into buf (n floats),
// normalised there and rounded once into out. x and out may be the same row.
template <typename T, typename W>
inline void rms_norm_row_any(const T* x, const W* weight, T* out, int64_t n, float eps, float* buf) {
  if constexpr (std::is_same_v<T, float> && std::is_same_v<W, float>) {
    rms_norm_row(x, weight, out, n, eps);
  } else {
    load_row(x, buf, n);
    const float ss = dot(buf, buf, n);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (int64_t d = 0; d < n; ++d) buf[d] = to_float(weight[d]) * (buf[d] * inv);
    store_row(buf, out, n);
  }
}

}  // namespace

// RMSNorm of each row of x [T, H] (float32 or bfloat16), computed in float32 as transformers does.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "rms_norm: x");
  check_weight(weight, x, "rms_norm");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = torch::empty({rows, n}, x.options());
  dispatch_rows(x, weight, [&](auto* t, const auto* w_type) {
    using T = std::remove_pointer_t<decltype(t)>;
    using W = std::remove_cv_t<std::remove_pointer_t<decltype(w_type)>>;
    const T* src = x.data_ptr<T>();
    const W* w = weight.data_ptr<W>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(std::is_same_v<T, float> ? 0 : n);
      for (int64_t r = begin; r < end; ++r) {
        rms_norm_row_any(src + r * stride, w, dst + r * n, n, static_cast<float>(eps), buf.data());
      }
    });
  });
  return out;
}

// residual += x (in place), then returns rms_norm(residual): the residual add and the next layer's
// input norm in one pass. In bfloat16 the sum is rounded into the residual and the norm is of that
// rounded row, as with the two ops apart.
torch::Tensor add_rms_norm(const torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm: x");
  check_rows(residual, "add_rms_norm: residual");
  TORCH_CHECK(residual.is_contiguous() && x.sizes() == residual.sizes(), "add_rms_norm: shapes differ");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type(), "add_rms_norm: dtypes differ");
  check_weight(weight, x, "add_rms_norm");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = torch::empty({rows, n}, x.options());
  dispatch_rows(x, weight, [&](auto* t, const auto* w_type) {
    using T = std::remove_pointer_t<decltype(t)>;
    using W = std::remove_cv_t<std::remove_pointer_t<decltype(w_type)>>;
    const T* src = x.data_ptr<T>();
    T* res = residual.data_ptr<T>();
    const W* w = weight.data_ptr<W>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(std::is_same_v<T, float> ? 0 : n);
      for (int64_t r = begin; r < end; ++r) {
        T* rr = res + r * n;
        const T* xr = src + r * stride;
        if constexpr (std::is_same_v<T, float>) {
          for (int64_t d = 0; d < n; ++d) rr[d] += xr[d];
        } else {
          for (int64_t d = 0; d < n; ++d) buf[d] = to_float(rr[d]) + to_float(xr[d]);
          store_row(buf.data(), rr, n);
        }
        rms_norm_row_any(static_cast<const T*>(rr), w, dst + r * n, n, static_cast<float>(eps), buf.data());
      }
    });
  });
  return out;
}

// [T, 2I] gate|up -> [T, I] silu(gate) * up.
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul: gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: odd width");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = torch::empty({rows, inter}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    const float* src = gate_up.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* g = src + r * stride;
        silu_mul_row(g, g + inter, dst + r * inter, inter);
      }
    });
    return out;
  }
  const at::BFloat16* src = gate_up.data_ptr<at::BFloat16>();
  at::BFloat16* dst = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(3 * inter);  // gate | up | result
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* g = src + r * stride;
      int64_t d = 0;
#ifdef SLUICE_AVX512
      d = silu_mul_row16(g, g + inter, dst + r * inter, inter);  // AVX512-BF16: straight from and to bfloat16
#endif
      if (d < inter) {  // the rest through float32 rows
        load_row(g + d, buf.data(), inter - d);
        load_row(g + inter + d, buf.data() + inter, inter - d);
        silu_mul_row(buf.data(), buf.data() + inter, buf.data() + 2 * inter, inter - d);
        store_row(buf.data() + 2 * inter, dst + r * inter + d, inter - d);
      }
    }
  });
  return out;
}

// Rotary embedding, GPT-NeoX layout (the halves of each head rotate together), in place on x
// [T, heads, D] whose heads and features are contiguous (tokens may be strided, e.g. a slice of the
// fused qkv output). cos/sin [max_positions, D/2], float32 or x's dtype; positions [T] int64.
void rotary_(torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 3, "rotary_: float32 or bfloat16 [T, H, D]");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == dim && dim % 2 == 0, "rotary_: heads and features contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == sin.scalar_type() &&
                  (cos.scalar_type() == at::kFloat || cos.scalar_type() == x.scalar_type()) && cos.dim() == 2 &&
                  cos.size(1) == half && sin.sizes() == cos.sizes(),
              "rotary_: cos/sin must be [positions, D/2], float32 or x's dtype");
  TORCH_CHECK(positions.is_contiguous() && positions.scalar_type() == at::kLong && positions.numel() == tokens,
              "rotary_: positions must be int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_: position out of range");
  const int64_t stride = x.stride(0);
  dispatch_rows(x, cos, [&](auto* t_type, const auto* c_type) {
    using T = std::remove_pointer_t<decltype(t_type)>;
    using C = std::remove_cv_t<std::remove_pointer_t<decltype(c_type)>>;
    T* base = x.data_ptr<T>();
    const C* c = cos.data_ptr<C>();
    const C* s = sin.data_ptr<C>();
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(std::is_same_v<T, float> && std::is_same_v<C, float> ? 0 : 3 * dim);
      for (int64_t t = begin; t < end; ++t) {
        if constexpr (std::is_same_v<T, float> && std::is_same_v<C, float>) {
          const float* ct = c + pos[t] * half;
          const float* st = s + pos[t] * half;
          for (int64_t h = 0; h < heads; ++h) {
            float* x1 = base + t * stride + h * dim;
            float* x2 = x1 + half;
            for (int64_t d = 0; d < half; ++d) {
              const float a = x1[d], b = x2[d];
              x1[d] = a * ct[d] - b * st[d];
              x2[d] = b * ct[d] + a * st[d];
            }
          }
        } else {
          float* ct = buf.data() + dim;  // widened cos | sin of this position
          float* st = ct + half;
          load_row(c + pos[t] * half, ct, half);
          load_row(s + pos[t] * half, st, half);
          for (int64_t h = 0; h < heads; ++h) {
            T* head = base + t * stride + h * dim;
            float* x1 = buf.data();
            float* x2 = x1 + half;
            load_row(head, x1, dim);
            for (int64_t d = 0; d < half; ++d) {
              const float a = x1[d], b = x2[d];
              x1[d] = a * ct[d] - b * st[d];
              x2[d] = b * ct[d] + a * st[d];
            }
            store_row(x1, head, dim);
          }
        }
      }
    });
  });
}

// reshape-and-cache: the new tokens' keys and values [T, Hkv, D] copied into their slots of kv_cache
// [2, NB, BS, Hkv, D] (slot = block * BS + offset), one row copy each. Same dtype as the cache; rows may be
// strided (slices of the fused QKV projection) as long as each token's Hkv x D values are contiguous. What
// two index_copy_ calls did in 25 us (128 tokens, SmolLM2's rows) per layer, in about 1.
void write_kv_cache(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& kv_cache,
                    const torch::Tensor& slots) {
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && kv_cache.device().is_cpu() &&
                  slots.device().is_cpu(), "write_kv_cache: CPU tensors only");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "write_kv_cache: a contiguous [2, blocks, block_size, kv_heads, head_dim] cache");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "write_kv_cache: keys and values must have the cache's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "write_kv_cache: int64 slots");
  const int64_t tokens = slots.size(0), heads = kv_cache.size(3), head_dim = kv_cache.size(4);
  for (const torch::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(1) == heads && t->size(2) == head_dim,
                "write_kv_cache: keys and values must be [tokens, kv_heads, head_dim] with one slot per token");
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == head_dim,
                "write_kv_cache: each token's kv_heads x head_dim values must be contiguous");
  }
  const int64_t n_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < tokens; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < n_slots, "write_kv_cache: slot ", slot[i], " out of range [0, ", n_slots, ")");
  }
  const int64_t elem = kv_cache.element_size(), row = heads * head_dim * elem;
  auto* keys = static_cast<char*>(kv_cache.data_ptr());
  char* values = keys + n_slots * row;
  const auto* k = static_cast<const char*>(key.data_ptr());
  const auto* v = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * elem, v_stride = value.stride(0) * elem;
  for (int64_t i = 0; i < tokens; ++i) {
    std::memcpy(keys + slot[i] * row, k + i * k_stride, row);
    std::memcpy(values + slot[i] * row, v + i * v_stride, row);
  }
}

// Index of the largest value of each row of x [N, V] (float32 or bfloat16, rows may be strided, e.g. logits trimmed to
// the vocabulary): torch.argmax(x, -1)'s answer, the first maximum, and the first NaN in a row that has one.
// torch's CPU argmax compares one element at a time (4.7 ms for 128 x 49152 logits here, against 0.5 ms for
// a sum over them); this is a vector compare-and-blend over 4 x 8 lanes, rows split across threads.
// bfloat16 rows are compared as the float32 values they widen to, exactly, so a bfloat16 lm_head's logits
// need no float32 copy for greedy rows (2 ms of a 128-sequence step: 25 MB written and read again).
template <typename T>
void argmax_rows_of(const T* src, int64_t rows, int64_t n, int64_t stride, int64_t* dst) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = src + r * stride;
      int64_t best = 0;
      float best_v = to_float(row[0]);
      int64_t i = 0;
      bool nan = false;
#ifdef SLUICE_AVX2
      if (n >= 32) {
        // Four independent (max, index) pairs, each over every fourth vector; a strict > keeps the first
        // index of a maximum within a lane, the lanes are merged by (value, lowest index) below.
        __m256 m0 = load8(row), m1 = load8(row + 8);
        __m256 m2 = load8(row + 16), m3 = load8(row + 24);
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i i0 = lane, i1 = _mm256_add_epi32(lane, _mm256_set1_epi32(8));
        __m256i i2 = _mm256_add_epi32(lane, _mm256_set1_epi32(16)), i3 = _mm256_add_epi32(lane, _mm256_set1_epi32(24));
        __m256 unord = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(m0, m0, _CMP_UNORD_Q), _mm256_cmp_ps(m1, m1, _CMP_UNORD_Q)),
                                    _mm256_or_ps(_mm256_cmp_ps(m2, m2, _CMP_UNORD_Q), _mm256_cmp_ps(m3, m3, _CMP_UNORD_Q)));
        for (i = 32; i + 32 <= n; i += 32) {
          const __m256i base = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int32_t>(i)));
          const __m256 v0 = load8(row + i), v1 = load8(row + i + 8);
          const __m256 v2 = load8(row + i + 16), v3 = load8(row + i + 24);
          const __m256 g0 = _mm256_cmp_ps(v0, m0, _CMP_GT_OQ), g1 = _mm256_cmp_ps(v1, m1, _CMP_GT_OQ);
          const __m256 g2 = _mm256_cmp_ps(v2, m2, _CMP_GT_OQ), g3 = _mm256_cmp_ps(v3, m3, _CMP_GT_OQ);
          m0 = _mm256_blendv_ps(m0, v0, g0);
          m1 = _mm256_blendv_ps(m1, v1, g1);
          m2 = _mm256_blendv_ps(m2, v2, g2);
          m3 = _mm256_blendv_ps(m3, v3, g3);
          i0 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(i0), _mm256_castsi256_ps(base), g0));
          i1 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(i1),
                                                    _mm256_castsi256_ps(_mm256_add_epi32(base, _mm256_set1_epi32(8))), g1));
          i2 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(i2),
                                                    _mm256_castsi256_ps(_mm256_add_epi32(base, _mm256_set1_epi32(16))), g2));
          i3 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(i3),
                                                    _mm256_castsi256_ps(_mm256_add_epi32(base, _mm256_set1_epi32(24))), g3));
          unord = _mm256_or_ps(unord, _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q),
                                                                  _mm256_cmp_ps(v1, v1, _CMP_UNORD_Q)),
                                                     _mm256_or_ps(_mm256_cmp_ps(v2, v2, _CMP_UNORD_Q),
                                                                  _mm256_cmp_ps(v3, v3, _CMP_UNORD_Q))));
        }
        nan = _mm256_movemask_ps(unord) != 0;
        float vals[32];
        int32_t idx[32];
        _mm256_storeu_ps(vals, m0);
        _mm256_storeu_ps(vals + 8, m1);
        _mm256_storeu_ps(vals + 16, m2);
        _mm256_storeu_ps(vals + 24, m3);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx), i0);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx + 8), i1);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx + 16), i2);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx + 24), i3);
        best_v = vals[0];
        best = idx[0];
        for (int k = 1; k < 32; ++k) {
          if (vals[k] > best_v || (vals[k] == best_v && idx[k] < best)) {
            best_v = vals[k];
            best = idx[k];
          }
        }
      }
#endif
      for (; i < n; ++i) {
        const float v = to_float(row[i]);
        if (v != v) nan = true;
        if (v > best_v) {
          best_v = v;
          best = i;
        }
      }
      if (nan || best_v != best_v) {  // torch counts NaN as the maximum: the first NaN wins
        for (int64_t k = 0; k < n; ++k) {
          if (to_float(row[k]) != to_float(row[k])) {
            best = k;
            break;
          }
        }
      }
      dst[r] = best;
    }
  });
}

torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.stride(1) == 1,
              "argmax_rows: float32 or bfloat16 [N, V] with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  TORCH_CHECK(n > 0 && n < (int64_t{1} << 31), "argmax_rows: rows of 1 to 2^31 - 1 values");
  auto out = torch::empty({rows}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat) {
    argmax_rows_of(x.data_ptr<float>(), rows, n, stride, out.data_ptr<int64_t>());
  } else {
    argmax_rows_of(x.data_ptr<at::BFloat16>(), rows, n, stride, out.data_ptr<int64_t>());
  }
  return out;
}

// quant_linear.cpp
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                           const torch::Tensor& mins, const std::string& format);
// amx_linear.cpp
bool has_amx_linear();
torch::Tensor amx_pack_linear(const torch::Tensor& weight);
torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias);
// int8_ops.cpp
std::tuple<torch::Tensor, torch::Tensor> int8_quantize_rows(const torch::Tensor& x,
                                                            const c10::optional<torch::Tensor>& smooth,
                                                            bool zero_point_128);
torch::Tensor int8_scale_rows(const torch::Tensor& acc, const torch::Tensor& x_scale, const torch::Tensor& w_scale,
                              const c10::optional<torch::Tensor>& bias, at::ScalarType dtype);
torch::Tensor w8a8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& w_scale,
                          const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& smooth,
                          const torch::Tensor& ones, const torch::Tensor& zeros);
std::string int8_isa();
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, int64_t group, const at::Tensor& sz);
std::string int4_gemv_isa();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released while a kernel runs (arguments are converted before, results after): the
  // engine's gRPC event loop shares the process with the thread that runs the model.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("paged_decode_attention", &paged_decode_attention, release(), py::arg("query"), py::arg("kv_cache"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"), py::arg("first_positions") = py::none(),
        "Paged decode attention over a [2, blocks, block_size, kv_heads, head_dim] KV cache (CPU); a sliding "
        "window's first key per sequence optional");
  m.def("paged_prefill_attention", &paged_prefill_attention, release(),
        "Causal prefill attention over a bfloat16 [2, blocks, block_size, kv_heads, head_dim] KV cache (CPU, AMX)");
  m.def("bf16_prefill_attention", &bf16_prefill_attention, release(),
        "paged_prefill_attention on AVX512-BF16 without AMX: causal prefill attention over the paged cache");
  m.def("has_bf16_attention", &has_bf16_attention, "Whether bf16_prefill_attention runs here (AVX512-BF16 build and CPU)");
  m.def("has_amx_attention", &has_amx_attention, "Whether bfloat16 decode attention can use AMX tiles here");
  m.def("set_amx_attention", &set_amx_attention,
        "Allow (default) or forbid AMX in bfloat16 decode attention; returns the previous setting");
  m.def("rms_norm", &rms_norm, release(), "RMSNorm of each row (float32 or bfloat16, CPU)");
  m.def("add_rms_norm", &add_rms_norm, release(), "residual += x in place, then RMSNorm(residual) (float32 or bfloat16, CPU)");
  m.def("silu_and_mul", &silu_and_mul, release(), "silu(gate) * up of a [T, 2I] gate|up tensor (float32 or bfloat16, CPU)");
  m.def("rotary_", &rotary_, release(), "GPT-NeoX rotary embedding in place (float32 or bfloat16, CPU)");
  m.def("write_kv_cache", &write_kv_cache, release(),
        "Copy keys and values [T, Hkv, D] into their slots of a [2, blocks, block_size, Hkv, D] cache (CPU)");
  m.def("argmax_rows", &argmax_rows, release(), "torch.argmax(x, -1) of float32 or bfloat16 [N, V] rows (CPU)");
  m.def("has_amx_linear", &has_amx_linear, "Whether amx_linear runs here (AMX-BF16 build, tiles granted)");
  m.def("amx_pack_linear", &amx_pack_linear, release(), "A bfloat16 [N, K] weight in amx_linear's tile layout");
  m.def("amx_linear", &amx_linear, release(), py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(),
        "x @ W.T (+ bias) for bfloat16 x of a few rows, W packed by amx_pack_linear (CPU, AMX)");
  m.def("quant_linear", &quant_linear, release(),
        "x @ dequant(W).T over llama.cpp-style block-quantized weights ('u4': Q4_0/Q4_1, 's8': Q8_0), float32 CPU");
  m.def("int8_quantize_rows", &int8_quantize_rows, release(), py::arg("x"), py::arg("smooth") = py::none(),
        py::arg("zero_point_128") = true,
        "Per-token symmetric int8 of float32/bfloat16 [M, K] rows: (uint8 q + 128 or int8 q, float32 scales [M])");
  m.def("int8_scale_rows", &int8_scale_rows, release(), py::arg("acc"), py::arg("x_scale"), py::arg("w_scale"),
        py::arg("bias") = py::none(), py::arg("dtype") = at::kFloat,
        "acc [M, N] (int32 sums, as float32 or int32) * x_scale[m] * w_scale[n] (+ bias[n]) as float32/bfloat16");
  m.def("w8a8_linear", &w8a8_linear, release(), py::arg("x"), py::arg("packed"), py::arg("w_scale"),
        py::arg("bias"), py::arg("smooth"), py::arg("ones"), py::arg("zeros"),
        "W8A8 x @ W.T (+ bias): rows quantized per token, oneDNN's int8 GEMM on a qlinear_prepack'd weight, scaled");
  m.def("int4_gemv", &int4_gemv, release(), py::arg("x"), py::arg("packed"), py::arg("group"), py::arg("sz"),
        "x @ W.T for 1-4 float32/bfloat16 rows, W 4-bit as _convert_weight_to_int4pack_for_cpu packs it, sz its table");
  m.def("int4_gemv_isa", &int4_gemv_isa, "int4_gemv's loops in this build: avx512-bf16, avx512 or '' (portable)");
  m.def("int8_isa", &int8_isa, "This CPU's int8 dot-product instructions: amx-int8, avx512-vnni, avx-vnni or ''");
}
