// f32-faithful dequantize-in-registers GEMV over GGUF blocks, for CPU decode.
//
// y[m, n] = sum_k x[m, k] * w[n, k] for x (M, K) float32 and w (N, K) stored as its GGUF
// blocks (N rows of row_bytes each), read in place: every weight byte is read once per
// call, whatever M. Each group of W consecutive weights (W = 8 with AVX2, 16 with
// AVX-512) is decoded to float32 in a register, bit-exact with the torch dequantization
// (every weight is d * (q - offset), d * q + m or (d * sc) * q - dmin * m, whose
// products are exact in float32, so the one rounding of an FMA gives the same bits),
// and multiplied into float32 accumulators with FMA.
//
// Summation order: NACC accumulators per activation row, group g goes to accumulator
// g % NACC, then (a0 + a1) + (a2 + a3) and a lane reduction. The order depends only on
// K and the ISA, never on M or the thread count, so a row's result is the same alone or
// in a batch. M = 1 decodes and multiplies in registers; M > 1 decodes a weight row
// once into an L1 buffer and runs M dot products over it, with the same order.
//
// Compiled by minivllm/kernels/cpu_gemv.py with -mavx2 -mfma -mf16c, or additionally
// -mavx512f -mavx512bw when the CPU has them (chosen at run time from the CPU flags).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <vector>
#include <cmath>

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int W = 16;
typedef __m512 vf;
typedef __m512i vi;
static inline vi u8x(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
static inline vi i8x(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
static inline vf tof(vi v) { return _mm512_cvtepi32_ps(v); }
static inline vi srl(vi v, int s) { return _mm512_srli_epi32(v, s); }
static inline vi srlv(vi v, vi s) { return _mm512_srlv_epi32(v, s); }
static inline vi andc(vi v, int c) { return _mm512_and_si512(v, _mm512_set1_epi32(c)); }
static inline vi or_(vi a, vi b) { return _mm512_or_si512(a, b); }
static inline vi sll(vi v, int s) { return _mm512_slli_epi32(v, s); }
static inline vi seti(int c) { return _mm512_set1_epi32(c); }
static inline vi iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
static inline vi addi(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vf setf(float c) { return _mm512_set1_ps(c); }
static inline vf zero() { return _mm512_setzero_ps(); }
static inline vf load(const float* p) { return _mm512_loadu_ps(p); }
static inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline float hsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf pow2n(vf n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#else
constexpr int W = 8;
typedef __m256 vf;
typedef __m256i vi;
static inline vi u8x(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
static inline vi i8x(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
static inline vf tof(vi v) { return _mm256_cvtepi32_ps(v); }
static inline vi srl(vi v, int s) { return _mm256_srli_epi32(v, s); }
static inline vi srlv(vi v, vi s) { return _mm256_srlv_epi32(v, s); }
static inline vi andc(vi v, int c) { return _mm256_and_si256(v, _mm256_set1_epi32(c)); }
static inline vi or_(vi a, vi b) { return _mm256_or_si256(a, b); }
static inline vi sll(vi v, int s) { return _mm256_slli_epi32(v, s); }
static inline vi seti(int c) { return _mm256_set1_epi32(c); }
static inline vi iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
static inline vi addi(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline vf setf(float c) { return _mm256_set1_ps(c); }
static inline vf zero() { return _mm256_setzero_ps(); }
static inline vf load(const float* p) { return _mm256_loadu_ps(p); }
static inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline float hsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf pow2n(vf n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#endif

// exp(x) for x <= 0 (softmax after subtracting the max), Cephes' expf: x = n ln2 + r with
// |r| <= ln2 / 2, a degree-7 polynomial for e^r, times 2^n; about 1 ulp. Below -87 it
// returns a tiny positive value instead of 0 (weights of order 1e-38 either way).
static inline vf exp_nonpos(vf x) {
  x = vmax(x, setf(-87.0f));
  const vf n = vround(mul(x, setf(1.44269504088896341f)));
  vf r = fma(n, setf(-0.693359375f), x);
  r = fma(n, setf(2.12194440e-4f), r);
  vf p = setf(1.9875691500e-4f);
  p = fma(p, r, setf(1.3981999507e-3f));
  p = fma(p, r, setf(8.3334519073e-3f));
  p = fma(p, r, setf(4.1665795894e-2f));
  p = fma(p, r, setf(1.6666665459e-1f));
  p = fma(p, r, setf(5.0000001201e-1f));
  p = fma(mul(p, r), r, add(r, setf(1.0f)));
  return mul(p, pow2n(n));
}

constexpr int NACC = 4;
constexpr int64_t PREFETCH_ROWS = 4;

static inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Each decoder calls emit(e, w) for every group of W consecutive weights of one block,
// e = the group's first element within the block, w = the weights as float32.

struct Q4_0 {  // f16 d | 16 B nibbles (elements 0-15 low, 16-31 high); w = d * (q - 8)
  static constexpr int BS = 32, TS = 18;
  template <class F> static inline void block(const uint8_t* b, F&& emit) {
    const vf d = setf(f16(b)), o = setf(-8.0f * f16(b));
#pragma GCC unroll 4
    for (int e = 0; e < 32; e += W)
      emit(e, fma(tof(andc(srl(u8x(b + 2 + e % 16), e < 16 ? 0 : 4), 0xF)), d, o));
  }
};

struct Q4_1 {  // f16 d | f16 m | 16 B nibbles; w = d * q + m
  static constexpr int BS = 32, TS = 20;
  template <class F> static inline void block(const uint8_t* b, F&& emit) {
    const vf d = setf(f16(b)), m = setf(f16(b + 2));
#pragma GCC unroll 4
    for (int e = 0; e < 32; e += W)
      emit(e, fma(tof(andc(srl(u8x(b + 4 + e % 16), e < 16 ? 0 : 4), 0xF)), d, m));
  }
};

struct Q5_0 {  // f16 d | u32 qh (bit i: 5th bit of element i) | 16 B nibbles; w = d * (q - 16)
  static constexpr int BS = 32, TS = 22;
  template <class F> static inline void block(const uint8_t* b, F&& emit) {
    const vf d = setf(f16(b)), o = setf(-16.0f * f16(b));
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const vi h = seti((int)qh);
#pragma GCC unroll 4
    for (int e = 0; e < 32; e += W) {
      vi lo = andc(srl(u8x(b + 6 + e % 16), e < 16 ? 0 : 4), 0xF);
      vi hi = sll(andc(srlv(h, addi(iota(), seti(e))), 1), 4);
      emit(e, fma(tof(or_(lo, hi)), d, o));
    }
  }
};

struct Q8_0 {  // f16 d | 32 x int8; w = d * q
  static constexpr int BS = 32, TS = 34;
  template <class F> static inline void block(const uint8_t* b, F&& emit) {
    const vf d = setf(f16(b));
#pragma GCC unroll 4
    for (int e = 0; e < 32; e += W) emit(e, mul(tof(i8x(b + 2 + e)), d));
  }
};

struct Q4_K {  // f16 d | f16 dmin | 12 B 6-bit scales/mins | 128 B nibbles; w = (d*sc) * q - dmin*m
  static constexpr int BS = 256, TS = 144;
  template <class F> static inline void block(const uint8_t* b, F&& emit) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t* s = b + 4;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      if (j < 4) {
        sc = s[j] & 63;
        mn = s[j + 4] & 63;
      } else {
        sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
      }
      const vf dl = setf(d * (float)sc), ml = setf(-(dmin * (float)mn));
      const uint8_t* q = b + 16 + 32 * (j / 2);
#pragma GCC unroll 4
      for (int e = 0; e < 32; e += W) emit(32 * j + e, fma(tof(andc(srl(u8x(q + e), 4 * (j & 1)), 0xF)), dl, ml));
    }
  }
};

struct Q6_K {  // 128 B low nibbles | 64 B high 2 bits | 16 int8 scales | f16 d; w = (d*sc) * (q - 32)
  static constexpr int BS = 256, TS = 210;
  template <class F> static inline void block(const uint8_t* b, F&& emit) {
    const float d = f16(b + 208);
    const int8_t* sc = (const int8_t*)(b + 192);
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = b + 64 * half;
      const uint8_t* qh = b + 128 + 32 * half;
#pragma GCC unroll 16
      for (int e = 0; e < 128; e += W) {
        const float s = d * (float)sc[8 * half + e / 16];
        vi lo = andc(srl(u8x(ql + e % 64), 4 * (e / 64)), 0xF);
        vi hi = sll(andc(srl(u8x(qh + e % 32), 2 * (e / 32)), 3), 4);
        emit(128 * half + e, fma(tof(or_(lo, hi)), setf(s), setf(-32.0f * s)));
      }
    }
  }
};

static inline float reduce(const vf* a) { return hsum(add(add(a[0], a[1]), add(a[2], a[3]))); }

// One weight row times one activation row, decoded in registers. The group at element
// E of the row goes to accumulator (E / W) % NACC; U blocks per iteration make that index
// a compile-time constant after unrolling, so the accumulators stay in registers.
template <class T>
static inline float dot_fused(const uint8_t* row, const float* x, int64_t nblocks) {
  constexpr int U = (NACC * W > T::BS) ? NACC * W / T::BS : 1;
  vf acc[NACC] = {zero(), zero(), zero(), zero()};
  int64_t i = 0;
  for (; i + U <= nblocks; i += U) {
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      const float* xb = x + (i + u) * T::BS;
      T::block(row + (i + u) * T::TS, [&](int e, vf w) {
        const int j = ((u * T::BS + e) / W) % NACC;
        acc[j] = fma(w, load(xb + e), acc[j]);
      });
    }
  }
  for (; i < nblocks; ++i) {
    const float* xb = x + i * T::BS;
    T::block(row + i * T::TS, [&](int e, vf w) {
      const int j = ((i * T::BS + e) / W) % NACC;
      acc[j] = fma(w, load(xb + e), acc[j]);
    });
  }
  return reduce(acc);
}

// The same sum over an already decoded row: same groups, same accumulators.
static inline float dot_decoded(const float* w, const float* x, int64_t k) {
  vf acc[NACC] = {zero(), zero(), zero(), zero()};
  int64_t i = 0;
  for (; i + NACC * W <= k; i += NACC * W)
    for (int j = 0; j < NACC; ++j) acc[j] = fma(load(w + i + j * W), load(x + i + j * W), acc[j]);
  for (int j = 0; i < k; i += W, ++j) acc[j] = fma(load(w + i), load(x + i), acc[j]);
  return reduce(acc);
}

template <class T>
static void rows(const uint8_t* w, int64_t row_bytes, int64_t k, const float* x, int64_t m, float* y,
                 int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t nblocks = k / T::BS;
  if (m == 1) {
    // Decode streams every weight from memory once per token: request the row
    // PREFETCH_ROWS ahead so its loads overlap this row's arithmetic (SmolLM2's layers,
    // DRAM-resident: 3.5 -> 3.1 ms a token at two threads, cpu_gemv.py).
    for (int64_t n = n0; n < n1; ++n) {
      if (n + PREFETCH_ROWS < n1)
        for (int64_t off = 0; off < row_bytes; off += 64)
          _mm_prefetch((const char*)(w + (n + PREFETCH_ROWS) * row_bytes + off), _MM_HINT_T0);
      y[n] = dot_fused<T>(w + n * row_bytes, x, nblocks);
    }
    return;
  }
  thread_local std::vector<float> buf;
  if ((int64_t)buf.size() < k) buf.resize(k);
  float* dec = buf.data();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t i = 0; i < nblocks; ++i) {
      float* out = dec + i * T::BS;
      T::block(row + i * T::TS, [&](int e, vf v) { store(out + e, v); });
    }
    for (int64_t r = 0; r < m; ++r) y[r * ldy + n] = dot_decoded(dec, x + r * k, k);
  }
}

// GGML type ids (gguf GGMLQuantizationType).
enum : int64_t { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 };

typedef void (*rows_fn)(const uint8_t*, int64_t, int64_t, const float*, int64_t, float*, int64_t, int64_t, int64_t);

static rows_fn pick(int64_t type) {
  switch (type) {
    case T_Q4_0: return rows<Q4_0>;
    case T_Q4_1: return rows<Q4_1>;
    case T_Q5_0: return rows<Q5_0>;
    case T_Q8_0: return rows<Q8_0>;
    case T_Q4_K: return rows<Q4_K>;
    case T_Q6_K: return rows<Q6_K>;
    default: return nullptr;
  }
}

static int64_t block_size(int64_t type) { return (type == T_Q4_K || type == T_Q6_K) ? 256 : 32; }

}  // namespace

bool supports(int64_t type) { return pick(type) != nullptr; }

int64_t vector_width() { return W; }

// y_i = x @ w_i.T for every weight w_i (same K): one parallel region over all their rows,
// so a layer's Q/K/V (or gate/up) cost one call.
std::vector<torch::Tensor> gemv(torch::Tensor x, std::vector<torch::Tensor> ws, std::vector<int64_t> types,
                                std::vector<int64_t> ns) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous (M, K) float32");
  TORCH_CHECK(ws.size() == types.size() && ws.size() == ns.size(), "one type and N per weight");
  const int64_t m = x.size(0), k = x.size(1);
  const float* xp = x.data_ptr<float>();
  const size_t nw = ws.size();
  std::vector<torch::Tensor> ys;
  std::vector<rows_fn> fns(nw);
  std::vector<int64_t> start(nw + 1, 0), row_bytes(nw);
  for (size_t i = 0; i < nw; ++i) {
    fns[i] = pick(types[i]);
    TORCH_CHECK(fns[i] != nullptr, "unsupported GGML type ", types[i]);
    TORCH_CHECK(k % block_size(types[i]) == 0, "K must be a multiple of the block size");
    TORCH_CHECK(ws[i].scalar_type() == torch::kUInt8 && ws[i].is_contiguous(), "weights: contiguous uint8 blocks");
    row_bytes[i] = ws[i].numel() / ns[i];
    ys.push_back(torch::empty({m, ns[i]}, x.options()));
    start[i + 1] = start[i] + ns[i];
  }
  if (m == 0) return ys;
  // Grain: enough rows per task that thread start-up stays small next to the work.
  at::parallel_for(0, start[nw], 16, [&](int64_t b, int64_t e) {
    for (size_t i = 0; i < nw; ++i) {
      const int64_t lo = std::max(b, start[i]), hi = std::min(e, start[i + 1]);
      if (lo >= hi) continue;
      fns[i](ws[i].data_ptr<uint8_t>(), row_bytes[i], k, xp, m, ys[i].data_ptr<float>(), ns[i], lo - start[i],
             hi - start[i]);
    }
  });
  return ys;
}

// One decode row's attention, float32 throughout: q (H, D); key/value row j of KV head g
// at krow(j) + g * D / vrow(j) + g * D; query head h reads KV head h / (H / KVH).
// Per head: scores = (q . k_s) * scale, exp(score - max) (exp_nonpos, about an ulp), then
// sum_s p_s v_s / sum_s p_s with the values' sum held in registers. The query heads of one
// KV head are done together, so each key and value row is read once. Where the rows lie
// (one contiguous run, or pool slots through a page table) does not change the arithmetic.
template <class KRow, class VRow>
static void attend_rows(const float* qp, KRow krow, VRow vrow, int64_t h, int64_t d, int64_t s, int64_t kvh,
                        float sc, float* op) {
  const int64_t group = h / kvh, nv = d / W;
  at::parallel_for(0, h, 1, [&](int64_t h0, int64_t h1) {
    thread_local std::vector<float> buf;
    if ((int64_t)buf.size() < s) buf.resize(s);
    float* p = buf.data();
    for (int64_t hh = h0; hh < h1; ++hh) {
      const float* qh = qp + hh * d;
      const int64_t off = (hh / group) * d;
      float mx = -INFINITY;
      for (int64_t j = 0; j < s; ++j) {
        const float* kr = krow(j) + off;
        vf acc = mul(load(qh), load(kr));
        for (int64_t c = W; c < d; c += W) acc = fma(load(qh + c), load(kr + c), acc);
        p[j] = hsum(acc) * sc;
        mx = p[j] > mx ? p[j] : mx;
      }
      vf tv = zero();
      const vf vmx = setf(mx);
      int64_t j0 = 0;
      for (; j0 + W <= s; j0 += W) {
        const vf e = exp_nonpos(add(load(p + j0), mul(vmx, setf(-1.0f))));
        store(p + j0, e);
        tv = add(tv, e);
      }
      float total = hsum(tv);
      for (; j0 < s; ++j0) {
        p[j0] = std::exp(p[j0] - mx);
        total += p[j0];
      }
      vf acc[16];
      for (int64_t c = 0; c < nv; ++c) acc[c] = zero();
      for (int64_t j = 0; j < s; ++j) {
        const vf pj = setf(p[j]);
        const float* vr = vrow(j) + off;
        for (int64_t c = 0; c < nv; ++c) acc[c] = fma(pj, load(vr + c * W), acc[c]);
      }
      const vf inv = setf(1.0f / total);
      float* oh = op + hh * d;
      for (int64_t c = 0; c < nv; ++c) store(oh + c * W, mul(acc[c], inv));
    }
  });
}

// k, v: (S, KVH, D) float32 with rows of KVH * D contiguous floats every stride(0).
torch::Tensor attend_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: contiguous (H, D) float32");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32,
              "k, v: (S, KVH, D) float32");
  const int64_t h = q.size(0), d = q.size(1), s = k.size(0), kvh = k.size(1);
  TORCH_CHECK(k.size(2) == d && v.sizes() == k.sizes() && h % kvh == 0 && d % W == 0 && d <= 16 * W,
              "shapes: q (H, D), k/v (S, KVH, D), D a multiple of the vector width");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == d && v.stride(2) == 1 && v.stride(1) == d, "k/v rows must be contiguous");
  const int64_t ks = k.stride(0), vs = v.stride(0);
  auto out = torch::empty({h, d}, q.options());
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  attend_rows(q.data_ptr<float>(), [&](int64_t j) { return kp + j * ks; }, [&](int64_t j) { return vp + j * vs; },
              h, d, s, kvh, (float)scale, out.data_ptr<float>());
  return out;
}

// The same over a page pool: k_pool, v_pool (slots, KVH, D) float32 contiguous, and
// slots (S,) int64: the pool slot of each position 0..S-1 (a request's page table).
torch::Tensor attend_decode_slots(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slots,
                                  double scale) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: contiguous (H, D) float32");
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.scalar_type() == torch::kFloat32 && k_pool.is_contiguous() &&
              v_pool.sizes() == k_pool.sizes() && v_pool.scalar_type() == torch::kFloat32 && v_pool.is_contiguous(),
              "k_pool, v_pool: contiguous (slots, KVH, D) float32");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == torch::kInt64 && slots.is_contiguous(), "slots: (S,) int64");
  const int64_t h = q.size(0), d = q.size(1), s = slots.size(0), kvh = k_pool.size(1), n = k_pool.size(0);
  TORCH_CHECK(k_pool.size(2) == d && h % kvh == 0 && d % W == 0 && d <= 16 * W, "shapes: q (H, D), pools (slots, KVH, D)");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t j = 0; j < s; ++j) TORCH_CHECK(sp[j] >= 0 && sp[j] < n, "slot ", sp[j], " outside the pool");
  const int64_t row = kvh * d;
  auto out = torch::empty({h, d}, q.options());
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  attend_rows(q.data_ptr<float>(), [&](int64_t j) { return kp + sp[j] * row; },
              [&](int64_t j) { return vp + sp[j] * row; }, h, d, s, kvh, (float)scale, out.data_ptr<float>());
  return out;
}

// RMSNorm of float32 rows: x * (1 / sqrt(mean(x^2) + eps)) * w, the statistics in float32
// (rmsnorm.py's math; only the order of the sum of squares differs).
torch::Tensor rms_norm_f32(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous (T, D) float32");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.size(0) == x.size(1),
              "w: (D,) float32");
  const int64_t t = x.size(0), d = x.size(1);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < t; ++r) {
    const float* xr = xp + r * d;
    float* orow = op + r * d;
    vf acc = zero();
    int64_t c = 0;
    for (; c + W <= d; c += W) acc = fma(load(xr + c), load(xr + c), acc);
    float ss = hsum(acc);
    for (; c < d; ++c) ss += xr[c] * xr[c];
    const float inv = 1.0f / std::sqrt(ss / (float)d + (float)eps);
    const vf vinv = setf(inv);
    for (c = 0; c + W <= d; c += W) store(orow + c, mul(mul(load(xr + c), vinv), load(wp + c)));
    for (; c < d; ++c) orow[c] = xr[c] * inv * wp[c];
  }
  return out;
}

// RoPE on float32 (T, heads, head_dim) rows, rope.py's math: pairs (x[2i], x[2i+1])
// ("adjacent") or (x[i], x[i + R/2]) ("halves") rotated by cos/sin (T, R/2); dimensions
// past R are copied. a*c - b*s and a*s + b*c are two products and one sum each, as in torch.
torch::Tensor rope_f32(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t rope_dim, bool adjacent) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous (T, H, D) float32");
  const int64_t t = x.size(0), nh = x.size(1), d = x.size(2), half = rope_dim / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == t && cos.size(1) == half &&
              cos.scalar_type() == torch::kFloat32 && sin.sizes() == cos.sizes(), "cos/sin: (T, R/2) float32");
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < t; ++r) {
    const float* cr = cp + r * half;
    const float* sr = sp + r * half;
    for (int64_t hh = 0; hh < nh; ++hh) {
      const float* xr = xp + (r * nh + hh) * d;
      float* orow = op + (r * nh + hh) * d;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t ia = adjacent ? 2 * i : i, ib = adjacent ? 2 * i + 1 : i + half;
        const float a = xr[ia], b = xr[ib], c = cr[i], s = sr[i];
        const float ac = a * c, bs = b * s, as = a * s, bc = b * c;
        orow[ia] = ac - bs;
        orow[ib] = as + bc;
      }
      for (int64_t i = rope_dim; i < d; ++i) orow[i] = xr[i];
    }
  }
  return out;
}
