// Decode attention for the CPU: one query per running row against that row's own cached
// keys and values, read where they lie in the running batch's buffers (engine/kv.py) and
// skipping the columns its mask leaves out (engine/decode_attention.py says why).
//
// Built with AVX2 and FMA where torch found them (engine/decode_attention.py's flags), a head
// dimension that is a multiple of 8 runs the vector path: four columns' dot products at once
// (independent accumulators, one horizontal sum for the four), the softmax's exponentials
// eight at a time, and the weighted sum of values with the output held in registers across
// all the columns. Anything else runs the plain loops, which compute the same.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FERRY_AVX2 1
#endif

namespace {

#ifdef FERRY_AVX2

// exp of eight floats: Cephes' expf (range reduction by ln 2, a degree-5 polynomial), as in
// avx_mathfun; relative error ~1e-7 over the softmax's range (inputs <= 0 there).
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), half = _mm256_set1_ps(0.5f);
  const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 is_neg_inf = _mm256_cmp_ps(x, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
  x = _mm256_min_ps(hi, _mm256_max_ps(lo, x));  // clamped; a NaN stays NaN (min/max return their second operand)
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, log2e, half));
  x = _mm256_fnmadd_ps(fx, c1, x);
  x = _mm256_fnmadd_ps(fx, c2, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, half);
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, one));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
  return _mm256_andnot_ps(is_neg_inf, y);  // exp(-inf) = 0 exactly
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// w[j] = scale * q . k(cols[j]) for the n kept columns; dim a multiple of 8.
inline void scores8(const float* q, const float* kb, int64_t ks2, const int64_t* cols, int64_t n, int64_t dim,
                    float scale, float* w) {
  const __m128 sc = _mm_set1_ps(scale);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const float* k0 = kb + cols[j] * ks2;
    const float* k1 = kb + cols[j + 1] * ks2;
    const float* k2 = kb + cols[j + 2] * ks2;
    const float* k3 = kb + cols[j + 3] * ks2;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
      a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
      a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
      a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
    }
    // [a0 a1 a2 a3] summed across their lanes, four at once.
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    _mm_storeu_ps(w + j, _mm_mul_ps(s, sc));
  }
  for (; j < n; ++j) {
    const float* k = kb + cols[j] * ks2;
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a);
    w[j] = sum8(a) * scale;
  }
}

// w[j] = exp(w[j] - max w); returns their sum, the max in *top_out.
inline float softmax_numerators8(float* w, int64_t n, float* top_out) {
  __m256 top8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(w + j));
  float top = max8(top8);
  for (; j < n; ++j) top = std::max(top, w[j]);
  *top_out = top;
  const __m256 t = _mm256_set1_ps(top);
  __m256 total8 = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(w + j), t));
    _mm256_storeu_ps(w + j, e);
    total8 = _mm256_add_ps(total8, e);
  }
  float total = sum8(total8);
  for (; j < n; ++j) {
    w[j] = std::exp(w[j] - top);
    total += w[j];
  }
  return total;
}

// out[0:8*NV] = inv * sum_j w[j] * v(cols[j])[0:8*NV], the NV accumulators in registers.
template <int NV>
inline void weighted_values8(const float* vb, int64_t vs2, const int64_t* cols, const float* w, int64_t n, float inv,
                             float* out) {
  __m256 acc[NV];
  for (int u = 0; u < NV; ++u) acc[u] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* v = vb + cols[j] * vs2;
    const __m256 wj = _mm256_set1_ps(w[j]);
    for (int u = 0; u < NV; ++u) acc[u] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(v + 8 * u), acc[u]);
  }
  const __m256 s = _mm256_set1_ps(inv);
  for (int u = 0; u < NV; ++u) _mm256_storeu_ps(out + 8 * u, _mm256_mul_ps(acc[u], s));
}

inline void values8(const float* vb, int64_t vs2, const int64_t* cols, const float* w, int64_t n, int64_t dim,
                    float inv, float* out) {
  int64_t d = 0;  // widest blocks first: dim 64 is one pass over the columns, 128 two
  for (; d + 64 <= dim; d += 64) weighted_values8<8>(vb + d, vs2, cols, w, n, inv, out + d);
  for (; d + 32 <= dim; d += 32) weighted_values8<4>(vb + d, vs2, cols, w, n, inv, out + d);
  for (; d + 16 <= dim; d += 16) weighted_values8<2>(vb + d, vs2, cols, w, n, inv, out + d);
  for (; d + 8 <= dim; d += 8) weighted_values8<1>(vb + d, vs2, cols, w, n, inv, out + d);
}

#endif  // FERRY_AVX2

// The plain loops: any head dimension, any CPU.
void attend_plain(const float* qg, const float* kb, const float* vb, int64_t ks2, int64_t vs2, const int64_t* cols,
                  int64_t n, int64_t group, int64_t dim, float sc, float* weights, float* og, float* lse) {
  std::vector<float> total(group);
  for (int64_t j = 0; j < n; ++j) {
    const float* k = kb + cols[j] * ks2;
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = qg + h * dim;
      float s = 0.f;
      for (int64_t d = 0; d < dim; ++d) s += qh[d] * k[d];
      weights[h * n + j] = s * sc;
    }
  }
  for (int64_t h = 0; h < group; ++h) {  // softmax, in place
    float* w = weights + h * n;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) top = std::max(top, w[j]);
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      w[j] = std::exp(w[j] - top);
      sum += w[j];
    }
    total[h] = sum;
    if (lse != nullptr) lse[h] = top + std::log(sum);
  }
  std::fill(og, og + group * dim, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const float* v = vb + cols[j] * vs2;
    for (int64_t h = 0; h < group; ++h) {
      const float w = weights[h * n + j];
      float* o = og + h * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] += w * v[d];
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    const float inv = total[h] > 0.f ? 1.f / total[h] : 0.f;
    float* o = og + h * dim;
    for (int64_t d = 0; d < dim; ++d) o[d] *= inv;
  }
}

// One (row, KV head): the group of query heads qg [group, dim] against the n columns `cols`
// of keys kb and values vb (a column's token at cols[j] * stride), into og [group, dim] and,
// where lse is not null, each head's log-sum-exp (-inf where n is 0).
inline void attend_task(const float* qg, const float* kb, const float* vb, int64_t ks2, int64_t vs2,
                        const int64_t* cols, int64_t n, int64_t group, int64_t dim, float sc, float* weights, float* og,
                        float* lse) {
#ifdef FERRY_AVX2
  if (dim % 8 == 0) {
    for (int64_t h = 0; h < group; ++h) {
      float* w = weights + h * n;
      scores8(qg + h * dim, kb, ks2, cols, n, dim, sc, w);
      float top = -std::numeric_limits<float>::infinity();
      const float total = n > 0 ? softmax_numerators8(w, n, &top) : 0.f;
      const float inv = total > 0.f ? 1.f / total : 0.f;
      if (n > 0) {
        values8(vb, vs2, cols, w, n, dim, inv, og + h * dim);
      } else {
        std::fill(og + h * dim, og + (h + 1) * dim, 0.f);
      }
      if (lse != nullptr) lse[h] = n > 0 ? top + std::log(total) : -std::numeric_limits<float>::infinity();
    }
    return;
  }
#endif
  attend_plain(qg, kb, vb, ks2, vs2, cols, n, group, dim, sc, weights, og, lse);
  if (lse != nullptr && n == 0) std::fill(lse, lse + group, -std::numeric_limits<float>::infinity());
}

// query [rows, heads, dim]; keys, values [>= rows, kv_heads, width, dim] with the last dim
// contiguous (views into the slot buffers); mask [>= rows, width], nonzero = attend.
// Returns [rows, heads, dim]; a row with no column to attend gets zeros.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& mask, double scale) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 4 && values.dim() == 4 && mask.dim() == 2,
              "decode_attention: query [rows, heads, dim], keys/values [rows, kv_heads, width, dim], mask [rows, width]");
  TORCH_CHECK(query.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu() && mask.device().is_cpu(),
              "decode_attention: CPU tensors only");
  TORCH_CHECK(query.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat && mask.scalar_type() == at::kLong,
              "decode_attention: float32 query, keys and values; int64 mask");
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = keys.size(1), width = keys.size(2);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "decode_attention: heads not a multiple of kv_heads");
  TORCH_CHECK(keys.sizes() == values.sizes() && keys.size(3) == dim && keys.size(0) >= rows &&
                  mask.size(0) >= rows && mask.size(1) == width,
              "decode_attention: shapes disagree");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1 && mask.stride(1) == 1,
              "decode_attention: the last dims must be contiguous");
  const int64_t group = heads / kv_heads;  // query heads per KV head
  const at::Tensor q = query.contiguous();
  at::Tensor out = at::empty({rows, heads, dim}, query.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const int64_t* mp = mask.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), ks2 = keys.stride(2);
  const int64_t vs0 = values.stride(0), vs1 = values.stride(1), vs2 = values.stride(2);
  const int64_t ms0 = mask.stride(0);
  const float sc = static_cast<float>(scale);

  // One task per (row, KV head): its keys are read once for all the query heads they serve.
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> cols(width);
    std::vector<float> weights(width * group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, g = task % kv_heads;
      const int64_t* m = mp + r * ms0;
      int64_t n = 0;
      for (int64_t c = 0; c < width; ++c) {
        if (m[c] != 0) cols[n++] = c;
      }
      const int64_t first = (r * heads + g * group) * dim;
      attend_task(qp + first, kp + r * ks0 + g * ks1, vp + r * vs0 + g * vs1, ks2, vs2, cols.data(), n, group, dim, sc,
                  weights.data(), op + first, nullptr);
    }
  });
  return out;
}

// Decode attention over KV kept in blocks (engine/blocks.py): query [rows, heads, dim]; the
// pools [slots, kv_heads, dim] (one layer's keys and values, a token's heads side by side,
// the last dim contiguous); blocks [>= rows, max blocks] int64, row r's token j lying in pool
// slot blocks[r][j / block] * block + j % block; lengths [>= rows] int64, the tokens each row
// attends (its first ones). Returns (out [rows, heads, dim], log-sum-exp [rows, heads]), the
// second so a caller can merge it with attention over other keys (a shared prefix).
std::tuple<at::Tensor, at::Tensor> paged_decode_attention(const at::Tensor& query, const at::Tensor& key_pool,
                                                          const at::Tensor& value_pool, const at::Tensor& blocks,
                                                          const at::Tensor& lengths, int64_t block, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_pool.dim() == 3 && value_pool.dim() == 3 && blocks.dim() == 2 &&
                  lengths.dim() == 1,
              "paged_decode_attention: query [rows, heads, dim], pools [slots, kv_heads, dim], blocks [rows, n], "
              "lengths [rows]");
  TORCH_CHECK(query.device().is_cpu() && key_pool.device().is_cpu() && value_pool.device().is_cpu() &&
                  blocks.device().is_cpu() && lengths.device().is_cpu(),
              "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key_pool.scalar_type() == at::kFloat &&
                  value_pool.scalar_type() == at::kFloat && blocks.scalar_type() == at::kLong &&
                  lengths.scalar_type() == at::kLong,
              "paged_decode_attention: float32 query and pools; int64 blocks and lengths");
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t slots = key_pool.size(0), kv_heads = key_pool.size(1);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "paged_decode_attention: heads not a multiple of kv_heads");
  TORCH_CHECK(key_pool.sizes() == value_pool.sizes() && key_pool.size(2) == dim && blocks.size(0) >= rows &&
                  lengths.size(0) >= rows && block > 0,
              "paged_decode_attention: shapes disagree");
  TORCH_CHECK(key_pool.stride(2) == 1 && value_pool.stride(2) == 1 && blocks.stride(1) == 1,
              "paged_decode_attention: the last dims must be contiguous");
  const at::Tensor lens = lengths.contiguous();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* bp = blocks.data_ptr<int64_t>();
  const int64_t bs0 = blocks.stride(0), per_row = blocks.size(1);
  int64_t width = 0;
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(lp[r] >= 0 && lp[r] <= per_row * block, "paged_decode_attention: a row's length exceeds its blocks");
    width = std::max(width, lp[r]);
  }
  const int64_t group = heads / kv_heads;
  const at::Tensor q = query.contiguous();
  at::Tensor out = at::empty({rows, heads, dim}, query.options());
  at::Tensor lse = at::empty({rows, heads}, query.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = key_pool.data_ptr<float>();
  const float* vp = value_pool.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  const int64_t ks0 = key_pool.stride(0), ks1 = key_pool.stride(1);
  const int64_t vs0 = value_pool.stride(0), vs1 = value_pool.stride(1);
  const float sc = static_cast<float>(scale);
  bool in_pool = true;
  for (int64_t r = 0; r < rows && in_pool; ++r) {
    for (int64_t b = 0; b * block < lp[r]; ++b) {
      const int64_t id = bp[r * bs0 + b];
      if (id < 0 || (id + 1) * block > slots) {
        in_pool = false;
        break;
      }
    }
  }
  TORCH_CHECK(in_pool, "paged_decode_attention: a block id lies outside the pools");

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> cols(width);
    std::vector<float> weights(width * group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, g = task % kv_heads;
      const int64_t n = lp[r];
      const int64_t* row_blocks = bp + r * bs0;
      for (int64_t j = 0; j < n; ++j) cols[j] = row_blocks[j / block] * block + j % block;
      const int64_t first = (r * heads + g * group) * dim;
      attend_task(qp + first, kp + g * ks1, vp + g * vs1, ks0, vs0, cols.data(), n, group, dim, sc, weights.data(),
                  op + first, lsep + r * heads + g * group);
    }
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(ferry, m) {
  m.def("decode_attention(Tensor query, Tensor keys, Tensor values, Tensor mask, float scale) -> Tensor");
  m.def(
      "paged_decode_attention(Tensor query, Tensor key_pool, Tensor value_pool, Tensor blocks, Tensor lengths, "
      "int block, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ferry, CPU, m) {
  m.impl("decode_attention", decode_attention);
  m.impl("paged_decode_attention", paged_decode_attention);
}
