// Vector types for the kernel, one per instruction set. Each ISA translation unit defines
// exactly one of QKV_AMX / QKV_AVX512_BF16 / QKV_AVX512 / QKV_AVX2 / (none: portable) before
// including kernel.h; the first two also get QKV_AVX512's vectors.
#pragma once
#include <math.h>
#include <cstdint>
#include <cstring>

#if defined(QKV_AMX) || defined(QKV_AVX512_BF16)
#define QKV_AVX512 1
#define QKV_BF16_PRODUCTS 1  // bfloat16 products: AMX tiles or VDPBF16PS
#endif
#if defined(QKV_AVX512) || defined(QKV_AVX2)
#include <immintrin.h>
#endif

namespace QKV_ISA_NS {

constexpr float LOG2E = 1.4426950408889634f;
// 2^f ~ 1 + c1 f + c2 f^2 + ... on 0 <= f < 1, constant term first. Degree 6: a near-minimax
// fit of 2^g on |g| <= 1/2 in relative error, moved to f = g + 1/2 (times sqrt 2), which keeps
// its error, 7e-8. Degree 5, for bfloat16 products, whose probabilities are rounded to
// bfloat16 but whose float32 sums give the float32 lse: a near-minimax fit on [0, 1) with its
// constant term held at 1, so that the largest weight, 2^0, is exactly 1 (the earlier fit's
// 0.99999988 moved every lse by -1.2e-7); relative error 1.4e-7 evaluated in float32, where
// the earlier fit's was 1.8e-7.
constexpr float EXP2_DEGREE6[] = {1.f, 0.6931469440460205f, 0.24022994935512543f, 0.0554828979074955f,
                                  0.009679540991783142f, 0.001243499107658863f, 0.000217129330849275f};
constexpr float EXP2_DEGREE5[] = {1.f, 0.6931512951850891f, 0.24016445875167847f, 0.05579987168312073f,
                                  0.009017088450491428f, 0.0018671028083190322f};

// The polynomial c[0] + c[1] f + ... + c[N-1] f^(N-1) by Horner's rule, for any vector type below.
template <class V, int N>
inline V horner(const float (&c)[N], V f) {
  V p = V::set1(c[N - 1]);
  for (int i = N - 2; i >= 0; --i) p = V::fma(p, f, V::set1(c[i]));
  return p;
}
template <class V>
inline V exp2_fraction(V f) {  // 2^f for 0 <= f < 1
  return horner(EXP2_DEGREE6, f);
}
template <class V>
inline V exp2_fraction_degree5(V f) {
  return horner(EXP2_DEGREE5, f);
}

#if defined(QKV_AVX512)
struct Vec {
  static constexpr int W = 16;
  static constexpr int REGISTERS = 32;
  __m512 v;
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const uint16_t* p) {  // bfloat16: each the high half of a float32
    const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(words, 16))};
  }
  // 2W bfloat16 as float32 in two vectors, the even-indexed elements and the odd ones: one
  // load and two integer operations, against two widening loads.
  static void load_pairs(const uint16_t* p, Vec& even, Vec& odd) {
    const __m512i words = _mm512_loadu_si512(p);
    even = {_mm512_castsi512_ps(_mm512_slli_epi32(words, 16))};
    odd = {_mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(int(0xffff0000u))))};
  }
  static Vec set1(float x) { return {_mm512_set1_ps(x)}; }
  static Vec zero() { return {_mm512_setzero_ps()}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  static Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
  static bool all_equal(Vec a, Vec b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ) == 0xffff; }
  bool any_nan() const { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
  // x where x > -inf, else 0 (a row max with nothing allowed yet shifts by 0)
  static Vec finite_or_zero(Vec x) {
    __mmask16 none = _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
    return {_mm512_mask_blend_ps(none, x.v, _mm512_setzero_ps())};
  }
  float reduce_max() const { return _mm512_reduce_max_ps(v); }
  float reduce_add() const { return _mm512_reduce_add_ps(v); }
  // out[0:4] = the sums of a, b, c and d: one shuffle tree for the four, 13 operations
  // against about 9 for each sum alone.
  static void sum4(Vec a, Vec b, Vec c, Vec d, float* out) {
    // per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3 (and c, d alike), then a, b, c, d
    const __m512d ab = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a.v, b.v), _mm512_unpackhi_ps(a.v, b.v)));
    const __m512d cd = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(c.v, d.v), _mm512_unpackhi_ps(c.v, d.v)));
    const __m512 lanes = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd)),
                                       _mm512_castpd_ps(_mm512_unpackhi_pd(ab, cd)));
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(lanes),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
  }
  // Lane 4·r + u = the sum of acc[u][r], for 4 x 4 vectors: one shuffle tree, 45 operations
  // (four sum4 take 52). Its loops are unrolled so that every index is a constant: with
  // indices computed at run time, GCC 12 kept the caller's accumulators on the stack, storing
  // and loading all 16 around each call's product loop (decoding with K and V in cache 1.06x
  // as fast without that, the results bitwise the same).
  static Vec sum16(const Vec (&acc)[4][4]) {
    auto x = [&](int i) { return acc[i % 4][i / 4].v; };
    __m512 pairs[8], quads[4], halves[2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: x0+x2, y0+y2, x1+x3, y1+y3
      pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(x(2 * i), x(2 * i + 1)), _mm512_unpackhi_ps(x(2 * i), x(2 * i + 1)));
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the four vectors' partial sums, in order
      const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
      quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i)  // 128-bit lanes 0 + 1 and 2 + 3 of two
      halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xdd));
    return {_mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88), _mm512_shuffle_f32x4(halves[0], halves[1], 0xdd))};
  }
  // 2^t for t <= 0 as 2^floor(t) * 2^f, f = t - floor(t) in [0, 1) by one VREDUCEPS, 2^f by
  // `fraction`, and VSCALEFPS, which floors t itself; 0 below the float range (no denormals)
  // and for -inf, NaN stays NaN.
  template <Vec (*fraction)(Vec)>
  static Vec exp2_by(__m512 t) {
    __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __mmask16 in_range = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.f), _CMP_NLT_UQ);  // NaN too
    return {_mm512_maskz_scalef_ps(in_range, fraction(Vec{f}).v, t)};
  }
  // exp(x) for x <= 0 (scores minus their row max) = 2^(x * log2(e)), degree-6 fraction.
  static Vec exp(Vec x) { return exp2_by<exp2_fraction<Vec>>(_mm512_mul_ps(x.v, _mm512_set1_ps(LOG2E))); }
  // 2^t for t <= 0 by the degree-5 fit.
  static Vec exp2_degree5(Vec t) { return exp2_by<exp2_fraction_degree5<Vec>>(t.v); }
};
#elif defined(QKV_AVX2)
struct Vec {
  static constexpr int W = 8;
  static constexpr int REGISTERS = 16;
  __m256 v;
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const uint16_t* p) {  // bfloat16: each the high half of a float32
    const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(words, 16))};
  }
  static void load_pairs(const uint16_t* p, Vec& even, Vec& odd) {
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = {_mm256_castsi256_ps(_mm256_slli_epi32(words, 16))};
    odd = {_mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(int(0xffff0000u))))};
  }
  static Vec set1(float x) { return {_mm256_set1_ps(x)}; }
  static Vec zero() { return {_mm256_setzero_ps()}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  static Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
  static bool all_equal(Vec a, Vec b) { return _mm256_movemask_ps(_mm256_cmp_ps(a.v, b.v, _CMP_EQ_OQ)) == 0xff; }
  bool any_nan() const { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }
  static Vec finite_or_zero(Vec x) {
    return {_mm256_blendv_ps(x.v, _mm256_setzero_ps(), _mm256_cmp_ps(x.v, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ))};
  }
  float reduce_max() const {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  float reduce_add() const {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static void sum4(Vec a, Vec b, Vec c, Vec d, float* out) {  // as the AVX-512 one, over two lanes
    const __m256d ab = _mm256_castps_pd(_mm256_add_ps(_mm256_unpacklo_ps(a.v, b.v), _mm256_unpackhi_ps(a.v, b.v)));
    const __m256d cd = _mm256_castps_pd(_mm256_add_ps(_mm256_unpacklo_ps(c.v, d.v), _mm256_unpackhi_ps(c.v, d.v)));
    const __m256 lanes = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(ab, cd)),
                                       _mm256_castpd_ps(_mm256_unpackhi_pd(ab, cd)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1)));
  }
  static Vec exp(Vec x) {
    const __m256 t = _mm256_mul_ps(x.v, _mm256_set1_ps(LOG2E));
    __m256 tiny = _mm256_cmp_ps(t, _mm256_set1_ps(-126.f), _CMP_LT_OQ);  // also -inf
    // keeps 2^n in range; NaN passes through (VMAXPS returns its second operand when either is NaN)
    __m256 tc = _mm256_max_ps(_mm256_set1_ps(-126.f), t);
    __m256 n = _mm256_round_ps(tc, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m256 p = exp2_fraction(Vec{_mm256_sub_ps(tc, n)}).v;
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return {_mm256_blendv_ps(y, _mm256_setzero_ps(), tiny)};
  }
};
#else
struct Vec {  // portable: plain loops the compiler may vectorise for the baseline ISA
  static constexpr int W = 8;
  static constexpr int REGISTERS = 8;  // a Vec is two of SSE2's 16 registers
  float v[8];
  static Vec load(const float* p) { Vec r; std::memcpy(r.v, p, sizeof r.v); return r; }
  static Vec load(const uint16_t* p) {  // bfloat16: each the high half of a float32
    Vec r;
    for (int i = 0; i < W; ++i) {
      const uint32_t bits = uint32_t(p[i]) << 16;
      std::memcpy(&r.v[i], &bits, 4);
    }
    return r;
  }
  static void load_pairs(const uint16_t* p, Vec& even, Vec& odd) {
    for (int i = 0; i < W; ++i) {
      const uint32_t e = uint32_t(p[2 * i]) << 16, o = uint32_t(p[2 * i + 1]) << 16;
      std::memcpy(&even.v[i], &e, 4), std::memcpy(&odd.v[i], &o, 4);
    }
  }
  static Vec set1(float x) { Vec r; for (float& e : r.v) e = x; return r; }
  static Vec zero() { return set1(0.f); }
  void store(float* p) const { std::memcpy(p, v, sizeof v); }
  static Vec fma(Vec a, Vec b, Vec c) { for (int i = 0; i < W; ++i) c.v[i] += a.v[i] * b.v[i]; return c; }
  friend Vec operator*(Vec a, Vec b) { for (int i = 0; i < W; ++i) a.v[i] *= b.v[i]; return a; }
  friend Vec operator-(Vec a, Vec b) { for (int i = 0; i < W; ++i) a.v[i] -= b.v[i]; return a; }
  friend Vec operator+(Vec a, Vec b) { for (int i = 0; i < W; ++i) a.v[i] += b.v[i]; return a; }
  // as x86's max: b unless a > b, so a NaN in either gives b (the SIMD paths' NaN behaviour)
  static Vec max(Vec a, Vec b) { for (int i = 0; i < W; ++i) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]; return a; }
  bool any_nan() const {
    for (int i = 0; i < W; ++i)
      if (v[i] != v[i]) return true;
    return false;
  }
  static bool all_equal(Vec a, Vec b) {
    for (int i = 0; i < W; ++i)
      if (!(a.v[i] == b.v[i])) return false;
    return true;
  }
  static Vec finite_or_zero(Vec x) { for (float& e : x.v) e = e == -INFINITY ? 0.f : e; return x; }
  float reduce_max() const { float m = v[0]; for (float e : v) m = e > m ? e : m; return m; }
  float reduce_add() const { float s = 0; for (float e : v) s += e; return s; }
  static void sum4(Vec a, Vec b, Vec c, Vec d, float* out) {
    out[0] = a.reduce_add(), out[1] = b.reduce_add(), out[2] = c.reduce_add(), out[3] = d.reduce_add();
  }
  static Vec exp(Vec x) { for (float& e : x.v) e = expf(e); return x; }
};
#endif

// bfloat16 <-> float32 (round to nearest even; NaN stays NaN).
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace QKV_ISA_NS
