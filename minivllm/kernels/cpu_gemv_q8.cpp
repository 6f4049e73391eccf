// The fast low-precision CPU GEMV: activations quantized to int8 per block of 32 (one
// float scale per block, like llama.cpp's q8 activations), weights read as their GGUF
// blocks, and each block's dot product summed exactly in int32 by the integer
// multiply-add instructions (AVX512-VNNI / AVX-VNNI vpdpbusd, or AVX2 vpmaddubsw +
// vpmaddwd); only the per-block scale products are float32.
//
// Error: the activations' rounding to int8 (|error| <= scale / 2 per element, about
// 0.4 % of the block's largest value), so this is the "fast" mode, selected only by
// name (cpu_gemv="q8", or dtype=bfloat16 on the CPU); the float32 kernel in cpu_gemv.cpp
// is the default.
//
// Types: Q4_0, Q4_1, Q5_0, Q8_0 (the block-32 types). For a weight q and activation a in
// one block, with weight scale d (and min m for Q4_1) and activation scale s:
//   Q8_0  sum d*q * s*a              = d*s * sum(q * a)          q in [-128, 127]
//   Q4_0  sum d*(q-8) * s*a          = d*s * sum((q-8) * a)      q-8 in [-8, 7]
//   Q5_0  sum d*(q-16) * s*a         = d*s * sum((q-16) * a)     q-16 in [-16, 15]
//   Q4_1  sum (d*q + m) * s*a        = d*s * sum(q * a) + m * (s * sum(a))
// vpdpbusd multiplies unsigned by signed bytes, so a signed weight w goes in as |w| with
// the activation's sign flipped where w < 0 (sign(a, w)): |w| * sign(a, w) = w * a.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <vector>

namespace q8 {

constexpr int QK = 32;

// One activation row, quantized: int8 values, and per block the scale and s * sum(a).
struct QRow {
  const int8_t* q;
  const float* scale;
  const float* scaled_sum;
};

static inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// sum over the 8 int32 lanes of u (unsigned bytes) times s (signed bytes), 4 per lane.
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  // u <= 128 and |s| <= 127 here, so each pair's sum fits int16: 2 * 128 * 127 < 32767.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// w * a summed per lane for signed weight bytes w.
static inline __m256i dot_s8s8(__m256i w, __m256i a) {
  return dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
}

// 32 nibbles of a Q4 block (16 bytes: elements 0-15 in the low nibbles, 16-31 in the high).
static inline __m256i nibbles(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// Byte i = 0xFF where bit i of x is set, else 0.
static inline __m256i bit_bytes(uint32_t x) {
  // Byte i takes byte i / 8 of x, then keeps only bit i % 8 of it.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32((int)x),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

// Each type: the int32 lanes of one block's sum(q' * a) and the float factor the weight
// block contributes (d, with Q4_1 also m for the s * sum(a) term).
struct Q4_0 {
  static constexpr int TS = 18;
  static inline __m256i lanes(const uint8_t* b, __m256i a) {
    return dot_s8s8(_mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8)), a);
  }
  static inline float d(const uint8_t* b) { return half_to_float(b); }
  static constexpr bool HAS_MIN = false;
  static inline float m(const uint8_t*) { return 0.0f; }
};

struct Q4_1 {
  static constexpr int TS = 20;
  static inline __m256i lanes(const uint8_t* b, __m256i a) { return dot_u8s8(nibbles(b + 4), a); }
  static inline float d(const uint8_t* b) { return half_to_float(b); }
  static constexpr bool HAS_MIN = true;
  static inline float m(const uint8_t* b) { return half_to_float(b + 2); }
};

struct Q5_0 {
  static constexpr int TS = 22;
  static inline __m256i lanes(const uint8_t* b, __m256i a) {
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const __m256i hi = _mm256_and_si256(bit_bytes(qh), _mm256_set1_epi8(0x10));
    const __m256i q = _mm256_or_si256(nibbles(b + 6), hi);
    return dot_s8s8(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), a);
  }
  static inline float d(const uint8_t* b) { return half_to_float(b); }
  static constexpr bool HAS_MIN = false;
  static inline float m(const uint8_t*) { return 0.0f; }
};

struct Q8_0 {
  static constexpr int TS = 34;
  static inline __m256i lanes(const uint8_t* b, __m256i a) {
    return dot_s8s8(_mm256_loadu_si256((const __m256i*)(b + 2)), a);
  }
  static inline float d(const uint8_t* b) { return half_to_float(b); }
  static constexpr bool HAS_MIN = false;
  static inline float m(const uint8_t*) { return 0.0f; }
};

// The 8-lane sum; cpu_gemv.cpp's hsum takes the build's widest vector (16 lanes with AVX-512).
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

constexpr int MAXM = 8;  // activation rows per pass over a weight row

// Rows n0..n1 of y (M, N) for `m` activation rows, MAXM at a time: each weight block is
// decoded once per pass and multiplied into every row's accumulators.
template <class T>
static void rows(const uint8_t* w, int64_t row_bytes, int64_t nblocks, const QRow* xs, int64_t m, float* y,
                 int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t r0 = 0; r0 < m; r0 += MAXM) {
    const int64_t mm = std::min<int64_t>(MAXM, m - r0);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * row_bytes;
      // Two accumulators per row (even and odd blocks), so consecutive blocks do not
      // wait on each other's FMA; every row takes the same order whatever M.
      __m256 acc[MAXM][2];
      float mins[MAXM];
      for (int r = 0; r < mm; ++r) {
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        mins[r] = 0.0f;
      }
      for (int64_t i = 0; i < nblocks; ++i) {
        const uint8_t* b = row + i * T::TS;
        const float d = T::d(b);
        for (int r = 0; r < mm; ++r) {
          const QRow& x = xs[r0 + r];
          const __m256i a = _mm256_loadu_si256((const __m256i*)(x.q + i * QK));
          const __m256 sum = _mm256_cvtepi32_ps(T::lanes(b, a));
          acc[r][i & 1] = _mm256_fmadd_ps(sum, _mm256_set1_ps(d * x.scale[i]), acc[r][i & 1]);
          if (T::HAS_MIN) mins[r] += T::m(b) * x.scaled_sum[i];
        }
      }
      for (int r = 0; r < mm; ++r) y[(r0 + r) * ldy + n] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1])) + mins[r];
    }
  }
}

// x (M, K) float32 -> per block of 32: scale = max|a| / 127, q = round(a / scale).
static void quantize(const float* x, int64_t m, int64_t k, std::vector<int8_t>& q, std::vector<float>& scale,
                     std::vector<float>& scaled_sum, std::vector<QRow>& out) {
  const int64_t nb = k / QK;
  q.resize(m * k);
  scale.resize(m * nb);
  scaled_sum.resize(m * nb);
  out.resize(m);
  const __m256 sign_off = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i = 0; i < nb; ++i) {
      const float* a = x + r * k + i * QK;
      __m256 v[4], mx = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(a + 8 * j);
        mx = _mm256_max_ps(mx, _mm256_and_ps(v[j], sign_off));
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float amax = _mm_cvtss_f32(h);
      const float s = amax / 127.0f;
      const __m256 inv = _mm256_set1_ps(s > 0.0f ? 1.0f / s : 0.0f);
      __m256i qi[4];
      for (int j = 0; j < 4; ++j) qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  // round to nearest even
      // int32 -> int8 with saturation; packs interleave 128-bit lanes, the permute undoes it.
      const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
      const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256((__m256i*)(q.data() + r * k + i * QK), p8);
      const __m256i isum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
      scale[r * nb + i] = s;
      scaled_sum[r * nb + i] = s * (float)_mm_cvtsi128_si32(t);
    }
    out[r] = QRow{q.data() + r * k, scale.data() + r * nb, scaled_sum.data() + r * nb};
  }
}

enum : int64_t { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q8_0 = 8 };

typedef void (*rows_fn)(const uint8_t*, int64_t, int64_t, const QRow*, int64_t, float*, int64_t, int64_t, int64_t);

static rows_fn pick(int64_t type) {
  switch (type) {
    case T_Q4_0: return rows<Q4_0>;
    case T_Q4_1: return rows<Q4_1>;
    case T_Q5_0: return rows<Q5_0>;
    case T_Q8_0: return rows<Q8_0>;
    default: return nullptr;
  }
}


#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// ---- The AVX512-VNNI kernel over repacked nibble blocks (Q4_0, Q4_1, Q5_0) -------------
//
// Repacked by cpu_gemv.pack_q8 (same bytes, separated): qs (N, nb * 16) the nibble bytes
// of consecutive blocks back to back; d (N, nb) the f16 scales; mins (N, nb) the f16
// mins (Q4_1); qh (N, nb / 2) the fifth bits of a block pair as one 64-bit lane mask
// (Q5_0). nb is even (the packer pads a zero block). Two blocks fill one 512-bit
// register: 32 packed bytes, low nibbles then high nibbles, are the bytes
// [b0 el 0-15 | b1 el 0-15 | b0 el 16-31 | b1 el 16-31], and the activations are
// quantized into that same order, so vpdpbusd's 16 lanes hold lanes 0-3 and 8-11 of
// block 0 and lanes 4-7 and 12-15 of block 1. The weights go in unsigned (q, no offset)
// and the offset (Q4_0: -8, Q5_0: -16) or the min (Q4_1) is added per block as
// offset_b * s_b * sum(a_b) from the activations' precomputed block sums.
constexpr int64_t PREFETCH_ROWS_PACKED = 4;

struct PackedRow {
  const int8_t* q;          // quantized activations in the pair order
  const float* scale;       // per block
  const float* scaled_sum;  // per block: scale * sum(a)
};

static inline __m512i pair_nibbles(const uint8_t* p) {
  const __m256i b = _mm256_loadu_si256((const __m256i*)p);
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
  return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
}

template <int TYPE>
static inline __m512i pair_weights(const uint8_t* qs, const uint64_t* qh, int64_t pair) {
  __m512i w = pair_nibbles(qs + pair * 32);
  if (TYPE == 6) w = _mm512_or_si512(w, _mm512_maskz_set1_epi8(qh[pair], 0x10));
  return w;
}

// R activation rows (R <= 4) against weight rows n0..n1. Per activation row: four
// accumulators (so consecutive block pairs do not wait on each other's FMA; the offset
// terms go to the fourth), one reduction. Every row runs the same sequence whatever R,
// so a row's result is the same alone or in a batch. Each weight pair is decoded once
// for the R rows.
template <int TYPE, int R>
static void packed_rows_r(const uint8_t* qs, const uint16_t* d, const uint16_t* mins, const uint64_t* qh, int64_t nb,
                          const PackedRow* xs, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const __m512i pair_lane = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
  const __m512i two = _mm512_set1_epi32(2);
  const float offset = TYPE == 2 ? -8.0f : TYPE == 6 ? -16.0f : 0.0f;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wq = qs + n * nb * 16;
    const uint64_t* wh = TYPE == 6 ? qh + n * (nb / 2) : nullptr;
    // The weights stream from memory once per token: ask for the row PREFETCH_ROWS ahead
    // (its nibbles and scales) so its loads overlap this row's arithmetic.
    if (n + PREFETCH_ROWS_PACKED < n1) {
      const uint8_t* ahead = wq + PREFETCH_ROWS_PACKED * nb * 16;
      for (int64_t off = 0; off < nb * 16; off += 64) _mm_prefetch((const char*)(ahead + off), _MM_HINT_T0);
      _mm_prefetch((const char*)(d + (n + PREFETCH_ROWS_PACKED) * nb), _MM_HINT_T0);
      if (TYPE == 3) _mm_prefetch((const char*)(mins + (n + PREFETCH_ROWS_PACKED) * nb), _MM_HINT_T0);
    }
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < nb; g += 16) {
      const int64_t left = std::min<int64_t>(16, nb - g);
      const __mmask16 live = (__mmask16)((1u << left) - 1);
      const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, d + n * nb + g));
      const __m512 ov = TYPE == 3 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, mins + n * nb + g))
                                  : _mm512_mul_ps(dv, _mm512_set1_ps(offset));
      __m512 sv[R];
      for (int r = 0; r < R; ++r) {
        sv[r] = _mm512_mul_ps(dv, _mm512_maskz_loadu_ps(live, xs[r].scale + g));
        acc[r][3] = _mm512_fmadd_ps(ov, _mm512_maskz_loadu_ps(live, xs[r].scaled_sum + g), acc[r][3]);
      }
      __m512i idx = pair_lane;
      int64_t p = 0;
      for (; p + 4 <= left; p += 4) {
        const int64_t pair = (g + p) / 2;
        const __m512i w0 = pair_weights<TYPE>(wq, wh, pair), w1 = pair_weights<TYPE>(wq, wh, pair + 1);
        const __m512i idx1 = _mm512_add_epi32(idx, two);
        for (int r = 0; r < R; ++r) {
          const int8_t* a = xs[r].q + pair * 64;
          const __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, _mm512_loadu_si512((const void*)a));
          const __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w1, _mm512_loadu_si512((const void*)(a + 64)));
          acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_permutexvar_ps(idx, sv[r]), acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_permutexvar_ps(idx1, sv[r]), acc[r][1]);
        }
        idx = _mm512_add_epi32(idx1, two);
      }
      for (; p < left; p += 2) {
        const int64_t pair = (g + p) / 2;
        const __m512i w0 = pair_weights<TYPE>(wq, wh, pair);
        for (int r = 0; r < R; ++r) {
          const __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0,
                                                 _mm512_loadu_si512((const void*)(xs[r].q + pair * 64)));
          acc[r][2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_permutexvar_ps(idx, sv[r]), acc[r][2]);
        }
        idx = _mm512_add_epi32(idx, two);
      }
    }
    for (int r = 0; r < R; ++r)
      y[r * ldy + n] = _mm512_reduce_add_ps(
          _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
  }
}

template <int TYPE>  // 2 = Q4_0, 3 = Q4_1, 6 = Q5_0
static void packed_rows(const uint8_t* qs, const uint16_t* d, const uint16_t* mins, const uint64_t* qh, int64_t nb,
                        const PackedRow* xs, int64_t m, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t r0 = 0; r0 < m; r0 += 4) {
    const PackedRow* x = xs + r0;
    float* yr = y + r0 * ldy;
    switch (std::min<int64_t>(4, m - r0)) {
      case 1: packed_rows_r<TYPE, 1>(qs, d, mins, qh, nb, x, yr, ldy, n0, n1); break;
      case 2: packed_rows_r<TYPE, 2>(qs, d, mins, qh, nb, x, yr, ldy, n0, n1); break;
      case 3: packed_rows_r<TYPE, 3>(qs, d, mins, qh, nb, x, yr, ldy, n0, n1); break;
      default: packed_rows_r<TYPE, 4>(qs, d, mins, qh, nb, x, yr, ldy, n0, n1); break;
    }
  }
}

// Activations for the packed kernel: per block scale and scale * sum, and the int8 values
// of each block pair in the lane order above (nb even; an odd K's last pair is zero).
static void quantize_pairs(const float* x, int64_t m, int64_t k, int64_t nb, std::vector<int8_t>& q,
                           std::vector<float>& scale, std::vector<float>& scaled_sum, std::vector<PackedRow>& out) {
  std::vector<int8_t> nat;
  std::vector<float> s1, ss1;
  std::vector<QRow> rows1;
  quantize(x, m, k, nat, s1, ss1, rows1);
  const int64_t nbk = k / QK;
  q.assign(m * nb * QK, 0);
  scale.assign(m * nb, 0.0f);
  scaled_sum.assign(m * nb, 0.0f);
  out.resize(m);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < nbk; ++b) {
      const int8_t* src = nat.data() + r * k + b * QK;
      int8_t* pair = q.data() + r * nb * QK + (b / 2) * 64;
      const int half = (int)(b % 2) * 16;
      std::memcpy(pair + half, src, 16);
      std::memcpy(pair + 32 + half, src + 16, 16);
      scale[r * nb + b] = s1[r * nbk + b];
      scaled_sum[r * nb + b] = ss1[r * nbk + b];
    }
    out[r] = PackedRow{q.data() + r * nb * QK, scale.data() + r * nb, scaled_sum.data() + r * nb};
  }
}
#endif
}  // namespace q8

bool supports_q8(int64_t type) { return q8::pick(type) != nullptr; }

// gemv's contract (y_i = x @ w_i.T, one parallel region over every weight's rows) with
// x quantized to int8 blocks once per call.
std::vector<torch::Tensor> gemv_q8(torch::Tensor x, std::vector<torch::Tensor> ws, std::vector<int64_t> types,
                                   std::vector<int64_t> ns) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous (M, K) float32");
  TORCH_CHECK(ws.size() == types.size() && ws.size() == ns.size(), "one type and N per weight");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % q8::QK == 0, "K must be a multiple of 32");
  const size_t nw = ws.size();
  std::vector<torch::Tensor> ys;
  std::vector<q8::rows_fn> fns(nw);
  std::vector<int64_t> start(nw + 1, 0), row_bytes(nw);
  for (size_t i = 0; i < nw; ++i) {
    fns[i] = q8::pick(types[i]);
    TORCH_CHECK(fns[i] != nullptr, "unsupported GGML type ", types[i], " for the q8 GEMV");
    TORCH_CHECK(ws[i].scalar_type() == torch::kUInt8 && ws[i].is_contiguous(), "weights: contiguous uint8 blocks");
    row_bytes[i] = ws[i].numel() / ns[i];
    ys.push_back(torch::empty({m, ns[i]}, x.options()));
    start[i + 1] = start[i] + ns[i];
  }
  if (m == 0) return ys;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> scale, scaled_sum;
  thread_local std::vector<q8::QRow> qrows;
  q8::quantize(x.data_ptr<float>(), m, k, q, scale, scaled_sum, qrows);
  const q8::QRow* xs = qrows.data();
  at::parallel_for(0, start[nw], 16, [&](int64_t b, int64_t e) {
    for (size_t i = 0; i < nw; ++i) {
      const int64_t lo = std::max(b, start[i]), hi = std::min(e, start[i + 1]);
      if (lo >= hi) continue;
      fns[i](ws[i].data_ptr<uint8_t>(), row_bytes[i], k / q8::QK, xs, m, ys[i].data_ptr<float>(), ns[i],
             lo - start[i], hi - start[i]);
    }
  });
  return ys;
}

bool has_packed_q8() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  return true;
#else
  return false;
#endif
}

// gemv_q8 over weights repacked by cpu_gemv.pack_q8 (AVX512-VNNI builds only): each
// weight as (type, qs, d, mins, qh, N); mins / qh empty where the type has none.
std::vector<torch::Tensor> gemv_q8_packed(torch::Tensor x, std::vector<int64_t> types, std::vector<torch::Tensor> qs,
                                          std::vector<torch::Tensor> d, std::vector<torch::Tensor> mins,
                                          std::vector<torch::Tensor> qh, std::vector<int64_t> ns) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous (M, K) float32");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % q8::QK == 0, "K must be a multiple of 32");
  const int64_t nb = (k / q8::QK + 1) / 2 * 2;
  const size_t nw = types.size();
  std::vector<torch::Tensor> ys;
  std::vector<int64_t> start(nw + 1, 0);
  for (size_t i = 0; i < nw; ++i) {
    TORCH_CHECK(types[i] == 2 || types[i] == 3 || types[i] == 6, "packed q8: Q4_0, Q4_1 or Q5_0, not type ", types[i]);
    TORCH_CHECK(qs[i].numel() == ns[i] * nb * 16 && d[i].numel() == ns[i] * nb, "packed q8: shapes do not match K");
    ys.push_back(torch::empty({m, ns[i]}, x.options()));
    start[i + 1] = start[i] + ns[i];
  }
  if (m == 0) return ys;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> scale, scaled_sum;
  thread_local std::vector<q8::PackedRow> rows;
  q8::quantize_pairs(x.data_ptr<float>(), m, k, nb, q, scale, scaled_sum, rows);
  const q8::PackedRow* xs = rows.data();
  at::parallel_for(0, start[nw], 16, [&](int64_t b, int64_t e) {
    for (size_t i = 0; i < nw; ++i) {
      const int64_t lo = std::max(b, start[i]), hi = std::min(e, start[i + 1]);
      if (lo >= hi) continue;
      const uint8_t* qp = qs[i].data_ptr<uint8_t>();
      const uint16_t* dp = (const uint16_t*)d[i].data_ptr();
      const uint16_t* mp = mins[i].numel() ? (const uint16_t*)mins[i].data_ptr() : nullptr;
      const uint64_t* hp = qh[i].numel() ? (const uint64_t*)qh[i].data_ptr() : nullptr;
      float* yp = ys[i].data_ptr<float>();
      if (types[i] == 2) q8::packed_rows<2>(qp, dp, mp, hp, nb, xs, m, yp, ns[i], lo - start[i], hi - start[i]);
      else if (types[i] == 3) q8::packed_rows<3>(qp, dp, mp, hp, nb, xs, m, yp, ns[i], lo - start[i], hi - start[i]);
      else q8::packed_rows<6>(qp, dp, mp, hp, nb, xs, m, yp, ns[i], lo - start[i], hi - start[i]);
    }
  });
  return ys;
#else
  TORCH_CHECK(false, "this build of the CPU kernels has no AVX512-VNNI packed q8 GEMV (has_packed_q8() is false)");
  return {};
#endif
}
