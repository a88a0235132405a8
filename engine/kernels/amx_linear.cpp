// bfloat16 linear layers of decode-sized steps on AMX tiles: y = x @ W.T (+ bias) for x of a few dozen rows.
// Built with cpu_ops.cpp (engine/kernels/__init__.py).
//
// Why: a decode step of a few dozen sequences reads every weight once and does little with it: it is bound
// by how fast the weights stream from memory. oneDNN's bfloat16 GEMM streamed the default model's 269 MB of
// projections at ~15 GB/s at 8-32 rows (14-18 ms per step, the larger part of a 32-sequence decode step) on 2
// Sapphire Rapids-class cores that read ~29 GB/s; this kernel streams them at 23-25 (10.7-11.8 ms, 1.3-1.5x).
// With more rows the products, not the reads, bound a step: 1.17x at 64 rows, even with oneDNN from ~96 on
// (the caller sends steps of more than 64 rows to oneDNN; benchmarks/amx_linear.py).
//
// Layout (amx_pack_linear): the weight [N, K] as [N/32][K/32][2][16][32] bfloat16: per 32 output columns and
// 32 inputs, two AMX B tiles of 16 columns each, in VNNI pairs (row r of a tile holds, for each of its 16
// columns n, the inputs 2r and 2r + 1): 2 KB per (32 columns, 32 inputs), and a column block's K/32 pairs of
// tiles are contiguous, so each thread reads its share of the weight front to back (prefetched ahead).
//
// Compute: each thread takes a contiguous range of 32-column blocks (the reads stay sequential per thread;
// with a shared counter instead the two threads' blocks interleaved and it was slower). Per block and per 32
// rows of x: C tiles tmm0-3 (2 row tiles x 2 column tiles, float32) accumulate over K/32 steps of two A tiles
// (16 rows of x each, loaded straight from x) and two B tiles; then each C row gets the bias and is rounded to
// bfloat16 (nearest-even, as oneDNN's output), overlapped with the next pass's products (BlockRunner). Rows past
// M are read from a zero-padded copy of x when M is not a multiple of 16, and never written.
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

// One thread's blocks, in order. Per block, one pass per 32 rows: C tiles tmm0-3 accumulate over K/32 steps,
// then go to a float32 buffer, and the next pass's steps round that buffer's rows to bfloat16 into the output
// a few rows per step: the vector unit's rounding then overlaps the tile products instead of stalling them (the
// same rounding after each pass took 15-25 % of the time at K = 576).
// Up to 32 rows a block is read once (from memory, prefetched a few steps ahead); with more rows the later
// passes read it again from L1/L2, and every step of every pass prefetches a share of the next block (the
// thread's next one: its blocks are contiguous), so the next block's first pass does not wait on memory.
// Prototype, the default model's linears per step: 19.4-20.7 -> 17.7-18.6 ms at 64 rows for the prefetch
// shares, then 12.6 -> 11.2 ms at 32 rows and 19.1 -> 16.6 at 64 for the overlapped rounding.
class BlockRunner {
 public:
  BlockRunner(const uint16_t* x, int64_t x_stride, int64_t rows_padded, int64_t rows, int64_t depth,
              const float* bias, uint16_t* out, int64_t out_stride)
      : x_(x), x_stride_(x_stride), rows_padded_(rows_padded), rows_(rows), steps_(depth / kDepth), bias_(bias),
        out_(out), out_stride_(out_stride), passes_((rows_padded + 31) / 32),
        share_((2 * 16 + passes_ - 1) / passes_), rows_per_step_(static_cast<int>((32 + steps_ - 1) / steps_)) {}

  // Output columns [n0, n0 + 32) for every row; w is the block's K/32 pairs of B tiles.
  void run(const uint16_t* w, int64_t n0) {
    const char* next = reinterpret_cast<const char*>(w + steps_ * kPairElems);
    for (int64_t m0 = 0, pass = 0; m0 < rows_padded_; m0 += 32, ++pass) {
      const bool two = m0 + 16 < rows_padded_;  // a second row tile in this pass
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const uint16_t* a = x_ + m0 * x_stride_;
      for (int64_t s = 0; s < steps_; ++s) {
        const uint16_t* b = w + s * kPairElems;
        if (passes_ == 1) {
          const char* ahead = reinterpret_cast<const char*>(b + kPrefetchSteps * kPairElems);
          for (int i = 0; i < 2 * 16 * 64; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T1);
        } else {
          const char* lines = next + (pass * steps_ + s) * share_ * 64;
          for (int64_t i = 0; i < share_; ++i) _mm_prefetch(lines + i * 64, _MM_HINT_T1);
        }
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + 512, 64);
        _tile_loadd(4, a + s * kDepth, x_stride_ * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
          _tile_loadd(5, a + 16 * x_stride_ + s * kDepth, x_stride_ * 2);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        round_rows(static_cast<int>(std::min<int64_t>(32, (s + 1) * rows_per_step_)));
      }
      round_rows(32);  // the buffer is free again
      float* c = buffer_;
      _tile_stored(0, c, 64);
      _tile_stored(1, c + 256, 64);
      if (two) {
        _tile_stored(2, c + 512, 64);
        _tile_stored(3, c + 768, 64);
      }
      pending_ = {c, m0, two, n0, 0};
    }
  }

  // Rounds what the last pass left in its buffer.
  void flush() { round_rows(32); }

 private:
  struct Pending {
    const float* c = nullptr;
    int64_t m0 = 0;
    bool two = false;
    int64_t n0 = 0;
    int done = 32;  // rows of the pass rounded so far (32: nothing pending)
  };

  // Rows [done, upto) of the pending pass: float32 + bias, rounded to bfloat16 (nearest-even), into the output.
  void round_rows(int upto) {
    Pending& p = pending_;
    for (; p.done < upto; ++p.done) {
      const int h = p.done / 16, r = p.done % 16;
      const int64_t m = p.m0 + p.done;
      if ((h == 1 && !p.two) || m >= rows_) {
        p.done = 32;
        return;
      }
      __m512 lo = _mm512_loadu_ps(p.c + (2 * h) * 256 + r * 16);
      __m512 hi = _mm512_loadu_ps(p.c + (2 * h + 1) * 256 + r * 16);
      if (bias_) {
        lo = _mm512_add_ps(lo, _mm512_loadu_ps(bias_ + p.n0));
        hi = _mm512_add_ps(hi, _mm512_loadu_ps(bias_ + p.n0 + 16));
      }
      _mm512_storeu_si512(out_ + m * out_stride_ + p.n0, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }

  const uint16_t* x_;
  int64_t x_stride_, rows_padded_, rows_, steps_;
  const float* bias_;
  uint16_t* out_;
  int64_t out_stride_, passes_, share_;
  int rows_per_step_;
  alignas(64) float buffer_[4 * 256];
  Pending pending_;
};
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
    BlockRunner runner(xp, x_stride, rows_padded, rows, depth, bp, op, n);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t blk = blocks * t / threads; blk < blocks * (t + 1) / threads; ++blk) {
        runner.run(wp + blk * block_elems, blk * kCols);
      }
    }
    runner.flush();
    _tile_release();
  });
  return out;
#else
  TORCH_CHECK(false, "amx_linear: built without AMX (see has_amx_linear)");
#endif
}
