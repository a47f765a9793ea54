// The sampler's passes over [B, V] logits for CPU. Token-bitmask application: one pass over the
// packed mask, writing -inf only where a token is banned (the logits themselves are never read).
// Row max and argmax in one pass (torch's max(dim) reads at about a quarter of the memory
// bandwidth here). Semantics of kernels/reference/sampling.py.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "common.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using arbor_cpu::to_float;

template <typename scalar_t>
void ban_row(scalar_t* row, const int32_t* words, int64_t num_words, int64_t vocab) {
  const scalar_t neg_inf = static_cast<scalar_t>(-std::numeric_limits<float>::infinity());
  const int64_t full_words = std::min<int64_t>(num_words, vocab / 32);
  for (int64_t w = 0; w < full_words; ++w) {
    uint32_t banned = ~static_cast<uint32_t>(words[w]);
    scalar_t* base = row + 32 * w;
    if (banned == ~0u) {  // the common case in structural states: one vector store run
      std::fill(base, base + 32, neg_inf);
      continue;
    }
    while (banned) {
      base[__builtin_ctz(banned)] = neg_inf;
      banned &= banned - 1;
    }
  }
  // A last word that covers the end of the vocabulary only partly, then tokens no word covers.
  int64_t token = 32 * full_words;
  if (full_words < num_words) {
    const uint32_t bits = static_cast<uint32_t>(words[full_words]);
    for (; token < vocab && token < 32 * (full_words + 1); ++token) {
      if (!((bits >> (token - 32 * full_words)) & 1u)) row[token] = neg_inf;
    }
  }
  for (; token < vocab; ++token) row[token] = neg_inf;
}

void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor indices) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [B, V] with unit stride");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32,
              "bitmask must be [N, W] int32");
  const int64_t vocab = logits.size(1), rows = bitmask.size(0);
  const bool indexed = indices.numel() > 0;
  TORCH_CHECK(indexed ? indices.numel() == rows : rows == logits.size(0),
              "one bitmask row per logits row (or per index)");
  auto mask = bitmask.contiguous();
  auto idx = indexed ? indices.to(torch::kInt64).contiguous() : indices;
  const int64_t* idx_ptr = indexed ? idx.data_ptr<int64_t>() : nullptr;
  for (int64_t n = 0; n < (indexed ? rows : 0); ++n) {
    TORCH_CHECK(idx_ptr[n] >= 0 && idx_ptr[n] < logits.size(0), "index out of range");
  }
  const int64_t words = mask.size(1), row_stride = logits.stride(0);
  const int32_t* mask_ptr = mask.data_ptr<int32_t>();
  ARBOR_DISPATCH_FLOAT(logits.scalar_type(), scalar_t, [&] {
    scalar_t* base = logits.data_ptr<scalar_t>();
    arbor_cpu::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const int64_t r = indexed ? idx_ptr[n] : n;
        ban_row<scalar_t>(base + r * row_stride, mask_ptr + n * words, words, vocab);
      }
    });
  });
}

// Each row's max and the first index holding it; NaN and that NaN's index where a row has one.
// One pass over the row in blocks, sixteen independent running maxima per block (so the scan
// vectorizes without reassociating anything), then a search of the first block holding the max.
template <typename scalar_t>
float block_max(const scalar_t* x, int64_t n, int* nans) {
  constexpr int kLanes = 16;
  float acc[kLanes];
  std::fill(acc, acc + kLanes, -std::numeric_limits<float>::infinity());
  int bad = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float v = to_float(x[i + j]);
      acc[j] = v > acc[j] ? v : acc[j];
      bad |= (v != v);
    }
  }
  for (; i < n; ++i) {
    const float v = to_float(x[i]);
    acc[0] = v > acc[0] ? v : acc[0];
    bad |= (v != v);
  }
  float top = acc[0];
  for (int j = 1; j < kLanes; ++j) top = acc[j] > top ? acc[j] : top;
  *nans |= bad;
  return top;
}

template <typename scalar_t>
void max_argmax_row(const scalar_t* row, int64_t n, float* best, int64_t* index) {
  constexpr int64_t kBlock = 1024;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<float> maxima(blocks);
  std::vector<int> nans(blocks, 0);
  float top = -std::numeric_limits<float>::infinity();
  bool any_nan = false;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kBlock, len = std::min(kBlock, n - lo);
    maxima[b] = block_max(row + lo, len, &nans[b]);
    top = maxima[b] > top ? maxima[b] : top;
    any_nan = any_nan || nans[b];
  }
  for (int64_t b = 0; b < blocks; ++b) {
    if (any_nan ? !nans[b] : maxima[b] != top) continue;
    const int64_t lo = b * kBlock, hi = std::min(n, lo + kBlock);
    for (int64_t k = lo; k < hi; ++k) {
      const float v = to_float(row[k]);
      if (any_nan ? v != v : v == top) {
        *best = v;
        *index = k;
        return;
      }
    }
  }
  *best = top;  // an empty row
  *index = 0;
}

TensorPair row_max_argmax(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2, "logits must be [B, V]");
  auto x = logits.contiguous();
  const int64_t rows = x.size(0), width = x.size(1);
  auto values = torch::empty({rows}, x.options().dtype(torch::kFloat32));
  auto indices = torch::empty({rows}, x.options().dtype(torch::kInt64));
  float* v = values.data_ptr<float>();
  int64_t* ix = indices.data_ptr<int64_t>();
  ARBOR_DISPATCH_FLOAT(x.scalar_type(), scalar_t, [&] {
    const scalar_t* base = x.data_ptr<scalar_t>();
    arbor_cpu::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) max_argmax_row<scalar_t>(base + r * width, width, v + r, ix + r);
    });
  });
  return {values.to(x.scalar_type()), indices};
}

}  // namespace

void register_sampling(pybind11::module& m) {
  const auto release = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("apply_token_bitmask", &apply_token_bitmask, release);
  m.def("row_max_argmax", &row_max_argmax, release);
}
