// Copyright 2026 The qkmap-hf authors. Licensed under the Apache License, Version 2.0.
//
// Causal attention on CPUs for keys wider than values: QK-MAP's wide layout, whose queries and keys are 2F*m wide
// against values head_dim wide (docs/performance.md, "Causal attention for wide keys on CPUs"). torch's CPU flash
// kernel wants one width, so values were zero-padded to the key width: twice the value FLOPs and bytes. This is the
// flash-attention algorithm (online softmax over key blocks forward; the scores recomputed from the saved
// log-sum-exp backward) with values at their own width. Its products are torch's batch-reduce GEMM
// (at::native::cpublas::brgemm, exported where the plain cpublas::gemm is not) on row-major blocks, so every
// operand a product would read transposed is transposed once per head first. GQA heads read their key/value head
// in place.
//
// Registered as torch.ops.qkmap_v1.causal_attention / causal_attention_backward, next to the feature map's ops in
// the same library (qkmap_hf/kernels/__init__.py builds both files into one). The model files call it where it is
// loaded and takes the call (float32, no mask, as many queries as keys) and run sdpa with padded values elsewhere.
// Layouts: query (B, H, T, Dk), key (B, Hkv, T, Dk), value (B, Hkv, T, Dv), any strides with the width contiguous;
// the output is (B, T, H, Dv) contiguous (what o_proj reads), the gradients token-major views (B, heads, T, width).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace qkmap {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Rows of queries and keys per block: of 64/128/256 x 256/512, 64 x 256 was the fastest or within 1.5 % of it
// (forward and backward, 2 threads, 2026-12-06) at d64 h8/kv2 T = 2048, d64 h8/kv8 T = 512 and d128 h2/kv2
// T = 512 and 1024 on this machine.
constexpr int64_t kQueryBlock = 64;
constexpr int64_t kKeyBlock = 256;

struct Heads {  // (batch, heads, seq, width) strides of one operand, width contiguous
  const float* data;
  int64_t batch, head, seq;
  Heads(const at::Tensor& t) : data(t.data_ptr<float>()), batch(t.stride(0)), head(t.stride(1)), seq(t.stride(2)) {}
  const float* row(int64_t b, int64_t h, int64_t t) const { return data + b * batch + h * head + t * seq; }
};

// x[i] = exp(x[i] * scale - shift), returns the sum; entries past `valid` are set to 0.
inline float exp_and_sum(float* x, int64_t n, int64_t valid, float scale, float shift) {
  const Vec shift_vec(shift), scale_vec(scale);
  Vec sum_vec(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= valid; i += Vec::size()) {
    Vec e = (Vec::loadu(x + i) * scale_vec - shift_vec).exp_u20();
    e.store(x + i);
    sum_vec = sum_vec + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum_vec);
  for (; i < valid; ++i) {
    x[i] = std::exp(x[i] * scale - shift);
    sum += x[i];
  }
  for (; i < n; ++i) x[i] = 0.f;
  return sum;
}

inline float row_max(const float* x, int64_t n) {
  return at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x, n);
}

inline void scale_row(float* x, int64_t n, float s) {
  at::vec::map([s](Vec v) { return v * Vec(s); }, x, x, n);
}

// C (m x n, ld_c) (+)= A (m x k, ld_a) . B (k x n, ld_b), row-major, on this thread (torch's exported brgemm).
inline void matmul(int64_t m, int64_t n, int64_t k, const float* a, int64_t ld_a, const float* b, int64_t ld_b,
                   float* c, int64_t ld_c, bool accumulate) {
  at::native::cpublas::brgemm(m, n, k, ld_a, ld_b, ld_c, accumulate, a, b, c, false);
}

inline at::Tensor width_contiguous(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

void check_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale) {
  TORCH_CHECK(scale > 0, "qkmap_v1.causal_attention: the logit scale must be positive, got ", scale);
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4,
              "qkmap_v1.causal_attention: query, key and value must be 4-d (batch, heads, seq, width)");
  for (const at::Tensor* t : {&query, &key, &value}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(),
                "qkmap_v1.causal_attention: float32 CPU tensors only, got ", t->scalar_type(), " on ", t->device());
  }
  TORCH_CHECK(key.size(0) == query.size(0) && value.size(0) == query.size(0) && value.size(1) == key.size(1) &&
                  key.size(2) == query.size(2) && value.size(2) == query.size(2) && key.size(3) == query.size(3) &&
                  key.size(1) > 0 && query.size(1) % key.size(1) == 0 && query.size(2) > 0,
              "qkmap_v1.causal_attention: expected query (B, H, T, Dk), key (B, Hkv, T, Dk), value (B, Hkv, T, Dv) "
              "with H a multiple of Hkv and T > 0; got ", query.sizes(), ", ", key.sizes(), ", ", value.sizes());
}

std::tuple<at::Tensor, at::Tensor> causal_attention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale) {
  check_inputs(query, key, value, scale);
  const at::Tensor q = width_contiguous(query), k = width_contiguous(key), v = width_contiguous(value);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), Dk = q.size(3);
  const int64_t Hkv = k.size(1), Dv = v.size(3);
  const int64_t group = H / Hkv;
  const at::Tensor k_t = k.transpose(2, 3).contiguous();  // (B, Hkv, Dk, T): the B operand of Q K^T
  at::Tensor out = at::empty({B, T, H, Dv}, q.options());
  at::Tensor lse = at::empty({B, H, T}, q.options());
  const Heads qh(q), vh(v);
  const float* kt_data = k_t.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  float* lse_data = lse.data_ptr<float>();
  const int64_t qb_size = std::min(kQueryBlock, T), kb_size = std::min(kKeyBlock, T);
  const int64_t n_q = (T + qb_size - 1) / qb_size;
  const float alpha = static_cast<float>(scale);
  at::parallel_for(0, B * H * n_q, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(qb_size * kb_size), acc(qb_size * Dv), row_m(qb_size), row_l(qb_size);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t i = unit % n_q, h = (unit / n_q) % H, b = unit / (n_q * H);
      const int64_t hk = h / group, r0 = i * qb_size, qb = std::min(qb_size, T - r0);
      const float* kt_head = kt_data + (b * Hkv + hk) * Dk * T;
      std::fill(row_m.begin(), row_m.end(), kNegInf);
      std::fill(row_l.begin(), row_l.end(), 0.f);
      const int64_t kv_end = r0 + qb;  // causal: keys up to the block's last query
      for (int64_t c0 = 0; c0 < kv_end; c0 += kb_size) {
        const int64_t kb = std::min(kb_size, kv_end - c0);
        matmul(qb, kb, Dk, qh.row(b, h, r0), qh.seq, kt_head + c0, T, scores.data(), kb, false);
        for (int64_t r = 0; r < qb; ++r) {
          float* s = scores.data() + r * kb;
          const int64_t valid = std::min(kb, r0 + r - c0 + 1);  // keys c0 .. r0 + r
          if (valid <= 0) {  // the whole block lies after this query: adds nothing
            std::fill(s, s + kb, 0.f);
            continue;
          }
          const float old_m = row_m[r];
          const float new_m = std::max(old_m, row_max(s, valid) * alpha);
          const float sum = exp_and_sum(s, kb, valid, alpha, new_m);
          const float rescale = c0 == 0 ? 0.f : std::exp(old_m - new_m);
          row_l[r] = row_l[r] * rescale + sum;
          row_m[r] = new_m;
          if (c0 > 0) scale_row(acc.data() + r * Dv, Dv, rescale);
        }
        matmul(qb, Dv, kb, scores.data(), kb, vh.row(b, hk, c0), vh.seq, acc.data(), Dv, c0 > 0);
      }
      for (int64_t r = 0; r < qb; ++r) {
        const float inv = 1.f / row_l[r];
        float* dst = out_data + ((b * T + r0 + r) * H + h) * Dv;
        at::vec::map([inv](Vec x) { return x * Vec(inv); }, dst, acc.data() + r * Dv, Dv);
        lse_data[(b * H + h) * T + r0 + r] = row_m[r] + std::log(row_l[r]);
      }
    }
    at::native::cpublas::brgemm_release(false);
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_attention_backward(
    const at::Tensor& grad_output, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& output, const at::Tensor& lse, double scale) {
  check_inputs(query, key, value, scale);
  TORCH_CHECK(grad_output.scalar_type() == at::kFloat && output.scalar_type() == at::kFloat &&
                  lse.scalar_type() == at::kFloat,
              "qkmap_v1.causal_attention_backward: float32 grad_output, output and logsumexp only");
  TORCH_CHECK(grad_output.sizes() == output.sizes() && output.size(0) == query.size(0) &&
                  output.size(1) == query.size(2) && output.size(2) == query.size(1) &&
                  output.size(3) == value.size(3) &&
                  lse.numel() == query.size(0) * query.size(1) * query.size(2) && lse.is_contiguous(),
              "qkmap_v1.causal_attention_backward: grad_output and output must be (B, T, H, Dv) and logsumexp "
              "(B, H, T) contiguous, as causal_attention returns them");
  const at::Tensor q = width_contiguous(query), k = width_contiguous(key), v = width_contiguous(value);
  const at::Tensor go = width_contiguous(grad_output).transpose(1, 2);  // (B, H, T, Dv) views
  const at::Tensor o = width_contiguous(output).transpose(1, 2);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), Dk = q.size(3);
  const int64_t Hkv = k.size(1), Dv = v.size(3), group = H / Hkv;
  // Transposed copies, (.., width, T): the A/B operands that would otherwise need a transposed product.
  const at::Tensor q_t = q.transpose(2, 3).contiguous(), k_t = k.transpose(2, 3).contiguous();
  const at::Tensor v_t = v.transpose(2, 3).contiguous(), go_t = go.transpose(2, 3).contiguous();
  at::Tensor grad_q = at::zeros({B, T, H, Dk}, q.options()).transpose(1, 2);  // token-major storage
  at::Tensor grad_k_t = at::zeros({B, H, Dk, T}, q.options());  // per query head, transposed
  at::Tensor grad_v_t = at::zeros({B, H, Dv, T}, q.options());
  const Heads qh(q), kh(k), goh(go), oh(o);
  const float *qt = q_t.data_ptr<float>(), *kt = k_t.data_ptr<float>(), *vt = v_t.data_ptr<float>();
  const float* got = go_t.data_ptr<float>();
  float* dq = grad_q.data_ptr<float>();
  float* dkt = grad_k_t.data_ptr<float>();
  float* dvt = grad_v_t.data_ptr<float>();
  const int64_t sdq_b = grad_q.stride(0), sdq_h = grad_q.stride(1), sdq_t = grad_q.stride(2);
  const float* lse_data = lse.data_ptr<float>();
  const int64_t qb_size = std::min(kQueryBlock, T), kb_size = std::min(kKeyBlock, T);
  const float alpha = static_cast<float>(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(qb_size * kb_size), dprobs(qb_size * kb_size), delta(qb_size);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t h = unit % H, b = unit / H, hk = h / group;
      const float* qt_head = qt + (b * H + h) * Dk * T;
      const float* kt_head = kt + (b * Hkv + hk) * Dk * T;
      const float* vt_head = vt + (b * Hkv + hk) * Dv * T;
      const float* got_head = got + (b * H + h) * Dv * T;
      float* dkt_head = dkt + (b * H + h) * Dk * T;
      float* dvt_head = dvt + (b * H + h) * Dv * T;
      for (int64_t r0 = 0; r0 < T; r0 += qb_size) {
        const int64_t qb = std::min(qb_size, T - r0);
        for (int64_t r = 0; r < qb; ++r) {
          delta[r] = at::vec::map2_reduce_all<float>(
              [](Vec x, Vec y) { return x * y; }, [](Vec x, Vec y) { return x + y; }, goh.row(b, h, r0 + r),
              oh.row(b, h, r0 + r), Dv);
        }
        const float* lse_rows = lse_data + (b * H + h) * T + r0;
        const int64_t kv_end = r0 + qb;
        for (int64_t c0 = 0; c0 < kv_end; c0 += kb_size) {
          const int64_t kb = std::min(kb_size, kv_end - c0);
          matmul(qb, kb, Dk, qh.row(b, h, r0), qh.seq, kt_head + c0, T, probs.data(), kb, false);
          for (int64_t r = 0; r < qb; ++r) {
            const int64_t valid = std::min(kb, r0 + r - c0 + 1);
            exp_and_sum(probs.data() + r * kb, kb, std::max<int64_t>(valid, 0), alpha, lse_rows[r]);
          }
          matmul(Dv, kb, qb, got_head + r0, T, probs.data(), kb, dvt_head + c0, T, true);  // dV^T += dO^T P
          matmul(qb, kb, Dv, goh.row(b, h, r0), goh.seq, vt_head + c0, T, dprobs.data(), kb, false);  // dP
          for (int64_t r = 0; r < qb; ++r) {  // dS = scale * P * (dP - delta)
            float* p = probs.data() + r * kb;
            float* dp = dprobs.data() + r * kb;
            const Vec d(delta[r]), a(alpha);
            at::vec::map2([d, a](Vec pv, Vec dpv) { return pv * (dpv - d) * a; }, dp, p, dp, kb);
          }
          matmul(qb, Dk, kb, dprobs.data(), kb, kh.row(b, hk, c0), kh.seq,
                 dq + b * sdq_b + h * sdq_h + r0 * sdq_t, sdq_t, true);  // dQ += dS K
          matmul(Dk, kb, qb, qt_head + r0, T, dprobs.data(), kb, dkt_head + c0, T, true);  // dK^T += Q^T dS
        }
      }
    }
    at::native::cpublas::brgemm_release(false);
  });
  auto per_kv_head = [&](const at::Tensor& g_t) {  // (B, H, D, T) -> (B, Hkv, T, D), token-major storage
    const int64_t D = g_t.size(2);
    at::Tensor summed = at::empty({B, T, Hkv, D}, q.options());
    summed.view({B, T, Hkv, 1, D}).copy_(g_t.permute({0, 3, 1, 2}).reshape({B, T, Hkv, group, D}).sum(3, true));
    return summed.transpose(1, 2);
  };
  return {grad_q, per_kv_head(grad_k_t), per_kv_head(grad_v_t)};
}

}  // namespace
}  // namespace qkmap

TORCH_LIBRARY_FRAGMENT(qkmap_v1, library) {
  library.def("causal_attention(Tensor query, Tensor key, Tensor value, float scale) -> (Tensor, Tensor)");
  library.def(
      "causal_attention_backward(Tensor grad_output, Tensor query, Tensor key, Tensor value, Tensor output, "
      "Tensor logsumexp, float scale) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(qkmap_v1, CPU, library) {
  library.impl("causal_attention", &qkmap::causal_attention);
  library.impl("causal_attention_backward", &qkmap::causal_attention_backward);
}
