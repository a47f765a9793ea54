// Token-bitmask application for CPU: one pass over the packed mask, writing -inf only where a
// token is banned (the logits themselves are never read). Semantics of
// kernels/reference/sampling.py::apply_token_bitmask.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "common.h"

#include <cstdint>
#include <limits>

namespace {

template <typename scalar_t>
void ban_row(scalar_t* row, const int32_t* words, int64_t num_words, int64_t vocab) {
  const scalar_t neg_inf = static_cast<scalar_t>(-std::numeric_limits<float>::infinity());
  const int64_t full_words = std::min<int64_t>(num_words, vocab / 32);
  for (int64_t w = 0; w < full_words; ++w) {
    uint32_t banned = ~static_cast<uint32_t>(words[w]);
    scalar_t* base = row + 32 * w;
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
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const int64_t r = indexed ? idx_ptr[n] : n;
        ban_row<scalar_t>(base + r * row_stride, mask_ptr + n * words, words, vocab);
      }
    });
  });
}

}  // namespace

void register_sampling(pybind11::module& m) {
  const auto release = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("apply_token_bitmask", &apply_token_bitmask, release);
}
