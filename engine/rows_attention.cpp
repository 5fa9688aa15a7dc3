// Attention over packed rows for the CPU: an encoder batch's rows lie token after token in one
// row (engine/packed_encoder.py), and each attends over its own tokens only (block-diagonal,
// no mask, no padding). One call per layer for every row and head, reading the query, key and
// value projections where they lie (any strides, the last dim contiguous) and writing the
// output in the [tokens, heads, dim] layout the output projection reads: no per-row dispatch,
// no slices, no concatenation. engine/rows_attention.py says why and what was measured.
//
// A (row, head) is one task. Its keys are copied once, transposed ([dim, columns], the columns
// rounded up to a vector's width), so that scores for a block of queries are a small matrix
// product: a vector of keys' values for one dim, times each query's value for that dim
// broadcast, into one accumulator per query (the micro-kernel of a GEMM). The softmax runs over
// the block's rows of scores with exponentials a vector at a time, and the weighted sum of
// values keeps each query's output in registers across the columns. The vectors are GCC's
// vector extensions: 16 floats where the build has AVX-512, 8 otherwise, the same code.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int vi __attribute__((vector_size(W * sizeof(int))));

constexpr int QB = 8;  // queries a block: 8 accumulators of scores, 8 x dim/W of values

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf splat(float x) { return vf{} + x; }

inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}
inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = std::max(m, v[i]);
  return m;
}

// exp of W floats at most 0 (scores less their row's maximum): 2^n by the float's exponent,
// the rest by Cephes' expf polynomial (degree 5 after a two-part reduction by ln 2, as in
// engine/decode_attention.cpp); relative error ~1e-7. Below -87 it gives exp(-87) (~1.6e-38,
// where a column past the row sits: nothing against a row's largest weight, 1), and a NaN
// stays NaN (kept aside: the exponent trick below would turn some NaN payloads into numbers).
inline vf exp_v(vf x) {
  const vi nan = x != x;
  const vf lo = splat(-87.0f);
  x = x < lo ? lo : x;  // a NaN compares false and stays NaN
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  vf fx = x * 1.44269504088896341f + magic;
  const vi n = (vi)fx - (vi)magic;
  fx = fx - magic;
  x = x - fx * 0.693359375f;
  x = x + fx * 2.12194440e-4f;
  vf y = splat(1.9875691500e-4f);
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 0.5f;
  y = y * (x * x) + (x + 1.f);
  y = (vf)((vi)y + (n << 23));  // times 2^n, by its exponent
  return nan ? x : y;
}

constexpr int KB = 2;  // vectors of keys a block of scores takes: QB x KB accumulators

// Scores of up to QB queries (q rows qs apart) over the keys kt ([dim, cols], cols a multiple
// of KB * W): s[i * cols + j] = scale * q_i . k_j, -inf past n (the row's columns); each
// query's largest score in top[i].
inline void scores(const float* q, int64_t qs, int nq, const float* kt, int64_t cols, int64_t n, int64_t dim,
                   float scale, float* s, float* top) {
  const float* qi[QB];
  for (int i = 0; i < QB; ++i) qi[i] = q + (i < nq ? i : 0) * qs;  // a short block repeats its first query
  vf best[QB];
  for (int i = 0; i < QB; ++i) best[i] = splat(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < cols; j += KB * W) {
    vf acc[QB][KB];
    for (int i = 0; i < QB; ++i)
      for (int u = 0; u < KB; ++u) acc[i][u] = vf{};
    const float* kj = kt + j;
    for (int64_t d = 0; d < dim; ++d) {
      vf k[KB];
      for (int u = 0; u < KB; ++u) k[u] = load(kj + d * cols + u * W);
      for (int i = 0; i < QB; ++i) {
        const float x = qi[i][d];
        for (int u = 0; u < KB; ++u) acc[i][u] += k[u] * x;
      }
    }
    for (int u = 0; u < KB; ++u) {
      const int64_t c = j + u * W;
      vf valid = splat(0.f);
      if (c + W > n) {
        for (int t = 0; t < W; ++t) valid[t] = c + t < n ? 0.f : -std::numeric_limits<float>::infinity();
      }
      for (int i = 0; i < nq; ++i) {
        const vf x = acc[i][u] * scale + valid;
        best[i] = x > best[i] ? x : best[i];
        store(s + i * cols + c, x);
      }
    }
  }
  for (int i = 0; i < nq; ++i) top[i] = hmax(best[i]);
}

// Each of the nq rows of s exponentiated less its maximum; 1 / its sum in inv.
inline void softmax_rows(float* s, int nq, int64_t cols, const float* top, float* inv) {
  for (int i = 0; i < nq; ++i) {
    float* r = s + i * cols;
    const vf t = splat(top[i]);
    vf total = vf{};
    for (int64_t j = 0; j < cols; j += W) {
      const vf e = exp_v(load(r + j) - t);
      store(r + j, e);
      total += e;
    }
    const float sum = hsum(total);
    inv[i] = sum > 0.f ? 1.f / sum : 0.f;
  }
}

// out_i = inv_i * sum_j p[i, j] v_j for NQ queries (outputs os apart); DV vectors of W floats
// make a head's dim. NQ x DV accumulators and DV values stay in registers.
template <int DV, int NQ>
inline void weighted_values(const float* p, int nq, int64_t cols, const float* v, int64_t vs, int64_t n,
                            const float* inv, float* out, int64_t os) {
  const float* pi[NQ];
  for (int i = 0; i < NQ; ++i) pi[i] = p + (i < nq ? i : 0) * cols;
  vf acc[NQ][DV];
  for (int i = 0; i < NQ; ++i)
    for (int u = 0; u < DV; ++u) acc[i][u] = vf{};
  for (int64_t j = 0; j < n; ++j) {
    vf vj[DV];
    for (int u = 0; u < DV; ++u) vj[u] = load(v + j * vs + u * W);
    for (int i = 0; i < NQ; ++i) {
      const float w = pi[i][j];
      for (int u = 0; u < DV; ++u) acc[i][u] += vj[u] * w;
    }
  }
  for (int i = 0; i < nq && i < NQ; ++i)
    for (int u = 0; u < DV; ++u) store(out + i * os + u * W, acc[i][u] * inv[i]);
}

// The block's queries in groups that keep their accumulators in registers (24 of 32 on AVX-512).
template <int DV>
inline void block_values(const float* p, int nq, int64_t cols, const float* v, int64_t vs, int64_t n,
                         const float* inv, float* out, int64_t os) {
  constexpr int NQ = DV >= 8 ? 2 : (DV >= 4 ? 4 : QB);
  for (int i = 0; i < nq; i += NQ)
    weighted_values<DV, NQ>(p + i * cols, nq - i, cols, v, vs, n, inv + i, out + i * os, os);
}

template <int DV>
void attend_rows(const float* qp, const float* kp, const float* vp, float* op, const int64_t* cuts, int64_t rows,
                 int64_t heads, int64_t qsh, int64_t qst, int64_t ksh, int64_t kst, int64_t vsh, int64_t vst,
                 float scale) {
  constexpr int64_t dim = DV * W;
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt, s;
    float inv[QB], top[QB];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / heads, h = task % heads;
      const int64_t lo = cuts[r], n = cuts[r + 1] - lo;
      if (n <= 0) continue;
      const int64_t cols = (n + KB * W - 1) / (KB * W) * (KB * W);
      kt.assign(dim * cols, 0.f);
      s.resize(QB * cols);
      const float* k = kp + h * ksh + lo * kst;
      for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < dim; ++d) kt[d * cols + j] = k[j * kst + d];
      const float* q = qp + h * qsh + lo * qst;
      const float* v = vp + h * vsh + lo * vst;
      float* o = op + (lo * heads + h) * dim;  // out [tokens, heads, dim]
      for (int64_t i = 0; i < n; i += QB) {
        const int nq = static_cast<int>(std::min<int64_t>(QB, n - i));
        scores(q + i * qst, qst, nq, kt.data(), cols, n, dim, scale, s.data(), top);
        softmax_rows(s.data(), nq, cols, top, inv);
        block_values<DV>(s.data(), nq, cols, v, vst, n, inv, o + i * heads * dim, heads * dim);
      }
    }
  });
}

// query, key, value [1, heads, tokens, dim] (any strides but the last dim's, 1); bounds
// [rows + 1] int64, the rows' token offsets (0 first, tokens last). Returns [1, tokens,
// heads, dim]: each row's tokens attended over that row's tokens only.
at::Tensor rows_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const at::Tensor& bounds, double scale) {
  TORCH_CHECK(query.dim() == 4 && query.size(0) == 1 && key.sizes() == query.sizes() &&
                  value.sizes() == query.sizes(),
              "rows_attention: query, key and value [1, heads, tokens, dim], one shape");
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
              "rows_attention: CPU tensors only");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat,
              "rows_attention: float32 only");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1,
              "rows_attention: the last dim must be contiguous");
  const int64_t heads = query.size(1), tokens = query.size(2), dim = query.size(3);
  const at::Tensor b = bounds.to(at::kLong).contiguous();
  const int64_t rows = b.numel() - 1;
  const int64_t* cuts = b.data_ptr<int64_t>();
  TORCH_CHECK(rows >= 0 && cuts[0] == 0 && cuts[rows] == tokens, "rows_attention: bounds must run from 0 to tokens");
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(cuts[r] <= cuts[r + 1], "rows_attention: bounds must not decrease");
  at::Tensor out = at::empty({1, tokens, heads, dim}, query.options());
  const float* qp = query.data_ptr<float>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t a = query.stride(1), c = query.stride(2), e = key.stride(1), f = key.stride(2);
  const int64_t g = value.stride(1), k = value.stride(2);
  switch (dim) {
    case W: attend_rows<1>(qp, kp, vp, op, cuts, rows, heads, a, c, e, f, g, k, sc); break;
    case 2 * W: attend_rows<2>(qp, kp, vp, op, cuts, rows, heads, a, c, e, f, g, k, sc); break;
    case 4 * W: attend_rows<4>(qp, kp, vp, op, cuts, rows, heads, a, c, e, f, g, k, sc); break;
    case 8 * W: attend_rows<8>(qp, kp, vp, op, cuts, rows, heads, a, c, e, f, g, k, sc); break;
    default: TORCH_CHECK(false, "rows_attention: head dim ", dim, " is not 1, 2, 4 or 8 vectors of ", W);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ferry, m) {
  m.def("rows_attention(Tensor query, Tensor key, Tensor value, Tensor bounds, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ferry, CPU, m) { m.impl("rows_attention", rows_attention); }
