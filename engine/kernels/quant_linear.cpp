// Linear layers straight from llama.cpp's block-quantized weights (Q4_0, Q4_1, Q8_0), float32
// activations and accumulation: y = x @ dequant(W).T with nothing rounded that the dequantized
// float32 matmul does not round too, so results match it (and transformers, which dequantizes the
// same file) to float32 precision. Built with cpu_ops.cpp (engine/kernels/__init__.py).
//
// Why: a decode step at small batch is a matrix-vector product per layer, bound by reading the
// weights. The default model's Q4_1 weights take 5 bits each in the file; dequantized to float32
// they take 32, so every token read 6x the bytes the file holds. Here each weight row is expanded
// into a float32 tile in L1 and used there for every row of x.
//
// Layouts (engine/models/quant.py builds them from GGUF blocks of 32 weights along the input):
//   u4: codes uint8 [N, K/2], per block of 32 the 16 bytes of ggml: element j in the low nibble of
//       byte j, element j+16 in its high nibble; w = scale * code + min   (Q4_1; Q4_0: min = -8 scale)
//   s8: codes int8  [N, K];   w = scale * code                           (Q8_0)
//   scales, mins: float16 [N, K/32], as in the file
//
// Up to 8 rows of x, each block's codes are unpacked into registers and multiplied there, with the
// scale applied per block and the offset as min * (sum of x over the block); more rows of x expand a
// tile of weight rows to float32 once and run a register-blocked product over it.
#include <torch/extension.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SLUICE_QUANT_AVX2 1
#endif
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // weights per scale, as in ggml's Q4_0 / Q4_1 / Q8_0
constexpr int64_t kTile = 4;    // weight rows expanded together, then used for every row of x
constexpr int64_t kSmallRows = 8;  // up to this many rows of x: the fused kernel

inline float half_to_float(uint16_t bits) {
#ifdef SLUICE_QUANT_AVX2
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
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

// out[m, r] = dot(x[m], w[r]) for `rows` (<= kTile) expanded weight rows w (kTile rows of k floats)
// and every row m of x; out rows are `ldo` apart.
void tile_products(const float* x, int64_t ldx, int64_t m_rows, const float* w, int64_t rows, int64_t k,
                   float* out, int64_t ldo) {
#ifdef SLUICE_QUANT_AVX2
  if (rows == kTile && k % 8 == 0) {
    const float *w0 = w, *w1 = w + k, *w2 = w + 2 * k, *w3 = w + 3 * k;
    int64_t m = 0;
    for (; m + 3 <= m_rows; m += 3) {  // 3 rows of x x 4 weight rows: 12 accumulators, x from memory operands
      const float* xa = x + m * ldx;
      const float* xb = xa + ldx;
      const float* xc = xb + ldx;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
      __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;
      for (int64_t i = 0; i < k; i += 8) {
        const __m256 v0 = _mm256_loadu_ps(w0 + i), v1 = _mm256_loadu_ps(w1 + i);
        const __m256 v2 = _mm256_loadu_ps(w2 + i), v3 = _mm256_loadu_ps(w3 + i);
        __m256 xv = _mm256_loadu_ps(xa + i);
        a0 = _mm256_fmadd_ps(xv, v0, a0); a1 = _mm256_fmadd_ps(xv, v1, a1);
        a2 = _mm256_fmadd_ps(xv, v2, a2); a3 = _mm256_fmadd_ps(xv, v3, a3);
        xv = _mm256_loadu_ps(xb + i);
        b0 = _mm256_fmadd_ps(xv, v0, b0); b1 = _mm256_fmadd_ps(xv, v1, b1);
        b2 = _mm256_fmadd_ps(xv, v2, b2); b3 = _mm256_fmadd_ps(xv, v3, b3);
        xv = _mm256_loadu_ps(xc + i);
        c0 = _mm256_fmadd_ps(xv, v0, c0); c1 = _mm256_fmadd_ps(xv, v1, c1);
        c2 = _mm256_fmadd_ps(xv, v2, c2); c3 = _mm256_fmadd_ps(xv, v3, c3);
      }
      float* oa = out + m * ldo;
      float* ob = oa + ldo;
      float* oc = ob + ldo;
      oa[0] = hsum(a0); oa[1] = hsum(a1); oa[2] = hsum(a2); oa[3] = hsum(a3);
      ob[0] = hsum(b0); ob[1] = hsum(b1); ob[2] = hsum(b2); ob[3] = hsum(b3);
      oc[0] = hsum(c0); oc[1] = hsum(c1); oc[2] = hsum(c2); oc[3] = hsum(c3);
    }
    for (; m + 2 <= m_rows; m += 2) {  // 2 rows of x x 4 weight rows: 8 accumulators
      const float* xa = x + m * ldx;
      const float* xb = xa + ldx;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
      for (int64_t i = 0; i < k; i += 8) {
        const __m256 va = _mm256_loadu_ps(xa + i), vb = _mm256_loadu_ps(xb + i);
        const __m256 v0 = _mm256_loadu_ps(w0 + i), v1 = _mm256_loadu_ps(w1 + i);
        const __m256 v2 = _mm256_loadu_ps(w2 + i), v3 = _mm256_loadu_ps(w3 + i);
        a0 = _mm256_fmadd_ps(va, v0, a0); b0 = _mm256_fmadd_ps(vb, v0, b0);
        a1 = _mm256_fmadd_ps(va, v1, a1); b1 = _mm256_fmadd_ps(vb, v1, b1);
        a2 = _mm256_fmadd_ps(va, v2, a2); b2 = _mm256_fmadd_ps(vb, v2, b2);
        a3 = _mm256_fmadd_ps(va, v3, a3); b3 = _mm256_fmadd_ps(vb, v3, b3);
      }
      float* oa = out + m * ldo;
      float* ob = oa + ldo;
      oa[0] = hsum(a0); oa[1] = hsum(a1); oa[2] = hsum(a2); oa[3] = hsum(a3);
      ob[0] = hsum(b0); ob[1] = hsum(b1); ob[2] = hsum(b2); ob[3] = hsum(b3);
    }
    for (; m < m_rows; ++m) {
      const float* xa = x + m * ldx;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t i = 0; i < k; i += 8) {
        const __m256 va = _mm256_loadu_ps(xa + i);
        a0 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w0 + i), a0);
        a1 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w1 + i), a1);
        a2 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w2 + i), a2);
        a3 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w3 + i), a3);
      }
      float* oa = out + m * ldo;
      oa[0] = hsum(a0); oa[1] = hsum(a1); oa[2] = hsum(a2); oa[3] = hsum(a3);
    }
    return;
  }
#endif
  for (int64_t m = 0; m < m_rows; ++m) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* xm = x + m * ldx;
      const float* wr = w + r * k;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      int64_t i = 0;
      for (; i + 8 <= k; i += 8) {
        for (int64_t j = 0; j < 8; ++j) acc[j] += xm[i + j] * wr[i + j];
      }
      float s = 0.f;
      for (; i < k; ++i) s += xm[i] * wr[i];
      for (int64_t j = 0; j < 8; ++j) s += acc[j];
      out[m * ldo + r] = s;
    }
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
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      if (u4) {
        small_dispatch<true>(m_rows, xp, ldx, block_sums.data(), cp, code_row, sp, mp, k, begin, end, op, n);
      } else {
        small_dispatch<false>(m_rows, xp, ldx, nullptr, cp, code_row, sp, nullptr, k, begin, end, op, n);
      }
    });
    return out;
  }

  const int64_t tiles = (n + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> expanded(kTile * k);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row0 = t * kTile, rows = std::min(kTile, n - row0);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = row0 + r;
        if (u4) {
          expand_u4(cp + row * code_row, sp + row * blocks, mp + row * blocks, k, expanded.data() + r * k);
        } else {
          expand_s8(reinterpret_cast<const int8_t*>(cp) + row * code_row, sp + row * blocks, k,
                    expanded.data() + r * k);
        }
      }
      tile_products(xp, ldx, m_rows, expanded.data(), rows, k, op + row0, n);
    }
  });
  return out;
}
