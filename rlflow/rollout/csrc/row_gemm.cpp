// Row GEMM: y = x @ W (+ add) for float32 on AVX-512 CPUs, for the fused decoder's decode steps
// (rlflow/rollout/row_gemm.py explains when it is used).
//
// W ([K, N], as the decoder stores it) is packed once into panels of 16 columns, [P, K, 16] (N padded with zeros
// to P * 16): one panel is a contiguous stream of K 64-byte lines. Each output element is one chain of fused
// multiply-adds over k = 0 .. K-1 in order, started from zero, with the addend added after the chain. So row i of
// y has the same bits whatever the row count, the thread count or which micro-kernel below computed it.
//
// The panels are split among torch's intra-op threads (at::parallel_for), each streaming a contiguous range.
// Up to 16 rows, one pass over a panel computes every row (16 accumulators), and each step prefetches the line
// PREFETCH floats ahead, so that the stream from memory overlaps the products: a decode step's few rows leave
// the products of a packed library waiting on memory between blocks. More rows (prefills) take blocks of at most
// 12 rows over two panels at once (24 accumulators), a chunk of panels at a time so that it stays in cache.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

namespace {

constexpr int64_t LANES = 16;          // floats per panel row: one AVX-512 register
constexpr int64_t PREFETCH = 2048;     // floats ahead of the line being multiplied (8 KiB)
constexpr int64_t CHUNK = 4;           // panels per chunk when several row blocks pass over them

inline __mmask16 lanes_mask(int64_t cols) {
  return cols >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
}

// R rows x one panel.
template <int R>
inline void panel1(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy, __mmask16 mask,
                   const float* add, int64_t ldadd) {
  __m512 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    _mm_prefetch((const char*)(w + k * LANES + PREFETCH), _MM_HINT_T0);
    const __m512 wk = _mm512_loadu_ps(w + k * LANES);
    for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), wk, acc[r]);
  }
  for (int r = 0; r < R; r++) {
    __m512 v = acc[r];
    if (add) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, add + r * ldadd), v);
    _mm512_mask_storeu_ps(y + r * ldy, mask, v);
  }
}

// R rows x two neighbouring panels (the first full, the second `mask`ed): each broadcast of x feeds two products.
template <int R>
inline void panel2(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy, __mmask16 mask,
                   const float* add, int64_t ldadd) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
  const float* w1 = w + K * LANES;
  for (int64_t k = 0; k < K; k++) {
    _mm_prefetch((const char*)(w + k * LANES + PREFETCH), _MM_HINT_T0);
    _mm_prefetch((const char*)(w1 + k * LANES + PREFETCH), _MM_HINT_T0);
    const __m512 wk0 = _mm512_loadu_ps(w + k * LANES), wk1 = _mm512_loadu_ps(w1 + k * LANES);
    for (int r = 0; r < R; r++) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      a0[r] = _mm512_fmadd_ps(xb, wk0, a0[r]);
      a1[r] = _mm512_fmadd_ps(xb, wk1, a1[r]);
    }
  }
  for (int r = 0; r < R; r++) {
    __m512 v0 = a0[r], v1 = a1[r];
    if (add) {
      v0 = _mm512_add_ps(_mm512_loadu_ps(add + r * ldadd), v0);
      v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, add + r * ldadd + LANES), v1);
    }
    _mm512_storeu_ps(y + r * ldy, v0);
    _mm512_mask_storeu_ps(y + r * ldy + LANES, mask, v1);
  }
}

struct Problem {
  const float* x; int64_t ldx;
  const float* w; int64_t K, N;
  float* y;
  const float* add; int64_t ldadd;
};

// Rows [m, m + R) over panels [p0, p1): one panel at a time (R <= 16) or two (R <= 12, `pairs`).
template <int R>
void rows_over_panels(const Problem& pr, int64_t m, int64_t p0, int64_t p1, bool pairs) {
  const float* x = pr.x + m * pr.ldx;
  const float* add = pr.add ? pr.add + m * pr.ldadd : nullptr;
  float* y = pr.y + m * pr.N;
  int64_t p = p0;
  if constexpr (R <= 12) {
    for (; pairs && p + 1 < p1; p += 2) {
      const int64_t n0 = p * LANES;
      panel2<R>(x, pr.ldx, pr.w + p * pr.K * LANES, pr.K, y + n0, pr.N, lanes_mask(pr.N - n0 - LANES),
                add ? add + n0 : nullptr, pr.ldadd);
    }
  }
  for (; p < p1; p++) {
    const int64_t n0 = p * LANES;
    panel1<R>(x, pr.ldx, pr.w + p * pr.K * LANES, pr.K, y + n0, pr.N, lanes_mask(pr.N - n0),
              add ? add + n0 : nullptr, pr.ldadd);
  }
}

using RowsFn = void (*)(const Problem&, int64_t, int64_t, int64_t, bool);
template <int... Rs>
constexpr std::array<RowsFn, sizeof...(Rs) + 1> table(std::integer_sequence<int, Rs...>) {
  return {nullptr, &rows_over_panels<Rs + 1>...};
}
constexpr auto ROWS = table(std::make_integer_sequence<int, 16>{});  // ROWS[r]: r rows, 1 <= r <= 16

}  // namespace

torch::Tensor pack(const torch::Tensor& weight_t) {
  TORCH_CHECK(weight_t.dim() == 2 && weight_t.scalar_type() == torch::kFloat32 && weight_t.device().is_cpu(),
              "row_gemm.pack: a float32 CPU matrix [K, N]");
  const int64_t K = weight_t.size(0), N = weight_t.size(1), P = (N + LANES - 1) / LANES;
  auto padded = torch::zeros({K, P * LANES}, weight_t.options());
  padded.narrow(1, 0, N).copy_(weight_t);
  return padded.view({K, P, LANES}).permute({1, 0, 2}).contiguous();
}

// r[j] <- column j of the 16 x 16 block whose row i is r[i] (the standard three-stage AVX-512 transpose).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  // r[4b + c] holds, in each 128-bit lane l, column c of rows 4l .. 4l + 3 of block-row group b; gather lanes
  for (int c = 0; c < 4; c++) {
    t[c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);       // lanes 0, 2 of r[c], then of r[4 + c]
    t[4 + c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);   // lanes 1, 3
    t[8 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
  }
  for (int c = 0; c < 4; c++) {
    r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xDD);
    r[4 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0xDD);
  }
}

// One panel: columns rows[0 .. n) (n <= 16; the others zero) of W, each element (src[k] * g[k]) * scale, k in
// blocks of 16 transposed in registers (a row's products are element-wise: the same bits as one at a time).
inline void pack_panel(const float* const* rows, const float* scales, int64_t n, const float* g, int64_t K,
                       float* panel) {
  int64_t k = 0;
  for (; k + LANES <= K; k += LANES) {
    __m512 r[16];
    const __m512 gk = g ? _mm512_loadu_ps(g + k) : _mm512_set1_ps(1.0f);
    for (int j = 0; j < 16; j++) {
      if (j >= n) {
        r[j] = _mm512_setzero_ps();
        continue;
      }
      __m512 v = _mm512_loadu_ps(rows[j] + k);
      if (g) v = _mm512_mul_ps(v, gk);
      if (scales[j] != 1.0f) v = _mm512_mul_ps(v, _mm512_set1_ps(scales[j]));
      r[j] = v;
    }
    transpose16(r);
    for (int j = 0; j < 16; j++) _mm512_storeu_ps(panel + (k + j) * LANES, r[j]);
  }
  for (; k < K; k++) {
    for (int64_t j = 0; j < LANES; j++) {
      float v = 0.0f;
      if (j < n) {
        v = g ? rows[j][k] * g[k] : rows[j][k];
        if (scales[j] != 1.0f) v = v * scales[j];
      }
      panel[k * LANES + j] = v;
    }
  }
}

// The panels of the matrix W = [pieces stacked, each row times col_scale, then times its piece's row_scale]^T, in
// one pass over the pieces ([n_i, K] each, nn.Linear's layout): what pack() gives for that matrix made by
// torch.cat, a broadcast product with col_scale and an in-place product of each piece's rows with its scale (each
// float32 product rounded once, in that order; a scale of 1 multiplies nothing), without its three copies.
torch::Tensor pack_rows(const std::vector<torch::Tensor>& pieces, const c10::optional<torch::Tensor>& col_scale,
                        const std::vector<double>& row_scales) {
  TORCH_CHECK(!pieces.empty() && pieces.size() == row_scales.size(),
              "row_gemm.pack_rows: one row scale per piece, at least one piece");
  const int64_t K = pieces[0].size(1);
  std::vector<const float*> rows;
  std::vector<float> scales;
  for (size_t i = 0; i < pieces.size(); i++) {
    const auto& piece = pieces[i];
    TORCH_CHECK(piece.dim() == 2 && piece.scalar_type() == torch::kFloat32 && piece.device().is_cpu() &&
                piece.size(1) == K && piece.stride(1) == 1,
                "row_gemm.pack_rows: float32 CPU matrices [n, K] with contiguous rows");
    const float* base = piece.data_ptr<float>();
    for (int64_t r = 0; r < piece.size(0); r++) {
      rows.push_back(base + r * piece.stride(0));
      scales.push_back(static_cast<float>(row_scales[i]));
    }
  }
  const float* g = nullptr;
  torch::Tensor scale;
  if (col_scale.has_value()) {
    scale = col_scale->contiguous();
    TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.numel() == K,
                "row_gemm.pack_rows: col_scale must be float32 [K]");
    g = scale.data_ptr<float>();
  }
  const int64_t N = static_cast<int64_t>(rows.size()), P = (N + LANES - 1) / LANES;
  auto packed = torch::empty({P, K, LANES}, pieces[0].options());
  float* out = packed.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++) pack_panel(rows.data() + p * LANES, scales.data() + p * LANES,
                                                  std::min(LANES, N - p * LANES), g, K, out + p * K * LANES);
  });
  return packed;
}

// The matrix [K, N] whose panels packed holds (pack's inverse).
torch::Tensor unpack(const torch::Tensor& packed, int64_t N) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == LANES && packed.size(0) * LANES >= N,
              "row_gemm.unpack: panels [P, K, 16] of at least N columns");
  const int64_t P = packed.size(0), K = packed.size(1);
  return packed.permute({1, 0, 2}).reshape({K, P * LANES}).narrow(1, 0, N).contiguous();
}

torch::Tensor mm(const torch::Tensor& x_in, const torch::Tensor& packed, int64_t N,
                 const c10::optional<torch::Tensor>& add_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32 && x_in.device().is_cpu(),
              "row_gemm.mm: x must be a float32 CPU matrix [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) * LANES >= N && packed.size(1) == x_in.size(1) &&
              packed.size(2) == LANES && packed.is_contiguous(), "row_gemm.mm: packed does not match x and N");
  auto x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = (N + LANES - 1) / LANES;
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor add;
  if (add_in.has_value()) {
    add = add_in->stride(1) == 1 ? *add_in : add_in->contiguous();
    TORCH_CHECK(add.scalar_type() == torch::kFloat32 && add.size(0) == M && add.size(1) == N,
                "row_gemm.mm: add must be float32 [M, N]");
  }
  if (M == 0) return y;
  const Problem pr{x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(), K, N, y.data_ptr<float>(),
                   add.defined() ? add.data_ptr<float>() : nullptr, add.defined() ? add.stride(0) : 0};
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    if (M <= 16) {
      ROWS[M](pr, 0, p0, p1, false);
      return;
    }
    const int64_t blocks = (M + 11) / 12;
    for (int64_t c = p0; c < p1; c += CHUNK) {
      const int64_t ce = std::min(c + CHUNK, p1);
      for (int64_t b = 0, m = 0; b < blocks; b++) {
        const int64_t r = (M - m + blocks - b - 1) / (blocks - b);  // balanced blocks of at most 12 rows
        ROWS[r](pr, m, c, ce, true);
        m += r;
      }
    }
  });
  return y;
}

void register_decode_ops(pybind11::module& m);  // csrc/decode_ops.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "W [K, N] float32 -> panels [P, K, 16]");
  m.def("pack_rows", &pack_rows, "pieces [n_i, K] (x col_scale [K], x a row scale per piece) -> panels [P, K, 16]",
        pybind11::arg("pieces"), pybind11::arg("col_scale"), pybind11::arg("row_scales"));
  m.def("unpack", &unpack, "panels [P, K, 16] -> W [K, N]");
  m.def("mm", &mm, "x [M, K] @ W (+ add [M, N]) from W's panels", pybind11::arg("x"), pybind11::arg("packed"),
        pybind11::arg("n"), pybind11::arg("add") = pybind11::none());
  register_decode_ops(m);
}
