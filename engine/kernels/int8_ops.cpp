// W8A8 int8 linears (engine/models/w8a8.py): the per-token activation quantization and the scaling epilogue
// around oneDNN's int8 GEMM, so that one linear is one native call. Built with cpu_ops.cpp
// (engine/kernels/__init__.py).
//
// oneDNN's int8 linear (torch.ops.onednn.qlinear_pointwise, the op inductor's int8 freezing emits) takes one
// activation scale per call, while W8A8 scales each token. So each row is quantized here (symmetric int8,
// scale = max|x| / 127, q = round-half-even(x / scale), as quantize_tokens does, the same float32 operations in
// the same order) and handed to oneDNN as uint8 q + 128 with zero point 128; it multiplies with AVX512-VNNI
// (vpdpbusd) or AMX-INT8, accumulating in int32, and is asked for float32 with every scale 1: the exact int32
// sum converted once. The epilogue then computes acc * x_scale[m] * w_scale[n] (+ bias[n]) in float32, in the
// reference's order and without fused multiply-adds, and casts: the result equals w8a8_reference bit for bit.
// (oneDNN given signed int8 activations runs a reference loop: 1000x slower. Without VNNI its u8 x s8 products
// go through vpmaddubsw, whose int16 pair sums saturate: that is why the device falls back to a portable path.)
#pragma GCC optimize("fp-contract=off")  // a * b + c must round twice, as PyTorch's separate ops do

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SLUICE_INT8_AVX512 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>

namespace {

constexpr float kQMax = 127.0f;
constexpr int64_t kZeroPoint = 128;  // uint8 codes: q + 128

// Rows per parallel task: at least ~16k elements, so 1-row decode steps stay on the calling thread.
int64_t row_grain(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

#ifdef SLUICE_INT8_AVX512
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }
#endif

// One row: x (divided by smooth) -> codes (uint8 q + 128 when offset, else int8 q) and its scale.
template <typename T, typename Q>
float quantize_row(const T* x, const float* smooth, int64_t k, Q* out) {
  float amax = 0.0f;
  int64_t j = 0;
#ifdef SLUICE_INT8_AVX512
  __m512 vmax = _mm512_setzero_ps();
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (; j < k; j += 16) {
    const __mmask16 m = tail_mask(k - j);
    __m512 v = load16(x + j, m);
    if (smooth != nullptr) v = _mm512_maskz_div_ps(m, v, _mm512_mask_loadu_ps(_mm512_set1_ps(1.0f), m, smooth + j));
    vmax = _mm512_max_ps(vmax, _mm512_and_ps(v, sign));
  }
  amax = _mm512_reduce_max_ps(vmax);
#else
  for (; j < k; ++j) {
    const float v = smooth != nullptr ? to_float(x[j]) / smooth[j] : to_float(x[j]);
    amax = std::max(amax, std::fabs(v));
  }
#endif
  const float scale = amax > 0.0f ? amax / kQMax : 1.0f;
  const int32_t offset = std::is_same<Q, uint8_t>::value ? kZeroPoint : 0;
#ifdef SLUICE_INT8_AVX512
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), off = _mm512_set1_epi32(offset);
  for (j = 0; j < k; j += 16) {
    const __mmask16 m = tail_mask(k - j);
    __m512 v = load16(x + j, m);
    if (smooth != nullptr) v = _mm512_maskz_div_ps(m, v, _mm512_mask_loadu_ps(_mm512_set1_ps(1.0f), m, smooth + j));
    // round half to even, as torch.round
    const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(v, vscale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i q = _mm512_cvtps_epi32(r);
    q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), off);
    _mm_mask_storeu_epi8(out + j, m, _mm512_cvtepi32_epi8(q));
  }
#else
  for (j = 0; j < k; ++j) {
    const float v = smooth != nullptr ? to_float(x[j]) / smooth[j] : to_float(x[j]);
    const float q = std::min(std::max(std::nearbyint(v / scale), -kQMax), kQMax);
    out[j] = static_cast<Q>(static_cast<int32_t>(q) + offset);
  }
#endif
  return scale;
}

// float32 -> bfloat16 bits, round to nearest even (c10's round_to_nearest_even, NaN aside).
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if (std::isnan(f)) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// out[n] = float(acc[n]) * xs * ws[n] (+ bias[n]), stored as O.
template <typename A, typename B, typename O>
void scale_row(const A* acc, float xs, const float* ws, const B* bias, int64_t n, O* out) {
  int64_t j = 0;
#ifdef SLUICE_INT8_AVX512
  const __m512 vxs = _mm512_set1_ps(xs);
  for (; j < n; j += 16) {
    const __mmask16 m = tail_mask(n - j);
    __m512 a;
    if constexpr (std::is_same<A, int32_t>::value) {
      a = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, acc + j));
    } else {
      a = _mm512_maskz_loadu_ps(m, acc + j);
    }
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(a, vxs), _mm512_maskz_loadu_ps(m, ws + j));
    if (bias != nullptr) v = _mm512_add_ps(v, load16(bias + j, m));
    if constexpr (std::is_same<O, float>::value) {
      _mm512_mask_storeu_ps(out + j, m, v);
    } else {
      const __m512i u = _mm512_castps_si512(v);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
      const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
      _mm256_mask_storeu_epi16(out + j, m, _mm512_cvtepi32_epi16(r));
    }
  }
#else
  for (; j < n; ++j) {
    float v = static_cast<float>(acc[j]) * xs;
    v = v * ws[j];
    if (bias != nullptr) v = v + to_float(bias[j]);
    if constexpr (std::is_same<O, float>::value) {
      out[j] = v;
    } else {
      out[j] = c10::BFloat16(bf16_bits(v), c10::BFloat16::from_bits());
    }
  }
#endif
}

const float* optional_floats(const c10::optional<torch::Tensor>& t, int64_t size, const char* what) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == size, what,
              ": float32, contiguous, ", size, " values");
  return t->data_ptr<float>();
}

void check_rows(const torch::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.stride(1) == 1,
              op, ": float32 or bfloat16 [M, K] with contiguous rows");
}

}  // namespace

// Per-token symmetric int8 of x [M, K] (divided by smooth [K] first): uint8 codes q + 128 (zero point 128, for
// oneDNN) or int8 codes q (signed), and float32 scales [M].
std::tuple<torch::Tensor, torch::Tensor> int8_quantize_rows(const torch::Tensor& x,
                                                            const c10::optional<torch::Tensor>& smooth,
                                                            bool zero_point_128) {
  check_rows(x, "int8_quantize_rows");
  const int64_t m = x.size(0), k = x.size(1), ldx = x.stride(0);
  const float* sm = optional_floats(smooth, k, "int8_quantize_rows: smooth");
  auto codes = torch::empty({m, k}, x.options().dtype(zero_point_128 ? at::kByte : at::kChar));
  auto scales = torch::empty({m}, x.options().dtype(at::kFloat));
  float* sc = scales.data_ptr<float>();
  auto run = [&](auto* xp, auto* qp) {
    at::parallel_for(0, m, row_grain(k), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) sc[r] = quantize_row(xp + r * ldx, sm, k, qp + r * k);
    });
  };
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (zero_point_128) {
    bf16 ? run(x.data_ptr<c10::BFloat16>(), codes.data_ptr<uint8_t>())
         : run(x.data_ptr<float>(), codes.data_ptr<uint8_t>());
  } else {
    bf16 ? run(x.data_ptr<c10::BFloat16>(), codes.data_ptr<int8_t>())
         : run(x.data_ptr<float>(), codes.data_ptr<int8_t>());
  }
  return {codes, scales};
}

// acc [M, N] (float32 holding exact int32 sums, or int32) * x_scale[m] * w_scale[n] (+ bias[n]) as `dtype`
// (float32 in place over a float32 acc).
torch::Tensor int8_scale_rows(const torch::Tensor& acc, const torch::Tensor& x_scale, const torch::Tensor& w_scale,
                              const c10::optional<torch::Tensor>& bias, at::ScalarType dtype) {
  TORCH_CHECK(acc.device().is_cpu() && (acc.scalar_type() == at::kFloat || acc.scalar_type() == at::kInt) &&
                  acc.dim() == 2 && acc.is_contiguous(),
              "int8_scale_rows: acc is a contiguous float32 or int32 [M, N]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "int8_scale_rows: dtype float32 or bfloat16");
  const int64_t m = acc.size(0), n = acc.size(1);
  const float* xs = optional_floats(x_scale, m, "int8_scale_rows: x_scale");
  const float* ws = optional_floats(w_scale, n, "int8_scale_rows: w_scale");
  // the bias in float32 or bfloat16 (a bfloat16 model's own, widened exactly as bias.float() does)
  const bool bf16_bias = bias.has_value() && bias->scalar_type() == at::kBFloat16;
  const float* b = bf16_bias ? nullptr : optional_floats(bias, n, "int8_scale_rows: bias");
  const c10::BFloat16* bb = nullptr;
  if (bf16_bias) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n, "int8_scale_rows: bias: contiguous, ", n, " values");
    bb = bias->data_ptr<c10::BFloat16>();
  }
  const bool in_place = dtype == at::kFloat && acc.scalar_type() == at::kFloat;
  torch::Tensor out = in_place ? acc : torch::empty({m, n}, acc.options().dtype(dtype));
  auto run = [&](auto* ap, auto* op) {
    at::parallel_for(0, m, row_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        if (bb != nullptr) {
          scale_row(ap + r * n, xs[r], ws, bb, n, op + r * n);
        } else {
          scale_row(ap + r * n, xs[r], ws, b, n, op + r * n);
        }
      }
    });
  };
  if (acc.scalar_type() == at::kInt) {
    dtype == at::kFloat ? run(acc.data_ptr<int32_t>(), out.data_ptr<float>())
                        : run(acc.data_ptr<int32_t>(), out.data_ptr<c10::BFloat16>());
  } else {
    dtype == at::kFloat ? run(acc.data_ptr<float>(), out.data_ptr<float>())
                        : run(acc.data_ptr<float>(), out.data_ptr<c10::BFloat16>());
  }
  return out;
}

// The whole W8A8 linear over a weight packed by torch.ops.onednn.qlinear_prepack: quantize x's rows, oneDNN's
// int8 GEMM (float32 out, every scale 1: the int32 sums), scale back. `ones` (float32 [N] of 1) and `zeros`
// (int64 [N]) are the weight's scales and zero points as oneDNN sees them, made once by the caller.
torch::Tensor w8a8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& w_scale,
                          const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& smooth,
                          const torch::Tensor& ones, const torch::Tensor& zeros) {
  static const auto qlinear = c10::Dispatcher::singleton().findSchemaOrThrow("onednn::qlinear_pointwise", "");
  auto [codes, x_scale] = int8_quantize_rows(x, smooth, true);
  torch::jit::Stack stack{codes, 1.0, kZeroPoint, packed, ones, zeros, c10::IValue(), 1.0, int64_t{0},
                          c10::IValue(at::kFloat), std::string("none"), c10::List<c10::optional<at::Scalar>>(),
                          std::string("")};
  qlinear.callBoxed(&stack);
  torch::Tensor acc = stack.back().toTensor();
  if (!acc.is_contiguous()) acc = acc.contiguous();
  return int8_scale_rows(acc, x_scale, w_scale, bias, x.scalar_type());
}

// Which int8 dot-product instructions this CPU has ("amx-int8", "avx512-vnni", "avx-vnni"), "" for none: oneDNN's
// int8 GEMM is exact and fast only with one of them.
std::string int8_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("amx-int8")) return "amx-int8";
  if (__builtin_cpu_supports("avx512vnni")) return "avx512-vnni";
  if (__builtin_cpu_supports("avxvnni")) return "avx-vnni";
#endif
  return "";
}
