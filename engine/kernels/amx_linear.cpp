// bfloat16 linear layers of decode-sized steps on AMX tiles: y = x @ W.T (+ bias) for x of a few dozen rows.
// Built with cpu_ops.cpp (engine/kernels/__init__.py).
//
// Why: a decode step of a few dozen sequences reads every weight once and does little with it: it is bound
// by how fast the weights stream from memory. oneDNN's bfloat16 GEMM streamed the default model's 269 MB of
// projections at ~15 GB/s at 8-32 rows (14-18 ms per step, the larger part of a 32-sequence decode step) on 2
// Sapphire Rapids-class cores that read ~29 GB/s; this kernel streams them at ~23 (11-12 ms). From ~128 rows
// on the products, not the reads, bound a step and oneDNN's blocking wins (the caller sends those to it).
//
// Layout (amx_pack_linear): the weight [N, K] as [N/32][K/32][2][16][32] bfloat16: per 32 output columns and
// 32 inputs, two AMX B tiles of 16 columns each, in VNNI pairs (row r of a tile holds, for each of its 16
// columns n, the inputs 2r and 2r + 1): 2 KB per (32 columns, 32 inputs), and a column block's K/32 pairs of
// tiles are contiguous, so each thread reads its share of the weight front to back (prefetched ahead).
//
// Compute: each thread takes a contiguous range of 32-column blocks (the reads stay sequential per thread;
// with a shared counter instead the two threads' blocks interleaved and it was slower). Per block and per 32
// rows of x: C tiles tmm0-3 (2 row tiles x 2 column tiles, float32) accumulate over K/32 steps of two A tiles
// (16 rows of x each, loaded straight from x) and two B tiles; then each C row is rounded to bfloat16
// (nearest-even, as oneDNN's output) with the bias added first. Rows past M are read from a zero-padded copy
// of x when M is not a multiple of 16, and never written.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Optional.h>

#include "amx.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define SLUICE_AMX_LINEAR 1

// Linux gives a process AMX tile state only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA);
// oneDNN asks too, but these kernels (and cpu_ops.cpp's attention) may run before any oneDNN GEMM has.
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}
#endif

namespace {

constexpr int64_t kCols = 32;   // output columns per block (two B tiles)
constexpr int64_t kDepth = 32;  // inputs per tile step (a bfloat16 A tile row: 64 bytes)
constexpr int64_t kPairElems = 2 * 16 * 32;  // one (block, step) pair of B tiles, in bfloat16 elements

#ifdef SLUICE_AMX_LINEAR
// tmm0-3: C (16 x 16 float32); tmm4, tmm5: A (16 rows x 32 bfloat16); tmm6, tmm7: B (16 pair rows x 32).
struct LinearTiles : AmxTileConfig {
  LinearTiles() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = 16;
    }
  }
};

// Prefetch distance in tile steps (2 KB each) into L2 for one-pass blocks (up to 32 rows): 8 KB ahead.
constexpr int64_t kPrefetchSteps = 4;

// Output columns [n0, n0 + 32) for every row: w is the block's K/32 pairs of B tiles. Up to 32 rows the block
// is read once (from memory, prefetched a few steps ahead); with more rows, one pass per 32 rows reads it again
// from L1/L2, and every step of every pass prefetches a share of the next block (the thread's next one: its
// blocks are contiguous), so the next block's first pass does not wait on memory (at 64 rows 19.4-20.7 ms ->
// 17.7-18.6 per model step, at 128 rows 34-35 -> 29 in a prototype).
void amx_block(const uint16_t* x, int64_t x_stride, int64_t rows_padded, int64_t rows, int64_t depth,
               const uint16_t* w, const float* bias, int64_t n0, uint16_t* out, int64_t out_stride, float* c) {
  const int64_t steps = depth / kDepth;
  const int64_t passes = (rows_padded + 31) / 32;
  const int64_t share = (2 * 16 + passes - 1) / passes;  // cache lines of the next block per step (32 per pair)
  const char* next = reinterpret_cast<const char*>(w + steps * kPairElems);
  for (int64_t m0 = 0, pass = 0; m0 < rows_padded; m0 += 32, ++pass) {
    const bool two = m0 + 16 < rows_padded;  // a second row tile in this pass
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* a = x + m0 * x_stride;
    for (int64_t s = 0; s < steps; ++s) {
      const uint16_t* b = w + s * kPairElems;
      if (passes == 1) {
        const char* ahead = reinterpret_cast<const char*>(b + kPrefetchSteps * kPairElems);
        for (int i = 0; i < 2 * 16 * 64; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T1);
      } else {
        const char* lines = next + (pass * steps + s) * share * 64;
        for (int64_t i = 0; i < share; ++i) _mm_prefetch(lines + i * 64, _MM_HINT_T1);
      }
      _tile_loadd(6, b, 64);
      _tile_loadd(7, b + 512, 64);
      _tile_loadd(4, a + s * kDepth, x_stride * 2);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two) {
        _tile_loadd(5, a + 16 * x_stride + s * kDepth, x_stride * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    if (two) {
      _tile_stored(2, c + 512, 64);
      _tile_stored(3, c + 768, 64);
    }
    const __m512 b_lo = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    const __m512 b_hi = bias ? _mm512_loadu_ps(bias + n0 + 16) : _mm512_setzero_ps();
    for (int h = 0; h < (two ? 2 : 1); ++h) {
      for (int r = 0; r < 16; ++r) {
        const int64_t m = m0 + 16 * h + r;
        if (m >= rows) break;
        const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(c + (2 * h) * 256 + r * 16), b_lo);
        const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(c + (2 * h + 1) * 256 + r * 16), b_hi);
        _mm512_storeu_si512(out + m * out_stride + n0, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
      }
    }
  }
}
#endif

}  // namespace

// Whether this build and process can run amx_linear (built for a CPU with AMX-BF16, and Linux granted the tiles).
bool has_amx_linear() {
#ifdef SLUICE_AMX_LINEAR
  return amx_permitted();
#else
  return false;
#endif
}

// The [N, K] bfloat16 weight in amx_linear's tile layout, [N/32, K/32, 2, 16, 32]; N and K multiples of 32.
torch::Tensor amx_pack_linear(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "amx_pack_linear: a 2-D bfloat16 CPU weight [out, in] is required");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kCols == 0 && k % kDepth == 0, "amx_pack_linear: out (", n, ") and in (", k,
              ") features must be multiples of 32");
  const auto w = weight.contiguous();
  auto packed = torch::empty({n / kCols, k / kDepth, 2, 16, 32}, weight.options());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, n / kCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      uint16_t* d = dst + blk * (k / kDepth) * kPairElems;
      for (int64_t s = 0; s < k / kDepth; ++s) {
        for (int t = 0; t < 2; ++t) {
          for (int r = 0; r < 16; ++r) {
            for (int c = 0; c < 16; ++c) {
              const uint16_t* row = src + (blk * kCols + t * 16 + c) * k + s * kDepth + 2 * r;
              uint16_t* o = d + ((s * 2 + t) * 16 + r) * 32 + 2 * c;
              o[0] = row[0];
              o[1] = row[1];
            }
          }
        }
      }
    }
  });
  return packed;
}

// x [M, K] bfloat16 (rows may be strided, each row contiguous) @ W.T (+ bias: [N], float32 or bfloat16), with W
// packed by amx_pack_linear; returns [M, N] bfloat16. Needs has_amx_linear().
torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && x.stride(1) == 1,
              "amx_linear: x must be a 2-D bfloat16 CPU tensor with contiguous rows");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kBFloat16 && packed.size(2) == 2 &&
                  packed.size(3) == 16 && packed.size(4) == 32 && packed.is_contiguous(),
              "amx_linear: the weight must come from amx_pack_linear");
  const int64_t rows = x.size(0), depth = x.size(1), n = packed.size(0) * kCols;
  TORCH_CHECK(depth == packed.size(1) * kDepth, "amx_linear: x has ", depth, " features, the weight takes ",
              packed.size(1) * kDepth);
  torch::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->device().is_cpu() &&
                    (bias->scalar_type() == at::kFloat || bias->scalar_type() == at::kBFloat16),
                "amx_linear: bias must be a float32 or bfloat16 CPU vector of ", n);
    bias_f = bias->to(at::kFloat).contiguous();
  }
  auto out = torch::empty({rows, n}, x.options());
  if (rows == 0) return out;
#ifdef SLUICE_AMX_LINEAR
  TORCH_CHECK(amx_permitted(), "amx_linear: this CPU or process has no AMX tiles");
  const int64_t rows_padded = (rows + 15) / 16 * 16;
  torch::Tensor xs = x;
  if (rows_padded != rows) {  // whole 16-row tiles: the rows past M read zeros (their outputs are dropped)
    xs = torch::zeros({rows_padded, depth}, x.options());
    xs.narrow(0, 0, rows).copy_(x);
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>());
  const int64_t x_stride = xs.stride(0);
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t blocks = n / kCols, threads = std::min<int64_t>(at::get_num_threads(), blocks);
  const int64_t block_elems = (depth / kDepth) * kPairElems;
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    const LinearTiles tiles;
    _tile_loadconfig(&tiles);
    alignas(64) float c[4 * 256];
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t blk = blocks * t / threads; blk < blocks * (t + 1) / threads; ++blk) {
        amx_block(xp, x_stride, rows_padded, rows, depth, wp + blk * block_elems, bp, blk * kCols, op, n, c);
      }
    }
    _tile_release();
  });
  return out;
#else
  TORCH_CHECK(false, "amx_linear: built without AMX (see has_amx_linear)");
#endif
}
