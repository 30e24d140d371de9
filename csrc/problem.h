// qkv native kernel: the problem description shared by the binding and every ISA variant.
//
// Layout (element strides, any order): q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv).
// A "row" is one (batch, kv head) pair holding the G = Hq / Hkv query heads that share it;
// a query tile of a row stacks those G heads: (G * block_q) x D. Plain C structs only:
// the ISA translation units must not share inline C++ library code (see kernel.h).
#pragma once
#include <cstddef>
#include <cstdint>

namespace qkv {

enum DType : int { F32 = 0, BF16 = 1 };
enum TileClass : int8_t { EMPTY = 0, PARTIAL = 1, FULL = 2 };

struct Strided4 {
  const void* data;
  int64_t s0, s1, s2, s3;  // element strides of (B, H, L, D)
};

struct Mask {
  // Tile classes (rows, nq, nk); null means every tile is FULL.
  const int8_t* tile_class = nullptr;
  // Interval masks: query i of batch row b sees keys lo[b*lo_bstride + i] <= j <= hi[...].
  const int32_t* lo = nullptr;
  const int32_t* hi = nullptr;
  int64_t lohi_bstride = 0;
  // Other masks: PARTIAL tiles carry a bitmap (G*block_q, block_k) of allowed pairs.
  const int32_t* bitmap_index = nullptr;  // (rows, nq, nk) -> bitmap number or -1
  const uint8_t* bitmaps = nullptr;
};

struct ScoreMods {
  const float* alibi_slopes = nullptr;  // (Hq): score -= slope[h] * |i + Lk - Lq - j|
  float softcap = 0.f;                  // > 0: score = cap * tanh(score / cap)
  const void* bias = nullptr;           // (B|1, Hq|1, Lq|1, Lk|1) with strides below, float32 or
  bool bias_bf16 = false;               // bfloat16 (read in place: a broadcast bias stays unexpanded)
  int64_t bias_s0 = 0, bias_s1 = 0, bias_s2 = 0, bias_s3 = 0;
};

struct Problem {
  int B, Hq, Hkv, Lq, Lk, D, Dv;
  DType dtype;
  float scale;
  Strided4 q, k, v;
  int block_q, block_k;
  Mask mask;
  ScoreMods mods;
  int num_threads;
};

struct Forward {
  Problem p;
  void* out;   // (B, Hq, Lq, Dv) contiguous, dtype out_dtype
  float* lse;  // (B, Hq, Lq) contiguous, or null: not wanted
  int64_t* tile_counts = nullptr;  // optional: [computed, masked] (row, query tile, key tile) units
  bool float32_on_amx = false;     // where AMX runs: float32 products as sums of bfloat16 parts
  DType out_dtype = F32;           // p.dtype, or float32 (ring attention merges blocks unrounded)
  // (B, Hq, Lq) or null: the part of each row's log-sum-exp that lse's rounding lost, so that
  // lse + lse_lo carries it to about float64 precision for the backward
  float* lse_lo = nullptr;
};

struct Backward {
  Problem p;
  Strided4 dout;        // (B, Hq, Lq, Dv)
  const float* lse;     // (B, Hq, Lq) contiguous
  const float* lse_lo;  // (B, Hq, Lq) contiguous, or null: P = exp(S - lse - lse_lo)
  const float* delta;   // (B, Hq, Lq) contiguous: rowsum(dO * O) - dlse
  void* dq;             // (B, Hq, Lq, D) contiguous, dtype `grads`
  void* dk;             // (B, Hkv, Lk, D)
  void* dv;             // (B, Hkv, Lk, Dv)
  DType grads;          // p.dtype, or F32 for bfloat16 inputs whose gradients are summed further
};

// One entry point per ISA (kernel.h, compiled once per instruction set with its flags).
#define QKV_DECLARE_ISA(ns)                 \
  namespace ns {                            \
  void forward(const Forward& f);           \
  void backward(const Backward& b);         \
  double peak_loop(int64_t flops, int threads, bool pairs); \
  }
QKV_DECLARE_ISA(isa_amx)
QKV_DECLARE_ISA(isa_avx512)
QKV_DECLARE_ISA(isa_avx512bf16)
QKV_DECLARE_ISA(isa_avx2)
QKV_DECLARE_ISA(isa_generic)

// Calls fn(ctx, i) for i in [0, n) on up to `threads` threads (caller included): OpenMP's,
// where the kernel is built with it, else a persistent pool of its own (threads.cc).
void parallel_for(int64_t n, int threads, void (*fn)(void*, int64_t), void* ctx);
// "openmp" or "own pool": whose threads parallel_for runs on in this process.
const char* threading_name();

// Scratch of one call too large for a thread's scratch stack (the backward's packed operands)
// comes from one block the process keeps between calls (workspace.cc), held by one call at a
// time: 64-byte aligned, at least `bytes`; null where another call holds it, bytes exceed
// KEPT_BLOCK_MAX or memory runs out (the caller then takes memory of its own).
constexpr size_t KEPT_BLOCK_MAX = size_t(256) << 20;
void* take_kept_block(size_t bytes);
void give_back_kept_block();
size_t kept_block_bytes();
// Frees the kept block; false (nothing freed) while a call holds it.
bool release_kept_block();

}  // namespace qkv
