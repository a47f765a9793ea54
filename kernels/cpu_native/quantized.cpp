// Linear layers and row lookups on quantized block weights, in the packed layout of
// kernels/quantized.py: groups of 16 output rows, each (group, block) one run of bytes holding
// the codes as 64-byte steps of [16 rows][4 k-values] (4-bit codes two per byte: the low
// nibbles k 8j..8j+3, the high nibbles 8j+4..8j+7), then 16 scales and 16 offsets.
//
// The activations are quantized per block as llama.cpp does (int8, scale max|x| / 127, round
// to nearest even), so each block's dot product is an integer one:
//   y += (scale * xscale) * dot(q, xq) + offset * offset_factor,
// offset_factor ~ xscale * sum(xq). How xscale and offset_factor are rounded is the weight's
// activation format (kernels/quantized.py, ACTIVATION_FORMATS): float32 both; xscale rounded to
// float16 (llama.cpp's Q8_0); or also offset_factor = float16(d * sum) with the unrounded d
// (llama.cpp's Q8_1),
// the two terms summed over the blocks in separate float accumulators (shorter chains).
// Two implementations of the per-tile work: AVX-512 VNNI (`vpdpbusd`: 16 rows x 4 codes times
// 4 broadcast activation bytes per instruction) when the build's -march=native has it, and
// portable C++. ARBOR_CPU_PORTABLE=1 in the environment, read at each call, forces the
// portable one. A tile is one group of 16 rows times up to kTileRows activation rows, so a
// weight step loaded once serves every activation row of the tile (GEMV at M = 1, GEMM-like
// reuse at large M); threads split the groups.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "common.h"

#include <cstdlib>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>
#define ARBOR_QUANTIZED_VNNI 1
#endif

namespace {

constexpr int kRows = 16;      // output rows per group
constexpr int kTileRows = 4;   // activation rows per tile

// The quantized activations: codes [M][k], and per (row, block) the scale and
// scale * sum(codes) (the factor of the weight's offset).
struct Activations {
  const int8_t* codes;
  const float* scale;
  const float* offset_factor;
  int64_t k;
  int64_t blocks;
};

struct Weights {
  const uint8_t* data;  // [groups][blocks][stride]
  int64_t n;
  int64_t blocks;
  int64_t stride;
};

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

bool portable_forced() {
  const char* value = std::getenv("ARBOR_CPU_PORTABLE");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

// How the activations' block scales are rounded (kernels/quantized.py, ACTIVATION_FORMATS).
enum class ActivationFormat { kFloat32 = 0, kQ8_0 = 1, kQ8_1 = 2 };

inline float round_half(float value) { return static_cast<float>(c10::Half(value)); }

// BLOCK is a constant so the block's loops unroll and vectorize.
template <int BLOCK>
void quantize_activations(const float* x, int64_t rows, int64_t k, ActivationFormat format,
                          int8_t* codes, float* scale, float* offset_factor) {
  const int64_t blocks = k / BLOCK;
  arbor_cpu::parallel_for(0, rows, std::max<int64_t>(1, 16384 / k), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = x + m * k + b * BLOCK;
        int8_t* qb = codes + m * k + b * BLOCK;
        float amax = 0.f;
        for (int c = 0; c < BLOCK; ++c) amax = std::max(amax, std::fabs(xb[c]));
        const float inverse = amax > 0.f ? 127.f / amax : 0.f;
        int32_t sum = 0;
        for (int c = 0; c < BLOCK; ++c) {
          // rint rounds half to even in the default rounding mode, as torch.round does.
          const int32_t q = static_cast<int32_t>(std::rint(xb[c] * inverse));
          qb[c] = static_cast<int8_t>(q);
          sum += q;
        }
        const float d = amax / 127.f;
        const float total = static_cast<float>(sum);
        if (format == ActivationFormat::kFloat32) {
          scale[m * blocks + b] = d;
          offset_factor[m * blocks + b] = d * total;
        } else {
          // d16 * sum is exact in float32 (11 by 12 significant bits).
          const float d16 = round_half(d);
          scale[m * blocks + b] = d16;
          offset_factor[m * blocks + b] =
              format == ActivationFormat::kQ8_1 ? round_half(d * total) : d16 * total;
        }
      }
    }
  });
}

template <bool HALF>
inline void load_scales(const uint8_t* p, float* scale, float* offset) {
  if constexpr (HALF) {
    const c10::Half* h = reinterpret_cast<const c10::Half*>(p);
    for (int r = 0; r < kRows; ++r) {
      scale[r] = static_cast<float>(h[r]);
      offset[r] = static_cast<float>(h[kRows + r]);
    }
  } else {
    std::memcpy(scale, p, kRows * sizeof(float));
    std::memcpy(offset, p + kRows * sizeof(float), kRows * sizeof(float));
  }
}

// out[m][r] for MT activation rows (from act row `m0`) and the 16 rows of group `w`.
template <int BITS, int BLOCK, bool HALF, int MT>
void tile_portable(const uint8_t* w, int64_t stride, const Activations& a, int64_t m0,
                   float* out) {
  constexpr int code_bytes = kRows * BLOCK * BITS / 8;
  float acc[MT][kRows] = {}, acc_offset[MT][kRows] = {};
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* wb = w + b * stride;
    int32_t dot[MT][kRows] = {};
    for (int m = 0; m < MT; ++m) {
      const int8_t* xb = a.codes + (m0 + m) * a.k + b * BLOCK;
      // A row's 4 bytes of a step are read as one 32-bit word and split by shifts, so the loop
      // over the 16 rows is plain 32-bit lane arithmetic that vectorizes.
      for (int j = 0; j < BLOCK * BITS / 32; ++j) {
        uint32_t word[kRows];
        std::memcpy(word, wb + 64 * j, sizeof(word));
        if constexpr (BITS == 8) {
          const int32_t x0 = xb[4 * j], x1 = xb[4 * j + 1], x2 = xb[4 * j + 2],
                        x3 = xb[4 * j + 3];
          for (int r = 0; r < kRows; ++r)
            dot[m][r] += static_cast<int32_t>(word[r] & 255) * x0 +
                         static_cast<int32_t>((word[r] >> 8) & 255) * x1 +
                         static_cast<int32_t>((word[r] >> 16) & 255) * x2 +
                         static_cast<int32_t>(word[r] >> 24) * x3;
        } else {
          int32_t x[8];
          for (int i = 0; i < 8; ++i) x[i] = xb[8 * j + i];
          for (int r = 0; r < kRows; ++r) {
            int32_t sum = 0;
            for (int i = 0; i < 4; ++i)
              sum += static_cast<int32_t>((word[r] >> (8 * i)) & 15) * x[i] +
                     static_cast<int32_t>((word[r] >> (8 * i + 4)) & 15) * x[4 + i];
            dot[m][r] += sum;
          }
        }
      }
    }
    float scale[kRows], offset[kRows];
    load_scales<HALF>(wb + code_bytes, scale, offset);
    for (int m = 0; m < MT; ++m) {
      const float xs = a.scale[(m0 + m) * a.blocks + b];
      const float xo = a.offset_factor[(m0 + m) * a.blocks + b];
      for (int r = 0; r < kRows; ++r) {
        acc[m][r] = std::fma(scale[r] * xs, static_cast<float>(dot[m][r]), acc[m][r]);
        acc_offset[m][r] = std::fma(offset[r], xo, acc_offset[m][r]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kRows; ++r) out[m * kRows + r] = acc[m][r] + acc_offset[m][r];
}

#ifdef ARBOR_QUANTIZED_VNNI
template <int BITS, int BLOCK, bool HALF, int MT>
void tile_vnni(const uint8_t* w, int64_t stride, const Activations& a, int64_t m0, float* out) {
  constexpr int code_bytes = kRows * BLOCK * BITS / 8;
  // One vpdpbusd chain waits ~5 cycles per step on the last; with few activation rows, the
  // steps of a block go round CH chains, summed once per block.
  constexpr int CH = MT == 1 ? 4 : (MT == 2 ? 2 : 1);
  const __m512i nibble = _mm512_set1_epi8(15);
  __m512 acc[MT], acc_offset[MT];
  for (int m = 0; m < MT; ++m) acc[m] = acc_offset[m] = _mm512_setzero_ps();
  const int8_t* x = a.codes + m0 * a.k;
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* wb = w + b * stride;
    const int8_t* xb = x + b * BLOCK;
    __m512i dot[MT][CH];
    for (int m = 0; m < MT; ++m)
      for (int c = 0; c < CH; ++c) dot[m][c] = _mm512_setzero_si512();
    if constexpr (BITS == 8) {
#pragma GCC unroll 8
      for (int j = 0; j < BLOCK / 4; ++j) {
        const __m512i codes = _mm512_loadu_si512(wb + 64 * j);
        for (int m = 0; m < MT; ++m)
          dot[m][j % CH] = _mm512_dpbusd_epi32(
              dot[m][j % CH], codes, _mm512_set1_epi32(load_i32(xb + m * a.k + 4 * j)));
      }
    } else {
#pragma GCC unroll 4
      for (int j = 0; j < BLOCK / 8; ++j) {
        const __m512i packed = _mm512_loadu_si512(wb + 64 * j);
        const __m512i low = _mm512_and_si512(packed, nibble);
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
        for (int m = 0; m < MT; ++m) {
          dot[m][(2 * j) % CH] = _mm512_dpbusd_epi32(
              dot[m][(2 * j) % CH], low, _mm512_set1_epi32(load_i32(xb + m * a.k + 8 * j)));
          dot[m][(2 * j + 1) % CH] =
              _mm512_dpbusd_epi32(dot[m][(2 * j + 1) % CH], high,
                                  _mm512_set1_epi32(load_i32(xb + m * a.k + 8 * j + 4)));
        }
      }
    }
    __m512 scale, offset;
    if constexpr (HALF) {
      const auto* halves = reinterpret_cast<const __m256i*>(wb + code_bytes);
      scale = _mm512_cvtph_ps(_mm256_loadu_si256(halves));
      offset = _mm512_cvtph_ps(_mm256_loadu_si256(halves + 1));
    } else {
      scale = _mm512_loadu_ps(wb + code_bytes);
      offset = _mm512_loadu_ps(wb + code_bytes + 64);
    }
    for (int m = 0; m < MT; ++m) {
      __m512i total = dot[m][0];
      for (int c = 1; c < CH; ++c) total = _mm512_add_epi32(total, dot[m][c]);
      const float xs = a.scale[(m0 + m) * a.blocks + b];
      const float xo = a.offset_factor[(m0 + m) * a.blocks + b];
      acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(scale, _mm512_set1_ps(xs)),
                               _mm512_cvtepi32_ps(total), acc[m]);
      acc_offset[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xo), acc_offset[m]);
    }
  }
  for (int m = 0; m < MT; ++m)
    _mm512_storeu_ps(out + kRows * m, _mm512_add_ps(acc[m], acc_offset[m]));
}
#endif

using TileFn = void (*)(const uint8_t*, int64_t, const Activations&, int64_t, float*);

template <int BITS, int BLOCK, bool HALF, bool VNNI, int MT>
constexpr TileFn tile_for() {
#ifdef ARBOR_QUANTIZED_VNNI
  if constexpr (VNNI) return &tile_vnni<BITS, BLOCK, HALF, MT>;
#endif
  return &tile_portable<BITS, BLOCK, HALF, MT>;
}

template <int BITS, int BLOCK, bool HALF, bool VNNI>
void linear(const Weights& w, const Activations& a, int64_t rows, const float* bias, float* y) {
  static_assert(kTileRows == 4, "one tile function per tile height");
  const TileFn tiles[kTileRows] = {
      tile_for<BITS, BLOCK, HALF, VNNI, 1>(), tile_for<BITS, BLOCK, HALF, VNNI, 2>(),
      tile_for<BITS, BLOCK, HALF, VNNI, 3>(), tile_for<BITS, BLOCK, HALF, VNNI, 4>()};
  const int64_t groups = (w.n + kRows - 1) / kRows;
  // About 64K multiply-adds per task at least, so small layers do not pay for threads.
  const int64_t per_group = kRows * a.k * rows;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(per_group, 1));
  arbor_cpu::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    float out[kTileRows * kRows];
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* wg = w.data + g * w.blocks * w.stride;
      const int64_t valid = std::min<int64_t>(kRows, w.n - g * kRows);
      for (int64_t m0 = 0; m0 < rows; m0 += kTileRows) {
        const int64_t mt = std::min<int64_t>(kTileRows, rows - m0);
        tiles[mt - 1](wg, w.stride, a, m0, out);
        for (int64_t m = 0; m < mt; ++m) {
          float* ym = y + (m0 + m) * w.n + g * kRows;
          for (int64_t r = 0; r < valid; ++r)
            ym[r] = out[m * kRows + r] + (bias ? bias[g * kRows + r] : 0.f);
        }
      }
    }
  });
}

template <int BITS, int BLOCK, bool HALF>
void linear_any(bool vnni, const Weights& w, const Activations& a, int64_t rows,
                const float* bias, float* y) {
#ifdef ARBOR_QUANTIZED_VNNI
  if (vnni) return linear<BITS, BLOCK, HALF, true>(w, a, rows, bias, y);
#endif
  (void)vnni;
  linear<BITS, BLOCK, HALF, false>(w, a, rows, bias, y);
}

int64_t expected_stride(int64_t bits, int64_t block, bool half_scales) {
  return kRows * block * bits / 8 + 2 * kRows * (half_scales ? 2 : 4);
}

void check_packed(const torch::Tensor& data, int64_t n, int64_t bits, int64_t block,
                  bool half_scales) {
  TORCH_CHECK(data.dtype() == torch::kUInt8 && data.dim() == 3 && data.is_contiguous(),
              "packed weight must be contiguous uint8 [groups, blocks, stride]");
  TORCH_CHECK((bits == 4 || bits == 8) && (block == 16 || block == 32),
              "unsupported blocks: bits ", bits, ", block ", block);
  TORCH_CHECK(data.size(0) == (n + kRows - 1) / kRows &&
                  data.size(2) == expected_stride(bits, block, half_scales),
              "packed weight shape ", data.sizes(), " does not match n ", n);
}

torch::Tensor quantized_linear(torch::Tensor x, torch::Tensor data, int64_t n, int64_t bits,
                               int64_t block, bool half_scales, int64_t activation_format,
                               c10::optional<torch::Tensor> bias) {
  check_packed(data, n, bits, block, half_scales);
  TORCH_CHECK(activation_format >= 0 && activation_format <= 2, "unknown activation format ",
              activation_format);
  const int64_t blocks = data.size(1), k = blocks * block;
  TORCH_CHECK(x.size(-1) == k, "x has ", x.size(-1), " features, the weight ", k);
  auto x2 = x.reshape({-1, k}).to(torch::kFloat32).contiguous();
  const int64_t rows = x2.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  auto y = torch::empty({rows, n}, x2.options());
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(b.numel() == n, "bias has ", b.numel(), " values, the weight ", n, " rows");
  }
  if (rows == 0) return y.view(shape);
  auto codes = torch::empty({rows, k}, x2.options().dtype(torch::kInt8));
  auto xscale = torch::empty({rows, blocks}, x2.options());
  auto xoffset = torch::empty({rows, blocks}, x2.options());
  auto quantize = block == 16 ? quantize_activations<16> : quantize_activations<32>;
  quantize(x2.data_ptr<float>(), rows, k, static_cast<ActivationFormat>(activation_format),
           codes.data_ptr<int8_t>(), xscale.data_ptr<float>(), xoffset.data_ptr<float>());
  const Activations a{codes.data_ptr<int8_t>(), xscale.data_ptr<float>(),
                      xoffset.data_ptr<float>(), k, blocks};
  const Weights w{data.data_ptr<uint8_t>(), n, blocks, data.size(2)};
  const float* bias_ptr = b.defined() ? b.data_ptr<float>() : nullptr;
  float* out = y.data_ptr<float>();
  const bool vnni = !portable_forced();
  const int key = static_cast<int>(bits) * 1000 + static_cast<int>(block) * 10 + half_scales;
  switch (key) {
    case 4160: linear_any<4, 16, false>(vnni, w, a, rows, bias_ptr, out); break;
    case 4161: linear_any<4, 16, true>(vnni, w, a, rows, bias_ptr, out); break;
    case 4320: linear_any<4, 32, false>(vnni, w, a, rows, bias_ptr, out); break;
    case 4321: linear_any<4, 32, true>(vnni, w, a, rows, bias_ptr, out); break;
    case 8160: linear_any<8, 16, false>(vnni, w, a, rows, bias_ptr, out); break;
    case 8161: linear_any<8, 16, true>(vnni, w, a, rows, bias_ptr, out); break;
    case 8320: linear_any<8, 32, false>(vnni, w, a, rows, bias_ptr, out); break;
    case 8321: linear_any<8, 32, true>(vnni, w, a, rows, bias_ptr, out); break;
    default: TORCH_CHECK(false, "unsupported blocks");
  }
  return y.view(shape);
}

// scale * q + offset, rounded after the product as the torch reference (no fused multiply-add,
// so the rows equal BlockWeights.dequantize bit for bit).
__attribute__((optimize("fp-contract=off"))) void dequantize_row(
    const uint8_t* data, int64_t row, int64_t blocks, int64_t stride, int64_t bits, int64_t block,
    bool half_scales, float* out) {
  const int64_t lane = row % kRows, code_bytes = kRows * block * bits / 8;
  const uint8_t* wg = data + (row / kRows) * blocks * stride;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = wg + b * stride;
    float scale, offset;
    if (half_scales) {
      const c10::Half* h = reinterpret_cast<const c10::Half*>(wb + code_bytes);
      scale = static_cast<float>(h[lane]);
      offset = static_cast<float>(h[kRows + lane]);
    } else {
      std::memcpy(&scale, wb + code_bytes + 4 * lane, 4);
      std::memcpy(&offset, wb + code_bytes + 4 * kRows + 4 * lane, 4);
    }
    for (int64_t c = 0; c < block; ++c) {
      int32_t code;
      if (bits == 8) {
        code = wb[64 * (c / 4) + 4 * lane + c % 4];
      } else {
        const int32_t packed = wb[64 * (c / 8) + 4 * lane + c % 4];
        code = c % 8 < 4 ? packed & 15 : packed >> 4;
      }
      const float product = scale * static_cast<float>(code);
      out[b * block + c] = product + offset;
    }
  }
}

torch::Tensor quantized_rows(torch::Tensor index, torch::Tensor data, int64_t n, int64_t bits,
                             int64_t block, bool half_scales) {
  check_packed(data, n, bits, block, half_scales);
  const int64_t blocks = data.size(1), k = blocks * block;
  auto idx = index.to(torch::kInt64).contiguous();
  const int64_t* ids = idx.data_ptr<int64_t>();
  const int64_t count = idx.numel();
  for (int64_t t = 0; t < count; ++t)
    TORCH_CHECK(ids[t] >= 0 && ids[t] < n, "row index ", ids[t], " out of range [0, ", n, ")");
  auto out = torch::empty({count, k}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  const uint8_t* d = data.data_ptr<uint8_t>();
  const int64_t stride = data.size(2);
  arbor_cpu::parallel_for(0, count, std::max<int64_t>(1, 16384 / k), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      dequantize_row(d, ids[t], blocks, stride, bits, block, half_scales, o + t * k);
  });
  std::vector<int64_t> shape(idx.sizes().begin(), idx.sizes().end());
  shape.push_back(k);
  return out.view(shape);
}

std::string quantized_isa() {
#ifdef ARBOR_QUANTIZED_VNNI
  if (!portable_forced()) return "avx512_vnni";
#endif
  return "portable";
}

}  // namespace

void register_quantized(pybind11::module& m) {
  m.def("quantized_linear", &quantized_linear,
        "y = x W^T (+ bias) on a packed quantized weight (kernels/quantized.py)");
  m.def("quantized_rows", &quantized_rows, "rows of a packed quantized weight, dequantized");
  m.def("quantized_isa", &quantized_isa,
        "the path quantized_linear takes now: avx512_vnni or portable (ARBOR_CPU_PORTABLE=1)");
}
