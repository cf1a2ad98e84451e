// Copyright 2026 The qkmap-hf authors. Licensed under the Apache License, Version 2.0.
//
// The QK-MAP feature map fused into one pass over memory each way, for CPUs (docs/performance.md, "The fused
// feature map on CPUs"). Eager PyTorch runs the map as ~20 elementwise ops per direction, each a dispatch and a pass
// over the phases; at hidden 128-512 those passes and calls, not the sin/cos, are most of what QK-MAP adds to a
// training step. Here one loop over the (batch, position, head) rows computes a row's phases, their sin/cos, the
// gains and the RoPE rotation in registers (ATen's Vectorized<float>, whose sin/cos are SLEEF's, as torch.sin's), and
// the backward pass recomputes them the same way, writes d/dz and sums the gradients of omega and the gains per chunk.
//
// Registered as torch.ops.qkmap_v1.features / feature_gradients. The model files look the ops up through torch.ops
// (they import only torch) and run the eager map where they are not loaded; qkmap_hf/kernels/__init__.py builds
// and loads this file. Float32 only: the Python side casts, as the eager map computes in float32 too.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

namespace qkmap {
namespace {

using at::Tensor;
using Vec = at::vec::Vectorized<float>;

// A partial vector's missing lanes load as zeros, so sums over whole vectors need no mask.
inline Vec load(const float* data, int64_t count) {
  return count == Vec::size() ? Vec::loadu(data) : Vec::loadu(data, count);
}

inline void store(const Vec& value, float* data, int64_t count) {
  if (count == Vec::size()) {
    value.store(data);
  } else {
    value.store(data, count);
  }
}

inline float lane_sum(const Vec& value) {
  alignas(64) float lanes[Vec::size()];
  value.store(lanes);
  float total = 0.f;
  for (int64_t lane = 0; lane < Vec::size(); ++lane) total += lanes[lane];
  return total;
}

// Sizes and pointers shared by both directions. z is (batch, heads, seq, m) with unit stride on m; frequency
// (kv_heads, F, m or 1), gain (kv_heads, 2F, m) rows cos_0, sin_0, cos_1, ...; the RoPE tables (1 or batch, seq, m).
struct Map {
  int64_t batch, heads, seq, m, kv_heads, num_freq, freq_width, groups, half, width;
  const float *z, *frequency, *gain, *cos, *sin;
  int64_t z_stride[3], cos_stride[2], sin_stride[2];
  bool rotate_cos_blocks;

  Map(const Tensor& z_, const Tensor& frequency_, const Tensor& gain_, const Tensor& cos_, const Tensor& sin_,
      bool rotate)
      : batch(z_.size(0)),
        heads(z_.size(1)),
        seq(z_.size(2)),
        m(z_.size(3)),
        kv_heads(frequency_.size(0)),
        num_freq(frequency_.size(1)),
        freq_width(frequency_.size(2)),
        groups(z_.size(1) / frequency_.size(0)),
        half(z_.size(3) / 2),
        width(2 * frequency_.size(1) * z_.size(3)),
        z(z_.data_ptr<float>()),
        frequency(frequency_.data_ptr<float>()),
        gain(gain_.data_ptr<float>()),
        cos(cos_.data_ptr<float>()),
        sin(sin_.data_ptr<float>()),
        z_stride{z_.stride(0), z_.stride(1), z_.stride(2)},
        cos_stride{cos_.size(0) == 1 ? 0 : cos_.stride(0), cos_.stride(1)},
        sin_stride{sin_.size(0) == 1 ? 0 : sin_.stride(0), sin_.stride(1)},
        rotate_cos_blocks(rotate) {}

  int64_t rows() const { return batch * seq * heads; }
  // Rows run token-major, (batch, position, head), the order of the feature buffer and of the projections.
  int64_t grain() const { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width)); }
};

struct Row {
  int64_t b, t, h, kv;
  const float *z, *cos, *sin;
};

inline Row row_of(const Map& map, int64_t r) {
  Row row;
  row.h = r % map.heads;
  row.t = (r / map.heads) % map.seq;
  row.b = r / (map.heads * map.seq);
  row.kv = row.h / map.groups;
  row.z = map.z + row.b * map.z_stride[0] + row.h * map.z_stride[1] + row.t * map.z_stride[2];
  row.cos = map.cos + row.b * map.cos_stride[0] + row.t * map.cos_stride[1];
  row.sin = map.sin + row.b * map.sin_stride[0] + row.t * map.sin_stride[1];
  return row;
}

Tensor as_float_rows(const Tensor& tensor) {
  return tensor.stride(-1) == 1 ? tensor : tensor.contiguous();
}

void check_inputs(const Tensor& z, const Tensor& frequency, const Tensor& gain, const Tensor& cos, const Tensor& sin) {
  for (const Tensor* tensor : {&z, &frequency, &gain, &cos, &sin}) {
    TORCH_CHECK(tensor->device().is_cpu(), "qkmap_v1: the fused feature map runs on CPU tensors only");
    TORCH_CHECK(tensor->scalar_type() == at::kFloat, "qkmap_v1: the fused feature map takes float32 tensors, got ",
                tensor->scalar_type());
  }
  TORCH_CHECK(z.dim() == 4, "qkmap_v1: z must be (batch, heads, seq, m), got ", z.sizes());
  TORCH_CHECK(frequency.dim() == 3 && gain.dim() == 3 && cos.dim() == 3 && sin.dim() == 3,
              "qkmap_v1: frequency, gain, cos and sin must be 3-d");
  const int64_t m = z.size(3), kv_heads = frequency.size(0), num_freq = frequency.size(1);
  TORCH_CHECK(m % 2 == 0, "qkmap_v1: m (z's last dimension) must be even for RoPE, got ", m);
  TORCH_CHECK(kv_heads > 0 && z.size(1) % kv_heads == 0, "qkmap_v1: heads (", z.size(1),
              ") must be a multiple of the frequency rows (", kv_heads, ")");
  TORCH_CHECK(frequency.size(2) == m || frequency.size(2) == 1, "qkmap_v1: frequency must be (kv_heads, F, m or 1)");
  TORCH_CHECK(gain.size(0) == kv_heads && gain.size(1) == 2 * num_freq && gain.size(2) == m,
              "qkmap_v1: gain must be (kv_heads, 2F, m), got ", gain.sizes());
  for (const Tensor* table : {&cos, &sin}) {
    TORCH_CHECK((table->size(0) == 1 || table->size(0) == z.size(0)) && table->size(1) == z.size(2) &&
                    table->size(2) == m,
                "qkmap_v1: RoPE tables must be (1 or batch, seq, m), got ", table->sizes());
  }
}

// phi(z): (batch, heads, seq, 2Fm) as a view of a (batch, seq, heads, 2Fm) buffer, the layout of the eager map.
Tensor features(const Tensor& z_in, const Tensor& frequency_in, const Tensor& gain_in, const Tensor& cos_in,
                const Tensor& sin_in, bool rotate_cos_blocks) {
  check_inputs(z_in, frequency_in, gain_in, cos_in, sin_in);
  const Tensor z = as_float_rows(z_in), frequency = frequency_in.contiguous(), gain = gain_in.contiguous();
  const Tensor cos = as_float_rows(cos_in), sin = as_float_rows(sin_in);
  const Map map(z, frequency, gain, cos, sin, rotate_cos_blocks);
  Tensor out = at::empty({map.batch, map.seq, map.heads, map.width}, z.options());
  float* out_data = out.data_ptr<float>();
  const int64_t half = map.half, m = map.m;
  at::parallel_for(0, map.rows(), map.grain(), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Row row = row_of(map, r);
      for (int64_t f = 0; f < map.num_freq; ++f) {
        const float* omega = map.frequency + (row.kv * map.num_freq + f) * map.freq_width;
        const float* gain_cos = map.gain + (row.kv * 2 * map.num_freq + 2 * f) * m;
        const float* gain_sin = gain_cos + m;
        float* out_cos = out_data + r * map.width + f * 2 * m;
        float* out_sin = out_cos + m;
        for (int64_t i = 0; i < half; i += Vec::size()) {
          const int64_t n = std::min<int64_t>(Vec::size(), half - i);
          const Vec omega1 = map.freq_width == 1 ? Vec(omega[0]) : load(omega + i, n);
          const Vec omega2 = map.freq_width == 1 ? Vec(omega[0]) : load(omega + half + i, n);
          const Vec phase1 = load(row.z + i, n) * omega1, phase2 = load(row.z + half + i, n) * omega2;
          const Vec cos1 = load(gain_cos + i, n) * phase1.cos(), cos2 = load(gain_cos + half + i, n) * phase2.cos();
          const Vec sin1 = load(gain_sin + i, n) * phase1.sin(), sin2 = load(gain_sin + half + i, n) * phase2.sin();
          const Vec c1 = load(row.cos + i, n), c2 = load(row.cos + half + i, n);
          const Vec s1 = load(row.sin + i, n), s2 = load(row.sin + half + i, n);
          // RoPE on the block's two halves: (x1 c1 - x2 s1, x2 c2 + x1 s2).
          if (map.rotate_cos_blocks) {
            store(cos1 * c1 - cos2 * s1, out_cos + i, n);
            store(cos2 * c2 + cos1 * s2, out_cos + half + i, n);
          } else {
            store(cos1, out_cos + i, n);
            store(cos2, out_cos + half + i, n);
          }
          store(sin1 * c1 - sin2 * s1, out_sin + i, n);
          store(sin2 * c2 + sin1 * s2, out_sin + half + i, n);
        }
      }
    }
  });
  return out.transpose(1, 2);
}

// Gradients of phi for z, omega and the gains from the gradient of its output, recomputing the phases' sin/cos.
// z's gradient is a (batch, heads, seq, m) view of a token-major buffer; omega's and the gains' are summed per chunk of
// rows in float over blocks of 64 positions, then in double across blocks, and the chunks' sums are added in the
// order of their rows: the same bits whatever thread ran which chunk.
std::tuple<Tensor, Tensor, Tensor> feature_gradients(const Tensor& grad_output_in, const Tensor& z_in,
                                                     const Tensor& frequency_in, const Tensor& gain_in,
                                                     const Tensor& cos_in, const Tensor& sin_in,
                                                     bool rotate_cos_blocks) {
  check_inputs(z_in, frequency_in, gain_in, cos_in, sin_in);
  TORCH_CHECK(grad_output_in.device().is_cpu() && grad_output_in.scalar_type() == at::kFloat,
              "qkmap_v1: grad_output must be a float32 CPU tensor");
  const Tensor z = as_float_rows(z_in), frequency = frequency_in.contiguous(), gain = gain_in.contiguous();
  const Tensor cos = as_float_rows(cos_in), sin = as_float_rows(sin_in);
  const Map map(z, frequency, gain, cos, sin, rotate_cos_blocks);
  const Tensor grad_output = as_float_rows(grad_output_in);
  TORCH_CHECK(grad_output.dim() == 4 && grad_output.size(0) == map.batch && grad_output.size(1) == map.heads &&
                  grad_output.size(2) == map.seq && grad_output.size(3) == map.width,
              "qkmap_v1: grad_output must be (batch, heads, seq, 2Fm), got ", grad_output.sizes());
  const float* incoming = grad_output.data_ptr<float>();
  const int64_t grad_stride[3] = {grad_output.stride(0), grad_output.stride(1), grad_output.stride(2)};
  Tensor grad_z = at::empty({map.batch, map.seq, map.heads, map.m}, z.options());
  float* grad_z_data = grad_z.data_ptr<float>();
  const int64_t half = map.half, m = map.m;
  const int64_t gain_numel = map.kv_heads * 2 * map.num_freq * m;
  const int64_t sums_numel = gain_numel + map.kv_heads * map.num_freq * map.freq_width;
  std::vector<std::pair<int64_t, std::vector<double>>> chunk_sums;  // (first row, sums) of each chunk
  std::mutex chunk_lock;
  const int64_t block_rows = 64 * map.heads;

  at::parallel_for(0, map.rows(), map.grain(), [&](int64_t begin, int64_t end) {
    std::vector<double> sums(sums_numel, 0.0);
    std::vector<float> block(sums_numel);
    for (int64_t start = begin; start < end; start += block_rows) {
      std::fill(block.begin(), block.end(), 0.f);
      for (int64_t r = start; r < std::min(end, start + block_rows); ++r) {
        const Row row = row_of(map, r);
        const float* grad_row = incoming + row.b * grad_stride[0] + row.h * grad_stride[1] + row.t * grad_stride[2];
        float* grad_z_row = grad_z_data + r * m;
        for (int64_t f = 0; f < map.num_freq; ++f) {
          const int64_t gain_offset = (row.kv * 2 * map.num_freq + 2 * f) * m;
          const int64_t freq_offset = (row.kv * map.num_freq + f) * map.freq_width;
          const float* omega = map.frequency + freq_offset;
          const float* gain_cos = map.gain + gain_offset;
          const float* gain_sin = gain_cos + m;
          float* grad_gain_cos = block.data() + gain_offset;
          float* grad_gain_sin = grad_gain_cos + m;
          float* grad_omega = block.data() + gain_numel + freq_offset;
          const float* in_cos = grad_row + f * 2 * m;
          const float* in_sin = in_cos + m;
          Vec shared_omega_sum(0.f);
          for (int64_t i = 0; i < half; i += Vec::size()) {
            const int64_t n = std::min<int64_t>(Vec::size(), half - i);
            const Vec omega1 = map.freq_width == 1 ? Vec(omega[0]) : load(omega + i, n);
            const Vec omega2 = map.freq_width == 1 ? Vec(omega[0]) : load(omega + half + i, n);
            const Vec z1 = load(row.z + i, n), z2 = load(row.z + half + i, n);
            const Vec phase1 = z1 * omega1, phase2 = z2 * omega2;
            const Vec cos1 = phase1.cos(), cos2 = phase2.cos(), sin1 = phase1.sin(), sin2 = phase2.sin();
            const Vec c1 = load(row.cos + i, n), c2 = load(row.cos + half + i, n);
            const Vec s1 = load(row.sin + i, n), s2 = load(row.sin + half + i, n);
            // Through the rotation (its adjoint): (g1 c1 + g2 s2, g2 c2 - g1 s1).
            const Vec a1 = load(in_cos + i, n), a2 = load(in_cos + half + i, n);
            const Vec b1 = load(in_sin + i, n), b2 = load(in_sin + half + i, n);
            const Vec grad_cos1 = map.rotate_cos_blocks ? a1 * c1 + a2 * s2 : a1;
            const Vec grad_cos2 = map.rotate_cos_blocks ? a2 * c2 - a1 * s1 : a2;
            const Vec grad_sin1 = b1 * c1 + b2 * s2, grad_sin2 = b2 * c2 - b1 * s1;
            store(load(grad_gain_cos + i, n) + grad_cos1 * cos1, grad_gain_cos + i, n);
            store(load(grad_gain_cos + half + i, n) + grad_cos2 * cos2, grad_gain_cos + half + i, n);
            store(load(grad_gain_sin + i, n) + grad_sin1 * sin1, grad_gain_sin + i, n);
            store(load(grad_gain_sin + half + i, n) + grad_sin2 * sin2, grad_gain_sin + half + i, n);
            // d/dphase of (a cos(phase), b sin(phase)) = (-a sin(phase), b cos(phase)).
            const Vec grad_phase1 = grad_sin1 * load(gain_sin + i, n) * cos1 - grad_cos1 * load(gain_cos + i, n) * sin1;
            const Vec grad_phase2 =
                grad_sin2 * load(gain_sin + half + i, n) * cos2 - grad_cos2 * load(gain_cos + half + i, n) * sin2;
            if (map.freq_width == 1) {
              shared_omega_sum = shared_omega_sum + grad_phase1 * z1 + grad_phase2 * z2;
            } else {
              store(load(grad_omega + i, n) + grad_phase1 * z1, grad_omega + i, n);
              store(load(grad_omega + half + i, n) + grad_phase2 * z2, grad_omega + half + i, n);
            }
            Vec grad_z1 = grad_phase1 * omega1, grad_z2 = grad_phase2 * omega2;
            if (f > 0) {
              grad_z1 = load(grad_z_row + i, n) + grad_z1;
              grad_z2 = load(grad_z_row + half + i, n) + grad_z2;
            }
            store(grad_z1, grad_z_row + i, n);
            store(grad_z2, grad_z_row + half + i, n);
          }
          if (map.freq_width == 1) grad_omega[0] += lane_sum(shared_omega_sum);
        }
      }
      for (int64_t k = 0; k < sums_numel; ++k) sums[k] += block[k];
    }
    const std::lock_guard<std::mutex> guard(chunk_lock);
    chunk_sums.emplace_back(begin, std::move(sums));
  });
  std::sort(chunk_sums.begin(), chunk_sums.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<double> total_sums(sums_numel, 0.0);
  for (const auto& chunk : chunk_sums) {
    for (int64_t k = 0; k < sums_numel; ++k) total_sums[k] += chunk.second[k];
  }

  Tensor grad_gain = at::empty({map.kv_heads, 2 * map.num_freq, m}, z.options());
  Tensor grad_frequency = at::empty({map.kv_heads, map.num_freq, map.freq_width}, z.options());
  float* grad_gain_data = grad_gain.data_ptr<float>();
  float* grad_frequency_data = grad_frequency.data_ptr<float>();
  for (int64_t k = 0; k < sums_numel; ++k) {
    if (k < gain_numel) {
      grad_gain_data[k] = static_cast<float>(total_sums[k]);
    } else {
      grad_frequency_data[k - gain_numel] = static_cast<float>(total_sums[k]);
    }
  }
  return {grad_z.transpose(1, 2), grad_frequency, grad_gain};
}

}  // namespace
}  // namespace qkmap

TORCH_LIBRARY(qkmap_v1, library) {
  library.def("features(Tensor z, Tensor frequency, Tensor gain, Tensor cos, Tensor sin, bool rotate_cos_blocks) -> Tensor");
  library.def(
      "feature_gradients(Tensor grad_output, Tensor z, Tensor frequency, Tensor gain, Tensor cos, Tensor sin, "
      "bool rotate_cos_blocks) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(qkmap_v1, CPU, library) {
  library.impl("features", &qkmap::features);
  library.impl("feature_gradients", &qkmap::feature_gradients);
}
