// Paged attention for CPU: one call per layer for a whole packed batch.
//
// K/V are read in place from the pool through the request-to-slot table (no gather copy).
// A work item is (request, KV head, block of queries or split of keys); it holds the scaled
// queries of every query head sharing that KV head (GQA without repeating K/V) and runs an
// online softmax over key blocks. Statistics and accumulators are float32 whatever the
// storage dtype of q, K and V.
//
// In deterministic mode (common.h) a query's result depends only on its keys: key blocks are
// aligned to absolute positions, every block is scored and summed one way (score_block, sums
// over a whole block), extend reads its keys in one pass as decode does, and decode splits no
// sequence over keys. Extend and decode, alone or batched, chunked or not, then agree bit for bit.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

using arbor_cpu::exp_nonpositive;
using arbor_cpu::to_float;

constexpr int64_t kKeyBlock = 64;      // keys scored per step
constexpr int64_t kQueryBlock = 64;    // extend: query tokens per work item
constexpr int64_t kMinSplitKeys = 256; // decode: fewest keys worth a split of their own
constexpr float kNegInf = -std::numeric_limits<float>::infinity();


template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Query rows scored together against a block of keys: enough to reuse each loaded key vector
// several times, few enough that their accumulators stay in vector registers.
#ifdef __AVX512F__
constexpr int64_t kScoreRows = 4;
#else
constexpr int64_t kScoreRows = 2;
#endif

#ifdef __AVX512F__
// dst[c * kKeyBlock + r] = rows[r][col0 + c] for r, c < 16: a 16 x 16 block transposed in
// registers (pairs, then quads within 128-bit lanes, then lanes across registers).
inline void transpose16(const float* const* rows, int64_t col0, float* dst) {
  __m512 r[16], t[16];
  for (int k = 0; k < 16; ++k) r[k] = _mm512_loadu_ps(rows[k] + col0);
  for (int k = 0; k < 16; k += 2) {
    t[k] = _mm512_unpacklo_ps(r[k], r[k + 1]);
    t[k + 1] = _mm512_unpackhi_ps(r[k], r[k + 1]);
  }
  // u[4g + c]: lane L holds column 4L + c of rows 4g .. 4g + 3.
  for (int g = 0; g < 4; ++g) {
    const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * g + 2]), d = _mm512_castps_pd(t[4 * g + 3]);
    r[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 v = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
    const __m512 w = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
    const __m512 v2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    const __m512 w2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
    _mm512_storeu_ps(dst + (c)*kKeyBlock, _mm512_shuffle_f32x4(v, v2, 0x88));
    _mm512_storeu_ps(dst + (4 + c) * kKeyBlock, _mm512_shuffle_f32x4(w, w2, 0x88));
    _mm512_storeu_ps(dst + (8 + c) * kKeyBlock, _mm512_shuffle_f32x4(v, v2, 0xdd));
    _mm512_storeu_ps(dst + (12 + c) * kKeyBlock, _mm512_shuffle_f32x4(w, w2, 0xdd));
  }
}
#endif

// scores[r * kKeyBlock + j] = q[r] . keys[j] for `rows` queries (rows >= kScoreRows) and n <=
// kKeyBlock keys. The keys are transposed into kt ([dim][kKeyBlock], zero past n) once, so each
// query's scores accumulate across keys in vector lanes (no horizontal sums per pair), and
// kScoreRows queries share every load of kt.
inline void score_block(const float* __restrict q, int64_t rows, int64_t dim,
                        const float* const* keys, int64_t n, float* __restrict kt,
                        float* __restrict scores) {
  int64_t j0 = 0;
#ifdef __AVX512F__
  for (; j0 + 16 <= n; j0 += 16) {
    int64_t i0 = 0;
    for (; i0 + 16 <= dim; i0 += 16) transpose16(keys + j0, i0, kt + i0 * kKeyBlock + j0);
    for (int64_t i = i0; i < dim; ++i)
      for (int64_t j = j0; j < j0 + 16; ++j) kt[i * kKeyBlock + j] = keys[j][i];
  }
#endif
  for (int64_t i = 0; i < dim; ++i) {
    float* row = kt + i * kKeyBlock;
    for (int64_t j = j0; j < n; ++j) row[j] = keys[j][i];
    for (int64_t j = n; j < kKeyBlock; ++j) row[j] = 0.f;
  }
  auto pass = [&](int64_t r0, auto count) {
    constexpr int64_t m = decltype(count)::value;
    float acc[m][kKeyBlock] = {};
    for (int64_t i = 0; i < dim; ++i) {
      const float* k = kt + i * kKeyBlock;
      for (int64_t a = 0; a < m; ++a) {
        const float x = q[(r0 + a) * dim + i];
#pragma omp simd
        for (int64_t j = 0; j < kKeyBlock; ++j) acc[a][j] += x * k[j];
      }
    }
    for (int64_t a = 0; a < m; ++a)
      std::memcpy(scores + (r0 + a) * kKeyBlock, acc[a], sizeof(float) * kKeyBlock);
  };
  int64_t r = 0;
  for (; r + kScoreRows <= rows; r += kScoreRows)
    pass(r, std::integral_constant<int64_t, kScoreRows>{});
  for (; r < rows; ++r) pass(r, std::integral_constant<int64_t, 1>{});
}

// Value columns accumulated at a time: kScoreRows rows of them stay in vector registers.
#ifdef __AVX512F__
constexpr int64_t kValueChunk = 64;
#else
constexpr int64_t kValueChunk = 32;
#endif

// acc[r] += sum_j p[r * kKeyBlock + j] * values[j] for `rows` rows and n keys (acc: [rows, dv]).
// kScoreRows rows at a time (the leftover rows together) and kValueChunk columns are held in
// registers across the keys and share each load of a value vector; leftover columns take the
// same path with fewer.
inline void accumulate_values(const float* __restrict p, int64_t rows, int64_t n,
                              const float* const* values, int64_t dv, float* __restrict acc) {
  auto pass = [&](int64_t r0, int64_t c0, auto count, auto width) {
    constexpr int64_t m = decltype(count)::value, w = decltype(width)::value;
    float a[m][w];
    for (int64_t r = 0; r < m; ++r) std::memcpy(a[r], acc + (r0 + r) * dv + c0, sizeof a[r]);
    for (int64_t j = 0; j < n; ++j) {
      const float* v = values[j] + c0;
      for (int64_t r = 0; r < m; ++r) {
        const float x = p[(r0 + r) * kKeyBlock + j];
#pragma omp simd
        for (int64_t i = 0; i < w; ++i) a[r][i] += x * v[i];
      }
    }
    for (int64_t r = 0; r < m; ++r) std::memcpy(acc + (r0 + r) * dv + c0, a[r], sizeof a[r]);
  };
  auto columns = [&](int64_t r0, auto count) {
    int64_t c = 0;
    for (; c + kValueChunk <= dv; c += kValueChunk)
      pass(r0, c, count, std::integral_constant<int64_t, kValueChunk>{});
    for (; c + 8 <= dv; c += 8) pass(r0, c, count, std::integral_constant<int64_t, 8>{});
    for (; c < dv; ++c) pass(r0, c, count, std::integral_constant<int64_t, 1>{});
  };
  int64_t r = 0;
  for (; r + kScoreRows <= rows; r += kScoreRows)
    columns(r, std::integral_constant<int64_t, kScoreRows>{});
  // The rest in one sweep too (decode's GQA group is often 2): each value vector is read once.
  switch (rows - r) {
    case 3: columns(r, std::integral_constant<int64_t, 3>{}); break;
    case 2: columns(r, std::integral_constant<int64_t, 2>{}); break;
    case 1: columns(r, std::integral_constant<int64_t, 1>{}); break;
    default: break;
  }
}

// max(x[0..n)), -inf for n == 0: sixteen independent maxima, so that the loop vectorizes
// without -ffast-math (a single running max is a chain of scalar maxss).
inline float max_of(const float* __restrict x, int64_t n) {
  float lanes[16];
  for (float& lane : lanes) lane = kNegInf;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int64_t k = 0; k < 16; ++k) lanes[k] = lanes[k] < x[j + k] ? x[j + k] : lanes[k];
  float m = kNegInf;
  for (float lane : lanes) m = std::max(m, lane);
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// Row `slot`'s vector of KV head `head` as float32: the pool's own memory for float32 pools,
// else converted into `buf`.
template <typename kv_t>
inline const float* kv_row(const kv_t* base, int64_t slot, int64_t row_stride, int64_t head,
                           int64_t dim, float* buf) {
  const kv_t* src = base + slot * row_stride + head * dim;
  if constexpr (std::is_same_v<kv_t, float>) {
    return src;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) buf[i] = to_float(src[i]);
    return buf;
  }
}

// Online-softmax state of `rows` query vectors.
struct SoftmaxState {
  std::vector<float> max, sum, acc;  // [rows], [rows], [rows * dv]
  void reset(int64_t rows, int64_t dv) {
    max.assign(rows, kNegInf);
    sum.assign(rows, 0.f);
    acc.assign(rows * dv, 0.f);
  }
};

struct Scratch {
  std::vector<float> q, scores, keys, keys_t, values, zeros;
  std::vector<int64_t> visible, first_visible;
};

// Runs fn(b, local, st, sc) in parallel for every work item, where request b owns items
// [first_item[b], first_item[b + 1]) and `local` counts from 0 within them; st and sc are the
// calling thread's own.
template <typename Fn>
void for_each_item(const std::vector<int64_t>& first_item, const Fn& fn) {
  arbor_cpu::parallel_for(0, first_item.back(), 1, [&](int64_t begin, int64_t end) {
    SoftmaxState st;
    Scratch sc;
    int64_t b =
        std::upper_bound(first_item.begin(), first_item.end(), begin) - first_item.begin() - 1;
    for (int64_t item = begin; item < end; ++item) {
      while (item >= first_item[b + 1]) ++b;
      fn(b, item - first_item[b], st, sc);
    }
  });
}

// Attend `rows` scaled float32 queries (`q`, [rows, dim]) over key positions [lo, hi) of one
// sequence (`slots` maps position -> pool slot) and KV head `head`, updating `st`. A query row
// r sees key position p only when p <= visible[r] and p >= first_visible[r] (nullptr: no bound
// on that side). aligned (deterministic mode): blocks start at multiples of kKeyBlock, the
// positions of the first one before lo unread (zero keys, masked), and each block is scored
// and summed the same way whatever its rows and keys, so a row's result does not depend on lo,
// on hi past its last visible key, or on the rows beside it.
template <typename kv_t>
void attend(const float* q, int64_t rows, int64_t dim, int64_t dv, const kv_t* k_buf,
            const kv_t* v_buf, int64_t k_stride, int64_t v_stride, int64_t head,
            const int64_t* slots, int64_t lo, int64_t hi, const int64_t* visible,
            const int64_t* first_visible, bool aligned, SoftmaxState& st, Scratch& sc) {
  sc.scores.resize(rows * kKeyBlock);
  sc.keys.resize(kKeyBlock * dim);
  sc.values.resize(kKeyBlock * dv);
  const bool blocked = aligned || rows >= kScoreRows;  // scored by score_block
  if (blocked) sc.keys_t.resize(dim * kKeyBlock);
  if (aligned) sc.zeros.assign(std::max(dim, dv), 0.f);
  const float* krows[kKeyBlock];
  float* scores = sc.scores.data();
  for (int64_t start = lo; start < hi;) {
    const int64_t base = aligned ? start - start % kKeyBlock : start;  // the block's position 0
    const int64_t skip = start - base;  // its positions before lo
    const int64_t n = std::min(kKeyBlock, hi - base);
    for (int64_t j = 0; j < skip; ++j) krows[j] = sc.zeros.data();
    for (int64_t j = skip; j < n; ++j)
      krows[j] = kv_row(k_buf, slots[base + j], k_stride, head, dim, sc.keys.data() + j * dim);
    if (blocked) {
      score_block(q, rows, dim, krows, n, sc.keys_t.data(), scores);
    } else {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < n; ++j) scores[r * kKeyBlock + j] = dot(q + r * dim, krows[j], dim);
    }
    if (visible)  // causal: row r sees key positions up to visible[r]
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = scores + r * kKeyBlock;
        for (int64_t j = std::max<int64_t>(0, visible[r] - base + 1); j < n; ++j) sr[j] = kNegInf;
      }
    if (first_visible)  // sliding window: row r sees key positions from first_visible[r] on
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = scores + r * kKeyBlock;
        const int64_t end = std::min(n, first_visible[r] - base);
        for (int64_t j = 0; j < end; ++j) sr[j] = kNegInf;
      }
    for (int64_t r = 0; r < rows && skip > 0; ++r)
      for (int64_t j = 0; j < skip; ++j) scores[r * kKeyBlock + j] = kNegInf;
    bool any = false;
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = scores + r * kKeyBlock;
      const float block_max = max_of(sr, n);
      if (block_max == kNegInf) {  // nothing visible to this row in the block
        for (int64_t j = 0; j < n; ++j) sr[j] = 0.f;
        continue;
      }
      any = true;
      const float new_max = std::max(st.max[r], block_max);
      const float alpha = std::exp(st.max[r] - new_max);  // exp(-inf) = 0 on the first block
      float block_sum = 0.f;
      if (aligned) {  // summed over the whole block, zeros past n: one order for every n
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) sr[j] = exp_nonpositive(sr[j] - new_max);
        for (int64_t j = n; j < kKeyBlock; ++j) sr[j] = 0.f;
#pragma omp simd reduction(+ : block_sum)
        for (int64_t j = 0; j < kKeyBlock; ++j) block_sum += sr[j];
      } else {
#pragma omp simd reduction(+ : block_sum)
        for (int64_t j = 0; j < n; ++j) {
          sr[j] = exp_nonpositive(sr[j] - new_max);
          block_sum += sr[j];
        }
      }
      st.sum[r] = st.sum[r] * alpha + block_sum;
      st.max[r] = new_max;
      if (alpha != 1.f) {
        float* ar = st.acc.data() + r * dv;
#pragma omp simd
        for (int64_t i = 0; i < dv; ++i) ar[i] *= alpha;
      }
    }
    start = base + n;
    if (!any) continue;
    const float* vrows[kKeyBlock];
    for (int64_t j = 0; j < skip; ++j) vrows[j] = sc.zeros.data();
    for (int64_t j = skip; j < n; ++j)
      vrows[j] = kv_row(v_buf, slots[base + j], v_stride, head, dv, sc.values.data() + j * dv);
    accumulate_values(scores, rows, n, vrows, dv, st.acc.data());
  }
}

// Copy `group` query heads starting at head `h0` of token `t` into sc.q, scaled.
template <typename q_t>
inline void load_queries(const q_t* q, int64_t t, int64_t h0, int64_t group, int64_t dim,
                         int64_t q_stride_t, int64_t q_stride_h, float scale, float* dst) {
  for (int64_t g = 0; g < group; ++g) {
    const q_t* src = q + t * q_stride_t + (h0 + g) * q_stride_h;
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) dst[g * dim + i] = to_float(src[i]) * scale;
  }
}

// Normalise row r of `st` into out (dv values) and return its log-sum-exp.
template <typename o_t>
inline float store_row(const SoftmaxState& st, int64_t r, int64_t dv, o_t* out) {
  const float s = st.sum[r];
  const float inv = s > 0.f ? 1.f / s : 0.f;
  const float* ar = st.acc.data() + r * dv;
  for (int64_t i = 0; i < dv; ++i) out[i] = from_float<o_t>(ar[i] * inv);
  return s > 0.f ? st.max[r] + std::log(s) : kNegInf;
}

struct Geometry {
  int64_t heads, kv_heads, group, dim, dv, k_stride, v_stride, q_stride_t, q_stride_h, table_stride;
};

Geometry geometry(const torch::Tensor& q, const torch::Tensor& k_buf, const torch::Tensor& v_buf,
                  const torch::Tensor& table) {
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3, "q, k_buffer, v_buffer: 3-D");
  TORCH_CHECK(q.stride(2) == 1, "q's last dimension must be contiguous");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous(), "K/V buffers must be contiguous");
  TORCH_CHECK(table.scalar_type() == torch::kInt64 && table.is_contiguous(),
              "req_to_token must be a contiguous int64 tensor");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type(), "K and V buffers differ in dtype");
  Geometry g;
  g.heads = q.size(1);
  g.kv_heads = k_buf.size(1);
  TORCH_CHECK(g.kv_heads > 0 && g.heads % g.kv_heads == 0, "query heads must be a multiple of KV heads");
  g.group = g.heads / g.kv_heads;
  g.dim = q.size(2);
  TORCH_CHECK(k_buf.size(2) == g.dim, "q and K head dims differ");
  g.dv = v_buf.size(2);
  g.k_stride = k_buf.size(1) * k_buf.size(2);
  g.v_stride = v_buf.size(1) * v_buf.size(2);
  g.q_stride_t = q.stride(0);
  g.q_stride_h = q.stride(1);
  g.table_stride = table.size(1);
  return g;
}

// Runs fn(q_p, out_p, k_p, v_p) with the typed data pointers of q and out (q's float dtype) and
// of the K/V pools (theirs, which may differ).
template <typename Fn>
void with_typed_buffers(const torch::Tensor& q, torch::Tensor& out, const torch::Tensor& k_buf,
                        const torch::Tensor& v_buf, const Fn& fn) {
  ARBOR_DISPATCH_FLOAT(q.scalar_type(), q_t, [&] {
    ARBOR_DISPATCH_FLOAT(k_buf.scalar_type(), kv_t, [&] {
      fn(q.data_ptr<q_t>(), out.data_ptr<q_t>(), k_buf.data_ptr<kv_t>(), v_buf.data_ptr<kv_t>());
    });
  });
}

torch::Tensor as_i64(const torch::Tensor& t) { return t.to(torch::kInt64).contiguous(); }

// Decode: one query token per request over key positions [kv_start[b], seq_lens[b]), and with a
// sliding window (window > 0) over the last `window` positions of that range at most. Returns
// (out [B, H, Dv] in q's dtype, lse [B, H] float32).
TensorPair decode_attention(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf,
                            torch::Tensor table, torch::Tensor rows_t, torch::Tensor kv_start_t,
                            torch::Tensor seq_lens_t, double sm_scale, int64_t window) {
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
  const Geometry g = geometry(q, k_buf, v_buf, table);
  const int64_t batch = q.size(0);
  auto rows = as_i64(rows_t), seq_lens = as_i64(seq_lens_t);
  const bool has_start = kv_start_t.numel() > 0;
  auto kv_start = has_start ? as_i64(kv_start_t) : rows;
  auto out = torch::empty({batch, g.heads, g.dv}, q.options());
  auto lse = torch::empty({batch, g.heads}, q.options().dtype(torch::kFloat32));
  if (batch == 0) return {out, lse};
  const int64_t* row_p = rows.data_ptr<int64_t>();
  const int64_t* len_p = seq_lens.data_ptr<int64_t>();
  const int64_t* start_p = has_start ? kv_start.data_ptr<int64_t>() : nullptr;
  const int64_t* table_p = table.data_ptr<int64_t>();
  // Request b's first key position: keys before it are never read.
  auto first_key = [&](int64_t b) {
    const int64_t lo = start_p ? start_p[b] : 0;
    return window > 0 ? std::max(lo, len_p[b] - window) : lo;
  };

  // Split long sequences over keys when (request, KV head) pairs alone cannot fill the threads;
  // never in deterministic mode, where the split would depend on the batch and the threads.
  const bool aligned = arbor_cpu::deterministic_mode();
  const int64_t threads = at::get_num_threads();
  const int64_t pairs = batch * g.kv_heads;
  int64_t max_splits = 1;
  if (pairs < 4 * threads && !aligned)
    max_splits = std::max<int64_t>(1, (4 * threads + pairs - 1) / pairs);
  std::vector<int64_t> splits(batch), first_item(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t keys = std::max<int64_t>(0, len_p[b] - first_key(b));
    splits[b] = std::clamp<int64_t>(keys / kMinSplitKeys, 1, max_splits);
    first_item[b + 1] = first_item[b] + splits[b] * g.kv_heads;
  }
  const int64_t most_splits = *std::max_element(splits.begin(), splits.end());
  torch::Tensor part_out, part_lse;
  float* part_out_p = nullptr;
  float* part_lse_p = nullptr;
  if (most_splits > 1) {
    part_out = torch::empty({batch, g.heads, most_splits, g.dv}, lse.options());
    part_lse = torch::full({batch, g.heads, most_splits}, kNegInf, lse.options());
    part_out_p = part_out.data_ptr<float>();
    part_lse_p = part_lse.data_ptr<float>();
  }
  float* lse_p = lse.data_ptr<float>();
  const float scale = static_cast<float>(sm_scale);

  with_typed_buffers(q, out, k_buf, v_buf, [&](const auto* q_p, auto* out_p, const auto* k_p,
                                               const auto* v_p) {
    using q_t = std::remove_cv_t<std::remove_pointer_t<decltype(out_p)>>;
    for_each_item(first_item, [&](int64_t b, int64_t local, SoftmaxState& st, Scratch& sc) {
      sc.q.resize(g.group * g.dim);
      const int64_t head = local / splits[b], split = local % splits[b];
      const int64_t lo = first_key(b), hi = len_p[b];
      const int64_t keys = std::max<int64_t>(0, hi - lo);
      const int64_t per = (keys + splits[b] - 1) / splits[b];
      const int64_t s_lo = std::min(hi, lo + split * per), s_hi = std::min(hi, s_lo + per);
      load_queries(q_p, b, head * g.group, g.group, g.dim, g.q_stride_t, g.q_stride_h, scale,
                   sc.q.data());
      st.reset(g.group, g.dv);
      attend(sc.q.data(), g.group, g.dim, g.dv, k_p, v_p, g.k_stride, g.v_stride, head,
             table_p + row_p[b] * g.table_stride, s_lo, s_hi, nullptr, nullptr, aligned, st, sc);
      for (int64_t r = 0; r < g.group; ++r) {
        const int64_t h = head * g.group + r;
        if (splits[b] == 1) {
          lse_p[b * g.heads + h] =
              store_row(st, r, g.dv, out_p + (b * g.heads + h) * g.dv);
        } else {
          const int64_t at = (b * g.heads + h) * most_splits + split;
          part_lse_p[at] = store_row(st, r, g.dv, part_out_p + at * g.dv);
        }
      }
    });
    if (most_splits == 1) return;
    arbor_cpu::parallel_for(0, batch * g.heads, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(g.dv);
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / g.heads;
        if (splits[b] == 1) continue;
        const float* pl = part_lse_p + bh * most_splits;
        float m = kNegInf;
        for (int64_t s = 0; s < splits[b]; ++s) m = std::max(m, pl[s]);
        std::fill(acc.begin(), acc.end(), 0.f);
        float total = 0.f;
        if (m != kNegInf) {
          for (int64_t s = 0; s < splits[b]; ++s) {
            const float w = std::exp(pl[s] - m);
            if (w == 0.f) continue;
            total += w;
            const float* po = part_out_p + (bh * most_splits + s) * g.dv;
            for (int64_t i = 0; i < g.dv; ++i) acc[i] += w * po[i];
          }
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t i = 0; i < g.dv; ++i) out_p[bh * g.dv + i] = from_float<q_t>(acc[i] * inv);
        lse_p[bh] = total > 0.f ? m + std::log(total) : kNegInf;
      }
    });
  });
  return {out, lse};
}

// RMSNorm of one head into `out` (scalar_t), as rms_norm does a row: float32 sum of squares,
// the normalised value rounded to scalar_t, then scaled by the weight.
template <typename scalar_t>
inline void norm_head(const scalar_t* x, const scalar_t* w, int64_t dim, float eps,
                      scalar_t* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < dim; ++i) ss += to_float(x[i]) * to_float(x[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
  for (int64_t i = 0; i < dim; ++i) {
    const scalar_t normed = static_cast<scalar_t>(to_float(x[i]) * inv);
    out[i] = static_cast<scalar_t>(to_float(w[i]) * to_float(normed));
  }
}

// The attention of a decode batch in one call, from the QKV projection's output: split qkv
// [B, (H + 2 Hkv) D] into heads, RMSNorm q and k per head when their weights are given (numel
// > 0), rotate them, write each request's K/V at out_cache_loc[b] (in the pool's dtype), then
// decode attention over each whole sequence (its last `window` keys when window > 0). Returns
// [B, H * D] in qkv's dtype.
torch::Tensor decode_self_attention(torch::Tensor qkv, torch::Tensor cos_t, torch::Tensor sin_t,
                                    torch::Tensor q_norm_t, torch::Tensor k_norm_t, double eps,
                                    torch::Tensor k_buf, torch::Tensor v_buf,
                                    torch::Tensor out_cache_loc, torch::Tensor table,
                                    torch::Tensor rows, torch::Tensor seq_lens, double sm_scale,
                                    int64_t window) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv: [B, (H + 2 Hkv) D], rows contiguous");
  TORCH_CHECK(k_buf.dim() == 3 && k_buf.is_contiguous() && v_buf.is_contiguous() &&
                  k_buf.sizes() == v_buf.sizes() && k_buf.scalar_type() == v_buf.scalar_type(),
              "K/V buffers: contiguous [S, Hkv, D] of one dtype");
  const int64_t batch = qkv.size(0), kv_heads = k_buf.size(1), dim = k_buf.size(2);
  const int64_t heads = qkv.size(1) / dim - 2 * kv_heads;
  TORCH_CHECK(heads > 0 && (heads + 2 * kv_heads) * dim == qkv.size(1),
              "qkv's width is not (H + 2 Hkv) D for the pool's Hkv and D");
  auto c = cos_t.to(torch::kFloat32).contiguous(), s = sin_t.to(torch::kFloat32).contiguous();
  TORCH_CHECK(c.size(0) == batch && c.size(1) == dim, "cos/sin: [B, D]");
  auto locs = as_i64(out_cache_loc);
  TORCH_CHECK(locs.numel() == batch, "out_cache_loc: one slot per request");
  const bool qk_norm = q_norm_t.numel() > 0;
  TORCH_CHECK(!qk_norm || (q_norm_t.numel() == dim && k_norm_t.numel() == dim),
              "q/k norm weights: [D] each, or both empty");
  auto q_norm = qk_norm ? q_norm_t.to(qkv.scalar_type()).contiguous() : q_norm_t;
  auto k_norm = qk_norm ? k_norm_t.to(qkv.scalar_type()).contiguous() : k_norm_t;
  auto q = torch::empty({batch, heads, dim}, qkv.options());
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  const int64_t* loc_p = locs.data_ptr<int64_t>();
  const int64_t width = qkv.stride(0), row_stride = kv_heads * dim, half = dim / 2;
  const int64_t slots = k_buf.size(0);
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(loc_p[b] >= 0 && loc_p[b] < slots, "out_cache_loc outside the KV pool");
  ARBOR_DISPATCH_FLOAT(qkv.scalar_type(), q_t, [&] {
    ARBOR_DISPATCH_FLOAT(k_buf.scalar_type(), kv_t, [&] {
      const q_t* src = qkv.data_ptr<q_t>();
      const q_t* qn = qk_norm ? q_norm.data_ptr<q_t>() : nullptr;
      const q_t* kn = qk_norm ? k_norm.data_ptr<q_t>() : nullptr;
      q_t* q_p = q.data_ptr<q_t>();
      kv_t* k_p = k_buf.data_ptr<kv_t>();
      kv_t* v_p = v_buf.data_ptr<kv_t>();
      arbor_cpu::parallel_for(0, batch, 16, [&](int64_t begin, int64_t end) {
        std::vector<q_t> normed(dim), rotated(dim);
        for (int64_t b = begin; b < end; ++b) {
          const q_t* row = src + b * width;
          const float* cb = cp + b * dim;
          const float* sb = sp + b * dim;
          for (int64_t h = 0; h < heads + kv_heads; ++h) {
            const q_t* x = row + h * dim;
            const bool is_q = h < heads;
            if (qk_norm) {
              norm_head(x, is_q ? qn : kn, dim, static_cast<float>(eps), normed.data());
              x = normed.data();
            }
            if (is_q) {
              arbor_cpu::rotate_head(x, cb, sb, half, q_p + (b * heads + h) * dim);
              continue;
            }
            arbor_cpu::rotate_head(x, cb, sb, half, rotated.data());
            kv_t* k_dst = k_p + loc_p[b] * row_stride + (h - heads) * dim;
            for (int64_t i = 0; i < dim; ++i) k_dst[i] = static_cast<kv_t>(to_float(rotated[i]));
          }
          const q_t* v_src = row + (heads + kv_heads) * dim;
          kv_t* v_dst = v_p + loc_p[b] * row_stride;
          for (int64_t i = 0; i < row_stride; ++i) v_dst[i] = static_cast<kv_t>(to_float(v_src[i]));
        }
      });
    });
  });
  auto no_start = torch::empty({0}, locs.options());
  auto out = std::get<0>(
      decode_attention(q, k_buf, v_buf, table, rows, no_start, seq_lens, sm_scale, window));
  return out.view({batch, heads * dim});
}

// Extend: request b's extend_lens[b] new tokens (packed back to back in q) at positions
// seq_lens[b] - extend_lens[b] + i, each seeing keys 0 .. its own position p, or p - window + 1
// .. p with a sliding window (window > 0). Returns [T, H, Dv].
torch::Tensor extend_attention(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf,
                               torch::Tensor table, torch::Tensor rows_t,
                               torch::Tensor seq_lens_t, torch::Tensor extend_lens_t,
                               double sm_scale, int64_t window) {
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
  const Geometry g = geometry(q, k_buf, v_buf, table);
  auto rows = as_i64(rows_t), seq_lens = as_i64(seq_lens_t), ext_lens = as_i64(extend_lens_t);
  const int64_t batch = rows.size(0);
  auto out = torch::empty({q.size(0), g.heads, g.dv}, q.options());
  if (batch == 0 || q.size(0) == 0) return out;
  const int64_t* row_p = rows.data_ptr<int64_t>();
  const int64_t* len_p = seq_lens.data_ptr<int64_t>();
  const int64_t* ext_p = ext_lens.data_ptr<int64_t>();
  const int64_t* table_p = table.data_ptr<int64_t>();
  // Work items: (request, query block, KV head), numbered request by request.
  std::vector<int64_t> token_start(batch + 1, 0), first_item(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b) {
    token_start[b + 1] = token_start[b] + ext_p[b];
    const int64_t blocks = (ext_p[b] + kQueryBlock - 1) / kQueryBlock;
    first_item[b + 1] = first_item[b] + blocks * g.kv_heads;
  }
  TORCH_CHECK(token_start[batch] == q.size(0), "sum(extend_lens) must equal q's token count");
  const float scale = static_cast<float>(sm_scale);
  const bool aligned = arbor_cpu::deterministic_mode();

  with_typed_buffers(q, out, k_buf, v_buf, [&](const auto* q_p, auto* out_p, const auto* k_p,
                                               const auto* v_p) {
    for_each_item(first_item, [&](int64_t b, int64_t local, SoftmaxState& st, Scratch& sc) {
      std::vector<int64_t>& visible = sc.visible;
      const int64_t block = local / g.kv_heads, head = local % g.kv_heads;
      const int64_t prefix = len_p[b] - ext_p[b];
      const int64_t i0 = block * kQueryBlock, i1 = std::min(ext_p[b], i0 + kQueryBlock);
      const int64_t rows_n = (i1 - i0) * g.group;
      sc.q.resize(rows_n * g.dim);
      visible.resize(rows_n);
      for (int64_t i = i0; i < i1; ++i) {
        load_queries(q_p, token_start[b] + i, head * g.group, g.group, g.dim, g.q_stride_t,
                     g.q_stride_h, scale, sc.q.data() + (i - i0) * g.group * g.dim);
        for (int64_t r = 0; r < g.group; ++r) visible[(i - i0) * g.group + r] = prefix + i;
      }
      st.reset(rows_n, g.dv);
      const int64_t* slots = table_p + row_p[b] * g.table_stride;
      if (window > 0) {
        // From the block's first query's window on (no query of the block sees a key before
        // it), each row bounded on both sides.
        std::vector<int64_t>& first_visible = sc.first_visible;
        first_visible.resize(rows_n);
        for (int64_t r = 0; r < rows_n; ++r) first_visible[r] = visible[r] - window + 1;
        attend(sc.q.data(), rows_n, g.dim, g.dv, k_p, v_p, g.k_stride, g.v_stride, head, slots,
               std::max<int64_t>(0, prefix + i0 - window + 1), prefix + i1, visible.data(),
               first_visible.data(), aligned, st, sc);
      } else if (aligned) {  // one pass, its blocks where decode's are
        attend(sc.q.data(), rows_n, g.dim, g.dv, k_p, v_p, g.k_stride, g.v_stride, head, slots,
               0, prefix + i1, visible.data(), nullptr, true, st, sc);
      } else {
        // Keys every query of the block sees need no mask; the causal tail does.
        attend(sc.q.data(), rows_n, g.dim, g.dv, k_p, v_p, g.k_stride, g.v_stride, head, slots,
               0, prefix + i0 + 1, nullptr, nullptr, false, st, sc);
        attend(sc.q.data(), rows_n, g.dim, g.dv, k_p, v_p, g.k_stride, g.v_stride, head, slots,
               prefix + i0 + 1, prefix + i1, visible.data(), nullptr, false, st, sc);
      }
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t r = 0; r < g.group; ++r) {
          const int64_t t = token_start[b] + i, h = head * g.group + r;
          store_row(st, (i - i0) * g.group + r, g.dv, out_p + (t * g.heads + h) * g.dv);
        }
    });
  });
  return out;
}

// Shared prefix (cascade): group g's queries, rows sharer_offsets[g] .. sharer_offsets[g + 1]
// of q, attend to key positions [0, prefix_lens[g]) of table row prefix_rows[g]. A work item is
// (group, KV head, block of sharers): the block's queries of that head's GQA group are scored
// together, so each prefix key row is read once per block instead of once per sharer, and no
// K/V is gathered. Returns (out [N, H, Dv] in q's dtype, lse [N, H] float32).
TensorPair shared_prefix_attention(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf,
                                   torch::Tensor table, torch::Tensor prefix_rows_t,
                                   torch::Tensor offsets_t, torch::Tensor prefix_lens_t,
                                   double sm_scale) {
  const Geometry g = geometry(q, k_buf, v_buf, table);
  auto prefix_rows = as_i64(prefix_rows_t), offsets = as_i64(offsets_t);
  auto prefix_lens = as_i64(prefix_lens_t);
  const int64_t groups = prefix_rows.size(0);
  TORCH_CHECK(offsets.size(0) == groups + 1 && prefix_lens.size(0) == groups,
              "sharer_offsets must hold one more entry than prefix_rows and prefix_lens");
  const int64_t n = q.size(0);
  auto out = torch::empty({n, g.heads, g.dv}, q.options());
  auto lse = torch::empty({n, g.heads}, q.options().dtype(torch::kFloat32));
  if (groups == 0) return {out, lse};
  const int64_t* row_p = prefix_rows.data_ptr<int64_t>();
  const int64_t* off_p = offsets.data_ptr<int64_t>();
  const int64_t* len_p = prefix_lens.data_ptr<int64_t>();
  const int64_t* table_p = table.data_ptr<int64_t>();
  TORCH_CHECK(off_p[0] == 0 && off_p[groups] == n, "sharer_offsets must run from 0 to q's rows");
  // Sharers per item: enough rows to reuse each transposed key tile, bounded so the items of
  // one large group still spread over the threads.
  constexpr int64_t kSharerBlock = 32;
  std::vector<int64_t> blocks(groups), first_item(groups + 1, 0);
  for (int64_t b = 0; b < groups; ++b) {
    const int64_t sharers = off_p[b + 1] - off_p[b];
    TORCH_CHECK(sharers >= 0, "sharer_offsets must not decrease");
    TORCH_CHECK(len_p[b] >= 0 && len_p[b] <= g.table_stride, "prefix length out of range");
    TORCH_CHECK(row_p[b] >= 0 && row_p[b] < table.size(0), "prefix row out of range");
    blocks[b] = (sharers + kSharerBlock - 1) / kSharerBlock;
    first_item[b + 1] = first_item[b] + blocks[b] * g.kv_heads;
  }
  float* lse_p = lse.data_ptr<float>();
  const float scale = static_cast<float>(sm_scale);

  with_typed_buffers(q, out, k_buf, v_buf, [&](const auto* q_p, auto* out_p, const auto* k_p,
                                               const auto* v_p) {
    for_each_item(first_item, [&](int64_t b, int64_t local, SoftmaxState& st, Scratch& sc) {
      const int64_t block = local / g.kv_heads, head = local % g.kv_heads;
      const int64_t t0 = off_p[b] + block * kSharerBlock;
      const int64_t t1 = std::min(off_p[b + 1], t0 + kSharerBlock);
      const int64_t rows_n = (t1 - t0) * g.group;
      sc.q.resize(rows_n * g.dim);
      for (int64_t t = t0; t < t1; ++t)
        load_queries(q_p, t, head * g.group, g.group, g.dim, g.q_stride_t, g.q_stride_h, scale,
                     sc.q.data() + (t - t0) * g.group * g.dim);
      st.reset(rows_n, g.dv);
      attend(sc.q.data(), rows_n, g.dim, g.dv, k_p, v_p, g.k_stride, g.v_stride, head,
             table_p + row_p[b] * g.table_stride, 0, len_p[b], nullptr, nullptr, false, st, sc);
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t r = 0; r < g.group; ++r) {
          const int64_t h = head * g.group + r;
          lse_p[t * g.heads + h] =
              store_row(st, (t - t0) * g.group + r, g.dv, out_p + (t * g.heads + h) * g.dv);
        }
    });
  });
  return {out, lse};
}

// In place: (out_a, lse_a) becomes the softmax-weighted merge of attention states a and b
// (each normalised over its own keys, with its log-sum-exp), as if over the union of keys.
void merge_attention_states(torch::Tensor out_a, torch::Tensor lse_a, torch::Tensor out_b,
                            torch::Tensor lse_b) {
  TORCH_CHECK(out_a.is_contiguous() && out_b.is_contiguous(), "merge: contiguous outputs");
  TORCH_CHECK(out_a.sizes() == out_b.sizes() && lse_a.sizes() == lse_b.sizes(), "merge: shapes");
  TORCH_CHECK(lse_a.scalar_type() == torch::kFloat32 && lse_b.scalar_type() == torch::kFloat32,
              "merge: lse must be float32");
  const int64_t n = lse_a.numel(), dv = out_a.numel() / std::max<int64_t>(n, 1);
  float* la = lse_a.data_ptr<float>();
  const float* lb = lse_b.contiguous().data_ptr<float>();
  ARBOR_DISPATCH_FLOAT(out_a.scalar_type(), q_t, [&] {
    q_t* oa = out_a.data_ptr<q_t>();
    const q_t* ob = out_b.data_ptr<q_t>();
    arbor_cpu::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const float m = std::max(la[i], lb[i]);
        if (m == kNegInf) continue;
        const float wa = std::exp(la[i] - m), wb = std::exp(lb[i] - m);
        const float inv = 1.f / (wa + wb);
        for (int64_t d = 0; d < dv; ++d)
          oa[i * dv + d] = from_float<q_t>(
              (wa * to_float(oa[i * dv + d]) + wb * to_float(ob[i * dv + d])) * inv);
        la[i] = m + std::log(wa + wb);
      }
    });
  });
}

}  // namespace

void register_attention(pybind11::module& m) {
  // The kernels touch no Python object: other threads (the detokenizer, the HTTP server) run
  // while they do, as they do during torch's own ops.
  const auto release = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("decode_attention", &decode_attention, release);
  m.def("decode_self_attention", &decode_self_attention, release);
  m.def("extend_attention", &extend_attention, release);
  m.def("shared_prefix_attention", &shared_prefix_attention, release);
  m.def("merge_attention_states", &merge_attention_states, release);
}
