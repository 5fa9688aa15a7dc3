// Decode attention for the CPU: one query per running row against that row's own cached
// keys and values, read where they lie in the running batch's buffers (engine/kv.py) and
// skipping the columns its mask leaves out (engine/decode_attention.py says why).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

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
    std::vector<float> total(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, g = task % kv_heads;
      const int64_t* m = mp + r * ms0;
      int64_t n = 0;
      for (int64_t c = 0; c < width; ++c) {
        if (m[c] != 0) cols[n++] = c;
      }
      const float* kb = kp + r * ks0 + g * ks1;
      const float* vb = vp + r * vs0 + g * vs1;
      const float* qg = qp + (r * heads + g * group) * dim;
      float* og = op + (r * heads + g * group) * dim;
      for (int64_t j = 0; j < n; ++j) {
        const float* k = kb + cols[j] * ks2;
        for (int64_t h = 0; h < group; ++h) {
          const float* qh = qg + h * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qh[d] * k[d];
          weights[h * n + j] = s * sc;
        }
      }
      for (int64_t h = 0; h < group; ++h) {  // softmax, in place
        float* w = weights.data() + h * n;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) top = std::max(top, w[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          w[j] = std::exp(w[j] - top);
          sum += w[j];
        }
        total[h] = sum;
      }
      std::fill(og, og + group * dim, 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const float* v = vb + cols[j] * vs2;
        for (int64_t h = 0; h < group; ++h) {
          const float w = weights[h * n + j];
          float* o = og + h * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) o[d] += w * v[d];
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        const float inv = total[h] > 0.f ? 1.f / total[h] : 0.f;
        float* o = og + h * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] *= inv;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(ferry, m) {
  m.def("decode_attention(Tensor query, Tensor keys, Tensor values, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ferry, CPU, m) { m.impl("decode_attention", decode_attention); }
