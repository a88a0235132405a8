// Weight-only 4-bit linears of decode-sized steps (1-4 rows): x @ W.T with W[n, k] = (q - 8) * scale + zero,
// read straight from the weight torch's _convert_weight_to_int4pack_for_cpu packed (the layout
// engine/models/layers/int4_linear.py's dequantize_packed documents) and its [groups, n, 2] scale|zero table, so the
// layer keeps one copy of its codes. Built with cpu_ops.cpp (engine/kernels/__init__.py).
//
// Per group each column sums x * q (codes 0..15 as float32, float32 accumulators); the group then adds
// scale * sum + (zero - 8 * scale) * sum(x over the group): the reference's value up to float32 rounding. The
// AVX-512 path takes a block of 64 columns (one 32-byte run per input feature) into 4 x rows accumulators, with
// FMAs for float32 rows and vdpbf16ps for bfloat16 ones (AVX512-BF16 + VBMI); the portable build runs the same sums
// in scalar loops. Measured against torch's kernel in docs/benchmarks.md ("Decode path: our int4 GEMV"). Threads take contiguous ranges of blocks (at::parallel_for),
// so each streams its share of the weight front to back.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SLUICE_INT4_AVX512 1
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;   // columns per block of the packed layout
constexpr int64_t kHalf = 32;    // bytes per input feature in a full block
constexpr int64_t kMaxRows = 4;
constexpr int64_t kPrefetch = 1024;   // bytes ahead of the codes being read

// Everything one block needs: x widened to float32 [rows, k], per-group sums of x [rows, groups], the table.
template <typename T>
struct Problem {
  const uint8_t* codes;
  const T* sz;          // [groups, n, 2]: scale, zero
  const float* x;       // [rows, k]
  const c10::BFloat16* xb;  // the same rows as they came, when bfloat16 (else nullptr)
  const float* xsum;    // [rows, groups]
  float* out;           // [rows, n]
  int64_t rows, n, k, group, groups;
};

template <typename T>
inline void finish_group(const Problem<T>& p, int64_t gi, int64_t c0, int64_t width, const float* acc, float* tot) {
  const T* sz = p.sz + (gi * p.n + c0) * 2;
  for (int64_t m = 0; m < p.rows; ++m) {
    const float xs = p.xsum[m * p.groups + gi];
    for (int64_t j = 0; j < width; ++j) {
      const float s = static_cast<float>(sz[2 * j]), z = static_cast<float>(sz[2 * j + 1]);
      tot[m * kBlock + j] += s * acc[m * kBlock + j] + (z - 8.0f * s) * xs;
    }
  }
}

// Columns c0..c0 + width of any block, one code at a time: the tail block (width = n % 64, byte j of an input
// feature's run holding columns 2j (low nibble) and 2j + 1) and, in the portable build, the full ones.
template <typename T>
void block_scalar(const Problem<T>& p, int64_t c0, int64_t width, float* tot) {
  const bool full = width == kBlock;
  const int64_t run = full ? kHalf : width / 2;
  const uint8_t* base = p.codes + c0 * p.k / 2;
  float acc[kMaxRows * kBlock];
  for (int64_t gi = 0; gi < p.groups; ++gi) {
    std::fill(acc, acc + kMaxRows * kBlock, 0.0f);
    for (int64_t kk = gi * p.group; kk < (gi + 1) * p.group; ++kk) {
      const uint8_t* r = base + kk * run;
      for (int64_t m = 0; m < p.rows; ++m) {
        const float xv = p.x[m * p.k + kk];
        float* a = acc + m * kBlock;
        if (full) {
          for (int64_t j = 0; j < kHalf; ++j) {
            a[j] += xv * static_cast<float>(r[j] & 0xF);
            a[kHalf + j] += xv * static_cast<float>(r[j] >> 4);
          }
        } else {
          for (int64_t j = 0; j < run; ++j) {
            a[2 * j] += xv * static_cast<float>(r[j] & 0xF);
            a[2 * j + 1] += xv * static_cast<float>(r[j] >> 4);
          }
        }
      }
    }
    finish_group(p, gi, c0, width, acc, tot);
  }
}

#ifdef SLUICE_INT4_AVX512
// Scale and zero - 8 * scale of 16 columns from their interleaved (scale, zero) pairs.
inline void load_sz(const float* sz, __m512& s, __m512& z) {
  const __m512 a = _mm512_loadu_ps(sz), b = _mm512_loadu_ps(sz + 16);
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  s = _mm512_permutex2var_ps(a, even, b);
  z = _mm512_permutex2var_ps(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b);
  z = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, z);
}
inline void load_sz(const c10::BFloat16* sz, __m512& s, __m512& z) {
  const __m512i v = _mm512_loadu_si512(sz);   // lane j: scale (low half), zero (high half) of column j
  s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  z = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  z = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, z);
}

// A full block of 64 columns for R rows: per input feature one 32-byte run, byte j holding column j (low nibble)
// and column 32 + j (high).
template <int R, typename T>
void block_avx512(const Problem<T>& p, int64_t c0, float* tot) {
  const uint8_t* base = p.codes + c0 * p.k / 2;
  const __m512i low = _mm512_set1_epi32(0xF);
  for (int64_t gi = 0; gi < p.groups; ++gi) {
    __m512 acc[R][4];
    for (int m = 0; m < R; ++m)
      for (int i = 0; i < 4; ++i) acc[m][i] = _mm512_setzero_ps();
    const uint8_t* r = base + gi * p.group * kHalf;
    const float* xg = p.x + gi * p.group;
    for (int64_t kk = 0; kk < p.group; ++kk, r += kHalf) {
      if (kk % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(r) + kPrefetch, _MM_HINT_T0);
      const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r)));
      const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 16)));
      const __m512 w[4] = {_mm512_cvtepi32_ps(_mm512_and_si512(b0, low)),
                           _mm512_cvtepi32_ps(_mm512_and_si512(b1, low)),
                           _mm512_cvtepi32_ps(_mm512_srli_epi32(b0, 4)),
                           _mm512_cvtepi32_ps(_mm512_srli_epi32(b1, 4))};
      for (int m = 0; m < R; ++m) {
        const __m512 xv = _mm512_set1_ps(xg[m * p.k + kk]);
        for (int i = 0; i < 4; ++i) acc[m][i] = _mm512_fmadd_ps(w[i], xv, acc[m][i]);
      }
    }
    const T* sz = p.sz + (gi * p.n + c0) * 2;
    for (int i = 0; i < 4; ++i) {
      __m512 s, z;
      load_sz(sz + 32 * i, s, z);
      for (int m = 0; m < R; ++m) {
        float* t = tot + m * kBlock + 16 * i;
        const __m512 part = _mm512_fmadd_ps(z, _mm512_set1_ps(p.xsum[m * p.groups + gi]), _mm512_loadu_ps(t));
        _mm512_storeu_ps(t, _mm512_fmadd_ps(acc[m][i], s, part));
      }
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
// The same block for bfloat16 rows on AVX512-BF16: the codes of features k and k + 1 of a column side by side as
// the bfloat16 pair (128 + q_k, 128 + q_k+1) (bits 0x4300 | q: exact), multiplied with the pair (x[k], x[k + 1]) by
// vdpbf16ps, which adds the exact products in float32; the group then takes 128 * sum(x) back off. One 64-byte
// load holds both features' runs; one vpermb per 16 columns puts each column's two bytes in its lane. About half
// the instructions of the float32 path per weight. The extra 128 costs float32 sums a few bits (a few 1e-7 of the
// result), far below the bfloat16 output's rounding.
template <int R, typename T>
void block_avx512_bf16(const Problem<T>& p, const c10::BFloat16* xb, int64_t c0, float* tot) {
  // lane j of the first: byte j (feature k), 0, byte 32 + j (feature k + 1), 0; of the second: 16 + j, 48 + j
  alignas(64) static const uint8_t kIndex[2][64] = {
      {0, 0, 32, 0, 1, 0, 33, 0, 2, 0, 34, 0, 3, 0, 35, 0, 4, 0, 36, 0, 5, 0, 37, 0, 6, 0, 38, 0, 7, 0, 39, 0,
       8, 0, 40, 0, 9, 0, 41, 0, 10, 0, 42, 0, 11, 0, 43, 0, 12, 0, 44, 0, 13, 0, 45, 0, 14, 0, 46, 0, 15, 0, 47, 0},
      {16, 0, 48, 0, 17, 0, 49, 0, 18, 0, 50, 0, 19, 0, 51, 0, 20, 0, 52, 0, 21, 0, 53, 0, 22, 0, 54, 0, 23, 0,
       55, 0, 24, 0, 56, 0, 25, 0, 57, 0, 26, 0, 58, 0, 27, 0, 59, 0, 28, 0, 60, 0, 29, 0, 61, 0, 30, 0, 62, 0,
       31, 0, 63, 0}};
  const __m512i idx0 = _mm512_load_si512(kIndex[0]), idx1 = _mm512_load_si512(kIndex[1]);
  constexpr __mmask64 kEvenBytes = 0x5555555555555555ull;
  const __m512i low = _mm512_set1_epi32(0x000F000F), bias = _mm512_set1_epi32(0x43004300);
  const uint8_t* base = p.codes + c0 * p.k / 2;
  for (int64_t gi = 0; gi < p.groups; ++gi) {
    // 1-2 rows keep two sets of accumulators (even and odd pairs of features): enough independent sums to
    // cover vdpbf16ps's latency
    constexpr int S = R <= 2 ? 2 : 1;
    __m512 acc[S][R][4];
    for (int u = 0; u < S; ++u)
      for (int m = 0; m < R; ++m)
        for (int i = 0; i < 4; ++i) acc[u][m][i] = _mm512_setzero_ps();
    const uint8_t* r = base + gi * p.group * kHalf;
    const c10::BFloat16* xg = xb + gi * p.group;
    for (int64_t kk = 0; kk < p.group; kk += 2 * S) {
      for (int u = 0; u < S; ++u, r += 2 * kHalf) {
        _mm_prefetch(reinterpret_cast<const char*>(r) + kPrefetch, _MM_HINT_T0);
        const __m512i both = _mm512_loadu_si512(r);
        const __m512i v0 = _mm512_maskz_permutexvar_epi8(kEvenBytes, idx0, both);
        const __m512i v1 = _mm512_maskz_permutexvar_epi8(kEvenBytes, idx1, both);
        // (v & low) | bias
        const __m512i w[4] = {_mm512_ternarylogic_epi32(v0, low, bias, 0xEA),
                              _mm512_ternarylogic_epi32(v1, low, bias, 0xEA),
                              _mm512_ternarylogic_epi32(_mm512_srli_epi16(v0, 4), low, bias, 0xEA),
                              _mm512_ternarylogic_epi32(_mm512_srli_epi16(v1, 4), low, bias, 0xEA)};
        for (int m = 0; m < R; ++m) {
          int32_t pair;
          std::memcpy(&pair, xg + m * p.k + kk + 2 * u, sizeof(pair));
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
          for (int i = 0; i < 4; ++i) acc[u][m][i] = _mm512_dpbf16_ps(acc[u][m][i], (__m512bh)w[i], xv);
        }
      }
    }
    if (S == 2)
      for (int m = 0; m < R; ++m)
        for (int i = 0; i < 4; ++i) acc[0][m][i] = _mm512_add_ps(acc[0][m][i], acc[S - 1][m][i]);
    const T* sz = p.sz + (gi * p.n + c0) * 2;
    for (int i = 0; i < 4; ++i) {
      __m512 s, z;
      load_sz(sz + 32 * i, s, z);
      z = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), s, z);   // zero - 136 * scale: the codes carry 128 more
      for (int m = 0; m < R; ++m) {
        float* t = tot + m * kBlock + 16 * i;
        const __m512 part = _mm512_fmadd_ps(z, _mm512_set1_ps(p.xsum[m * p.groups + gi]), _mm512_loadu_ps(t));
        _mm512_storeu_ps(t, _mm512_fmadd_ps(acc[0][m][i], s, part));
      }
    }
  }
}
#endif
#endif

template <typename T>
void run_block(const Problem<T>& p, int64_t c0, int64_t width) {
  float tot[kMaxRows * kBlock];
  std::fill(tot, tot + kMaxRows * kBlock, 0.0f);
#ifdef SLUICE_INT4_AVX512
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  if (width == kBlock && p.xb != nullptr) {
    switch (p.rows) {
      case 1: block_avx512_bf16<1>(p, p.xb, c0, tot); break;
      case 2: block_avx512_bf16<2>(p, p.xb, c0, tot); break;
      case 3: block_avx512_bf16<3>(p, p.xb, c0, tot); break;
      default: block_avx512_bf16<4>(p, p.xb, c0, tot); break;
    }
  } else
#endif
  if (width == kBlock) {
    switch (p.rows) {
      case 1: block_avx512<1>(p, c0, tot); break;
      case 2: block_avx512<2>(p, c0, tot); break;
      case 3: block_avx512<3>(p, c0, tot); break;
      default: block_avx512<4>(p, c0, tot); break;
    }
  } else {
    block_scalar(p, c0, width, tot);
  }
#else
  block_scalar(p, c0, width, tot);
#endif
  for (int64_t m = 0; m < p.rows; ++m)
    std::copy(tot + m * kBlock, tot + m * kBlock + width, p.out + m * p.n + c0);
}

}  // namespace

// Which loops int4_gemv runs here: "avx512-bf16" (bfloat16 rows on vdpbf16ps, float32 rows on AVX-512 FMAs),
// "avx512" (both on AVX-512 FMAs) or "" (the portable loops, as the compiler vectorizes them).
std::string int4_gemv_isa() {
#if defined(SLUICE_INT4_AVX512) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  return "avx512-bf16";
#elif defined(SLUICE_INT4_AVX512)
  return "avx512";
#else
  return "";
#endif
}

// x [rows <= 4, k] (float32 or bfloat16) @ W.T for W packed by _convert_weight_to_int4pack_for_cpu ([n, k / 2]
// uint8, n a multiple of 16) with its table sz [k / group, n, 2] in x's dtype. Returns [rows, n] in x's dtype.
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, int64_t group, const at::Tensor& sz) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows, "int4_gemv takes 1 to 4 rows, got ",
              x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int4_gemv takes float32 or bfloat16 rows");
  TORCH_CHECK(sz.scalar_type() == x.scalar_type() && sz.is_contiguous() && sz.dim() == 3 && sz.size(2) == 2,
              "int4_gemv: the table must be a contiguous [groups, n, 2] tensor in x's dtype");
  const int64_t rows = x.size(0), k = x.size(1), n = sz.size(1), groups = sz.size(0);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() * 2 == n * k,
              "int4_gemv: packed must be the uint8 [n, k / 2] weight of _convert_weight_to_int4pack_for_cpu");
  TORCH_CHECK(n % 16 == 0 && group > 0 && groups * group == k, "int4_gemv: n must be a multiple of 16 and "
              "k = groups * group");
  const at::Tensor xc = x.contiguous(), xf = xc.to(at::kFloat).contiguous();
  std::vector<float> xsum(rows * groups);
  const float* xp = xf.data_ptr<float>();
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t gi = 0; gi < groups; ++gi) {
      float s = 0.0f;
      for (int64_t kk = gi * group; kk < (gi + 1) * group; ++kk) s += xp[m * k + kk];
      xsum[m * groups + gi] = s;
    }
  at::Tensor out = at::empty({rows, n}, x.options().dtype(at::kFloat));
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  // at least ~64 KiB of codes per task, so small layers stay on the calling thread
  const int64_t grain = std::max<int64_t>(1, 65536 / (kHalf * k));
  AT_DISPATCH_SWITCH(x.scalar_type(), "int4_gemv",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      const Problem<float> p{packed.data_ptr<uint8_t>(), sz.data_ptr<float>(), xp, nullptr, xsum.data(),
                             out.data_ptr<float>(), rows, n, k, group, groups};
      at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) run_block(p, b * kBlock, std::min(kBlock, n - b * kBlock));
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      const Problem<c10::BFloat16> p{packed.data_ptr<uint8_t>(), sz.data_ptr<c10::BFloat16>(), xp,
                                     xc.data_ptr<c10::BFloat16>(), xsum.data(),
                                     out.data_ptr<float>(), rows, n, k, group, groups};
      at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) run_block(p, b * kBlock, std::min(kBlock, n - b * kBlock));
      });
    }));
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}
