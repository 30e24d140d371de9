// The attention kernel (FlashAttention-2 style), written once over the vector type of vec.h
// and compiled once per instruction set. Everything here lives in the namespace the
// including file names (QKV_ISA_NS) and uses no inline C++ library templates, so the
// variants never share a symbol: an older CPU never runs code built for a newer one.
//
// Forward, per work item (row r, query tile t, key split s):
//   Q tile (n = G*bq rows) against each non-EMPTY key tile:
//   S = scale·(Q·Kᵀ) -> modifiers -> mask (PARTIAL tiles only) -> online softmax (m, l) -> acc += P·V.
// Backward recomputes P = exp(S - lse - lse_lo) tile by tile. A (batch, KV head) row runs on one
// thread in one pass (each pair adds to dQ, dK and dV), or, for the rows left when the others
// share out evenly over the threads, in one pass per query tile for dQ and one per key tile for
// dK and dV; either way no two threads ever add into the same memory.
#pragma once
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cmath>

#include "problem.h"
#include "vec.h"

namespace QKV_ISA_NS {
namespace {

using qkv::Backward;
using qkv::Forward;
using qkv::Problem;
using qkv::Strided4;

constexpr float NEG_INF = -INFINITY;
constexpr int W = Vec::W;

template <class T>
inline T round_up(T x, T m) { return (x + m - 1) / m * m; }
inline int imin(int a, int b) { return a < b ? a : b; }
inline int imax(int a, int b) { return a > b ? a : b; }
inline int cdiv(int a, int b) { return (a + b - 1) / b; }

// ---- buffers ---------------------------------------------------------------------------
// 64-byte aligned memory from malloc, aligned by hand: aligned_alloc frees the slack before
// its block as a small chunk, and glibc then merges all small free chunks on each later large
// request, which cost small calls (decoding steps) about a third of their time.
inline char* aligned_in(void* raw) {
  return raw ? reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw) + 63) & ~uintptr_t(63)) : nullptr;
}

// Scratch memory of each thread, kept between calls and handed out as a stack: Buffers are
// scoped, so they are released in the reverse order they were taken. A decoding step takes
// some thirty small buffers, which from malloc cost its kernel call 10-15%. Requests that
// do not fit fall back to malloc; the stack then grows, when empty, to at most kMax bytes.
// Sanitizer builds always use malloc, so that overruns are still caught.
struct ScratchStack {
  static constexpr size_t kMax = size_t(1) << 20;
  void* raw = nullptr;
  char* base = nullptr;
  size_t capacity = 0, top = 0, wanted = 0;
  ~ScratchStack() { free(raw); }
  char* take(size_t bytes) {  // bytes: a multiple of 64
#if defined(__SANITIZE_ADDRESS__)
    return nullptr;
#else
    if (top == 0 && wanted > capacity) grow();
    if (top + bytes > capacity) {
      if (top + bytes <= kMax && top + bytes > wanted) wanted = top + bytes;
      return nullptr;
    }
    char* p = base + top;
    top += bytes;
    return p;
#endif
  }
  void grow() {
    free(raw);
    raw = malloc(wanted + 64), base = aligned_in(raw);
    capacity = raw ? wanted : 0;
  }
};
inline thread_local ScratchStack scratch_stack;

// 64-byte aligned float scratch, released at scope exit; none for n = 0. From the thread's
// scratch stack where it fits, else from malloc.
struct Buffer {
  size_t bytes;
  void* raw = nullptr;  // malloc'd, or nullptr when on the scratch stack
  float* p = nullptr;
  explicit Buffer(int64_t n) : bytes((size_t(n) * 4 + 63) & ~size_t(63)) {
    if (n <= 0) return;
    char* s = scratch_stack.take(bytes);
    if (!s) raw = malloc(bytes + 64), s = aligned_in(raw);
    p = reinterpret_cast<float*>(s);
  }
  ~Buffer() {
    if (raw) free(raw);
    else if (p) scratch_stack.top -= bytes;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

// Float scratch of a whole call, too large for a thread's scratch stack (the backward's packed
// operands), taken by the calling thread: the process's kept block (workspace.cc) where no
// other call holds it, else malloc.
struct Workspace {
  float* p = nullptr;
  void* raw = nullptr;  // malloc'd, or nullptr when p is the kept block (or n = 0)
  explicit Workspace(int64_t n) {
    if (n <= 0) return;
    if (void* kept = qkv::take_kept_block(size_t(n) * 4)) {
      p = static_cast<float*>(kept);
      return;
    }
    raw = malloc(size_t(n) * 4 + 64), p = reinterpret_cast<float*>(aligned_in(raw));
  }
  ~Workspace() {
    if (raw) free(raw);
    else if (p) qkv::give_back_kept_block();
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
};

inline void fill(float* p, int64_t n, float x) {
  for (int64_t i = 0; i < n; ++i) p[i] = x;
}

// ---- reading inputs ----------------------------------------------------------------------
inline float element(const Strided4& t, qkv::DType dt, int64_t off) {
  return dt == qkv::F32 ? static_cast<const float*>(t.data)[off]
                        : bf16_to_f32(static_cast<const uint16_t*>(t.data)[off]);
}

// Row l of bfloat16 t[b, h], its bits: row[d * step] = t[b, h, l, d] for d < n.
inline void bf16_row(const Strided4& t, int b, int h, int l, int n, uint16_t* row, int64_t step) {
  const uint16_t* src = static_cast<const uint16_t*>(t.data) + b * t.s0 + h * t.s1 + int64_t(l) * t.s2;
  for (int d = 0; d < n; ++d) row[d * step] = src[d * t.s3];
}

// dst[0:n] = t[b, h, l, 0:n]; dst[n:padded] = 0
inline void load_vector(const Strided4& t, qkv::DType dt, int b, int h, int l, int n, int padded, float* dst) {
  int64_t base = b * t.s0 + h * t.s1 + l * t.s2;
  if (dt == qkv::F32 && t.s3 == 1) {
    const float* src = static_cast<const float*>(t.data) + base;
    for (int d = 0; d < n; ++d) dst[d] = src[d];
  } else {
    for (int d = 0; d < n; ++d) dst[d] = element(t, dt, base + d * t.s3);
  }
  for (int d = n; d < padded; ++d) dst[d] = 0.f;
}

// Rows [l0, l0 + count) of t[b, h] as a row-major (rows x ld) block, zero beyond `count` rows up to `rows`.
inline void load_rows(const Strided4& t, qkv::DType dt, int b, int h, int l0, int count, int rows, int n, int ld,
                      float* dst) {
  for (int i = 0; i < count; ++i) load_vector(t, dt, b, h, l0 + i, n, ld, dst + int64_t(i) * ld);
  fill(dst + int64_t(count) * ld, int64_t(rows - count) * ld, 0.f);
}

// The transpose of rows [l0, l0 + count) of t[b, h]: (n x ld), dst[d*ld + c] = t[b, h, l0 + c, d].
inline void load_transposed(const Strided4& t, qkv::DType dt, int b, int h, int l0, int count, int n, int ld,
                            float* dst) {
  fill(dst, int64_t(n) * ld, 0.f);
  for (int c = 0; c < count; ++c) {
    int64_t base = b * t.s0 + h * t.s1 + int64_t(l0 + c) * t.s2;
    for (int d = 0; d < n; ++d) dst[int64_t(d) * ld + c] = element(t, dt, base + d * t.s3);
  }
}

// ---- the one matrix-multiply shape: C (M x N) (+)= A (M x K) · B (K x N, row-major, ldb) ----
// A is read element-wise at A[r * ars + k * acs], so it can be a transposed view of an input
// (no packing); N is a multiple of W (B and C are padded). MR rows x NV vectors of C stay in
// registers.
struct Operand {
  const float* p;
  int64_t rs, cs;  // element strides of rows and columns
};

// How a product meets what C holds:
//   STORE:     C = scale·(A·B)
//   CONTINUE:  C += A·B, the products added to C one by one (C's sum goes on)
//   ADD_AFTER: C = scale·(C + A·B), A·B summed from zero first (a new chain of a long sum)
// Scaled sums are scaled after they are summed, as the plain formula's scores are (a scale
// folded into A first rounds each of A's elements once more, which at large scores put the
// float32 gradients past the tolerance rule).
enum Sum { STORE, CONTINUE, ADD_AFTER };

// c (MR rows x NV vectors of C) += A[:, k0:k1]·B[k0:k1, :], A read at A[r * ars + k * acs].
template <int MR, int NV>
__attribute__((always_inline)) inline void multiply_add(Vec (&c)[MR][NV], int k0, int k1, const float* A,
                                                        int64_t ars, int64_t acs, const float* B, int ldb) {
  for (int k = k0; k < k1; ++k) {
    Vec b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = Vec::load(B + int64_t(k) * ldb + v * W);
    const float* a = A + k * acs;
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      Vec x = Vec::set1(a[r * ars]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] = Vec::fma(x, b[v], c[r][v]);
    }
  }
}

template <int MR, int NV>
__attribute__((always_inline)) inline void scale_all(Vec (&c)[MR][NV], float scale) {
  const Vec s = Vec::set1(scale);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[r][v] = c[r][v] * s;
}

// C's block = c; with MAX, colmax (NV vectors) also takes the maxima of its columns.
template <bool MAX, int MR, int NV>
__attribute__((always_inline)) inline void store_block(Vec (&c)[MR][NV], float* C, int ldc, float* colmax) {
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[r][v].store(C + r * ldc + v * W);
  if constexpr (MAX) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      Vec mx = Vec::load(colmax + v * W);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) mx = Vec::max(mx, c[r][v]);
      mx.store(colmax + v * W);
    }
  }
}

// SUM is a template parameter so the accumulators start in registers with no branch, and
// A's pointer and strides travel in registers (an Operand by value would go through memory).
// With MAX, colmax (NV vectors) also takes the maxima of C's columns over these MR rows.
template <int MR, int NV, Sum SUM, bool MAX = false>
inline void micro(int K, const float* A, int64_t ars, int64_t acs, const float* B, int ldb, float* C, int ldc,
                  float scale, float* colmax) {
  Vec c[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[r][v] = SUM == CONTINUE ? Vec::load(C + r * ldc + v * W) : Vec::zero();
  multiply_add(c, 0, K, A, ars, acs, B, ldb);
  if constexpr (SUM == ADD_AFTER) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] = Vec::load(C + r * ldc + v * W) + c[r][v];
  }
  if constexpr (SUM != CONTINUE) scale_all(c, scale);
  store_block<MAX>(c, C, ldc, colmax);
}

// The block of C kept in registers: MR rows x NV vectors, plus NV vectors of B and one
// broadcast of A, must fit the vector registers, or the accumulators spill to memory on
// every k. 32 registers (AVX-512): 6 x 4; 16 (AVX2): 6 x 2, 15 registers.
constexpr int MAX_NV = Vec::REGISTERS >= 32 ? 4 : 2;
template <int NV>
constexpr int block_rows() {
  if constexpr (Vec::REGISTERS >= 32) return NV >= 4 ? 6 : 8;
  return NV >= 2 ? 6 : 8;
}

template <int NV, Sum SUM, bool MAX>
inline void gemm_columns(int M, int K, Operand A, const float* B, int ldb, float* C, int ldc, float scale,
                         float* colmax) {
  constexpr int MR = block_rows<NV>();
  int i = 0;
  for (; i + MR <= M; i += MR)
    micro<MR, NV, SUM, MAX>(K, A.p + i * A.rs, A.rs, A.cs, B, ldb, C + int64_t(i) * ldc, ldc, scale, colmax);
  const float* a = A.p + i * A.rs;
  float* c = C + int64_t(i) * ldc;
  switch (M - i) {  // the last rows in one block too, so B is loaded once per k for them
    case 7: micro<7, NV, SUM, MAX>(K, a, A.rs, A.cs, B, ldb, c, ldc, scale, colmax); break;
    case 6: micro<6, NV, SUM, MAX>(K, a, A.rs, A.cs, B, ldb, c, ldc, scale, colmax); break;
    case 5: micro<5, NV, SUM, MAX>(K, a, A.rs, A.cs, B, ldb, c, ldc, scale, colmax); break;
    case 4: micro<4, NV, SUM, MAX>(K, a, A.rs, A.cs, B, ldb, c, ldc, scale, colmax); break;
    case 3: micro<3, NV, SUM, MAX>(K, a, A.rs, A.cs, B, ldb, c, ldc, scale, colmax); break;
    case 2: micro<2, NV, SUM, MAX>(K, a, A.rs, A.cs, B, ldb, c, ldc, scale, colmax); break;
    case 1: micro<1, NV, SUM, MAX>(K, a, A.rs, A.cs, B, ldb, c, ldc, scale, colmax); break;
    default: break;
  }
}

template <Sum SUM, bool MAX = false>
inline void gemm_pass(int M, int N, int K, Operand A, const float* B, int ldb, float* C, int ldc, float scale,
                      float* colmax = nullptr) {
  for (int j = 0; j < N;) {
    int vectors = (N - j) / W;
    int nv = vectors >= MAX_NV ? MAX_NV : vectors;
    float* mx = MAX ? colmax + j : nullptr;
    switch (nv) {
      case 4: gemm_columns<4, SUM, MAX>(M, K, A, B + j, ldb, C + j, ldc, scale, mx); break;
      case 3: gemm_columns<3, SUM, MAX>(M, K, A, B + j, ldb, C + j, ldc, scale, mx); break;
      case 2: gemm_columns<2, SUM, MAX>(M, K, A, B + j, ldb, C + j, ldc, scale, mx); break;
      default: gemm_columns<1, SUM, MAX>(M, K, A, B + j, ldb, C + j, ldc, scale, mx); break;
    }
    j += nv * W;
  }
}

// C = scale·(A·B) in chains of at most CHAIN products, each summed from zero and then added
// to the chains before it: one chain along the whole head dim rounds about twice as much as
// the reference's float32 products at D = 256, and scores of std 25 then broke the tolerance
// rule (tests: test_head_dims_sum_in_chains). Few query rows (9, D = 64, q and k of std
// 3, scale 0.3) broke it in 28 of 100 seeds with one chain, 10 with chains of 32, 5 with 16.
// Chains of 32 cost a float32 forward of 8 heads of 4096 x 64 1.7% (paired runs, 2 threads),
// chains of 16 5-10%.
constexpr int CHAIN = 32;

// One block of C summed in chains, their total in registers beside the chain being summed:
// the same sums in the same order as a pass over C per chain (STORE, then ADD_AFTER), without
// storing C and loading it again between chains.
template <int MR, int NV, bool MAX>
inline void micro_chains(int K, const float* A, int64_t ars, int64_t acs, const float* B, int ldb, float* C, int ldc,
                         float scale, float* colmax) {
  Vec total[MR][NV], c[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) total[r][v] = Vec::zero();
  multiply_add(total, 0, CHAIN, A, ars, acs, B, ldb);
  for (int k0 = CHAIN; k0 < K; k0 += CHAIN) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] = Vec::zero();
    multiply_add(c, k0, imin(k0 + CHAIN, K), A, ars, acs, B, ldb);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) total[r][v] = total[r][v] + c[r][v];
  }
  scale_all(total, scale);
  store_block<MAX>(total, C, ldc, colmax);
}

// Chains in registers take blocks of 6 rows x 2 vectors: twice 12 accumulators, 2 vectors of
// B and a broadcast of A. On AVX-512 (Zen 4, float32, paired medians of 5-9 rounds in one
// process, outputs and gradients bitwise the same) against a pass over C per chain: 8 heads of
// 4096 x 64, forward 1.010-1.017x as fast, causal 1.011-1.018x, forward + backward
// 1.036-1.058x (the backward sums its scores and dP = dO·Vᵀ in chains); 8 heads of 2048 x 128
// 1.02x and 1.01-1.03x; 4 heads of 2048 x 256 1.035x and 1.045-1.05x. Blocks of 3 x 4: 0.92x
// and 0.95x. With 16 registers (3 x 2 blocks, AVX2 code on the same CPU) 0.91x and 0.93x:
// there the chains take a pass each.
constexpr bool CHAINS_IN_REGISTERS = Vec::REGISTERS >= 32;
constexpr int CHAINS_MR = 6, CHAINS_NV = 2;

template <int NV, bool MAX>
inline void chains_columns(int M, int K, Operand A, const float* B, int ldb, float* C, int ldc, float scale,
                           float* colmax) {
  int i = 0;
  for (; i + CHAINS_MR <= M; i += CHAINS_MR)
    micro_chains<CHAINS_MR, NV, MAX>(K, A.p + i * A.rs, A.rs, A.cs, B, ldb, C + int64_t(i) * ldc, ldc, scale, colmax);
  const float* a = A.p + i * A.rs;
  float* c = C + int64_t(i) * ldc;
  switch (M - i) {  // the last rows in one block too
    case 5: micro_chains<5, NV, MAX>(K, a, A.rs, A.cs, B, ldb, c, ldc, scale, colmax); break;
    case 4: micro_chains<4, NV, MAX>(K, a, A.rs, A.cs, B, ldb, c, ldc, scale, colmax); break;
    case 3: micro_chains<3, NV, MAX>(K, a, A.rs, A.cs, B, ldb, c, ldc, scale, colmax); break;
    case 2: micro_chains<2, NV, MAX>(K, a, A.rs, A.cs, B, ldb, c, ldc, scale, colmax); break;
    case 1: micro_chains<1, NV, MAX>(K, a, A.rs, A.cs, B, ldb, c, ldc, scale, colmax); break;
    default: break;
  }
}

template <bool MAX>
inline void gemm_chains(int M, int N, int K, Operand A, const float* B, int ldb, float* C, int ldc, float scale,
                        float* colmax) {
  if (K <= CHAIN) return gemm_pass<STORE, MAX>(M, N, K, A, B, ldb, C, ldc, scale, colmax);
  if constexpr (CHAINS_IN_REGISTERS) {
    for (int j = 0; j < N; j += CHAINS_NV * W) {
      float* mx = MAX ? colmax + j : nullptr;
      if (N - j >= CHAINS_NV * W) chains_columns<CHAINS_NV, MAX>(M, K, A, B + j, ldb, C + j, ldc, scale, mx);
      else chains_columns<1, MAX>(M, K, A, B + j, ldb, C + j, ldc, scale, mx);  // N is a multiple of W
    }
    return;
  }
  gemm_pass<STORE>(M, N, CHAIN, A, B, ldb, C, ldc, 1.f);
  int k0 = CHAIN;
  for (; K - k0 > CHAIN; k0 += CHAIN)
    gemm_pass<ADD_AFTER>(M, N, CHAIN, {A.p + k0 * A.cs, A.rs, A.cs}, B + int64_t(k0) * ldb, ldb, C, ldc, 1.f);
  gemm_pass<ADD_AFTER, MAX>(M, N, K - k0, {A.p + k0 * A.cs, A.rs, A.cs}, B + int64_t(k0) * ldb, ldb, C, ldc, scale,
                            colmax);
}

// C (+)= A·B; with add, C's sums go on (across key tiles).
inline void gemm(int M, int N, int K, Operand A, const float* B, int ldb, float* C, int ldc, bool add) {
  if (add) gemm_pass<CONTINUE>(M, N, K, A, B, ldb, C, ldc, 1.f);
  else gemm_chains<false>(M, N, K, A, B, ldb, C, ldc, 1.f, nullptr);
}

// C = scale·(A·B), the scale applied to the finished sums (scores).
inline void gemm_scaled(int M, int N, int K, Operand A, const float* B, int ldb, float* C, int ldc, float scale) {
  gemm_chains<false>(M, N, K, A, B, ldb, C, ldc, scale, nullptr);
}

// C = scale·(A·B) as gemm_scaled does, and colmax (N) = the maxima of C's columns: the softmax
// then needs no pass of its own over the scores for them.
inline void gemm_column_max(int M, int N, int K, Operand A, const float* B, int ldb, float* C, int ldc, float scale,
                            float* colmax) {
  fill(colmax, N, NEG_INF);
  gemm_chains<true>(M, N, K, A, B, ldb, C, ldc, scale, colmax);
}

inline Operand rows_of(const float* p, int ld) { return {p, ld, 1}; }

// ---- a tile's rule: modifiers and mask, applied to scores S (n x ld) -----------------------
struct Tile {
  const Problem& p;
  int b, kv, r, t, j;   // batch row, kv head, row, query tile, key tile
  int q0, rows, k0, cols;  // query rows per head in this tile, keys in this tile
  int n() const { return p.Hq / p.Hkv * rows; }
  int head(int rr) const { return kv * (p.Hq / p.Hkv) + rr / rows; }
  int query(int rr) const { return q0 + rr % rows; }
};

inline int8_t tile_class(const Problem& p, int r, int t, int j) {
  if (!p.mask.tile_class) return qkv::FULL;
  int nq = cdiv(p.Lq, p.block_q), nk = cdiv(p.Lk, p.block_k);
  return p.mask.tile_class[(int64_t(r) * nq + t) * nk + j];
}

inline bool any_modifier(const Problem& p) { return p.mods.alibi_slopes || p.mods.bias || p.mods.softcap > 0; }

// Whether apply_rule leaves the tile's scores as they are: no modifiers, and no mask on it.
inline bool rule_keeps_scores(const Tile& tl) {
  return !any_modifier(tl.p) && tile_class(tl.p, tl.r, tl.t, tl.j) != qkv::PARTIAL;
}

// Modifiers, then -inf where the mask forbids (PARTIAL tiles only). Score (query rr, key c)
// lives at S[rr * rs + c * cs]: the forward keeps scores transposed, the backward does not.
inline void apply_rule(const Tile& tl, float* S, int64_t rs, int64_t cs) {
  if (rule_keeps_scores(tl)) return;
  const Problem& p = tl.p;
  const auto& mods = p.mods;
  const int n = tl.n(), shift = p.Lk - p.Lq;
  const bool partial = tile_class(p, tl.r, tl.t, tl.j) == qkv::PARTIAL;
  const uint8_t* bitmap = nullptr;
  if (partial && p.mask.bitmaps) {
    int nq = cdiv(p.Lq, p.block_q), nk = cdiv(p.Lk, p.block_k);
    int32_t index = p.mask.bitmap_index[(int64_t(tl.r) * nq + tl.t) * nk + tl.j];
    bitmap = p.mask.bitmaps + int64_t(index) * (p.Hq / p.Hkv) * p.block_q * p.block_k;
  }
  for (int rr = 0; rr < n; ++rr) {
    float* s = S + int64_t(rr) * rs;
    const int h = tl.head(rr), i = tl.query(rr);
    if (mods.alibi_slopes) {
      float slope = mods.alibi_slopes[h];
      for (int c = 0; c < tl.cols; ++c) s[c * cs] -= slope * fabsf(float(i + shift - (tl.k0 + c)));
    }
    if (mods.bias) {
      const int64_t row = tl.b * mods.bias_s0 + h * mods.bias_s1 + i * mods.bias_s2;
      if (mods.bias_bf16) {
        const uint16_t* bias = static_cast<const uint16_t*>(mods.bias) + row;
        for (int c = 0; c < tl.cols; ++c) s[c * cs] += bf16_to_f32(bias[(tl.k0 + c) * mods.bias_s3]);
      } else {
        const float* bias = static_cast<const float*>(mods.bias) + row;
        for (int c = 0; c < tl.cols; ++c) s[c * cs] += bias[(tl.k0 + c) * mods.bias_s3];
      }
    }
    if (mods.softcap > 0) {
      float cap = mods.softcap, inv = 1.f / cap;
      for (int c = 0; c < tl.cols; ++c) {  // a -inf bias stays masked, not -cap
        const float x = s[c * cs];
        s[c * cs] = x == NEG_INF ? x : cap * tanhf(x * inv);
      }
    }
    if (partial && p.mask.lo) {
      int64_t at = tl.b * p.mask.lohi_bstride + i;
      // allowed: keys [first, end) of the tile; no per-key test, so no mispredicted branches
      const int first = imin(imax(p.mask.lo[at] - tl.k0, 0), tl.cols);
      const int end = imin(imax(p.mask.hi[at] - tl.k0 + 1, first), tl.cols);
      for (int c = 0; c < first; ++c) s[c * cs] = NEG_INF;
      for (int c = end; c < tl.cols; ++c) s[c * cs] = NEG_INF;
    } else if (bitmap) {
      const uint8_t* allowed = bitmap + (int64_t(rr / tl.rows) * p.block_q + rr % tl.rows) * p.block_k;
      for (int c = 0; c < tl.cols; ++c)
        if (!allowed[c]) s[c * cs] = NEG_INF;
    }
  }
}

// ---- forward -------------------------------------------------------------------------------
// Scores are kept transposed, Sᵀ (keys x queries): the K tile is read in place as the left
// operand, every vector holds W queries, and the online softmax runs down columns with no
// horizontal reductions; the output accumulates transposed too, Oᵀ (Dv x queries).
#if defined(QKV_BF16_PRODUCTS)
// Operand tiles of every (row, key tile), packed once before the main pass: Vᵀ (Dv_pad x
// bk_pad) and, for float32, K (bk_pad x D_pad), bf16 in `parts` planes, zero padded. A tile's
// rows lie a padded tile width apart, not Lk apart: rows a multiple of 4 KiB apart would all
// fall in the same few L1 sets and evict each other.
struct PackedTiles {
  const Problem& p;
  const Strided4& t;  // p.k or p.v
  bool transpose;     // Vᵀ: rows are the head dim
  int rows, cols, nk, parts;  // padded rows and columns of one plane
  uint16_t* data = nullptr;
  int64_t plane() const { return int64_t(rows) * cols; }
  int64_t elements() const { return int64_t(p.B) * p.Hkv * nk * parts * plane(); }
  int64_t bytes() const { return parts * plane() * 2; }  // of one tile
  const uint16_t* tile(int r, int j) const { return data + (int64_t(r) * nk + j) * parts * plane(); }
};

#endif

struct ForwardPlan {
  const Forward& f;
  int G, nq, nk, splits, tiles_per_split, np;  // np: queries of a tile, padded to W (32 for pairs)
  int dv_rows;     // rows of Oᵀ: Dv, padded to 32 for pairs
  bool pairs;      // products of bfloat16 pairs (pairs_matmul: AMX tiles or VDPBF16PS)
  int parts = 1;   // bfloat16 parts of each operand: 3 for float32 on AMX
#if defined(QKV_BF16_PRODUCTS)
  const PackedTiles* values = nullptr;  // Vᵀ tiles
  const PackedTiles* keys = nullptr;    // K tiles, float32 only (bfloat16 K is read in place)
#endif
  float* partial;  // splits > 1: per (row, q tile, split): m, l (np each) and the output so far
  int64_t partial_stride;
  bool few_queries = false;  // decoding: few_queries_tiles
  // Element strides of the output accumulated so far, along Dv and along query rows: Oᵀ
  // (Dv x np) on the tile paths, O (np x Dv) on the few-queries path.
  int64_t out_d, out_row;
  int64_t output_at(int rr, int d) const { return d * out_d + rr * out_row; }
  int split_end(int split) const { return imin(nk, (split + 1) * tiles_per_split); }  // past its last key tile
};

// A key tile of k or v as an operand with rows = keys: in place for contiguous float32,
// else converted into `scratch` (cols x n).
inline bool rows_in_place(const Strided4& t, qkv::DType dt) { return dt == qkv::F32 && t.s3 == 1; }

inline Operand key_rows(const Strided4& t, qkv::DType dt, int b, int h, int k0, int cols, int n, float* scratch) {
  if (rows_in_place(t, dt))
    return {static_cast<const float*>(t.data) + b * t.s0 + h * t.s1 + int64_t(k0) * t.s2, t.s2, 1};
  load_rows(t, dt, b, h, k0, cols, cols, n, n, scratch);
  return {scratch, n, 1};
}

inline Operand transposed(Operand a) { return {a.p, a.cs, a.rs}; }

// The maxima over `cols` rows of ST (rows of np floats) of the W columns from q on. Four
// independent chains, since one would wait on the latency of every max.
inline Vec column_max(const float* ST, int cols, int np, int q) {
  Vec mx[4] = {Vec::set1(NEG_INF), Vec::set1(NEG_INF), Vec::set1(NEG_INF), Vec::set1(NEG_INF)};
  int c = 0;
  for (; c + 4 <= cols; c += 4)
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) mx[u] = Vec::max(mx[u], Vec::load(ST + int64_t(c + u) * np + q));
  for (; c < cols; ++c) mx[0] = Vec::max(mx[0], Vec::load(ST + int64_t(c) * np + q));
  return Vec::max(Vec::max(mx[0], mx[1]), Vec::max(mx[2], mx[3]));
}

// A byte range brought into L1 one cache line per call, spread over the softmax loop: the
// next key tile's K and this tile's V arrive while the vector units work, instead of stalling
// the products that read them from L2.
struct Prefetch {
  const char* p = nullptr;
  int64_t bytes = 0, at = 0;
  int lines = 1;  // per call
  void next_line() {
    if (at >= bytes) return;
    __builtin_prefetch(p + at, 0, 3), at += 64;
    for (int i = 1; i < lines && at < bytes; ++i, at += 64) __builtin_prefetch(p + at, 0, 3);
  }
};

// A packed tile of `bytes`, brought in over `calls` calls.
inline Prefetch whole(const void* p, int64_t bytes, int calls) {
  return {static_cast<const char*>(p), bytes, 0, int(imax(1, cdiv(int(bytes / 64), calls)))};
}

// The rows k0 .. k0 + count of k or v (b, h), n elements each (nothing when rows are strided).
inline Prefetch rows_span(const Strided4& t, qkv::DType dt, int b, int h, int k0, int count, int n) {
  Prefetch span;
  if (t.s3 != 1 || count <= 0) return span;
  const int64_t size = dt == qkv::F32 ? 4 : 2;
  span.p = static_cast<const char*>(t.data) + (b * t.s0 + h * t.s1 + int64_t(k0) * t.s2) * size;
  span.bytes = ((count - 1) * t.s2 + n) * size;
  return span;
}

struct Ahead {
  Prefetch keys, values;  // of the next key tile and of this one
  void next() { keys.next_line(), values.next_line(); }
};

struct NextKeys {
  int k0 = 0, count = 0;  // keys k0 .. k0 + count; none when count is 0
};

// The keys of the item's next key tile after tj: none past the split's end or where that
// tile is EMPTY (as past a causal diagonal).
inline NextKeys next_tile_keys(const ForwardPlan& plan, const Tile& tj, int split) {
  const Problem& p = plan.f.p;
  const int j = tj.j + 1;
  if (j >= plan.split_end(split) || tile_class(p, tj.r, tj.t, j) == qkv::EMPTY) return {};
  const int k0 = tj.k0 + p.block_k;
  return {k0, imin(p.block_k, p.Lk - k0)};
}

// Ahead of key tile tj: K of the next key tile in the item's split, no values. Packed float32
// keys come in over `calls` calls.
inline Ahead next_keys(const ForwardPlan& plan, const Tile& tj, int split, int calls = 1) {
  const Problem& p = plan.f.p;
  const NextKeys next = next_tile_keys(plan, tj, split);
  if (next.count == 0) return {};
#if defined(QKV_BF16_PRODUCTS)
  if (plan.keys) return {whole(plan.keys->tile(tj.r, tj.j + 1), plan.keys->bytes(), calls), {}};
#endif
  return {rows_span(p.k, p.dtype, tj.b, tj.kv, next.k0, next.count, p.D), {}};
}

// Oᵀ's columns q .. q + W - 1 (Dv rows of np) times alpha, unless no maximum moved: alpha is
// then 1 (or 0 on columns with nothing allowed yet, whose output is still 0), and past the
// first key tiles the maxima rarely move.
inline void rescale_output(int Dv, int np, int q, Vec m_old, Vec m_new, Vec alpha, float* OT) {
  if (Vec::all_equal(m_old, m_new)) return;
  for (int d = 0; d < Dv; ++d) (Vec::load(OT + int64_t(d) * np + q) * alpha).store(OT + int64_t(d) * np + q);
}

// Fold one tile of transposed scores ST (cols x np) into m, l (np) and OT (Dv x np); ST becomes
// Pᵀ. The tile's column maxima come in colmax, or, where that is null, from a pass over ST.
// ahead is a copy, so that it stays in registers across the stores to ST.
inline void online_softmax_columns(int cols, int np, int Dv, float* ST, const float* colmax, float* m, float* l,
                                   float* OT, Ahead ahead) {
  for (int q = 0; q < np; q += W) {
    const Vec mx = colmax ? Vec::load(colmax + q) : column_max(ST, cols, np, q);
    Vec m_old = Vec::load(m + q), m_new = Vec::max(m_old, mx);
    Vec shift = Vec::finite_or_zero(m_new);  // columns with nothing allowed yet shift by 0
    Vec alpha = Vec::exp(m_old - shift);
    // Four sums of every fourth key: one over a tile's 128 keys in turn drifts by up to
    // 128 roundings where many weights are equal (a softcap saturating them), which put
    // the lse past the tolerance rule (3.1e-6 against 2.7e-6)
    Vec sums[4] = {Vec::zero(), Vec::zero(), Vec::zero(), Vec::zero()};
    int c = 0;
    for (; c + 4 <= cols; c += 4) {
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {  // unrolled, so the sums stay in registers (GCC 12 left
                                     // them on the stack without the pragma: forward 1.015x)
        float* s = ST + int64_t(c + u) * np + q;
        Vec e = Vec::exp(Vec::load(s) - shift);
        e.store(s);
        sums[u] = sums[u] + e;
        ahead.next();
      }
    }
    for (; c < cols; ++c) {
      float* s = ST + int64_t(c) * np + q;
      Vec e = Vec::exp(Vec::load(s) - shift);
      e.store(s);
      sums[0] = sums[0] + e;
      ahead.next();
    }
    const Vec sum = (sums[0] + sums[1]) + (sums[2] + sums[3]);
    (Vec::load(l + q) * alpha + sum).store(l + q);
    m_new.store(m + q);
    rescale_output(Dv, np, q, m_old, m_new, alpha, OT);
  }
}

inline void store_output(const ForwardPlan& plan, const Tile& tl, const float* m, const float* l, const float* O) {
  const Forward& f = plan.f;
  const Problem& p = f.p;
  const int64_t step = plan.out_d;  // 1 on the few-queries path: the loops below then vectorise
  for (int rr = 0; rr < tl.n(); ++rr) {
    const int64_t at = (int64_t(tl.b) * p.Hq + tl.head(rr)) * p.Lq + tl.query(rr);
    const bool none = l[rr] == 0.f;  // no allowed key: output 0, lse -inf (NaN stays NaN)
    const float inv = none ? 0.f : 1.f / l[rr];
    const float* src = O + plan.output_at(rr, 0);  // output element d at src[d * step]
    if (f.lse) {
      const float log_l = logf(l[rr]), lse = m[rr] + log_l;
      f.lse[at] = none ? NEG_INF : lse;
      // m - lse is exact near the rounded lse (Sterbenz): the backward's P = exp(S - lse - lo)
      // then misses only log_l's rounding, not |lse|·6e-8 (1e-4 relative at scores of 2000)
      if (f.lse_lo) f.lse_lo[at] = none || lse - lse != 0.f ? 0.f : (m[rr] - lse) + log_l;
    }
    if (f.out_dtype == qkv::F32) {
      float* o = static_cast<float*>(f.out) + at * p.Dv;
      for (int d = 0; d < p.Dv; ++d) o[d] = none ? 0.f : src[d * step] * inv;
    } else {
      uint16_t* o = static_cast<uint16_t*>(f.out) + at * p.Dv;
      for (int d = 0; d < p.Dv; ++d) o[d] = f32_to_bf16(none ? 0.f : src[d * step] * inv);
    }
  }
}

// Calls too small to pay for a second thread run on the calling thread. The work items stay
// the same, so the results do too. On OpenMP's threads (float32 forwards of 8 heads of 64,
// paired calls), two threads ran 1.18-1.21x as fast as one at 0.08-0.14M multiply-adds,
// 1.27-1.30x at 0.25M and 1.33-1.53x at 0.5-0.75M while the threads were awake (a torch
// operation, or none, between calls); after 20 ms idle 0.74-0.77x, 0.85x and 0.85-0.88x.
// The bound was 1M on the kernel's own pool, whose helpers took 25-30 µs to wake.
constexpr double MIN_PARALLEL_MULTIPLY_ADDS = 1 << 18;
inline int threads_for(const Problem& p, double min_multiply_adds) {
  const double multiply_adds = double(p.B) * p.Hq * p.Lq * p.Lk * (p.D + p.Dv);
  return multiply_adds < min_multiply_adds ? 1 : p.num_threads;
}
// Decoding (few_queries_tiles) costs what it reads of K and V, not its multiply-adds (float32
// with one query: four bytes per multiply-add). On OpenMP's threads, in a loop of decoding steps
// between torch operations (bfloat16, 8 query heads of 64 over 2 or 8 KV heads, paired calls),
// two threads ran 1.12-1.13x as fast as one at 64-128 KiB of K and V, 1.23-1.44x at 128-256,
// 1.43-1.47x at 384-768; with 1 ms between steps 1.26-1.43x from 256 KiB on. After 20 ms idle,
// when every call is slow (120-260 µs) and the threads must be woken, 0.65-0.70x up to 128 KiB,
// 0.80-0.94x at 256-768.
constexpr double FEW_QUERIES_MIN_PARALLEL_BYTES = 256 * 1024;
inline int few_queries_threads(const Problem& p) {
  const double bytes = double(p.B) * p.Hkv * p.Lk * (p.D + p.Dv) * (p.dtype == qkv::F32 ? 4 : 2);
  return bytes < FEW_QUERIES_MIN_PARALLEL_BYTES ? 1 : p.num_threads;
}

inline Tile make_tile(const Problem& p, int r, int t, int j) {
  Tile tl{p, r / p.Hkv, r % p.Hkv, r, t, j, 0, 0, 0, 0};
  tl.q0 = t * p.block_q;
  tl.rows = imin(p.block_q, p.Lq - tl.q0);
  tl.k0 = j * p.block_k;
  tl.cols = j < cdiv(p.Lk, p.block_k) ? imin(p.block_k, p.Lk - tl.k0) : 0;
  return tl;
}

// Qᵀ of a query tile: (D x np), zero beyond the tile's n queries.
inline void load_queries_transposed(const Problem& p, const Tile& tl, int G, int np, float* QT) {
  fill(QT, int64_t(p.D) * np, 0.f);
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < tl.rows; ++i) {
      const int64_t base = tl.b * p.q.s0 + int64_t(tl.kv * G + g) * p.q.s1 + int64_t(tl.q0 + i) * p.q.s2;
      const int rr = g * tl.rows + i;
      for (int d = 0; d < p.D; ++d) QT[int64_t(d) * np + rr] = element(p.q, p.dtype, base + d * p.q.s3);
    }
}


#if defined(QKV_BF16_PRODUCTS)
// ---- bfloat16 products: Sᵀ = K·Qᵀ and Oᵀ += Vᵀ·Pᵀ with operands in bfloat16 --------------------
// B operands are in "VNNI" pairs: row p holds, for each column, the elements 2p and 2p+1 of
// the reduction dimension, which both the tile unit and VDPBF16PS multiply and add in one step.
#if defined(QKV_AMX)
// ---- AMX (bfloat16 tile matrix multiply) ------------------------------------------------------
// Eight tile registers of 16 rows x 64 bytes: C = tmm0..3 (2x2 blocks of 16x16 float32),
// A = tmm4, tmm5 (16 rows x 32 bf16), B = tmm6, tmm7 (16 pairs x 16 columns, "VNNI" layout:
// row p holds, for each column, the elements 2p and 2p+1 of the reduction dimension).
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

inline void amx_configure() {
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

// C (rows x np, float32, ldc) (+)= A (rows x depth bf16, lda) · B (depth/2 pairs x np, VNNI, np*2 per pair).
// rows, np and depth are multiples of 32.
inline void pairs_matmul(int rows, int np, int depth, const uint16_t* A, int64_t lda, const uint16_t* B, float* C,
                         int64_t ldc, bool add) {
  for (int i = 0; i < rows; i += 32)
    for (int q = 0; q < np; q += 32) {
      float* c = C + i * ldc + q;
      if (add) {
        _tile_loadd(0, c, ldc * 4); _tile_loadd(1, c + 16, ldc * 4);
        _tile_loadd(2, c + 16 * ldc, ldc * 4); _tile_loadd(3, c + 16 * ldc + 16, ldc * 4);
      } else {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      }
      for (int k = 0; k < depth; k += 32) {
        const uint16_t* b = B + int64_t(k / 2) * np * 2 + q * 2;
        _tile_loadd(4, A + i * lda + k, lda * 2);
        _tile_loadd(5, A + (i + 16) * lda + k, lda * 2);
        _tile_loadd(6, b, np * 4);
        _tile_loadd(7, b + 32, np * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c, ldc * 4); _tile_stored(1, c + 16, ldc * 4);
      _tile_stored(2, c + 16 * ldc, ldc * 4); _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
    }
}

#else
// ---- VDPBF16PS (AVX-512 bfloat16 dot products) -------------------------------------------------
// MR rows x NV vectors of C in registers; per pair of the depth, NV vectors of B's pairs and
// one 32-bit broadcast of a row's pair of A meet in VDPBF16PS, which adds both products of a
// pair into each float32 lane (as the tile unit does: bfloat16 products exact in float32,
// denormal inputs read as 0, sums rounded to nearest).
// ADD: C's sums go on (the output across key tiles). Otherwise C = A·B in chains of CHAIN
// depth, each summed from zero and then added to the chains before it, as gemm_chains does:
// with one chain over a head dim of 256 the float32 lse broke the tolerance rule (2.5e-6
// against 2.3e-6, bfloat16 inputs; tests: test_bfloat16_products_sum_in_chains).
template <int MR, int NV, bool ADD>
inline void pairs_micro(int depth, const uint16_t* A, int64_t lda, const uint16_t* B, int np, float* C, int64_t ldc) {
  for (int k0 = 0; k0 < depth; k0 += ADD ? depth : CHAIN) {
    const int k_end = ADD ? depth : imin(depth, k0 + CHAIN);
    __m512 c[MR][NV];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] = ADD ? _mm512_loadu_ps(C + r * ldc + v * W) : _mm512_setzero_ps();
    for (int k = k0; k < k_end; k += 2) {
      const uint16_t* b_row = B + int64_t(k / 2) * np * 2;
      __m512bh b[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(b_row + v * 2 * W);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        memcpy(&pair, A + r * lda + k, 4);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) c[r][v] = _mm512_dpbf16_ps(c[r][v], a, b[v]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        float* at = C + r * ldc + v * W;
        _mm512_storeu_ps(at, ADD || k0 == 0 ? c[r][v] : _mm512_add_ps(_mm512_loadu_ps(at), c[r][v]));
      }
  }
}

template <bool ADD>
inline void pairs_pass(int rows, int np, int depth, const uint16_t* A, int64_t lda, const uint16_t* B, float* C,
                       int64_t ldc) {
  constexpr int MR = 4, NV = 4;
  for (int q = 0; q < np; q += NV * W) {
    const bool whole = np - q >= NV * W;  // else 2 vectors: np is a multiple of 32
    for (int i = 0; i < rows; i += MR) {
      if (whole) pairs_micro<MR, NV, ADD>(depth, A + i * lda, lda, B + q * 2, np, C + i * ldc + q, ldc);
      else pairs_micro<MR, 2, ADD>(depth, A + i * lda, lda, B + q * 2, np, C + i * ldc + q, ldc);
    }
  }
}

// C (rows x np, float32, ldc) (+)= A (rows x depth bf16, lda) · B (depth/2 pairs x np, VNNI, np*2 per pair).
// rows, np and depth are multiples of 32, as for the tile unit.
inline void pairs_matmul(int rows, int np, int depth, const uint16_t* A, int64_t lda, const uint16_t* B, float* C,
                         int64_t ldc, bool add) {
  if (add) pairs_pass<true>(rows, np, depth, A, lda, B, C, ldc);
  else pairs_pass<false>(rows, np, depth, A, lda, B, C, ldc);
}
#endif

// Float32 on AMX: every float32 operand is split into three bfloat16 parts, x = x0 + x1 + x2
// exactly (each part is the bfloat16 nearest what the parts before it left, and takes at
// least 8 of float32's 24 significant bits). A product x·y is the sum of the six part
// products xi·yj with i + j <= 2; the three left out are below 2^-26 |x·y|. The parts'
// products are exact in float32, and the largest, x0·y0, is summed last, over the whole
// depth: the small products round while the sum is still small, so a dot product rounds
// about as a float32 FMA chain (in tests, less).
constexpr int PARTS = 3;

// C (rows x np, float32, ldc) = A·B for A (rows x depth, lda) and B (VNNI pairs) in PARTS
// parts, A's planes a_plane elements apart, B's b_plane. The five small products go k step
// by k step in an order where each shares a loaded tile with the one before (12 tile loads
// for 20 products instead of 20), then x0·y0 from the last k step down (its first A tiles
// are still loaded). rows, np and depth are multiples of 32.
#if defined(QKV_AMX)
inline void amx_matmul_parts(int rows, int np, int depth, const uint16_t* A, int64_t lda, int64_t a_plane,
                             const uint16_t* B, int64_t b_plane, float* C, int64_t ldc) {
  for (int i = 0; i < rows; i += 32)
    for (int q = 0; q < np; q += 32) {
      auto load_a = [&](int part, int k) {
        const uint16_t* a = A + part * a_plane + i * lda + k;
        _tile_loadd(4, a, lda * 2);
        _tile_loadd(5, a + 16 * lda, lda * 2);
      };
      auto load_b = [&](int part, int k) {
        const uint16_t* b = B + part * b_plane + int64_t(k / 2) * np * 2 + q * 2;
        _tile_loadd(6, b, np * 4);
        _tile_loadd(7, b + 32, np * 4);
      };
      auto products = [] {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      };
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int k = 0; k < depth; k += 32) {
        load_a(2, k), load_b(0, k), products();  // x2·y0
        load_a(1, k), products();                // x1·y0
        load_b(1, k), products();                // x1·y1
        load_a(0, k), products();                // x0·y1
        load_b(2, k), products();                // x0·y2
      }
      for (int k = depth - 32; k >= 0; k -= 32) {  // x0·y0
        if (k != depth - 32) load_a(0, k);
        load_b(0, k), products();
      }
      float* c = C + i * ldc + q;
      _tile_stored(0, c, ldc * 4); _tile_stored(1, c + 16, ldc * 4);
      _tile_stored(2, c + 16 * ldc, ldc * 4); _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
    }
}
#endif

// src[0:n] as `parts` bfloat16 parts, part i of src[e] to parts_out[i * n + e]: the first
// part is src rounded to bfloat16, each next one what the parts before it leave (an
// infinite part leaves nothing, not inf - inf).
inline void split_row(const float* src, int n, int parts, uint16_t* parts_out) {
  for (int e = 0; e < n; e += 16) {
    const __mmask16 in = n - e >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - e)) - 1);
    __m512 x = _mm512_maskz_loadu_ps(in, src + e);
    for (int i = 0; i < parts; ++i) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
      _mm256_mask_storeu_epi16(parts_out + int64_t(i) * n + e, in, h);
      const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      x = _mm512_maskz_sub_ps(~_mm512_fpclass_ps_mask(back, 0x18), x, back);  // 0x18: +-inf
    }
  }
}

inline uint16_t bits(const Strided4& t, int64_t off) { return static_cast<const uint16_t*>(t.data)[off]; }

// Row l of t[b, h] in bfloat16 parts: parts x n words in `row`, float scratch `tmp` (n).
// A bfloat16 row is its own one part: its bits are copied.
inline void split_input_row(const Strided4& t, qkv::DType dt, int b, int h, int l, int n, int parts, float* tmp,
                            uint16_t* row) {
  if (dt == qkv::BF16 && parts == 1) return bf16_row(t, b, h, l, n, row, 1);
  load_vector(t, dt, b, h, l, n, n, tmp);
  split_row(tmp, n, parts, row);
}

// Qᵀ of a query tile in VNNI pairs, (Dpad/2) x np x 2 bf16 per part, zero padded (unscaled:
// the scores are scaled).
inline void pack_queries(const Problem& p, const Tile& tl, int G, int Dpad, int np, int parts, uint16_t* QB) {
  const int64_t plane = int64_t(Dpad) * np;
  Buffer tmp(p.D), row_(int64_t(parts) * round_up(p.D, 2) / 2);
  uint16_t* row = reinterpret_cast<uint16_t*>(row_.p);
  memset(QB, 0, size_t(plane) * parts * 2);
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < tl.rows; ++i) {
      split_input_row(p.q, p.dtype, tl.b, tl.kv * G + g, tl.q0 + i, p.D, parts, tmp.p, row);
      uint16_t* column = QB + (g * tl.rows + i) * 2;  // this query's pairs lie np * 2 apart
      for (int part = 0; part < parts; ++part)
        for (int d = 0; d < p.D; ++d) column[part * plane + int64_t(d / 2) * np * 2 + d % 2] = row[part * p.D + d];
    }
}

// A key tile of k as bf16 rows (keys_pad x Dpad): in place when it already is one, else copied.
inline const uint16_t* key_tile(const Problem& p, const Tile& tj, int Dpad, int keys_pad, uint16_t* scratch,
                                int64_t* ld) {
  const Strided4& k = p.k;
  const int64_t base = tj.b * k.s0 + int64_t(tj.kv) * k.s1 + int64_t(tj.k0) * k.s2;
  if (k.s3 == 1 && p.D == Dpad && tj.cols == keys_pad) {
    *ld = k.s2;
    return static_cast<const uint16_t*>(k.data) + base;
  }
  memset(scratch, 0, size_t(keys_pad) * Dpad * 2);
  for (int c = 0; c < tj.cols; ++c)
    for (int d = 0; d < p.D; ++d) scratch[int64_t(c) * Dpad + d] = bits(k, base + c * k.s2 + d * k.s3);
  *ld = Dpad;
  return scratch;
}

void pack_tile_item(void* ctx, int64_t rj) {  // one (row, key tile)
  const PackedTiles& pt = *static_cast<const PackedTiles*>(ctx);
  const Problem& p = pt.p;
  const Strided4& t = pt.t;
  const int r = int(rj / pt.nk), j = int(rj % pt.nk);
  const int k0 = j * p.block_k, keys = imin(p.block_k, p.Lk - k0), n = &t == &p.k ? p.D : p.Dv;
  const int64_t plane = pt.plane(), base = int64_t(r / p.Hkv) * t.s0 + int64_t(r % p.Hkv) * t.s1 + int64_t(k0) * t.s2;
  uint16_t* out = const_cast<uint16_t*>(pt.tile(r, j));
  memset(out, 0, size_t(pt.parts) * plane * 2);
  if (p.dtype == qkv::BF16 && pt.parts == 1) {  // bfloat16 in: its bits, placed directly
    const int64_t along_c = pt.transpose ? 1 : pt.cols, along_d = pt.transpose ? pt.cols : 1;
    for (int c = 0; c < keys; ++c)  // each key's row is read once, in order
      for (int d = 0; d < n; ++d) out[c * along_c + d * along_d] = bits(t, base + c * t.s2 + d * t.s3);
    return;
  }
  constexpr int BLOCK = 32;  // keys split before they are written: a cache line of each Vᵀ row
  const int64_t row_words = int64_t(pt.parts) * n;
  Buffer tmp(n), rows_(BLOCK * row_words / 2 + 1);
  uint16_t* rows = reinterpret_cast<uint16_t*>(rows_.p);  // (BLOCK keys, parts, n)
  for (int c0 = 0; c0 < keys; c0 += BLOCK) {  // each key's row is read once, in order
    const int count = imin(BLOCK, keys - c0);
    for (int c = 0; c < count; ++c)
      split_input_row(t, p.dtype, r / p.Hkv, r % p.Hkv, k0 + c0 + c, n, pt.parts, tmp.p, rows + c * row_words);
    for (int part = 0; part < pt.parts; ++part) {
      uint16_t* to = out + part * plane;
      if (pt.transpose)  // Vᵀ: row d gets the block's keys side by side
        for (int d = 0; d < n; ++d)
          for (int c = 0; c < count; ++c) to[int64_t(d) * pt.cols + c0 + c] = rows[c * row_words + part * n + d];
      else
        for (int c = 0; c < count; ++c)
          memcpy(to + int64_t(c0 + c) * pt.cols, rows + c * row_words + part * n, size_t(n) * 2);
    }
  }
}

// Words 2i and 2i + 1: even[i] and odd[i] rounded to bfloat16, a VNNI pair of keys.
inline __m512i bf16_pairs(Vec even, Vec odd) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd.v, even.v);  // words 0-15: even, 16-31: odd
  return _mm512_permutexvar_epi16(interleave, both);
}

// One pass of the online softmax for bfloat16 products: fold a tile of transposed scores ST
// (cols x np) into m, l (np), writing P straight out as bf16 VNNI pairs of keys,
// (keys_pad/2) x np x 2 per part (keys past cols are 0). ST is only read.
// bfloat16 (SPLIT false): scores times `scale` give P by the degree-5 exp, one part, and
// the output so far OT (Dv x np) is rescaled here. float32 (SPLIT): scaled scores give P by
// the float path's exp, in PARTS parts, and the rescale factors go to alphas (np).
template <bool SPLIT>
inline void softmax_to_bf16_pairs(int cols, int keys_pad, int np, int Dv, const float* ST, float scale, float* m,
                                  float* l, float* OT, float* alphas, uint16_t* PB, Ahead ahead) {
  const Vec scaled = Vec::set1(scale), log2e = Vec::set1(LOG2E);
  const int64_t plane = int64_t(keys_pad) * np;
  const __m512i high_words = _mm512_set1_epi32(int(0xffff0000u));
  for (int q = 0; q < np; q += W) {
    const Vec mx = column_max(ST, cols, np, q);
    Vec m_old = Vec::load(m + q), m_new = Vec::max(m_old, mx * scaled);
    Vec shift = Vec::finite_or_zero(m_new);  // columns with nothing allowed yet shift by 0
    Vec alpha = Vec::exp(m_old - shift), sum = Vec::zero();
    const Vec neg_shift = Vec::zero() - shift;
    auto p_of = [&](int c) {
      if (c >= cols) return Vec::zero();
      Vec s = Vec::load(ST + int64_t(c) * np + q);
      if (SPLIT) return Vec::exp(s - shift);
      // exp(scale * s - shift) = 2^((scale * s - shift) * log2(e)): the difference from one fma,
      // which rounds only the difference, then to log2 units. Folding log2(e) into the fma's
      // terms, as this did, rounds shift * log2(e) on its own, which put lse 1.5 ulp off
      // (scores near -120 under alibi; tests: test_large_bfloat16_scores_keep_the_lse).
      return Vec::exp2_degree5(Vec::fma(s, scaled, neg_shift) * log2e);
    };
    for (int c = 0; c < keys_pad; c += 2) {  // keys c and c + 1
      Vec even = p_of(c), odd = p_of(c + 1);
      sum = sum + (even + odd);  // one add on the loop-carried chain
      uint16_t* at = PB + int64_t(c / 2) * np * 2 + q * 2;
      __m512i pairs = bf16_pairs(even, odd);
      _mm512_storeu_si512(at, pairs);
      for (int part = 1; SPLIT && part < PARTS; ++part) {  // what the parts so far leave
        even = even - Vec{_mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16))};
        odd = odd - Vec{_mm512_castsi512_ps(_mm512_and_si512(pairs, high_words))};
        pairs = bf16_pairs(even, odd);
        _mm512_storeu_si512(at + part * plane, pairs);
      }
      ahead.next();
    }
    (Vec::load(l + q) * alpha + sum).store(l + q);
    m_new.store(m + q);
    if (SPLIT) alpha.store(alphas + q);
    else rescale_output(Dv, np, q, m_old, m_new, alpha, OT);
  }
}

// OT (rows x np) = OT * alphas (per column) + T: the output so far rescaled, plus a key tile's.
inline void rescale_add(int rows, int np, const float* alphas, const float* T, float* OT) {
  for (int q = 0; q < np; q += W) {
    const Vec alpha = Vec::load(alphas + q);
    for (int d = 0; d < rows; ++d) {
      float* o = OT + int64_t(d) * np + q;
      Vec::fma(Vec::load(o), alpha, Vec::load(T + int64_t(d) * np + q)).store(o);
    }
  }
}

inline void scale_tile(float* ST, int cols, int np, float scale) {
  Vec s = Vec::set1(scale);
  for (int64_t e = 0; e < int64_t(cols) * np; e += W) (Vec::load(ST + e) * s).store(ST + e);
}
#endif


// ---- decoding: a few stacked queries against many keys ---------------------------------------
// With few queries a transposed score tile would fill a fraction of each vector, so here
// the rows of K and V (float32 or bfloat16, T) are read in place and the vectors run along
// the head dim instead: S = scale·Q·Kᵀ (n x keys) by dot products, O (n x Dv) += P·V with up to
// four rows and four vectors of O held in registers, all in float32 (bfloat16 rows are widened
// as they are loaded; P is not rounded). The result is written out as Oᵀ for the common code.
// Up to how many stacked queries (per KV head) take this path. bfloat16 goes further: its
// bfloat16 products (AMX or VDPBF16PS) would first pack all of Vᵀ, which few queries do not
// pay back (measured on AMX, with the tile unit's products: 32/8 heads of 128 over
// 1024 and 8192 keys: at 16 queries here 583-602 and 4907-5002 µs against 1571-1670 and
// 15185-16571, at 32 1102-1127 and 9138-9175 against 1627-1835 and 13683-15300, at 64
// 2242-2246 and 17420-17704 against 1757-1911 and 15029-16411). On Zen 4 with VDPBF16PS the
// crossover is about as far: 32 queries here took 1118 and 7884 µs, 36 and 64 queries on the
// bfloat16 products 1369-1393 and 11977-12037 (medians of 7 rounds).
constexpr int FEW_QUERIES = 8, FEW_QUERIES_BF16 = 32;
// Elements of a row of T in one 64-byte cache line: prefetches go a line at a time.
template <class T>
constexpr int PER_LINE = 64 / int(sizeof(T));

inline bool few_queries_path(const Problem& p, int n) {
  const int most = p.dtype == qkv::BF16 ? FEW_QUERIES_BF16 : p.dtype == qkv::F32 ? FEW_QUERIES : 0;
  return n <= most && p.k.s3 == 1 && p.v.s3 == 1 && p.D % W == 0 && p.Dv % W == 0;
}

// Whether the forward of p runs on the decoding path: G stacked heads of a query tile are few.
inline bool decoding_forward(const Problem& p) { return few_queries_path(p, p.Hq / p.Hkv * imin(p.block_q, p.Lq)); }

// bfloat16 K and V rows are read 2W elements at a time as their even-indexed elements and
// their odd ones (Vec::load_pairs: one load and two integer operations, where widening them in
// order takes two loads and four). The query and output rows they meet are held in that "pair
// order" too: each whole block of 2W elements as its W even ones, then its W odd ones; a last
// W elements stay in order. float32 rows are read, and held, in order.
inline void load_two(const float* row, Vec& first, Vec& second) { first = Vec::load(row), second = Vec::load(row + W); }
inline void load_two(const uint16_t* row, Vec& even, Vec& odd) { Vec::load_pairs(row, even, odd); }

inline void to_pair_order(float* row, int n) {
  float block[2 * W];
  for (int d0 = 0; d0 + 2 * W <= n; d0 += 2 * W) {
    for (int i = 0; i < W; ++i) block[i] = row[d0 + 2 * i], block[W + i] = row[d0 + 2 * i + 1];
    for (int i = 0; i < 2 * W; ++i) row[d0 + i] = block[i];
  }
}
inline void from_pair_order(float* row, int n) {
  float block[2 * W];
  for (int d0 = 0; d0 + 2 * W <= n; d0 += 2 * W) {
    for (int i = 0; i < W; ++i) block[2 * i] = row[d0 + i], block[2 * i + 1] = row[d0 + W + i];
    for (int i = 0; i < 2 * W; ++i) row[d0 + i] = block[i];
  }
}

// S[rr][c + u·step] = scale·(Q[rr]·K[k0 + c + u·step]) for the N query rows (Q: N x D, in the
// rows' order) and the KEYS keys u = 0 .. KEYS - 1 from key c of the tile, `spacing` apart if
// SPACED, else in a row (step 1). N and KEYS are template parameters so the accumulators stay
// in registers; four keys' sums share one reduction, and on AVX-512 four rows' four keys one
// 16-way reduction (decoding 32/8 heads of 128, float32, paired medians of 12-15 rounds in one
// process: 1.048x as fast with K and V in cache, 1.014x from memory). SPACED is a template
// parameter too, so the calls in order keep a constant step (a step read at run time made AVX2
// code with 2 rows per KV head 0.79x as fast, decoding 32768 keys on Zen 4).
template <int N, int KEYS, class T, bool SPACED = false>
inline void scores_of_keys(const Problem& p, const Tile& tj, int c, const float* Q, float* S, int ld, int spacing = 1) {
  const T* K = static_cast<const T*>(p.k.data) + tj.b * p.k.s0 + int64_t(tj.kv) * p.k.s1;
  const int step = SPACED ? spacing : 1;
  const T* key[KEYS];
  for (int u = 0; u < KEYS; ++u) key[u] = K + int64_t(tj.k0 + c + u * step) * p.k.s2;
  Vec acc[KEYS][N];
  for (int u = 0; u < KEYS; ++u)
    for (int rr = 0; rr < N; ++rr) acc[u][rr] = Vec::zero();
  int d = 0;
  if constexpr (sizeof(T) == 2)  // bfloat16: 2W elements a step, each key's as one load in pair order
    for (; d + 2 * W <= p.D; d += 2 * W)
      for (int u = 0; u < KEYS; ++u) {
        Vec k0, k1;
        load_two(key[u] + d, k0, k1);
        for (int rr = 0; rr < N; ++rr) {
          acc[u][rr] = Vec::fma(k0, Vec::load(Q + rr * p.D + d), acc[u][rr]);
          acc[u][rr] = Vec::fma(k1, Vec::load(Q + rr * p.D + d + W), acc[u][rr]);
        }
      }
  // W elements a step: all of a float32 row, a last W of a bfloat16 one. Where they fit the
  // registers beside the accumulators, a vector of each query row is loaded once and met by
  // every key, so a step takes N + KEYS loads, not N per key (float32 decoding as measured in
  // scores_by_rows: 21.7-22.1 GB/s with a query load per product, 26.7-27.3 with this); else
  // each product loads its own.
  constexpr bool query_in_registers = N * (KEYS + 1) + 1 <= Vec::REGISTERS;
  for (; d < p.D; d += W) {
    Vec query[query_in_registers ? N : 1];
    if constexpr (query_in_registers)
      for (int rr = 0; rr < N; ++rr) query[rr] = Vec::load(Q + rr * p.D + d);
    for (int u = 0; u < KEYS; ++u) {
      const Vec kd = Vec::load(key[u] + d);
      for (int rr = 0; rr < N; ++rr)
        acc[u][rr] = Vec::fma(kd, query_in_registers ? query[rr] : Vec::load(Q + rr * p.D + d), acc[u][rr]);
    }
  }
#if defined(QKV_AVX512)
  if constexpr (N == 4 && KEYS == 4) {
    float sums[16];
    (Vec::sum16(acc) * Vec::set1(p.scale)).store(sums);
    for (int rr = 0; rr < N; ++rr)
      for (int u = 0; u < KEYS; ++u) S[rr * ld + c + u * step] = sums[rr * 4 + u];
    return;
  }
#endif
  for (int rr = 0; rr < N; ++rr) {
    float sums[KEYS];
    if constexpr (KEYS == 4) Vec::sum4(acc[0][rr], acc[1][rr], acc[2][rr], acc[3][rr], sums);
    else for (int u = 0; u < KEYS; ++u) sums[u] = acc[u][rr].reduce_add();
    for (int u = 0; u < KEYS; ++u) S[rr * ld + c + u * step] = sums[u] * p.scale;  // as gemm_scaled: after the sum
  }
}

// Keys scored at once for n query rows: their KEYS x n accumulators and a key's vectors must
// fit the registers (scores_of_keys keeps the query vectors there too where they fit). 32
// registers: four keys for n <= 4; 16: four for n <= 3, two for n <= 6.
constexpr int keys_at_once(int n) {
  if (Vec::REGISTERS >= 32) return n <= 4 ? 4 : 1;
  return n <= 3 ? 4 : n <= 6 ? 2 : 1;
}

// Vectors of a value row the values pass can take at once: with 32 registers a row of 128
// float32 or bfloat16 values, though 4 rows of 8 accumulators spill some (decoding as below,
// keys in streams: 1.10-1.19x as fast as half rows in two passes).
constexpr int ROW_VECTORS = Vec::REGISTERS >= 32 ? 8 : 2;

// Decoding reads a key tile's rows as STREAMS runs through it side by side: the first
// STREAMS · spacing keys (spacing = cols / STREAMS) in the order c, c + spacing, c + 2·spacing,
// ... for c = 0 .. spacing - 1, the rest in order. One core keeps more reads in flight over
// several runs than over one (plain reads of 134 MB by one thread on Zen 4: 24-27 GB/s from four
// far-apart runs in lockstep, 17-18 from one). It does so where the scores take four keys at
// once (they take the runs' keys) and the values pass takes a value row whole; the K and V rows
// then need no requests. Decoding 32768 keys, 32/8 heads of 128 on Zen 4, tiles of 512 keys
// against tiles of 128 read in order, paired medians of 12 rounds in one process: float32
// 1.25-1.46x as fast (70-100% of the read a sum gets, which itself varies), bfloat16 1.03-1.12x.
// Where one of the two cannot (16 registers; more rows; wider rows) the runs were slower (AVX2
// code with 2 rows per KV head, the scores in streams: 0.89x), and the keys are read in order.
constexpr int STREAMS = 4;
inline bool reads_in_streams(const Problem& p, int n) {  // n: the query rows of a tile
  const int row = p.Dv / W;
  return keys_at_once(n) == STREAMS && p.Dv % W == 0 && row <= ROW_VECTORS && (row & (row - 1)) == 0;
}
inline int stream_spacing(int cols) { return cols / STREAMS; }
inline int key_in_streams(int i, int cols) {  // the i-th key read
  const int spacing = stream_spacing(cols);
  return i < STREAMS * spacing ? i % STREAMS * spacing + i / STREAMS : i;
}

// The N query rows against every key of the tile, keys_at_once(N) at a time, the last ones
// one at a time. With `ahead`, each key's K and V rows are requested whole just before it is
// scored: the key's lines then arrive together rather than one per step, and the value row is
// in cache for the values pass (decoding 32768 float32 keys, 4 queries per KV head, on AVX2:
// 8.8 GB/s with one thread, 10.7-11.3 with it; 15.4-16.5 with two, 17.4-19.9 with it). These
// are the path's only prefetches: requesting each line again some keys ahead as the rows were
// read, and the value rows again in the values pass, cost more than they saved (the same
// decoding by these functions alone, in a C++ loop, two threads: 21.3-22.8 GB/s with them,
// 24.1-27.9 without).
// With `next` too (AVX-512 builds), key u's K and V rows of the item's next key tile are
// requested into L2 as key u of this one is scored, so the memory keeps streaming while the
// cores compute: on Zen 4 without it a key's compute and its memory time added up rather than
// overlapped. Decoding 32768 float32 keys, 32/8 heads of 128, two threads: with the request
// switched by a flag, paired medians of 10 rounds in one process, 1.25-1.36x as fast (75-78%
// of a sum over K and V against 54-64%; into L1 instead, 0.99x); the builds with and without
// it in alternating processes, 1.04-1.19x (21.0-22.7 GB/s against 18.4-20.2, 66-75% of the
// sum), bfloat16 0.95-1.15x. Not measured on AVX2, where requesting the next tile during the
// values pass was slower (README, "Speed").
constexpr bool REQUEST_NEXT_TILE = Vec::REGISTERS >= 32;

// The keys of a tile's streams, scores_of_keys inlined into the loop (flatten) where GCC would
// call it: decoding 32/8 heads of 128 on Zen 4, paired medians of 9-15 rounds in one process,
// float32 1.03-1.09x as fast; bfloat16 0.88-0.96x, so its keys are scored by calls.
template <int N, class T>
__attribute__((flatten)) inline void scores_in_streams(const Problem& p, const Tile& tj, const float* Q, float* S,
                                                       int ld) {
  const int spacing = stream_spacing(tj.cols);
  for (int c = 0; c < spacing; ++c) scores_of_keys<N, STREAMS, T, true>(p, tj, c, Q, S, ld, spacing);
}

template <int N, class T>
inline void scores_by_rows(const Problem& p, const Tile& tj, const float* Q, float* S, int ld, bool ahead,
                           NextKeys next, bool streams) {
  constexpr int KEYS = keys_at_once(N);
  if (KEYS == STREAMS && streams) {
    const int spacing = stream_spacing(tj.cols);
    if constexpr (sizeof(T) == 4) scores_in_streams<N, T>(p, tj, Q, S, ld);
    else
      for (int c = 0; c < spacing; ++c) scores_of_keys<N, KEYS, T, true>(p, tj, c, Q, S, ld, spacing);
    for (int c = KEYS * spacing; c < tj.cols; ++c) scores_of_keys<N, 1, T>(p, tj, c, Q, S, ld);
    return;
  }
  const T* K = static_cast<const T*>(p.k.data) + tj.b * p.k.s0 + int64_t(tj.kv) * p.k.s1;
  const T* V = static_cast<const T*>(p.v.data) + tj.b * p.v.s0 + int64_t(tj.kv) * p.v.s1;
  const int fetched = ahead ? tj.cols : 0;
  int c = 0;
  for (; c + KEYS <= tj.cols; c += KEYS) {
    for (int u = c; u < c + KEYS && u < fetched; ++u) {  // K and V rows, whole
      for (int d = 0; d < p.D; d += PER_LINE<T>) __builtin_prefetch(K + int64_t(tj.k0 + u) * p.k.s2 + d, 0, 3);
      for (int d = 0; d < p.Dv; d += PER_LINE<T>) __builtin_prefetch(V + int64_t(tj.k0 + u) * p.v.s2 + d, 0, 3);
      if (u >= next.count) continue;
      for (int d = 0; d < p.D; d += PER_LINE<T>) __builtin_prefetch(K + int64_t(next.k0 + u) * p.k.s2 + d, 0, 2);
      for (int d = 0; d < p.Dv; d += PER_LINE<T>) __builtin_prefetch(V + int64_t(next.k0 + u) * p.v.s2 + d, 0, 2);
    }
    scores_of_keys<N, KEYS, T>(p, tj, c, Q, S, ld);
  }
  for (; c < tj.cols; ++c) scores_of_keys<N, 1, T>(p, tj, c, Q, S, ld);
}

// All n rows, eight at a time (the tile's K rows stay in L1 for the next eight).
template <class T>
inline void scores_by_rows(const Problem& p, const Tile& tj, int n, const float* Q, float* S, int ld,
                           NextKeys next = {}, bool streams = false) {
  for (int r0 = 0; r0 < n; r0 += 8, next = {}) {  // the first eight rows request what comes
    const float* q = Q + int64_t(r0) * p.D;
    float* s = S + int64_t(r0) * ld;
    const bool ahead = r0 == 0;
    switch (imin(8, n - r0)) {
      case 1: scores_by_rows<1, T>(p, tj, q, s, ld, ahead, next, streams); break;
      case 2: scores_by_rows<2, T>(p, tj, q, s, ld, ahead, next, streams); break;
      case 3: scores_by_rows<3, T>(p, tj, q, s, ld, ahead, next, streams); break;
      case 4: scores_by_rows<4, T>(p, tj, q, s, ld, ahead, next, streams); break;
      case 5: scores_by_rows<5, T>(p, tj, q, s, ld, ahead, next, streams); break;
      case 6: scores_by_rows<6, T>(p, tj, q, s, ld, ahead, next, streams); break;
      case 7: scores_by_rows<7, T>(p, tj, q, s, ld, ahead, next, streams); break;
      default: scores_by_rows<8, T>(p, tj, q, s, ld, ahead, next, streams); break;
    }
  }
}

// Online softmax along rows of S (n x ld, `cols` keys): S becomes P; m, l and O (n x Dv) update.
inline void online_softmax_rows(int n, int cols, int ld, int Dv, float* S, float* m, float* l, float* O) {
  const int span = round_up(cols, W);  // <= ld: whole vectors, the keys past cols at -inf
  for (int rr = 0; rr < n; ++rr) {
    float* s = S + int64_t(rr) * ld;
    fill(s + cols, span - cols, NEG_INF);
    Vec mx = Vec::set1(NEG_INF);
    bool nan = false;  // a NaN score must make the row's maximum NaN: vector max drops it
    for (int c = 0; c < span; c += W) {
      const Vec x = Vec::load(s + c);
      nan |= x.any_nan();
      mx = Vec::max(mx, x);
    }
    // a NaN maximum becomes the row's, so NaN propagates (a comparison with it fails, and the
    // tile was left out as if all masked)
    const float tile_max = nan ? NAN : mx.reduce_max();
    const float m_new = tile_max > m[rr] || std::isnan(tile_max) ? tile_max : m[rr];
    if (m_new == NEG_INF) {  // nothing allowed yet: contributes nothing
      fill(s, ld, 0.f);
      continue;
    }
    const float alpha = expf(m[rr] - m_new);  // rescales what was summed under the old max
    Vec shift = Vec::set1(m_new), sum = Vec::zero();
    for (int c = 0; c < span; c += W) {
      Vec e = Vec::exp(Vec::load(s + c) - shift);
      e.store(s + c);
      sum = sum + e;
    }
    l[rr] = l[rr] * alpha + sum.reduce_add(), m[rr] = m_new;
    for (int d = 0; d < Dv; d += W) (Vec::load(O + int64_t(rr) * Dv + d) * Vec::set1(alpha)).store(O + int64_t(rr) * Dv + d);
  }
}

// O (rows r0 .. r0 + R, columns d0 .. d0 + NV * W) += P (those rows of n x ld) · V[k0 : k0 + cols]
// (those columns): R rows and NV vectors of O in registers. The keys in order, or in streams.
template <int R, int NV, bool IN_STREAMS, class T>
inline void values_block(const Problem& p, const Tile& tj, int r0, int d0, const float* P, int ld, float* O) {
  const T* V = static_cast<const T*>(p.v.data) + tj.b * p.v.s0 + int64_t(tj.kv) * p.v.s1;
  Vec acc[R][NV];
  for (int rr = 0; rr < R; ++rr)
    for (int v = 0; v < NV; ++v) acc[rr][v] = Vec::load(O + int64_t(r0 + rr) * p.Dv + d0 + v * W);
  for (int i = 0; i < tj.cols; ++i) {
    const int c = IN_STREAMS ? key_in_streams(i, tj.cols) : i;
    const T* value = V + int64_t(tj.k0 + c) * p.v.s2 + d0;
    Vec vv[NV];
    for (int v = 0; v + 1 < NV; v += 2) load_two(value + v * W, vv[v], vv[v + 1]);
    if (NV % 2) vv[NV - 1] = Vec::load(value + (NV - 1) * W);
    for (int rr = 0; rr < R; ++rr) {
      Vec pr = Vec::set1(P[(r0 + rr) * ld + c]);
      for (int v = 0; v < NV; ++v) acc[rr][v] = Vec::fma(pr, vv[v], acc[rr][v]);
    }
  }
  for (int rr = 0; rr < R; ++rr)
    for (int v = 0; v < NV; ++v) acc[rr][v].store(O + int64_t(r0 + rr) * p.Dv + d0 + v * W);
}

// Rows r0 .. r0 + R of O. In streams, a whole row at a time (reads_in_streams: a power of two
// vectors, ROW_VECTORS at most). Else four vectors at a time (two with 16 registers, where
// 4 x 4 accumulators would spill), then two, then a last one (the blocks of pair order).
template <int R, class T>
inline void values_for_rows(const Problem& p, const Tile& tj, int r0, const float* P, int ld, float* O, bool streams) {
  if (streams) {
    if (p.Dv == W) return values_block<R, 1, true, T>(p, tj, r0, 0, P, ld, O);
    if (p.Dv == 2 * W) return values_block<R, 2, true, T>(p, tj, r0, 0, P, ld, O);
    if constexpr (ROW_VECTORS == 8) {
      if (p.Dv == 4 * W) return values_block<R, 4, true, T>(p, tj, r0, 0, P, ld, O);
      return values_block<R, 8, true, T>(p, tj, r0, 0, P, ld, O);
    }
  }
  constexpr int WIDE = Vec::REGISTERS >= 32 ? 4 : 2;
  int d0 = 0;
  for (; d0 + WIDE * W <= p.Dv; d0 += WIDE * W) values_block<R, WIDE, false, T>(p, tj, r0, d0, P, ld, O);
  if (d0 + 2 * W <= p.Dv) values_block<R, 2, false, T>(p, tj, r0, d0, P, ld, O), d0 += 2 * W;
  if (d0 < p.Dv) values_block<R, 1, false, T>(p, tj, r0, d0, P, ld, O);
}

// O (n x Dv) += P (n x ld) · V[k0 : k0 + cols], four rows at a time and the last 1-4.
template <class T>
inline void values_by_rows(const Problem& p, const Tile& tj, int n, const float* P, int ld, float* O, bool streams) {
  for (int r0 = 0; r0 < n; r0 += 4) switch (imin(4, n - r0)) {
      case 1: values_for_rows<1, T>(p, tj, r0, P, ld, O, streams); break;
      case 2: values_for_rows<2, T>(p, tj, r0, P, ld, O, streams); break;
      case 3: values_for_rows<3, T>(p, tj, r0, P, ld, O, streams); break;
      default: values_for_rows<4, T>(p, tj, r0, P, ld, O, streams); break;
    }
}

// The state one work item folds its key tiles into: running maxima m and sums l (np each)
// and the output so far, O, in the plan's output layout (Oᵀ on the tile paths).
struct Accumulator {
  float *m, *l, *O;
  int64_t computed = 0, masked = 0;  // key tiles run, and those of them with a mask applied
};

// visit(tj) for each key tile of the item's split that the mask does not leave EMPTY.
template <class Visit>
inline void for_each_key_tile(const ForwardPlan& plan, const Tile& tl, int split, Accumulator& acc, Visit visit) {
  for (int j = split * plan.tiles_per_split, j_end = plan.split_end(split); j < j_end; ++j) {
    const int8_t cls = tile_class(plan.f.p, tl.r, tl.t, j);
    if (cls == qkv::EMPTY) continue;
    acc.computed += 1, acc.masked += cls == qkv::PARTIAL;
    visit(make_tile(plan.f.p, tl.r, tl.t, j));
  }
}

template <class T>
void few_queries_tiles_of(const ForwardPlan& plan, const Tile& tl, int split, Accumulator& acc) {
  const Problem& p = plan.f.p;
  const int n = tl.n(), ld = round_up(p.block_k, W);
  Buffer Q(int64_t(n) * p.D), S(int64_t(n) * ld);  // acc.O: n <= np zeroed rows of Dv (out_row = Dv)
  for (int g = 0; g < plan.G; ++g)
    load_rows(p.q, p.dtype, tl.b, tl.kv * plan.G + g, tl.q0, tl.rows, tl.rows, p.D, p.D,
              Q.p + int64_t(g) * tl.rows * p.D);
  constexpr bool paired = sizeof(T) == 2;  // bfloat16 rows: Q and O in pair order
  for (int rr = 0; paired && rr < n; ++rr) to_pair_order(Q.p + int64_t(rr) * p.D, p.D);
  const bool streams = reads_in_streams(p, n);
  for_each_key_tile(plan, tl, split, acc, [&](const Tile& tj) {  // each reads only what it wrote to S
    scores_by_rows<T>(p, tj, n, Q.p, S.p, ld, REQUEST_NEXT_TILE ? next_tile_keys(plan, tj, split) : NextKeys{}, streams);
    apply_rule(tj, S.p, ld, 1);
    online_softmax_rows(n, tj.cols, ld, p.Dv, S.p, acc.m, acc.l, acc.O);
    values_by_rows<T>(p, tj, n, S.p, ld, acc.O, streams);
  });
  for (int rr = 0; paired && rr < n; ++rr) from_pair_order(acc.O + int64_t(rr) * p.Dv, p.Dv);
}

void few_queries_tiles(const ForwardPlan& plan, const Tile& tl, int split, Accumulator& acc) {
  if (plan.f.p.dtype == qkv::BF16) few_queries_tiles_of<uint16_t>(plan, tl, split, acc);
  else few_queries_tiles_of<float>(plan, tl, split, acc);
}

// Float32 products on the FMA units; rows of k and v that are not contiguous float32 are
// converted a tile at a time, into buffers allocated only then.
void float_tiles(const ForwardPlan& plan, const Tile& tl, int split, Accumulator& acc) {
  const Problem& p = plan.f.p;
  const int np = plan.np;
  Buffer QT(int64_t(p.D) * np), ST(int64_t(p.block_k) * np), colmax(np);
  Buffer k_rows(rows_in_place(p.k, p.dtype) ? 0 : int64_t(p.block_k) * p.D);
  Buffer v_rows(rows_in_place(p.v, p.dtype) ? 0 : int64_t(p.block_k) * p.Dv);
  load_queries_transposed(p, tl, plan.G, np, QT.p);
  for_each_key_tile(plan, tl, split, acc, [&](const Tile& tj) {
    Operand K = key_rows(p.k, p.dtype, tl.b, tl.kv, tj.k0, tj.cols, p.D, k_rows.p);
    Operand V = key_rows(p.v, p.dtype, tl.b, tl.kv, tj.k0, tj.cols, p.Dv, v_rows.p);
    Ahead ahead = next_keys(plan, tj, split);
    if (rows_in_place(p.v, p.dtype)) ahead.values = rows_span(p.v, p.dtype, tl.b, tl.kv, tj.k0, tj.cols, p.Dv);
    if (rule_keeps_scores(tj)) {  // the scores' maxima as they are computed
      gemm_column_max(tj.cols, np, p.D, K, QT.p, np, ST.p, np, p.scale, colmax.p);  // Sᵀ = scale·K·Qᵀ (keys x queries)
      online_softmax_columns(tj.cols, np, p.Dv, ST.p, colmax.p, acc.m, acc.l, acc.O, ahead);
    } else {
      gemm_scaled(tj.cols, np, p.D, K, QT.p, np, ST.p, np, p.scale);
      apply_rule(tj, ST.p, 1, np);
      online_softmax_columns(tj.cols, np, p.Dv, ST.p, nullptr, acc.m, acc.l, acc.O, ahead);
    }
    gemm(p.Dv, np, tj.cols, transposed(V), ST.p, np, acc.O, np, true);  // Oᵀ += Vᵀ·Pᵀ
  });
}

#if defined(QKV_BF16_PRODUCTS)
// Products of bfloat16 pairs (on AMX, float32 as bfloat16 parts too), the softmax on the
// vector units.
void pairs_tiles(const ForwardPlan& plan, const Tile& tl, int split, Accumulator& acc) {
  const Problem& p = plan.f.p;
  const int np = plan.np, Dpad = round_up(p.D, 32), keys_max = round_up(p.block_k, 32), parts = plan.parts;
  Buffer QB_(int64_t(Dpad) * np / 2 * parts), ST(int64_t(keys_max) * np), K_(parts > 1 ? 0 : keys_max * Dpad / 2),
      PB_(int64_t(keys_max) * np / 2 * parts), T(parts > 1 ? int64_t(plan.dv_rows) * np : 0),
      alphas(parts > 1 ? np : 0);
  uint16_t* QB = reinterpret_cast<uint16_t*>(QB_.p);
  uint16_t* PB = reinterpret_cast<uint16_t*>(PB_.p);
  // Scores are scaled after their products: by the bfloat16 softmax itself, which takes
  // max(s)·scale for max(s·scale) and keeps -inf at -inf (true only for a positive scale), or
  // first, by scale_tile, wherever that does not hold: a scale of 0 or below, modifiers (they
  // see scaled scores), and float32 parts (their softmax takes scaled scores).
  const bool scale_first = parts > 1 || any_modifier(p) || !(p.scale > 0.f);
#if defined(QKV_AMX)
  amx_configure();
#endif
  pack_queries(p, tl, plan.G, Dpad, np, parts, QB);
  for_each_key_tile(plan, tl, split, acc, [&](const Tile& tj) {
    const int keys_pad = round_up(tj.cols, 32);
    int64_t ldk = Dpad;
    const uint16_t* K = parts > 1 ? plan.keys->tile(tl.r, tj.j)
                                  : key_tile(p, tj, Dpad, keys_pad, reinterpret_cast<uint16_t*>(K_.p), &ldk);
#if defined(QKV_AMX)
    if (parts > 1) amx_matmul_parts(keys_pad, np, Dpad, K, ldk, plan.keys->plane(), QB, int64_t(Dpad) * np, ST.p, np);
    else
#endif
      pairs_matmul(keys_pad, np, Dpad, K, ldk, QB, ST.p, np, false);  // Sᵀ = K·Qᵀ (keys x queries)
    if (scale_first) scale_tile(ST.p, tj.cols, np, p.scale);
    apply_rule(tj, ST.p, 1, np);  // masked scores become -inf, scaled or not
    const uint16_t* values = plan.values->tile(tl.r, tj.j);
    const int calls = keys_pad / 2 * (np / W);  // of ahead.next(), one per pair of keys and W queries
    Ahead ahead = next_keys(plan, tj, split, calls);
    ahead.values = whole(values, plan.values->bytes(), calls);
    if (parts == 1) {
      const float scale = scale_first ? 1.f : p.scale;
      softmax_to_bf16_pairs<false>(tj.cols, keys_pad, np, p.Dv, ST.p, scale, acc.m, acc.l, acc.O, nullptr, PB, ahead);
      pairs_matmul(plan.dv_rows, np, keys_pad, values, plan.values->cols, PB, acc.O, np, true);  // Oᵀ += Vᵀ·Pᵀ
    }
#if defined(QKV_AMX)
    else {  // the tile's Vᵀ·Pᵀ summed apart, so its small terms round while small
      softmax_to_bf16_pairs<true>(tj.cols, keys_pad, np, p.Dv, ST.p, 1.f, acc.m, acc.l, acc.O, alphas.p, PB, ahead);
      amx_matmul_parts(plan.dv_rows, np, keys_pad, values, plan.values->cols, plan.values->plane(), PB,
                       int64_t(keys_pad) * np, T.p, np);
      rescale_add(plan.dv_rows, np, alphas.p, T.p, acc.O);  // Oᵀ = Oᵀ·alpha + Vᵀ·Pᵀ
    }
#endif
  });
#if defined(QKV_AMX)
  _tile_release();
#endif
}
#endif

// The query tile of work item rt: last tiles first, since under causal masks they are the
// longest, so the pool ends on short ones.
inline int query_tile_of(const ForwardPlan& plan, int64_t rt) { return plan.nq - 1 - int(rt % plan.nq); }

void forward_item(void* ctx, int64_t item) {
  const ForwardPlan& plan = *static_cast<const ForwardPlan*>(ctx);
  const int split = int(item % plan.splits), rt = int(item / plan.splits), np = plan.np;
  Tile tl = make_tile(plan.f.p, rt / plan.nq, query_tile_of(plan, rt), 0);
  Buffer own(plan.splits > 1 ? 0 : int64_t(np) * (2 + plan.dv_rows));
  Accumulator acc;
  acc.m = plan.splits > 1 ? plan.partial + item * plan.partial_stride : own.p;
  acc.l = acc.m + np, acc.O = acc.l + np;
  fill(acc.m, np, NEG_INF), fill(acc.l, np, 0.f), fill(acc.O, int64_t(plan.dv_rows) * np, 0.f);
  if (plan.few_queries) few_queries_tiles(plan, tl, split, acc);
#if defined(QKV_BF16_PRODUCTS)
  else if (plan.pairs) pairs_tiles(plan, tl, split, acc);
#endif
  else float_tiles(plan, tl, split, acc);
  if (plan.splits == 1) store_output(plan, tl, acc.m, acc.l, acc.O);
  if (plan.f.tile_counts) {  // a builtin, not std::atomic: no shared inline templates here
    __atomic_fetch_add(&plan.f.tile_counts[0], acc.computed, __ATOMIC_RELAXED);
    __atomic_fetch_add(&plan.f.tile_counts[1], acc.masked, __ATOMIC_RELAXED);
  }
}

// Merge the key splits of one (row, query tile) by their maxima and sums.
void merge_item(void* ctx, int64_t rt) {
  const ForwardPlan& plan = *static_cast<const ForwardPlan*>(ctx);
  const Problem& p = plan.f.p;
  Tile tl = make_tile(p, int(rt / plan.nq), query_tile_of(plan, rt), 0);
  const int np = plan.np;
  Buffer merged(int64_t(np) * (2 + plan.dv_rows));
  float *m = merged.p, *l = m + np, *O = l + np;  // O in the plan's output layout
  fill(m, np, NEG_INF), fill(l, np, 0.f), fill(O, int64_t(plan.dv_rows) * np, 0.f);
  for (int s = 0; s < plan.splits; ++s) {
    const float* part = plan.partial + (rt * plan.splits + s) * plan.partial_stride;
    for (int rr = 0; rr < tl.n(); ++rr) {
      float ms = part[rr], ls = part[np + rr];
      if (ls == 0.f) continue;
      float m_new = ms > m[rr] ? ms : m[rr];
      float a_old = expf(m[rr] - m_new), a_new = expf(ms - m_new);
      l[rr] = l[rr] * a_old + ls * a_new;
      for (int d = 0; d < p.Dv; ++d)
        O[plan.output_at(rr, d)] = O[plan.output_at(rr, d)] * a_old + part[2 * np + plan.output_at(rr, d)] * a_new;
      m[rr] = m_new;
    }
  }
  store_output(plan, tl, m, l, O);
}

}  // namespace

void forward(const Forward& f) {
  const Problem& p = f.p;
  if (p.B == 0 || p.Hkv == 0 || p.Lq == 0) return;  // nothing to write
  const int G = p.Hq / p.Hkv, n = G * imin(p.block_q, p.Lq);
  const bool few_queries = decoding_forward(p);  // on the FMA units, either dtype
#if defined(QKV_AMX)
  const bool float_on_amx = p.dtype == qkv::F32 && f.float32_on_amx && !few_queries;
#else
  const bool float_on_amx = false;
#endif
#if defined(QKV_BF16_PRODUCTS)
  const bool pairs = !few_queries && (p.dtype == qkv::BF16 || float_on_amx);
#else
  const bool pairs = false;
#endif
  ForwardPlan plan{f, G, cdiv(p.Lq, p.block_q), cdiv(p.Lk, p.block_k), 1, 0, round_up(n, pairs ? 32 : W),
                   pairs ? round_up(p.Dv, 32) : p.Dv, pairs};
  plan.tiles_per_split = plan.nk;
  plan.few_queries = few_queries;
  const int threads = plan.few_queries ? few_queries_threads(p) : threads_for(p, MIN_PARALLEL_MULTIPLY_ADDS);
  plan.out_d = plan.few_queries ? 1 : plan.np, plan.out_row = plan.few_queries ? p.Dv : 1;
  const int64_t items = int64_t(p.B) * p.Hkv * plan.nq;
  // Few (row, query tile) items and many keys (decoding): split the keys too, so every
  // thread has work, 512 keys a split at least. The split depends on the shape only, so
  // results never depend on threads.
  const int split_tiles = cdiv(512, p.block_k);
  if (items < 16 && plan.nk >= 2 * split_tiles) {
    plan.splits = imin(16, imin(int(32 / items + 1), plan.nk / split_tiles));
    plan.tiles_per_split = cdiv(plan.nk, plan.splits);
    plan.splits = cdiv(plan.nk, plan.tiles_per_split);
  }
#if defined(QKV_BF16_PRODUCTS)
  const int64_t key_tiles = int64_t(p.B) * p.Hkv * plan.nk;
  const int keys_pad = round_up(p.block_k, 32);
  plan.parts = float_on_amx ? PARTS : 1;
  PackedTiles values{p, p.v, true, plan.dv_rows, keys_pad, plan.nk, plan.parts};
  PackedTiles keys{p, p.k, false, keys_pad, round_up(p.D, 32), plan.nk, plan.parts};
  const int64_t value_words = pairs ? values.elements() : 0, key_words = float_on_amx ? keys.elements() : 0;
  Workspace packed((value_words + key_words + 1) / 2);
  if (pairs) {
    values.data = reinterpret_cast<uint16_t*>(packed.p), plan.values = &values;
    qkv::parallel_for(key_tiles, threads, pack_tile_item, &values);
  }
  if (float_on_amx) {
    keys.data = reinterpret_cast<uint16_t*>(packed.p) + value_words, plan.keys = &keys;
    qkv::parallel_for(key_tiles, threads, pack_tile_item, &keys);
  }
#endif
  if (plan.splits == 1) {
    qkv::parallel_for(items, threads, forward_item, &plan);
    return;
  }
  plan.partial_stride = int64_t(plan.np) * (2 + plan.dv_rows);
  Buffer partial(items * plan.splits * plan.partial_stride);
  plan.partial = partial.p;
  qkv::parallel_for(items * plan.splits, threads, forward_item, &plan);
  // A decoding step's merge is a few rows: waking a helper for it would cost more than it does
  qkv::parallel_for(items, plan.few_queries ? 1 : threads, merge_item, &plan);
}

// ---- backward ------------------------------------------------------------------------------
// One packing pass first (O(N) copies, in the layouts the products want), so the work items
// never gather inputs element by element more than once.
namespace {

// The leading dimension of the backward's buffers one key tile wide (S, dP, Kᵀ, Vᵀ): bkp
// floats, or bkp + 32 where bkp is a multiple of 64. The products walk these buffers down a
// column; at a row stride of 512 bytes (tiles of 128 keys) such a walk touches only 8 of the
// 64 sets of a 32 KiB L1 and evicts its own lines. Forward + backward of 8 heads of 4096 x 64,
// float32, two threads, paired medians of 8-14 rounds in one process, gradients bitwise the
// same: 1.013-1.033x as fast with 32 floats more (16: 1.014-1.027x, 48: 1.009-1.036x).
inline int key_tile_ld(int bkp) { return bkp % 64 == 0 ? bkp + 32 : bkp; }

// bfloat16 inputs (off the decoding path) on CPUs with VDPBF16PS but no AMX take the five
// products on bfloat16 pairs, two products per float32 lane and instruction: S = Q·Kᵀ and
// dP = dO·Vᵀ from the inputs' own bits, then dQ += dS·K, dVᵀ += dOᵀ·P and dKᵀ += Qᵀ·dS with P
// and dS rounded to bfloat16 (as the forward rounds P for P·V), all summed in float32.
// Elsewhere the products run on FMAs, in float32.
#if defined(QKV_AVX512_BF16)
constexpr bool BACKWARD_ON_BF16_PRODUCTS = true;
#else
constexpr bool BACKWARD_ON_BF16_PRODUCTS = false;
#endif

struct BackwardPlan {
  const Backward& bw;
  int G, nq, nk, Dp, Dvp, bkp, n_max;
  bool decoding;  // the forward ran on the decoding path, which rounds scores its own way
  bool bf16_products;  // the products on bfloat16 pairs (above)
  // bf16_products: query rows (n_max to 4), D and Dv to 4 (pairs along them; rows of dKᵀ, dVᵀ),
  // dQ's columns (D to 32)
  int pn, pd, pdv, dq_cols;
  // per (row, query tile), query_tile_floats() each:
  //   float32 products: Q (n_max x Dp), dO (n_max x Dvp), and for bfloat16 on the decoding path
  //   Q in pair order (n_max x Dp), as that path reads it;
  //   bf16_products, as bfloat16: Q (pn x pd), dO (pn x pdv), Qᵀ (pd x pn), dOᵀ (pdv x pn);
  // and lse, lse_lo and delta (n_max each)
  float *query_tiles, *lse, *lse_lo, *delta;
  // per (row, key tile), key_tile_floats() each:
  //   float32 products: Kᵀ (Dp x bkp, rows ldk apart), Vᵀ (Dvp x bkp, the same), K (bkp x Dp);
  //   bf16_products, as bfloat16 VNNI pairs: Kᵀ and Vᵀ of pairs along the head dim
  //   (pd/2 x bkp x 2, pdv/2 x bkp x 2), K of pairs of keys (bkp/2 x dq_cols x 2)
  float* key_tiles;
  // rows before two_pass_row0, a thread's each, compute each pair once: a row's dQ (nq tiles
  // of dq_tile_floats(), summed over its key tiles) in one of `row_dq_slots` slots, one per
  // thread of the call, claimed by a row for its run (row_dq_taken[slot] != 0); the rows from
  // two_pass_row0 on run in two passes (backward, below)
  float* row_dq;
  int* row_dq_taken;
  int row_dq_slots, two_pass_row0;

  bool pairs() const { return decoding && bw.p.dtype == qkv::BF16; }
  int ldk() const { return key_tile_ld(bkp); }
  int64_t query_tile_floats() const {
    return bf16_products ? int64_t(pn) * (pd + pdv) : int64_t(n_max) * ((pairs() ? 2 : 1) * Dp + Dvp);
  }
  int64_t key_tile_floats() const {
    return bf16_products ? int64_t(bkp) * (pd + pdv + dq_cols) / 2 : int64_t(ldk()) * (Dp + Dvp) + int64_t(bkp) * Dp;
  }
  // a query tile's dQ: dq_rows() x dq_ld(); a key tile's dK and dV: bkp x Dp and bkp x Dvp, or
  // on bfloat16 products their transposes, pd x bkp and pdv x bkp
  int dq_rows() const { return bf16_products ? pn : n_max; }
  int dq_ld() const { return bf16_products ? dq_cols : Dp; }
  int64_t dq_tile_floats() const { return int64_t(dq_rows()) * dq_ld(); }
  int64_t dk_floats() const { return int64_t(bkp) * (bf16_products ? pd : Dp); }
  int64_t dv_floats() const { return int64_t(bkp) * (bf16_products ? pdv : Dvp); }
  int64_t row_dq_floats() const { return nq * dq_tile_floats(); }
  int64_t q_tile(int r, int t) const { return int64_t(r) * nq + t; }
  int64_t k_tile(int r, int j) const { return int64_t(r) * nk + j; }
};

// A query tile's packed rows.
struct QueryTile {
  const float *Q, *dO, *Q_pairs;           // float32 products
  const uint16_t *Qb, *dOb, *QbT, *dObT;  // bfloat16 products
  const float *lse, *lse_lo, *delta;
  QueryTile(const BackwardPlan& plan, int r, int t) {
    const int64_t at = plan.q_tile(r, t);
    float* base = plan.query_tiles + at * plan.query_tile_floats();
    Q = base, dO = Q + int64_t(plan.n_max) * plan.Dp;
    Q_pairs = plan.pairs() ? dO + int64_t(plan.n_max) * plan.Dvp : nullptr;
    Qb = reinterpret_cast<const uint16_t*>(base), dOb = Qb + int64_t(plan.pn) * plan.pd;
    QbT = dOb + int64_t(plan.pn) * plan.pdv, dObT = QbT + int64_t(plan.pd) * plan.pn;
    lse = plan.lse + at * plan.n_max;
    lse_lo = plan.lse_lo + at * plan.n_max;
    delta = plan.delta + at * plan.n_max;
  }
};

// A key tile's packed operands.
struct KeyTile {
  const float *Kt, *Vt, *K;          // float32 products
  const uint16_t *KbT, *VbT, *Kb;  // bfloat16 products
  KeyTile(const BackwardPlan& plan, int r, int j) {
    float* base = plan.key_tiles + plan.k_tile(r, j) * plan.key_tile_floats();
    Kt = base, Vt = Kt + int64_t(plan.Dp) * plan.ldk(), K = Vt + int64_t(plan.Dvp) * plan.ldk();
    KbT = reinterpret_cast<const uint16_t*>(base), VbT = KbT + int64_t(plan.pd) * plan.bkp;
    Kb = VbT + int64_t(plan.pdv) * plan.bkp;
  }
};

// Q and dO of a query tile as bfloat16 rows and their transposes (zero padded).
inline void pack_query_bf16(const BackwardPlan& plan, const Tile& tl, const QueryTile& qt) {
  const Problem& p = plan.bw.p;
  const int pn = plan.pn, pd = plan.pd, pdv = plan.pdv;
  memset(const_cast<uint16_t*>(qt.Qb), 0, size_t(plan.query_tile_floats()) * 4);
  for (int g = 0; g < plan.G; ++g)
    for (int i = 0; i < tl.rows; ++i) {
      const int h = tl.kv * plan.G + g, rr = g * tl.rows + i, l = tl.q0 + i;
      bf16_row(p.q, tl.b, h, l, p.D, const_cast<uint16_t*>(qt.Qb) + int64_t(rr) * pd, 1);
      bf16_row(p.q, tl.b, h, l, p.D, const_cast<uint16_t*>(qt.QbT) + rr, pn);
      bf16_row(plan.bw.dout, tl.b, h, l, p.Dv, const_cast<uint16_t*>(qt.dOb) + int64_t(rr) * pdv, 1);
      bf16_row(plan.bw.dout, tl.b, h, l, p.Dv, const_cast<uint16_t*>(qt.dObT) + rr, pn);
    }
}

void pack_query_item(void* ctx, int64_t rt) {
  const BackwardPlan& plan = *static_cast<const BackwardPlan*>(ctx);
  const Problem& p = plan.bw.p;
  const int r = int(rt / plan.nq), t = int(rt % plan.nq);
  Tile tl = make_tile(p, r, t, 0);
  QueryTile qt(plan, r, t);
  float *lse = const_cast<float*>(qt.lse), *lse_lo = const_cast<float*>(qt.lse_lo);
  float* delta = const_cast<float*>(qt.delta);
  for (int g = 0; g < plan.G; ++g) {
    const int h = tl.kv * plan.G + g;
    if (!plan.bf16_products) {
      float *Q = const_cast<float*>(qt.Q), *dO = const_cast<float*>(qt.dO);
      load_rows(p.q, p.dtype, tl.b, h, tl.q0, tl.rows, tl.rows, p.D, plan.Dp, Q + int64_t(g) * tl.rows * plan.Dp);
      load_rows(plan.bw.dout, p.dtype, tl.b, h, tl.q0, tl.rows, tl.rows, p.Dv, plan.Dvp,
                dO + int64_t(g) * tl.rows * plan.Dvp);
    }
    for (int i = 0; i < tl.rows; ++i) {
      int64_t at = (int64_t(tl.b) * p.Hq + h) * p.Lq + tl.q0 + i;
      float row_lse = plan.bw.lse[at];
      lse[g * tl.rows + i] = row_lse == NEG_INF ? INFINITY : row_lse;  // empty rows: P = 0
      lse_lo[g * tl.rows + i] = plan.bw.lse_lo && row_lse != NEG_INF ? plan.bw.lse_lo[at] : 0.f;
      delta[g * tl.rows + i] = plan.bw.delta[at];
    }
  }
  if (plan.bf16_products) pack_query_bf16(plan, tl, qt);
  if (!plan.pairs()) return;
  float* pairs = const_cast<float*>(qt.Q_pairs);  // Dp = D on the decoding path
  memcpy(pairs, qt.Q, size_t(tl.n()) * p.D * 4);
  for (int rr = 0; rr < tl.n(); ++rr) to_pair_order(pairs + int64_t(rr) * p.D, p.D);
}

// K and V of a key tile as bfloat16 VNNI pairs (zero padded): Kᵀ and Vᵀ of pairs along the
// head dim, K of pairs of keys.
inline void pack_key_bf16(const BackwardPlan& plan, const Tile& tk, const KeyTile& kt) {
  const Problem& p = plan.bw.p;
  const int bkp = plan.bkp, dq_cols = plan.dq_cols;
  uint16_t *KbT = const_cast<uint16_t*>(kt.KbT), *VbT = const_cast<uint16_t*>(kt.VbT);
  uint16_t* Kb = const_cast<uint16_t*>(kt.Kb);
  memset(KbT, 0, size_t(plan.key_tile_floats()) * 4);
  Buffer row_(round_up(imax(p.D, p.Dv), 2) / 2);
  uint16_t* row = reinterpret_cast<uint16_t*>(row_.p);
  for (int c = 0; c < tk.cols; ++c) {
    bf16_row(p.k, tk.b, tk.kv, tk.k0 + c, p.D, row, 1);
    for (int d = 0; d < p.D; ++d) {
      KbT[int64_t(d / 2) * bkp * 2 + c * 2 + d % 2] = row[d];
      Kb[int64_t(c / 2) * dq_cols * 2 + d * 2 + c % 2] = row[d];
    }
    bf16_row(p.v, tk.b, tk.kv, tk.k0 + c, p.Dv, row, 1);
    for (int d = 0; d < p.Dv; ++d) VbT[int64_t(d / 2) * bkp * 2 + c * 2 + d % 2] = row[d];
  }
}

void pack_key_item(void* ctx, int64_t rj) {
  const BackwardPlan& plan = *static_cast<const BackwardPlan*>(ctx);
  const Problem& p = plan.bw.p;
  const int r = int(rj / plan.nk), j = int(rj % plan.nk);
  Tile tk = make_tile(p, r, 0, j);
  KeyTile kt(plan, r, j);
  if (plan.bf16_products) return pack_key_bf16(plan, tk, kt);
  const int ldk = plan.ldk();
  load_transposed(p.k, p.dtype, tk.b, tk.kv, tk.k0, tk.cols, p.D, ldk, const_cast<float*>(kt.Kt));
  load_transposed(p.v, p.dtype, tk.b, tk.kv, tk.k0, tk.cols, p.Dv, ldk, const_cast<float*>(kt.Vt));
  load_rows(p.k, p.dtype, tk.b, tk.kv, tk.k0, tk.cols, plan.bkp, p.D, plan.Dp, const_cast<float*>(kt.K));
}

// S = scale·Q·Kᵀ and dP = dO·Vᵀ (n x bkp, rows ldk apart). S is rounded as the forward rounded
// it, so that P is rebuilt against the lse of the same scores. The decoding path sums each
// q·k along the head dim in vector lanes (bfloat16 ones in pair order); from the products'
// sums instead, the lse was 7.6e-6 off them at scale 7 and dq broke the tolerance rule.
// bfloat16 products leave S unscaled (pn rows).
inline void scores_and_dp(const BackwardPlan& plan, const Tile& tj, const QueryTile& qt, const KeyTile& kt,
                          float* S, float* dP) {
  const Problem& p = plan.bw.p;
  const int n = tj.n(), bkp = plan.bkp, ldk = plan.ldk();
#if defined(QKV_AVX512_BF16)
  if (plan.bf16_products) {  // the bfloat16 forward's products too
    pairs_matmul(plan.pn, bkp, plan.pd, qt.Qb, plan.pd, kt.KbT, S, ldk, false);
    pairs_matmul(plan.pn, bkp, plan.pdv, qt.dOb, plan.pdv, kt.VbT, dP, ldk, false);
    return;
  }
#endif
  if (!plan.decoding) gemm_scaled(n, bkp, p.D, rows_of(qt.Q, plan.Dp), kt.Kt, ldk, S, ldk, p.scale);
  else if (p.dtype == qkv::F32) scores_by_rows<float>(p, tj, n, qt.Q, S, ldk);  // Dp = D here
  else scores_by_rows<uint16_t>(p, tj, n, qt.Q_pairs, S, ldk);
  gemm(n, bkp, p.Dv, rows_of(qt.dO, plan.Dvp), kt.Vt, ldk, dP, ldk, false);
}

// The tile's rule (modifiers, mask) on its scaled scores S, and -inf for its padding keys.
inline void rule_and_padding(const BackwardPlan& plan, const Tile& tj, float* S) {
  const int ldk = plan.ldk();
  apply_rule(tj, S, ldk, 1);
  for (int rr = 0; rr < tj.n(); ++rr) fill(S + int64_t(rr) * ldk + tj.cols, plan.bkp - tj.cols, NEG_INF);
}

// P = exp(S - lse - lse_lo) in S; dS = P ∘ (dP - delta) ∘ d(modifier) in dP.
inline void probabilities_and_score_grads(const BackwardPlan& plan, const Tile& tj, const QueryTile& qt, float* S,
                                          float* dP) {
  const int n = tj.n(), bkp = plan.bkp, ldk = plan.ldk();
  const float cap = plan.bw.p.mods.softcap;
  for (int rr = 0; rr < n; ++rr) {
    float* s = S + int64_t(rr) * ldk;
    float* dp = dP + int64_t(rr) * ldk;
    const float row_lse = qt.lse[rr], row_lo = qt.lse_lo[rr], row_delta = qt.delta[rr];
    if (cap > 0) {  // softcap: d(cap·tanh(x/cap))/dx = 1 - (modified / cap)²
      for (int c = 0; c < bkp; ++c) {
        float u = s[c] / cap, prob = c < tj.cols ? expf(s[c] - row_lse - row_lo) : 0.f;
        s[c] = prob;
        dp[c] = prob == 0.f ? 0.f : prob * (dp[c] - row_delta) * (1.f - u * u);
      }
      continue;
    }
    Vec lse = Vec::set1(row_lse), lse_lo = Vec::set1(row_lo), delta = Vec::set1(row_delta);
    for (int c = 0; c < bkp; c += W) {
      Vec prob = Vec::exp(Vec::load(s + c) - lse - lse_lo);
      prob.store(s + c);
      (prob * (Vec::load(dp + c) - delta)).store(dp + c);
    }
  }
}

// Rows first_row .. first_row + count of base (n wide) = scale · src's (ld apart), or with
// `transposed` scale · src's columns (src[e * ld + c] for row c).
inline void store_rows(qkv::DType dtype, void* base, int64_t first_row, int count, int n, const float* src, int ld,
                       float scale, bool transposed = false) {
  const int64_t along_row = transposed ? ld : 1, along_column = transposed ? 1 : ld;
  for (int c = 0; c < count; ++c) {
    const float* s = src + c * along_column;
    if (dtype == qkv::F32) {
      float* d = static_cast<float*>(base) + (first_row + c) * n;
      for (int e = 0; e < n; ++e) d[e] = s[e * along_row] * scale;
    } else {
      uint16_t* d = static_cast<uint16_t*>(base) + (first_row + c) * n;
      for (int e = 0; e < n; ++e) d[e] = f32_to_bf16(s[e * along_row] * scale);
    }
  }
}

// Scratch of one thread for one (query tile, key tile) pair: S and dP, and on bfloat16
// products P and dS rounded to bfloat16 (pn x bkp words each): P and dS in VNNI pairs of
// query rows, dS in rows.
struct PairScratch {
  Buffer S, dP, rounded;
  uint16_t *P_pairs, *dS_pairs, *dS_rows;
  explicit PairScratch(const BackwardPlan& plan)
      : S(int64_t(plan.pn) * plan.ldk()), dP(int64_t(plan.pn) * plan.ldk()),
        rounded(plan.bf16_products ? int64_t(plan.pn) * plan.bkp * 3 / 2 : 0) {
    const int64_t words = int64_t(plan.pn) * plan.bkp;
    P_pairs = reinterpret_cast<uint16_t*>(rounded.p), dS_pairs = P_pairs + words, dS_rows = dS_pairs + words;
  }
};

#if defined(QKV_AVX512_BF16)
// P and dS of n rows as the bfloat16 operands of the gradients' products, in w: P and dS in
// VNNI pairs of query rows, dS in rows (rows n to pn are 0). FROM_SCORES: from the scores S
// (times `scale`, 1 where they are scaled already) and dP, P = exp(scale·S - lse - lse_lo)
// and dS = P ∘ (dP - delta), in the same pass; else S and dP hold P and dS.
template <bool FROM_SCORES>
inline void round_to_bf16(const BackwardPlan& plan, int n, const QueryTile& qt, const float* S, const float* dP,
                          float scale, const PairScratch& w) {
  const int bkp = plan.bkp, ldk = plan.ldk();
  const Vec scaled = Vec::set1(scale);
  for (int i = 0; i < plan.pn; i += 2) {
    const bool live[2] = {i < n, i + 1 < n};
    Vec neg_lse[2], lse_lo[2], delta[2];
    for (int u = 0; u < 2; ++u) {
      neg_lse[u] = Vec::set1(live[u] ? -qt.lse[i + u] : 0.f);
      lse_lo[u] = Vec::set1(live[u] ? qt.lse_lo[i + u] : 0.f), delta[u] = Vec::set1(live[u] ? qt.delta[i + u] : 0.f);
    }
    for (int c = 0; c < bkp; c += W) {
      Vec prob[2], ds[2];
#pragma GCC unroll 2
      for (int u = 0; u < 2; ++u) {
        const int64_t at = int64_t(i + u) * ldk + c;
        if (!live[u]) {
          prob[u] = ds[u] = Vec::zero();
        } else if (FROM_SCORES) {
          prob[u] = Vec::exp(Vec::fma(Vec::load(S + at), scaled, neg_lse[u]) - lse_lo[u]);
          ds[u] = prob[u] * (Vec::load(dP + at) - delta[u]);
        } else {
          prob[u] = Vec::load(S + at), ds[u] = Vec::load(dP + at);
        }
      }
      const int64_t pair_at = int64_t(i / 2) * bkp * 2 + c * 2;
      _mm512_storeu_si512(w.P_pairs + pair_at, bf16_pairs(prob[0], prob[1]));
      _mm512_storeu_si512(w.dS_pairs + pair_at, bf16_pairs(ds[0], ds[1]));
      for (int u = 0; u < 2; ++u)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.dS_rows + int64_t(i + u) * bkp + c),
                            (__m256i)_mm512_cvtneps_pbh(ds[u].v));
    }
  }
}

// One pair's gradients on bfloat16 pairs, from S = Q·Kᵀ and dP in w: P and dS rounded to
// bfloat16, then dQ += dS·K, dVᵀ += dOᵀ·P, dKᵀ += Qᵀ·dS. The scale goes into P's exponent
// where nothing else reads the scores (no modifier, no mask on the tile, no padding keys).
inline void accumulate_bf16_products(const BackwardPlan& plan, const Tile& tj, const QueryTile& qt,
                                     const KeyTile& kt, const PairScratch& w, float* dQ, float* dKT, float* dVT) {
  const Problem& p = plan.bw.p;
  const int bkp = plan.bkp, ldk = plan.ldk(), pn = plan.pn, n = tj.n();
  if (rule_keeps_scores(tj) && tj.cols == bkp) {
    round_to_bf16<true>(plan, n, qt, w.S.p, w.dP.p, p.scale, w);
  } else {
    scale_tile(w.S.p, n, ldk, p.scale);  // n rows, their unread ends past bkp too
    rule_and_padding(plan, tj, w.S.p);
    if (p.mods.softcap > 0) {  // its own pass, as on the FMA units
      probabilities_and_score_grads(plan, tj, qt, w.S.p, w.dP.p);
      round_to_bf16<false>(plan, n, qt, w.S.p, w.dP.p, 1.f, w);
    } else {
      round_to_bf16<true>(plan, n, qt, w.S.p, w.dP.p, 1.f, w);
    }
  }
  if (dQ) pairs_matmul(pn, plan.dq_cols, bkp, w.dS_rows, bkp, kt.Kb, dQ, plan.dq_cols, true);  // dQ += dS·K
  if (dVT) pairs_matmul(plan.pdv, bkp, pn, qt.dObT, pn, w.P_pairs, dVT, bkp, true);            // dVᵀ += dOᵀ·P
  if (dKT) pairs_matmul(plan.pd, bkp, pn, qt.QbT, pn, w.dS_pairs, dKT, bkp, true);             // dKᵀ += Qᵀ·dS
}
#endif

// The gradients one (query tile t, key tile j) pair of row r contributes: dQ_t += dS·K and,
// where given, dK_j += dSᵀ·Q, dV_j += Pᵀ·dO (on bfloat16 products dK_jᵀ and dV_jᵀ; dQ and
// dK are scaled as they are stored). One compiled body (not inlined, not cloned) for all its
// callers, so that both ways the backward walks the pairs round alike.
#if defined(__clang__)
__attribute__((noinline))
#else
__attribute__((noinline, noclone))
#endif
void accumulate_pair(const BackwardPlan& plan, int r, int t, int j, PairScratch& w, float* dQ, float* dK,
                     float* dV) {
  const Problem& p = plan.bw.p;
  Tile tj = make_tile(p, r, t, j);
  const int n = tj.n(), ldk = plan.ldk();
  QueryTile qt(plan, r, t);
  KeyTile kt(plan, r, j);
  scores_and_dp(plan, tj, qt, kt, w.S.p, w.dP.p);
#if defined(QKV_AVX512_BF16)
  if (plan.bf16_products) return accumulate_bf16_products(plan, tj, qt, kt, w, dQ, dK, dV);
#endif
  rule_and_padding(plan, tj, w.S.p);
  probabilities_and_score_grads(plan, tj, qt, w.S.p, w.dP.p);
  if (dQ) gemm(n, plan.Dp, tj.cols, rows_of(w.dP.p, ldk), kt.K, plan.Dp, dQ, plan.Dp, true);
  // Pᵀ and dSᵀ are read in place as transposed operands (no copies)
  if (dV) gemm(tj.cols, plan.Dvp, n, transposed(rows_of(w.S.p, ldk)), qt.dO, plan.Dvp, dV, plan.Dvp, true);  // dV += Pᵀ·dO
  if (dK) gemm(tj.cols, plan.Dp, n, transposed(rows_of(w.dP.p, ldk)), qt.Q, plan.Dp, dK, plan.Dp, true);  // dK += dSᵀ·Q
}

inline void store_dq(const BackwardPlan& plan, int r, int t, const float* dQ) {
  const Problem& p = plan.bw.p;
  Tile tl = make_tile(p, r, t, 0);
  for (int rr = 0; rr < tl.n(); ++rr) {
    const int64_t at = (int64_t(tl.b) * p.Hq + tl.head(rr)) * p.Lq + tl.query(rr);
    store_rows(plan.bw.grads, plan.bw.dq, at, 1, p.D, dQ + int64_t(rr) * plan.dq_ld(), plan.dq_ld(), p.scale);
  }
}

inline void store_dkdv(const BackwardPlan& plan, int r, int j, const float* dK, const float* dV) {
  const Problem& p = plan.bw.p;
  Tile tk = make_tile(p, r, 0, j);
  const int64_t first = (int64_t(tk.b) * p.Hkv + tk.kv) * p.Lk + tk.k0;
  const bool transposed = plan.bf16_products;  // dKᵀ and dVᵀ, bkp apart
  store_rows(plan.bw.grads, plan.bw.dk, first, tk.cols, p.D, dK, transposed ? plan.bkp : plan.Dp, p.scale, transposed);
  store_rows(plan.bw.grads, plan.bw.dv, first, tk.cols, p.Dv, dV, transposed ? plan.bkp : plan.Dvp, 1.f, transposed);
}

// Two passes, for the rows left when the others share out evenly: every (row, query tile)
// sums its dQ, every (row, key tile) its dK, dV; items count from row two_pass_row0.
void dq_item(void* ctx, int64_t rt) {
  const BackwardPlan& plan = *static_cast<const BackwardPlan*>(ctx);
  const int r = plan.two_pass_row0 + int(rt / plan.nq), t = int(rt % plan.nq);
  PairScratch w(plan);
  Buffer dQ(plan.dq_tile_floats());
  fill(dQ.p, plan.dq_tile_floats(), 0.f);
  for (int j = 0; j < plan.nk; ++j)
    if (tile_class(plan.bw.p, r, t, j) != qkv::EMPTY) accumulate_pair(plan, r, t, j, w, dQ.p, nullptr, nullptr);
  store_dq(plan, r, t, dQ.p);
}

void dkdv_item(void* ctx, int64_t rj) {
  const BackwardPlan& plan = *static_cast<const BackwardPlan*>(ctx);
  const int r = plan.two_pass_row0 + int(rj / plan.nk), j = int(rj % plan.nk);
  PairScratch w(plan);
  Buffer dK(plan.dk_floats()), dV(plan.dv_floats());
  fill(dK.p, plan.dk_floats(), 0.f), fill(dV.p, plan.dv_floats(), 0.f);
  for (int t = 0; t < plan.nq; ++t)
    if (tile_class(plan.bw.p, r, t, j) != qkv::EMPTY) accumulate_pair(plan, r, t, j, w, nullptr, dK.p, dV.p);
  store_dkdv(plan, r, j, dK.p, dV.p);
}

// One pass: a row's thread computes each pair once and adds to all three.
void row_item(void* ctx, int64_t r64) {
  const BackwardPlan& plan = *static_cast<const BackwardPlan*>(ctx);
  const int r = int(r64);
  PairScratch w(plan);
  const int64_t dq_tile = plan.dq_tile_floats();
  int slot = 0;  // a free one exists: no more rows run at once than there are threads
  while (__atomic_exchange_n(plan.row_dq_taken + slot, 1, __ATOMIC_ACQUIRE)) slot = (slot + 1) % plan.row_dq_slots;
  float* dQ = plan.row_dq + slot * plan.row_dq_floats();
  Buffer dK(plan.dk_floats()), dV(plan.dv_floats());
  fill(dQ, plan.row_dq_floats(), 0.f);
  for (int j = 0; j < plan.nk; ++j) {
    fill(dK.p, plan.dk_floats(), 0.f), fill(dV.p, plan.dv_floats(), 0.f);
    for (int t = 0; t < plan.nq; ++t)
      if (tile_class(plan.bw.p, r, t, j) != qkv::EMPTY) accumulate_pair(plan, r, t, j, w, dQ + t * dq_tile, dK.p, dV.p);
    store_dkdv(plan, r, j, dK.p, dV.p);
  }
  for (int t = 0; t < plan.nq; ++t) store_dq(plan, r, t, dQ + t * dq_tile);
  __atomic_store_n(plan.row_dq_taken + slot, 0, __ATOMIC_RELEASE);
}

}  // namespace

void backward(const Backward& bw) {
  const Problem& p = bw.p;
  if (p.B == 0 || p.Hkv == 0) return;  // no gradient elements
  const int G = p.Hq / p.Hkv, threads = threads_for(p, MIN_PARALLEL_MULTIPLY_ADDS);
  const bool decoding = decoding_forward(p);
  const bool bf16_products = BACKWARD_ON_BF16_PRODUCTS && p.dtype == qkv::BF16 && !decoding;
  const int n_max = G * p.block_q;
  BackwardPlan plan{bw, G, cdiv(p.Lq, p.block_q), cdiv(p.Lk, p.block_k), round_up(p.D, W), round_up(p.Dv, W),
                    round_up(p.block_k, bf16_products ? 32 : W), n_max, decoding, bf16_products,
                    bf16_products ? round_up(n_max, 4) : n_max, round_up(p.D, 4), round_up(p.Dv, 4),
                    round_up(p.D, 32)};
  const int64_t rows = int64_t(p.B) * p.Hkv, q_tiles = rows * plan.nq, k_tiles = rows * plan.nk;
  // Rows that share out evenly run a thread's each, computing each pair once; the rest (fewer
  // than the threads) in two passes, which keep every thread busy though they compute each pair
  // twice. Both sum every gradient in the same order with the same arithmetic, so the split,
  // which depends on the threads, leaves the results as they are. Float32 forward + backward,
  // two threads, paired medians of 6 rounds in one process, against the shape rule this
  // replaces (one pass from 4 rows, else two): 2 heads of 4096 x 64 1.27x as fast, 3 heads
  // 1.17x, 5 heads of 2048 x 64 1.08x, 8 heads of 4096 x 64 (one pass either way) 1.00x; one
  // pass for all 8 heads was 1.21x as fast as two.
  plan.two_pass_row0 = int(rows - rows % threads);
  plan.row_dq_slots = imin(plan.two_pass_row0, threads);  // at most that many rows at once
  // 64-byte aligned parts of one workspace (a tile's floats are a multiple of W): the query
  // side (tiles, then lse, lse_lo, delta), the key side, the rows' dQ slots and their flags
  const int64_t q_tile_floats = plan.query_tile_floats(), k_side = k_tiles * plan.key_tile_floats();
  const int64_t q_side = round_up<int64_t>(q_tiles * (q_tile_floats + 3 * n_max), W);
  Workspace space(q_side + k_side + plan.row_dq_slots * (plan.row_dq_floats() + 1));
  plan.query_tiles = space.p, plan.lse = plan.query_tiles + q_tiles * q_tile_floats;
  plan.lse_lo = plan.lse + q_tiles * n_max, plan.delta = plan.lse_lo + q_tiles * n_max;
  plan.key_tiles = space.p + q_side;
  plan.row_dq = plan.key_tiles + k_side;
  plan.row_dq_taken = reinterpret_cast<int*>(plan.row_dq + plan.row_dq_slots * plan.row_dq_floats());
  for (int slot = 0; slot < plan.row_dq_slots; ++slot) plan.row_dq_taken[slot] = 0;
  qkv::parallel_for(q_tiles, threads, pack_query_item, &plan);
  qkv::parallel_for(k_tiles, threads, pack_key_item, &plan);
  const int64_t two_pass_rows = rows - plan.two_pass_row0;
  qkv::parallel_for(plan.two_pass_row0, threads, row_item, &plan);
  qkv::parallel_for(two_pass_rows * plan.nq, threads, dq_item, &plan);
  qkv::parallel_for(two_pass_rows * plan.nk, threads, dkdv_item, &plan);
}

// ---- the arithmetic's own rate -------------------------------------------------------------
// What the vector units do with no memory in the way: the yardstick `qkv bench` sets its compute
// workloads against. Each item runs passes of one multiply-add on each of PEAK_ACCUMULATORS
// independent accumulators (no loads, and no multiply-add waits on another within a pass).
namespace {

constexpr int PEAK_ACCUMULATORS = Vec::REGISTERS >= 32 ? 24 : 12;

struct PeakLoop {
  int64_t passes, items;  // in all, shared out evenly
  bool pairs;             // bfloat16 pair dot products (VDPBF16PS) instead of float32 FMAs
  float* sinks;           // one per item: the accumulators' sum, so that no pass can be left out
  int64_t passes_of(int64_t item) const { return passes / items + (item < passes % items); }
};

template <class Acc, class Step>
inline void run_passes(int64_t passes, Acc (&acc)[PEAK_ACCUMULATORS], Step step) {
  for (int64_t pass = 0; pass < passes; ++pass)
#pragma GCC unroll 24
    for (int i = 0; i < PEAK_ACCUMULATORS; ++i) acc[i] = step(acc[i]);
}

inline float lanes_sum(const Vec (&acc)[PEAK_ACCUMULATORS]) {
  float lanes[W], sum = 0.f;
  for (const Vec& a : acc) {
    a.store(lanes);
    for (float x : lanes) sum += x;
  }
  return sum;
}

void peak_item(void* ctx, int64_t item) {
  const PeakLoop& loop = *static_cast<const PeakLoop*>(ctx);
#if defined(QKV_BF16_PRODUCTS)
  if (loop.pairs) {
    __m512 acc[PEAK_ACCUMULATORS];
    for (int i = 0; i < PEAK_ACCUMULATORS; ++i) acc[i] = _mm512_set1_ps(float(i));
    const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3c003c00);
    run_passes(loop.passes_of(item), acc, [&](__m512 c) { return _mm512_dpbf16_ps(c, a, b); });
    Vec sums[PEAK_ACCUMULATORS];
    for (int i = 0; i < PEAK_ACCUMULATORS; ++i) sums[i] = {acc[i]};
    loop.sinks[item] = lanes_sum(sums);
    return;
  }
#endif
  Vec acc[PEAK_ACCUMULATORS];
  for (int i = 0; i < PEAK_ACCUMULATORS; ++i) acc[i] = Vec::set1(float(i));
  const Vec x = Vec::set1(0.999f), y = Vec::set1(1e-3f);  // each accumulator settles at 1, no overflow
  run_passes(loop.passes_of(item), acc, [&](Vec c) { return Vec::fma(c, x, y); });
  loop.sinks[item] = lanes_sum(acc);
}

}  // namespace

double peak_loop(int64_t flops, int threads, bool pairs) {
#if !defined(QKV_BF16_PRODUCTS)
  if (pairs) return 0.0;
#endif
  const int64_t per_pass = int64_t(2) * PEAK_ACCUMULATORS * W * (pairs ? 2 : 1);  // VDPBF16PS: two products a lane
  const int64_t items = int64_t(imax(threads, 1)) * 16;  // small items, so a thread that starts late takes fewer
  PeakLoop loop{(flops + per_pass - 1) / per_pass, items, pairs, nullptr};
  Buffer sinks(items);
  loop.sinks = sinks.p;
  qkv::parallel_for(items, threads, peak_item, &loop);
  return double(per_pass) * double(loop.passes);
}

}  // namespace QKV_ISA_NS
