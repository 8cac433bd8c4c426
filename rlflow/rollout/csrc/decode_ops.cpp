// The float32 operations of a decode step around its matrix products, each one call (rlflow/rollout/decode_ops.py
// explains when they are used): the RMS norm, RoPE on q and k, SiLU(gate) * up, and the decode attention with the
// step's key/value write. At decode sizes (a few rows) each torch operator costs more in dispatch than in maths, and
// a layer written in torch operators takes some 30 of them; these take 4.
//
// Built with -ffp-contract=off, so that each product and sum rounds where torch's element-wise kernels round: RoPE
// gives torch's bits (torch's addcmul fuses its product into the sum), SiLU * up torch's vectorised bits (the
// exponential is torch's own, Sleef's). The RMS norm's sum of squares and the attention's dot products add in
// another order than torch's kernels (float32 rounding). Every row is computed by one thread in one order, so its
// bits do not depend on the row count or the thread count.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <utility>
#include <cmath>
#include <limits>
#include <vector>

extern "C" __m512 Sleef_expf16_u10(__m512);  // libtorch_cpu's vector exp, which torch's float32 SiLU calls

namespace {

constexpr int64_t LANES = 16;
constexpr int64_t GRAIN = 1 << 15;  // elements a thread's share must reach before a call runs on several threads

inline __mmask16 lanes(int64_t n) {
  return n >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}

void check_float32(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.device().is_cpu() && t.stride(-1) == 1,
              "decode_ops: ", what, " must be a float32 CPU tensor with contiguous rows");
}

// y = x * (1 / sqrt(mean(x^2) + eps)), then times w where given.
void rms_row(const float* x, float* y, int64_t D, float eps, const float* w) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += LANES) {
    const __m512 v = _mm512_maskz_loadu_ps(lanes(D - d), x + d);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  const float mean = _mm512_reduce_add_ps(acc) / (float)D;
  const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
  for (int64_t d = 0; d < D; d += LANES) {
    const __mmask16 m = lanes(D - d);
    __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + d), r);
    if (w) v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + d), v);
    _mm512_mask_storeu_ps(y + d, m, v);
  }
}

}  // namespace

// x [M, D] (rows strided) -> [M, D]: the RMS norm of each row; `weight` [W, D] (or [D]: W = 1) multiplies row i by
// its row i % W (Qwen3's q/k norms: one weight row per head, rows of x being heads).
torch::Tensor rms_norm(const torch::Tensor& x, double eps, const c10::optional<torch::Tensor>& weight) {
  check_float32(x, "x");
  TORCH_CHECK(x.dim() == 2, "decode_ops.rms_norm: x must be [rows, features]");
  const int64_t M = x.size(0), D = x.size(1);
  torch::Tensor w;
  int64_t W = 1;
  if (weight.has_value()) {
    w = weight->contiguous();
    check_float32(w, "weight");
    W = w.dim() == 1 ? 1 : w.size(0);
    TORCH_CHECK(w.size(-1) == D && w.numel() == W * D, "decode_ops.rms_norm: weight must be [D] or [W, D]");
  }
  auto y = torch::empty({M, D}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* wp = w.defined() ? w.data_ptr<float>() : nullptr;
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, M, std::max<int64_t>(1, GRAIN / std::max<int64_t>(D, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) rms_row(xp + m * ldx, yp + m * D, D, (float)eps, wp ? wp + (m % W) * D : nullptr);
  });
  return y;
}

// The first `heads` heads of each row of qkv ([rows, >= heads * dim], rows strided) rotated at the row's position:
// x * cos + roll(x, dim / 2) * sin, with cos and sin ([P, 2, dim]: cos, then sin with rotate_half's sign folded in)
// of table[positions[row]]. Returns [rows, heads, dim].
torch::Tensor rope(const torch::Tensor& qkv, const torch::Tensor& table, const torch::Tensor& positions,
                   int64_t heads, int64_t dim) {
  check_float32(qkv, "qkv");
  check_float32(table, "table");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) >= heads * dim && dim % 2 == 0, "decode_ops.rope: qkv too narrow");
  TORCH_CHECK(table.dim() == 3 && table.size(1) == 2 && table.size(2) == dim && table.is_contiguous(),
              "decode_ops.rope: table must be [positions, 2, dim], contiguous");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.dim() == 1 && positions.size(0) == qkv.size(0),
              "decode_ops.rope: positions must be int64 [rows]");
  const int64_t M = qkv.size(0), half = dim / 2, P = table.size(0);
  auto pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; m++) TORCH_CHECK(pp[m] >= 0 && pp[m] < P, "decode_ops.rope: position outside the table");
  auto y = torch::empty({M, heads, dim}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  const float* tp = table.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = qkv.stride(0);
  at::parallel_for(0, M, std::max<int64_t>(1, GRAIN / std::max<int64_t>(heads * dim, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) {
      const float* cos = tp + pp[m] * 2 * dim;
      const float* sin = cos + dim;
      for (int64_t h = 0; h < heads; h++) {
        const float* x = xp + m * ldx + h * dim;
        float* y = yp + (m * heads + h) * dim;
        for (int64_t j = 0; j < half; j += LANES) {
          const __mmask16 k = lanes(half - j);
          const __m512 a = _mm512_maskz_loadu_ps(k, x + j), b = _mm512_maskz_loadu_ps(k, x + half + j);
          // torch's addcmul(x * cos, roll(x), sin): the second product fused into the sum (one rounding)
          const __m512 lo = _mm512_fmadd_ps(b, _mm512_maskz_loadu_ps(k, sin + j),
                                            _mm512_mul_ps(a, _mm512_maskz_loadu_ps(k, cos + j)));
          const __m512 hi = _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(k, sin + half + j),
                                            _mm512_mul_ps(b, _mm512_maskz_loadu_ps(k, cos + half + j)));
          _mm512_mask_storeu_ps(y + j, k, lo);
          _mm512_mask_storeu_ps(y + half + j, k, hi);
        }
      }
    }
  });
  return y;
}

// gate_up [M, 2 * I] (rows strided) -> SiLU(gate) * up [M, I], SiLU(x) = x / (1 + exp(-x)) as torch computes it.
torch::Tensor silu_mul(const torch::Tensor& gate_up, int64_t I) {
  check_float32(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) == 2 * I, "decode_ops.silu_mul: gate_up must be [rows, 2 * I]");
  const int64_t M = gate_up.size(0), ld = gate_up.stride(0);
  auto y = torch::empty({M, I}, gate_up.options());
  const float* xp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const __m512 one = _mm512_set1_ps(1.0f);
  at::parallel_for(0, M, std::max<int64_t>(1, GRAIN / std::max<int64_t>(I, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) {
      const float* g = xp + m * ld;
      const float* u = g + I;
      for (int64_t j = 0; j < I; j += LANES) {
        const __mmask16 k = lanes(I - j);
        const __m512 x = _mm512_maskz_loadu_ps(k, g + j);
        const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(yp + m * I + j, k, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(k, u + j)));
      }
    }
  });
  return y;
}

namespace {

using GroupHeadFn = void (*)(const struct Attention&, int64_t, int64_t, std::vector<int32_t>&, std::vector<float>&);

// HSUM_SLOT[c]: the accumulator whose horizontal sum hsum16 leaves in lane c (the order its shuffles produce).
constexpr int HSUM_SLOT[LANES] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

// The 16 horizontal sums of v[0..15], lane c holding the sum of v[HSUM_SLOT[c]]: 15 shuffle-and-add steps where
// 16 separate reductions take some 60 instructions.
inline __m512 hsum16(const __m512* v) {
  __m512 u[8], w[4], x[2];
  for (int i = 0; i < 8; i++)  // 512 -> 256 bits per vector: [v_i's two halves | v_i+8's two halves]
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; i++)  // -> 128 bits per vector
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[i], u[i + 4], 0x88), _mm512_shuffle_f32x4(u[i], u[i + 4], 0xDD));
  for (int i = 0; i < 2; i++)  // -> 64 bits per vector
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[i], w[i + 2], 0x44), _mm512_shuffle_ps(w[i], w[i + 2], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], 0x88), _mm512_shuffle_ps(x[0], x[1], 0xDD));
}

struct Attention {
  const float *q, *k, *v;  // [rows, H, D], [rows, KV, D], [rows, KV, D] (row and head strides below)
  int64_t q_row, q_head, k_row, k_head, v_row, v_head;
  float *cache_k, *cache_v;  // [G, KV, C, D]
  int64_t KV, C, D, rep, n, width, start;
  const float* bias;  // [G, n, >= width] (row strides below)
  int64_t bias_g, bias_s;
  const float* step_bias;  // [G, >= width] or null
  int64_t step_g;
  float scale;
  float* out;  // [rows, H * D]
};

// Lanes of the i-th vector of 16 of a D-vector (0 past its end).
inline __mmask16 part(int64_t D, int i) {
  return D <= i * LANES ? (__mmask16)0 : lanes(D - i * LANES);
}

// The softmax-weighted sum of the values in `cols` for R query heads at once (`probs` rows `stride` apart): each
// value row is read once for the R heads, their R * NV accumulators kept in registers.
template <int NV, int R>
void weighted_values(const float* cv, int64_t D, const int32_t* cols, int64_t count, const float* probs,
                     int64_t stride, float* out) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; r++)
    for (int i = 0; i < NV; i++) acc[r][i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < count; c++) {
    const float* vr = cv + (int64_t)cols[c] * D;
    __m512 p[R];
    for (int r = 0; r < R; r++) p[r] = _mm512_set1_ps(probs[r * stride + c]);
    for (int i = 0; i < NV; i++) {
      const __m512 vi = _mm512_maskz_loadu_ps(part(D, i), vr + i * LANES);
      for (int r = 0; r < R; r++) acc[r][i] = _mm512_fmadd_ps(p[r], vi, acc[r][i]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int i = 0; i < NV; i++) _mm512_mask_storeu_ps(out + r * D + i * LANES, part(D, i), acc[r][i]);
}

// One group's queries of one key/value head (heads of NV vectors of 16 at most). For each of the group's rows:
// the columns it sees (finite bias); scores 16 columns at a time for each of its query heads (the 16 key rows
// stay in L1 across the heads; one horizontal-sum pass per 16 scores), softmax, then the weighted values.
template <int NV>
void attend_group_head(const Attention& a, int64_t g, int64_t kvh, std::vector<int32_t>& cols,
                       std::vector<float>& probs) {
  const int64_t D = a.D, stride = a.width + LANES;
  float* ck = a.cache_k + (g * a.KV + kvh) * a.C * D;
  float* cv = a.cache_v + (g * a.KV + kvh) * a.C * D;
  if (a.start >= 0) {
    for (int64_t s = 0; s < a.n; s++) {
      const int64_t row = g * a.n + s;
      std::copy_n(a.k + row * a.k_row + kvh * a.k_head, D, ck + (a.start + s) * D);
      std::copy_n(a.v + row * a.v_row + kvh * a.v_head, D, cv + (a.start + s) * D);
    }
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < a.n; s++) {
    const int64_t row = g * a.n + s;
    const float* b = a.bias + g * a.bias_g + s * a.bias_s;
    const float* b2 = a.step_bias ? a.step_bias + g * a.step_g : nullptr;
    int64_t count = 0;
    for (int64_t j = 0; j < a.width; j++)
      if ((b2 ? b[j] + b2[j] : b[j]) != neg_inf) cols[count++] = (int32_t)j;
    float* o = a.out + (row * a.rep * a.KV + kvh * a.rep) * D;
    if (count == 0) {  // nothing to attend (never in a DecodeState: a row sees its prompt)
      std::fill_n(o, a.rep * D, 0.0f);
      continue;
    }
    for (int64_t c0 = 0; c0 < count; c0 += LANES) {  // scores, 16 columns at a time for every head
      const int64_t m = std::min<int64_t>(LANES, count - c0);
      const __mmask16 mk = lanes(m);
      const __m512i idx = _mm512_maskz_loadu_epi32(mk, cols.data() + c0);
      __m512 mask_add = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mk, idx, b, 4);
      if (b2) mask_add = _mm512_add_ps(mask_add, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mk, idx, b2, 4));
      for (int64_t r = 0; r < a.rep; r++) {
        const float* qh = a.q + row * a.q_row + (kvh * a.rep + r) * a.q_head;
        __m512 qv[NV];
        for (int i = 0; i < NV; i++) {
          qv[i] = _mm512_maskz_loadu_ps(part(D, i), qh + i * LANES);
          if (a.scale != 1.0f) qv[i] = _mm512_mul_ps(qv[i], _mm512_set1_ps(a.scale));  // scaled first, as torch does
        }
        __m512 acc[LANES];
        for (int c = 0; c < LANES; c++) {
          const float* kr = ck + (int64_t)cols[c0 + std::min<int64_t>(c, m - 1)] * D;
          __m512 t = _mm512_mul_ps(qv[0], _mm512_maskz_loadu_ps(part(D, 0), kr));
          for (int i = 1; i < NV; i++) t = _mm512_fmadd_ps(qv[i], _mm512_maskz_loadu_ps(part(D, i), kr + i * LANES), t);
          acc[HSUM_SLOT[c]] = t;
        }
        const __m512 sc = _mm512_mask_blend_ps(mk, _mm512_set1_ps(neg_inf), _mm512_add_ps(hsum16(acc), mask_add));
        _mm512_storeu_ps(probs.data() + r * stride + c0, sc);
      }
    }
    for (int64_t r = 0; r < a.rep; r++) {  // softmax (padding lanes hold -inf: exp gives 0)
      float* pr = probs.data() + r * stride;
      __m512 top = _mm512_set1_ps(neg_inf);
      for (int64_t c0 = 0; c0 < count; c0 += LANES) top = _mm512_max_ps(top, _mm512_loadu_ps(pr + c0));
      const __m512 topv = _mm512_set1_ps(_mm512_reduce_max_ps(top));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c0 = 0; c0 < count; c0 += LANES) {
        const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_loadu_ps(pr + c0), topv));
        _mm512_storeu_ps(pr + c0, e);
        sum = _mm512_add_ps(sum, e);
      }
      const __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(sum));
      for (int64_t c0 = 0; c0 < count; c0 += LANES) _mm512_storeu_ps(pr + c0, _mm512_div_ps(_mm512_loadu_ps(pr + c0), total));
    }
    constexpr int64_t RMAX = NV <= 4 ? 4 : NV <= 8 ? 2 : 1;  // heads whose values are summed in one pass
    for (int64_t r = 0; r < a.rep;) {
      const int64_t heads = std::min(RMAX, a.rep - r);
      const float* pr = probs.data() + r * stride;
      if (heads == 4) weighted_values<NV, (RMAX >= 4 ? 4 : 1)>(cv, D, cols.data(), count, pr, stride, o + r * D);
      else if (heads == 3) weighted_values<NV, (RMAX >= 3 ? 3 : 1)>(cv, D, cols.data(), count, pr, stride, o + r * D);
      else if (heads == 2) weighted_values<NV, (RMAX >= 2 ? 2 : 1)>(cv, D, cols.data(), count, pr, stride, o + r * D);
      else weighted_values<NV, 1>(cv, D, cols.data(), count, pr, stride, o + r * D);
      r += heads;
    }
  }
}

constexpr int MAX_VECTORS = 16;  // head dims up to 256

// The instance for head dims of D: 64 and less in 4 vectors, 128 and less in 8, else 16 (masked past D).
GroupHeadFn group_head_for(int64_t D) {
  return D <= 4 * LANES ? &attend_group_head<4> : D <= 8 * LANES ? &attend_group_head<8> : &attend_group_head<16>;
}

}  // namespace

// One decode step's attention, DecodeState's layout (rlflow/rollout/decode_state.py): rows g * n + s; caches
// [G, KV, C, dim] (contiguous); q [rows, H, dim], k and v [rows, KV, dim] (heads and rows strided). With start >= 0
// the step's k and v are first written at columns start + s. Each of a group's n * H / KV queries per key/value
// head attends the columns [0, width) with the additive bias [G, n, >= width] (plus step_bias [G, >= width] where
// given; -inf columns are skipped), scores scaled by `scale`, one softmax. Returns [rows, H * dim].
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor cache_k,
                     torch::Tensor cache_v, int64_t start, const torch::Tensor& bias,
                     const c10::optional<torch::Tensor>& step_bias, int64_t width, int64_t n, double scale) {
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&q, &k, &v, &cache_k, &cache_v, &bias})
    check_float32(*t, "every operand");
  TORCH_CHECK(cache_k.dim() == 4 && cache_k.is_contiguous() && cache_v.is_contiguous() &&
              cache_v.sizes() == cache_k.sizes(), "decode_ops.attend: caches must be contiguous [G, KV, C, dim]");
  const int64_t G = cache_k.size(0), KV = cache_k.size(1), C = cache_k.size(2), D = cache_k.size(3);
  const int64_t rows = q.size(0), H = q.size(1);
  TORCH_CHECK(q.dim() == 3 && q.size(2) == D && rows == G * n && H % KV == 0,
              "decode_ops.attend: q must be [G * n, H, dim]");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(0) == rows && v.size(0) == rows && k.size(1) == KV &&
              v.size(1) == KV && k.size(2) == D && v.size(2) == D, "decode_ops.attend: k and v must be [G * n, KV, dim]");
  TORCH_CHECK(D > 0 && D <= MAX_VECTORS * LANES, "decode_ops.attend: head dims up to ", MAX_VECTORS * LANES);
  TORCH_CHECK(width > 0 && width <= C && (start < 0 || start + n <= width) && width < (1LL << 31),
              "decode_ops.attend: width or start outside the cache");
  TORCH_CHECK(bias.dim() == 3 && bias.size(0) == G && bias.size(1) == n && bias.size(2) >= width,
              "decode_ops.attend: bias must be [G, n, >= width]");
  torch::Tensor sb;
  if (step_bias.has_value()) {
    sb = *step_bias;
    check_float32(sb, "step_bias");
    TORCH_CHECK(sb.dim() == 2 && sb.size(0) == G && sb.size(1) >= width,
                "decode_ops.attend: step_bias must be [G, >= width]");
  }
  auto out = torch::empty({rows, H * D}, q.options());
  const Attention a{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), q.stride(0), q.stride(1),
                    k.stride(0), k.stride(1), v.stride(0), v.stride(1), cache_k.data_ptr<float>(),
                    cache_v.data_ptr<float>(), KV, C, D, H / KV, n, width, start, bias.data_ptr<float>(),
                    bias.stride(0), bias.stride(1), sb.defined() ? sb.data_ptr<float>() : nullptr,
                    sb.defined() ? sb.stride(0) : 0, (float)scale, out.data_ptr<float>()};
  const auto fn = group_head_for(D);
  at::parallel_for(0, G * KV, 1, [&](int64_t t0, int64_t t1) {
    std::vector<int32_t> cols(width + LANES);
    std::vector<float> probs((H / KV) * (width + LANES));
    for (int64_t t = t0; t < t1; t++) fn(a, t / KV, t % KV, cols, probs);
  });
  return out;
}

void register_decode_ops(pybind11::module& m) {
  m.def("rms_norm", &rms_norm, "RMS norm of each row (times weight row i % W)", pybind11::arg("x"),
        pybind11::arg("eps"), pybind11::arg("weight") = pybind11::none());
  m.def("rope", &rope, "RoPE on the first heads of each row of qkv, at its position's cos/sin");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up of [rows, 2 * I]");
  m.def("attend", &attend, "a decode step's attention over DecodeState's caches (writing the step's k/v first)",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("cache_k"), pybind11::arg("cache_v"),
        pybind11::arg("start"), pybind11::arg("bias"), pybind11::arg("step_bias"), pybind11::arg("width"),
        pybind11::arg("n"), pybind11::arg("scale"));
}
