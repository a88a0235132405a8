// Linear layers straight from llama.cpp's block-quantized weights (Q4_0, Q4_1, Q8_0), float32
// activations and accumulation: y = x @ dequant(W).T with nothing rounded that the dequantized
// float32 matmul does not round too, so results match it (and transformers, which dequantizes the
// same file) to float32 precision. Built with cpu_ops.cpp (engine/kernels/__init__.py).
//
// Why: a decode step at small batch is a matrix-vector product per layer, bound by reading the
// weights. The default model's Q4_1 weights take 5 bits each in the file; dequantized to float32
// they take 32, so every token read 6x the bytes the file holds. Larger steps are bound by arithmetic,
// and there a GEMM written for this layout beats oneDNN's float32 one on the dequantized weights too.
//
// Layouts (engine/models/quant.py builds them from GGUF blocks of 32 weights along the input):
//   u4: codes uint8 [N, K/2], per block of 32 the 16 bytes of ggml: element j in the low nibble of
//       byte j, element j+16 in its high nibble; w = scale * code + min   (Q4_1; Q4_0: min = -8 scale)
//   s8: codes int8  [N, K];   w = scale * code                           (Q8_0)
//   scales, mins: float16 [N, K/32], as in the file
//
// Up to 8 rows of x, each block's codes are unpacked into registers and multiplied there, with the
// scale applied per block and the offset as min * (sum of x over the block). More rows: x is packed
// k-major in blocks of 6 rows, each panel of 16 weight rows is expanded to float32 k-major in cache,
// and a 6 x 16 register block (BLIS's shape for AVX2: 12 accumulators) multiplies them; past 2 MB of
// packed x (prefill), in chunks of rows that fit L2, each thread reusing its expanded panels. Below that,
// threads take the output columns in pieces from a shared counter (dynamic_for).
#include <torch/extension.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SLUICE_QUANT_AVX2 1
#endif
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // weights per scale, as in ggml's Q4_0 / Q4_1 / Q8_0
constexpr int64_t kSmallRows = 8;  // up to this many rows of x: the fused kernel

inline float half_to_float(uint16_t bits) {
#ifdef SLUICE_QUANT_AVX2
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// f(begin, end) over [0, n) in pieces of `grain`, which torch's threads take from a shared counter as they
// finish the last, instead of each running an equal share fixed in advance. These cores are shared with the
// engine's event loop, the tokenizer service and the gateway: a thread the OS preempts for them now leaves its
// pieces to the other threads, where a fixed share made the whole parallel region wait for it.
template <typename F>
void dynamic_for(int64_t n, int64_t grain, const F& f) {
  const int64_t pieces = (n + grain - 1) / grain;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), pieces);
  if (threads <= 1) {
    f(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t p = next.fetch_add(1, std::memory_order_relaxed); p < pieces;
         p = next.fetch_add(1, std::memory_order_relaxed)) {
      f(p * grain, std::min(n, (p + 1) * grain));
    }
  });
}

// A grain giving each thread about 16 pieces of [0, n), a multiple of `unit`.
inline int64_t grain_for(int64_t n, int64_t unit) {
  const int64_t per = (n + 16 * at::get_num_threads() - 1) / (16 * at::get_num_threads());
  return std::max<int64_t>(1, (per + unit - 1) / unit) * unit;
}

// Expands one row of K weights into `out` (float32, K values).
void expand_u4(const uint8_t* codes, const uint16_t* scales, const uint16_t* mins, int64_t k, float* out) {
  for (int64_t b = 0; b < k / kBlock; ++b, codes += kBlock / 2, out += kBlock) {
    const float d = half_to_float(scales[b]), m = half_to_float(mins[b]);
#ifdef SLUICE_QUANT_AVX2
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    const auto put = [&](float* dst, __m128i bytes) {
      _mm256_storeu_ps(dst, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), vd, vm));
    };
    put(out, lo);
    put(out + 8, _mm_srli_si128(lo, 8));
    put(out + 16, hi);
    put(out + 24, _mm_srli_si128(hi, 8));
#else
    for (int64_t j = 0; j < kBlock / 2; ++j) {
      out[j] = d * static_cast<float>(codes[j] & 0x0F) + m;
      out[j + kBlock / 2] = d * static_cast<float>(codes[j] >> 4) + m;
    }
#endif
  }
}

void expand_s8(const int8_t* codes, const uint16_t* scales, int64_t k, float* out) {
  for (int64_t b = 0; b < k / kBlock; ++b, codes += kBlock, out += kBlock) {
    const float d = half_to_float(scales[b]);
#ifdef SLUICE_QUANT_AVX2
    const __m256 vd = _mm256_set1_ps(d);
    for (int64_t j = 0; j < kBlock; j += 8) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j));
      _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), vd));
    }
#else
    for (int64_t j = 0; j < kBlock; ++j) out[j] = d * static_cast<float>(codes[j]);
#endif
  }
}

#ifdef SLUICE_QUANT_AVX2
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

// The fused kernel for M <= kSmallRows rows of x and weight rows [begin, end): out[m, n] =
// sum_b d_b * (q_b . x_m,b) + min_b * sum(x_m,b). `block_sums` [M, K/32] holds sum(x_m,b) (u4 only).
template <int M, bool U4>
void small_rows(const float* x, int64_t ldx, const float* block_sums, const uint8_t* codes, int64_t code_row,
                const uint16_t* scales, const uint16_t* mins, int64_t k, int64_t begin, int64_t end, float* out,
                int64_t ldo) {
  const int64_t blocks = k / kBlock;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* c = codes + n * code_row;
    const uint16_t* sc = scales + n * blocks;
    const uint16_t* mn = U4 ? mins + n * blocks : nullptr;
    float offset[M] = {};
#ifdef SLUICE_QUANT_AVX2
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; ++b) {
      __m256 q0, q1, q2, q3;
      if constexpr (U4) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b * kBlock / 2));
        const __m128i lo = _mm_and_si128(raw, mask);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
      } else {
        const int8_t* cb = reinterpret_cast<const int8_t*>(c) + b * kBlock;
        q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cb))));
        q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cb + 8))));
        q2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cb + 16))));
        q3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cb + 24))));
      }
      const __m256 d = _mm256_set1_ps(half_to_float(sc[b]));
      const float mv = U4 ? half_to_float(mn[b]) : 0.f;
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * ldx + b * kBlock;
        __m256 t = _mm256_mul_ps(q0, _mm256_loadu_ps(xb));
        t = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xb + 8), t);
        t = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xb + 16), t);
        t = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xb + 24), t);
        acc[m] = _mm256_fmadd_ps(t, d, acc[m]);
        if constexpr (U4) offset[m] += mv * block_sums[m * blocks + b];
      }
    }
    for (int m = 0; m < M; ++m) out[m * ldo + n] = hsum(acc[m]) + offset[m];
#else
    float acc[M] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      float q[kBlock];
      for (int64_t j = 0; j < kBlock / 2 && U4; ++j) {
        q[j] = static_cast<float>(c[b * kBlock / 2 + j] & 0x0F);
        q[j + kBlock / 2] = static_cast<float>(c[b * kBlock / 2 + j] >> 4);
      }
      for (int64_t j = 0; j < kBlock && !U4; ++j) q[j] = static_cast<float>(reinterpret_cast<const int8_t*>(c)[b * kBlock + j]);
      const float d = half_to_float(sc[b]);
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * ldx + b * kBlock;
        float t = 0.f;
        for (int64_t j = 0; j < kBlock; ++j) t += q[j] * xb[j];
        acc[m] += d * t;
        if constexpr (U4) offset[m] += half_to_float(mn[b]) * block_sums[m * blocks + b];
      }
    }
    for (int m = 0; m < M; ++m) out[m * ldo + n] = acc[m] + offset[m];
#endif
  }
}

template <bool U4>
void small_dispatch(int64_t m_rows, const float* x, int64_t ldx, const float* block_sums, const uint8_t* codes,
                    int64_t code_row, const uint16_t* scales, const uint16_t* mins, int64_t k, int64_t begin,
                    int64_t end, float* out, int64_t ldo) {
  switch (m_rows) {
    case 1: small_rows<1, U4>(x, ldx, block_sums, codes, code_row, scales, mins, k, begin, end, out, ldo); break;
    case 2: small_rows<2, U4>(x, ldx, block_sums, codes, code_row, scales, mins, k, begin, end, out, ldo); break;
    case 3: small_rows<3, U4>(x, ldx, block_sums, codes, code_row, scales, mins, k, begin, end, out, ldo); break;
    case 4: small_rows<4, U4>(x, ldx, block_sums, codes, code_row, scales, mins, k, begin, end, out, ldo); break;
    case 5: small_rows<5, U4>(x, ldx, block_sums, codes, code_row, scales, mins, k, begin, end, out, ldo); break;
    case 6: small_rows<6, U4>(x, ldx, block_sums, codes, code_row, scales, mins, k, begin, end, out, ldo); break;
    case 7: small_rows<7, U4>(x, ldx, block_sums, codes, code_row, scales, mins, k, begin, end, out, ldo); break;
    default: small_rows<8, U4>(x, ldx, block_sums, codes, code_row, scales, mins, k, begin, end, out, ldo); break;
  }
}

// More rows of x: a GEMM over weights expanded to float32 one panel at a time, laid out as BLIS does for
// AVX2 (a 6 x 16 register block: 12 accumulators, two weight vectors and a broadcast per k).
//   x is packed once per call into blocks of kRows rows, k-major: xp[block][k][kRows] (rows past M zero);
//   each panel of kPanel weight rows is expanded k-major: wp[k][kPanel] (rows past N zero).
constexpr int64_t kRows = 6;
constexpr int64_t kPanel = 16;
constexpr int64_t kChunkAbove = 2 << 20;          // packed x larger than this goes in chunks (L3: 16 MB here)
constexpr int64_t kChunkBytes = 384 * 1024;       // packed rows of x per chunk: L2 is 512 KB per core here
constexpr int64_t kPanelCacheBytes = 8 << 20;     // a thread's expanded panels kept across chunks

#ifdef SLUICE_QUANT_AVX2
// The 8 x 16 byte matrix r[0..7] transposed: out[i] holds byte 2i of every row in its low 8 bytes (row 0
// first) and byte 2i + 1 in its high 8 bytes.
inline void transpose_8x16_bytes(const __m128i r[8], __m128i out[8]) {
  const __m128i a0 = _mm_unpacklo_epi8(r[0], r[1]), a1 = _mm_unpackhi_epi8(r[0], r[1]);
  const __m128i a2 = _mm_unpacklo_epi8(r[2], r[3]), a3 = _mm_unpackhi_epi8(r[2], r[3]);
  const __m128i a4 = _mm_unpacklo_epi8(r[4], r[5]), a5 = _mm_unpackhi_epi8(r[4], r[5]);
  const __m128i a6 = _mm_unpacklo_epi8(r[6], r[7]), a7 = _mm_unpackhi_epi8(r[6], r[7]);
  const __m128i b0 = _mm_unpacklo_epi16(a0, a2), b1 = _mm_unpackhi_epi16(a0, a2);
  const __m128i b2 = _mm_unpacklo_epi16(a1, a3), b3 = _mm_unpackhi_epi16(a1, a3);
  const __m128i b4 = _mm_unpacklo_epi16(a4, a6), b5 = _mm_unpackhi_epi16(a4, a6);
  const __m128i b6 = _mm_unpacklo_epi16(a5, a7), b7 = _mm_unpackhi_epi16(a5, a7);
  out[0] = _mm_unpacklo_epi32(b0, b4); out[1] = _mm_unpackhi_epi32(b0, b4);
  out[2] = _mm_unpacklo_epi32(b1, b5); out[3] = _mm_unpackhi_epi32(b1, b5);
  out[4] = _mm_unpacklo_epi32(b2, b6); out[5] = _mm_unpackhi_epi32(b2, b6);
  out[6] = _mm_unpacklo_epi32(b3, b7); out[7] = _mm_unpackhi_epi32(b3, b7);
}

// The float16 values at p[0], p[stride], ..., p[7 stride] as 8 floats.
inline __m256 gather_halves(const uint16_t* p, int64_t stride) {
  return _mm256_cvtph_ps(_mm_setr_epi16(p[0], p[stride], p[2 * stride], p[3 * stride], p[4 * stride],
                                        p[5 * stride], p[6 * stride], p[7 * stride]));
}

// expand_panel for a full panel, straight from the codes to k-major floats: each block's codes of 8 rows
// are transposed as bytes (a 16th of the floats' shuffles) and converted there, with the rows' scales
// (and offsets) as vectors.
void expand_panel_direct(bool u4, const uint8_t* codes, int64_t code_row, const uint16_t* scales,
                         const uint16_t* mins, int64_t k, int64_t row0, float* wp) {
  const int64_t blocks = k / kBlock;
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t half = 0; half < kPanel; half += 8) {
    const int64_t row = row0 + half;
    for (int64_t b = 0; b < blocks; ++b) {
      const __m256 d = gather_halves(scales + row * blocks + b, blocks);
      float* dst = wp + b * kBlock * kPanel + half;
      const auto put = [&](int64_t kk, __m128i bytes, __m256 value_min, bool is_signed) {
        const __m256i ints = is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
        const __m256 f = _mm256_cvtepi32_ps(ints);
        _mm256_storeu_ps(dst + kk * kPanel, u4 ? _mm256_fmadd_ps(f, d, value_min) : _mm256_mul_ps(f, d));
      };
      __m128i r[8], t[8];
      if (u4) {
        const __m256 m = gather_halves(mins + row * blocks + b, blocks);
        for (int i = 0; i < 8; ++i) {
          r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (row + i) * code_row + b * kBlock / 2));
        }
        transpose_8x16_bytes(r, t);
        for (int i = 0; i < 8; ++i) {  // byte j: element j in the low nibble, j + 16 in the high one
          const __m128i lo = _mm_and_si128(t[i], mask);
          const __m128i hi = _mm_and_si128(_mm_srli_epi16(t[i], 4), mask);
          put(2 * i, lo, m, false);
          put(2 * i + 1, _mm_unpackhi_epi64(lo, lo), m, false);
          put(2 * i + 16, hi, m, false);
          put(2 * i + 17, _mm_unpackhi_epi64(hi, hi), m, false);
        }
      } else {
        for (int64_t part = 0; part < kBlock; part += 16) {
          for (int i = 0; i < 8; ++i) {
            r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (row + i) * code_row + b * kBlock + part));
          }
          transpose_8x16_bytes(r, t);
          for (int i = 0; i < 8; ++i) {
            put(part + 2 * i, t[i], d, true);
            put(part + 2 * i + 1, _mm_unpackhi_epi64(t[i], t[i]), d, true);
          }
        }
      }
    }
  }
}
#endif

// Expands weight rows [row0, row0 + kPanel) of the layer into wp [k][kPanel]; `rows` (row-major
// kPanel x k) is scratch.
void expand_panel(bool u4, const uint8_t* codes, int64_t code_row, const uint16_t* scales, const uint16_t* mins,
                  int64_t n, int64_t k, int64_t row0, float* rows, float* wp) {
  const int64_t blocks = k / kBlock;
  for (int64_t r = 0; r < kPanel; ++r) {
    const int64_t row = row0 + r;
    float* dst = rows + r * k;
    if (row >= n) {
      std::fill(dst, dst + k, 0.f);
    } else if (u4) {
      expand_u4(codes + row * code_row, scales + row * blocks, mins + row * blocks, k, dst);
    } else {
      expand_s8(reinterpret_cast<const int8_t*>(codes) + row * code_row, scales + row * blocks, k, dst);
    }
  }
#ifdef SLUICE_QUANT_AVX2
  for (int64_t half = 0; half < kPanel; half += 8) {  // 8 x 8 transposes
    for (int64_t i = 0; i < k; i += 8) {
      const float* s = rows + half * k + i;
      __m256 r0 = _mm256_loadu_ps(s), r1 = _mm256_loadu_ps(s + k), r2 = _mm256_loadu_ps(s + 2 * k);
      __m256 r3 = _mm256_loadu_ps(s + 3 * k), r4 = _mm256_loadu_ps(s + 4 * k), r5 = _mm256_loadu_ps(s + 5 * k);
      __m256 r6 = _mm256_loadu_ps(s + 6 * k), r7 = _mm256_loadu_ps(s + 7 * k);
      const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
      const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
      const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
      const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4v = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      float* d = wp + i * kPanel + half;
      _mm256_storeu_ps(d + 0 * kPanel, _mm256_permute2f128_ps(u0, u4v, 0x20));
      _mm256_storeu_ps(d + 1 * kPanel, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(d + 2 * kPanel, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(d + 3 * kPanel, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(d + 4 * kPanel, _mm256_permute2f128_ps(u0, u4v, 0x31));
      _mm256_storeu_ps(d + 5 * kPanel, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(d + 6 * kPanel, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(d + 7 * kPanel, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
  }
#else
  for (int64_t r = 0; r < kPanel; ++r) {
    for (int64_t i = 0; i < k; ++i) wp[i * kPanel + r] = rows[r * k + i];
  }
#endif
}

// out[r, 0..cols) = xp_block[:, r] . wp for the first R rows of one packed block of x; out rows `ldo` apart.
#ifdef SLUICE_QUANT_AVX2
inline void store_row(float* out, __m256 lo, __m256 hi, int64_t cols) {
  if (cols == kPanel) {
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
    return;
  }
  alignas(32) float tail[kPanel];
  _mm256_store_ps(tail, lo);
  _mm256_store_ps(tail + 8, hi);
  std::copy(tail, tail + cols, out);
}
#endif

// out[r, 0..cols) = xp_block[:, r] . wp for the first R rows of one packed block of x; out rows `ldo` apart.
// The accumulators are named variables, not an array: g++ kept an array's copy on the stack, stored
// every iteration.
//
// With 4 or more rows there are 8 or more independent accumulators, enough to hide the FMA latency (5
// cycles, 2 per cycle). With 1 to 3 rows (the last block of x when M % 6 is 1 to 3: 32 and 128 rows
// leave 2) each accumulator would wait on its previous FMA, and a block of 2 rows cost 80 % of a block of
// 6; so even and odd k go to two sets of accumulators, summed at the end (K is a multiple of 32).
template <int R>
void panel_product(const float* xb, const float* wp, int64_t k, float* out, int64_t ldo, int64_t cols) {
#ifdef SLUICE_QUANT_AVX2
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  if constexpr (R <= 3) {
    __m256 d00 = c00, d01 = c00, d10 = c00, d11 = c00, d20 = c00, d21 = c00;
    for (int64_t i = 0; i < k; i += 2, xb += 2 * kRows, wp += 2 * kPanel) {
      __m256 b0 = _mm256_loadu_ps(wp), b1 = _mm256_loadu_ps(wp + 8);
#define SLUICE_ROW2(r, acc, off)                             \
  if constexpr (R > r) {                                     \
    const __m256 a = _mm256_broadcast_ss(xb + (off) + r);    \
    acc##r##0 = _mm256_fmadd_ps(a, b0, acc##r##0);           \
    acc##r##1 = _mm256_fmadd_ps(a, b1, acc##r##1);           \
  }
      SLUICE_ROW2(0, c, 0) SLUICE_ROW2(1, c, 0) SLUICE_ROW2(2, c, 0)
      b0 = _mm256_loadu_ps(wp + kPanel), b1 = _mm256_loadu_ps(wp + kPanel + 8);
      SLUICE_ROW2(0, d, kRows) SLUICE_ROW2(1, d, kRows) SLUICE_ROW2(2, d, kRows)
#undef SLUICE_ROW2
    }
    store_row(out, _mm256_add_ps(c00, d00), _mm256_add_ps(c01, d01), cols);
    if constexpr (R > 1) store_row(out + ldo, _mm256_add_ps(c10, d10), _mm256_add_ps(c11, d11), cols);
    if constexpr (R > 2) store_row(out + 2 * ldo, _mm256_add_ps(c20, d20), _mm256_add_ps(c21, d21), cols);
    return;
  }
  for (int64_t i = 0; i < k; ++i, xb += kRows, wp += kPanel) {
    const __m256 b0 = _mm256_loadu_ps(wp), b1 = _mm256_loadu_ps(wp + 8);
#define SLUICE_ROW(r)                                  \
  if constexpr (R > r) {                               \
    const __m256 a = _mm256_broadcast_ss(xb + r);      \
    c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);         \
    c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);         \
  }
    SLUICE_ROW(0) SLUICE_ROW(1) SLUICE_ROW(2) SLUICE_ROW(3) SLUICE_ROW(4) SLUICE_ROW(5)
#undef SLUICE_ROW
  }
  store_row(out, c00, c01, cols);
  if constexpr (R > 1) store_row(out + ldo, c10, c11, cols);
  if constexpr (R > 2) store_row(out + 2 * ldo, c20, c21, cols);
  if constexpr (R > 3) store_row(out + 3 * ldo, c30, c31, cols);
  if constexpr (R > 4) store_row(out + 4 * ldo, c40, c41, cols);
  if constexpr (R > 5) store_row(out + 5 * ldo, c50, c51, cols);
#else
  float acc[R][kPanel] = {};
  for (int64_t i = 0; i < k; ++i, xb += kRows, wp += kPanel) {
    for (int r = 0; r < R; ++r) {
      for (int64_t j = 0; j < kPanel; ++j) acc[r][j] += xb[r] * wp[j];
    }
  }
  for (int r = 0; r < R; ++r) std::copy(acc[r], acc[r] + cols, out + r * ldo);
#endif
}

void panel_rows(int64_t rows, const float* xb, const float* wp, int64_t k, float* out, int64_t ldo, int64_t cols) {
  switch (rows) {
    case 1: panel_product<1>(xb, wp, k, out, ldo, cols); break;
    case 2: panel_product<2>(xb, wp, k, out, ldo, cols); break;
    case 3: panel_product<3>(xb, wp, k, out, ldo, cols); break;
    case 4: panel_product<4>(xb, wp, k, out, ldo, cols); break;
    case 5: panel_product<5>(xb, wp, k, out, ldo, cols); break;
    default: panel_product<6>(xb, wp, k, out, ldo, cols); break;
  }
}

// Buffers that live as long as their thread (the caller's, and at::parallel_for's fixed pool of
// workers), so a call does not allocate, fault in and zero its scratch again: packed x for 32 rows of
// the down projection is 221 KB, over malloc's mmap threshold. They keep their largest size: packed x of
// the largest step (12.6 MB for 2048 rows of the down projection) and up to kPanelCacheBytes of panels.
thread_local std::vector<float> tl_packed, tl_rows, tl_panels;

float* grow(std::vector<float>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

// Rows of x past the block's `rows` are never read (panel_product<R> reads the first R).
void pack_rows(const float* x, int64_t ldx, int64_t rows, int64_t k, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = x + r * ldx;
    for (int64_t i = 0; i < k; ++i) dst[i * kRows + r] = src[i];
  }
}

}  // namespace

// x [M, K] float32 (rows contiguous) -> [M, N] float32, N = codes.size(0). `mins` is ignored for s8
// (pass an empty tensor).
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                           const torch::Tensor& mins, const std::string& format) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "quant_linear: x must be a float32 CPU [M, K] tensor with contiguous rows");
  const int64_t m_rows = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(k % kBlock == 0, "quant_linear: K must be a multiple of ", kBlock, ", got ", k);
  TORCH_CHECK(codes.is_contiguous() && codes.dim() == 2, "quant_linear: codes must be contiguous [N, ...]");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kHalf && scales.dim() == 2 &&
                  scales.size(0) == n && scales.size(1) == k / kBlock,
              "quant_linear: scales must be float16 [N, K/32]");
  const bool u4 = format == "u4";
  TORCH_CHECK(u4 || format == "s8", "quant_linear: format must be 'u4' or 's8', got '", format, "'");
  if (u4) {
    TORCH_CHECK(codes.scalar_type() == at::kByte && codes.size(1) == k / 2, "quant_linear: u4 codes must be uint8 [N, K/2]");
    TORCH_CHECK(mins.is_contiguous() && mins.scalar_type() == at::kHalf && mins.sizes() == scales.sizes(),
                "quant_linear: u4 mins must be float16 [N, K/32]");
  } else {
    TORCH_CHECK(codes.scalar_type() == at::kChar && codes.size(1) == k, "quant_linear: s8 codes must be int8 [N, K]");
  }
  auto out = torch::empty({m_rows, n}, x.options());
  if (m_rows == 0 || n == 0) return out;
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  const auto* mp = u4 ? reinterpret_cast<const uint16_t*>(mins.data_ptr()) : nullptr;
  const auto* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const int64_t code_row = codes.size(1), blocks = k / kBlock;
  float* op = out.data_ptr<float>();

  if (m_rows <= kSmallRows) {
    std::vector<float> block_sums(u4 ? m_rows * blocks : 0);
    for (int64_t i = 0; u4 && i < m_rows * blocks; ++i) {
      const float* xb = xp + (i / blocks) * ldx + (i % blocks) * kBlock;
      float s = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) s += xb[j];
      block_sums[i] = s;
    }
    dynamic_for(n, grain_for(n, 16), [&](int64_t begin, int64_t end) {
      if (u4) {
        small_dispatch<true>(m_rows, xp, ldx, block_sums.data(), cp, code_row, sp, mp, k, begin, end, op, n);
      } else {
        small_dispatch<false>(m_rows, xp, ldx, nullptr, cp, code_row, sp, nullptr, k, begin, end, op, n);
      }
    });
    return out;
  }

  // Pack x k-major in blocks of kRows rows, then expand one weight panel at a time and multiply every
  // block of x by it. When packed x outgrows L2, its rows go in chunks that fit there (kChunkBytes), and
  // each thread keeps its panels expanded (up to kPanelCacheBytes) for the next chunks instead of
  // expanding them again: otherwise every panel streams all of x from memory (prefill's 2048 rows of
  // the down projection ran at 0.65x the speed of 32 rows).
  const int64_t row_blocks = (m_rows + kRows - 1) / kRows;
  float* packed = grow(tl_packed, row_blocks * k * kRows);
  at::parallel_for(0, row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) pack_rows(xp + b * kRows * ldx, ldx, std::min(kRows, m_rows - b * kRows), k,
                                                    packed + b * k * kRows);
  });
  const int64_t panels = (n + kPanel - 1) / kPanel, panel_floats = k * kPanel;
  const int64_t block_bytes = k * kRows * static_cast<int64_t>(sizeof(float));
  const int64_t chunk_blocks = row_blocks * block_bytes > kChunkAbove ? std::max<int64_t>(1, kChunkBytes / block_bytes) : row_blocks;
  const bool chunked = chunk_blocks < row_blocks;
  auto panel_range = [&](int64_t begin, int64_t end) {
    const bool cache = chunked && (end - begin) * panel_floats * static_cast<int64_t>(sizeof(float)) <= kPanelCacheBytes;
    float* rows = grow(tl_rows, kPanel * k);
    float* wps = grow(tl_panels, (cache ? end - begin : 1) * panel_floats);
    for (int64_t c0 = 0; c0 < row_blocks; c0 += chunk_blocks) {
      const int64_t c1 = std::min(row_blocks, c0 + chunk_blocks);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t row0 = p * kPanel, cols = std::min(kPanel, n - row0);
        float* wp = cache ? wps + (p - begin) * panel_floats : wps;
        if (c0 == 0 || !cache) {
#ifdef SLUICE_QUANT_AVX2
          if (cols == kPanel) {
            expand_panel_direct(u4, cp, code_row, sp, mp, k, row0, wp);
          } else {
            expand_panel(u4, cp, code_row, sp, mp, n, k, row0, rows, wp);
          }
#else
          expand_panel(u4, cp, code_row, sp, mp, n, k, row0, rows, wp);
#endif
        }
        for (int64_t b = c0; b < c1; ++b) {
          panel_rows(std::min(kRows, m_rows - b * kRows), packed + b * k * kRows, wp, k, op + b * kRows * n + row0, n,
                     cols);
        }
      }
    }
  };
  if (chunked) {
    // Fixed shares: a thread's panels stay expanded across the chunks of x (each piece taken from a counter
    // would read all of x again).
    at::parallel_for(0, panels, 1, panel_range);
  } else {
    dynamic_for(panels, grain_for(panels, 1), panel_range);
  }
  return out;
}
