// Python binding of the native kernel (nanobind). Takes NumPy arrays and torch CPU tensors
// alike (DLPack), any strides for q, k, v, dout; picks the instruction set at run time.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>

#include "problem.h"

namespace nb = nanobind;
using namespace qkv;

// Inputs are only read, so read-only arrays (np.broadcast_to views, for one) pass too.
using Any = nb::ndarray<nb::ro, nb::device::cpu>;
using Out = nb::ndarray<nb::device::cpu>;
template <class T>
using Flat = nb::ndarray<const T, nb::c_contig, nb::device::cpu>;
template <class T>
using FlatOut = nb::ndarray<T, nb::c_contig, nb::device::cpu>;

namespace {

enum class Isa { Generic, Avx2, Avx512, Avx512Bf16, Amx };

#if defined(QKV_X86)
// Linux hands out the AMX tile state only to processes that ask for it.
bool amx_permitted() {
  const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
#endif

// The best instruction set of the CPU (and, for AMX, that the kernel lets this process use).
Isa cpu_best_isa() {
  Isa best = Isa::Generic;
#if defined(QKV_X86)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::Avx2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    best = Isa::Avx512;
  if (best == Isa::Avx512 && __builtin_cpu_supports("avx512bf16")) best = Isa::Avx512Bf16;
  if (best == Isa::Avx512Bf16 && __builtin_cpu_supports("amx-tile") &&
      __builtin_cpu_supports("amx-bf16") && amx_permitted())
    best = Isa::Amx;
#endif
  return best;
}

// The best variant this build holds (CMakeLists.txt leaves out those its compiler cannot build).
constexpr Isa BUILT_BEST =
#if defined(QKV_BUILT_AMX)
    Isa::Amx;
#elif defined(QKV_BUILT_AVX512BF16)
    Isa::Avx512Bf16;
#elif defined(QKV_BUILT_AVX512)
    Isa::Avx512;
#elif defined(QKV_BUILT_AVX2)
    Isa::Avx2;
#else
    Isa::Generic;
#endif

Isa detect_isa() {
  Isa best = std::min(cpu_best_isa(), BUILT_BEST);
  // QKV_ISA=generic|avx2|avx512|avx512bf16 (any case, spaces ignored) forces a lower path (tests); never
  // a higher one than the CPU has. Python warns when the request is not what runs.
  if (const char* force = std::getenv("QKV_ISA")) {
    std::string want;
    for (const char* c = force; *c; ++c)
      if (!std::isspace(static_cast<unsigned char>(*c))) want += char(std::tolower(static_cast<unsigned char>(*c)));
    if (want == "generic") best = Isa::Generic;
    else if (want == "avx2" && best >= Isa::Avx2) best = Isa::Avx2;
    else if (want == "avx512" && best >= Isa::Avx512) best = Isa::Avx512;
    else if (want == "avx512bf16" && best >= Isa::Avx512Bf16) best = Isa::Avx512Bf16;
  }
  return best;
}

Isa isa() {
  static const Isa chosen = detect_isa();
  return chosen;
}

const char* name_of(Isa chosen) {
  switch (chosen) {
    case Isa::Amx: return "amx";
    case Isa::Avx512Bf16: return "avx512bf16";
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    default: return "generic";
  }
}

DType dtype_of(const Any& a, const char* name) {
  if (a.dtype() == nb::dtype<float>()) return F32;
  if (a.dtype().code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && a.dtype().bits == 16) return BF16;
  throw std::invalid_argument(std::string(name) + ": the native kernel takes float32 or bfloat16");
}

Strided4 strided(const Any& a, const char* name) {
  if (a.ndim() != 4) throw std::invalid_argument(std::string(name) + " must be 4-D (B, H, L, D)");
  return {a.data(), a.stride(0), a.stride(1), a.stride(2), a.stride(3)};
}

// The dtype results are written in: q's, or float32 (ring attention merges its blocks unrounded).
// `names` says which arrays, for the error.
DType written_dtype(std::initializer_list<const Out*> arrays, DType q_dtype, const char* names) {
  const auto dtype = (*arrays.begin())->dtype();
  bool alike = true;
  for (const Out* a : arrays) alike = alike && a->dtype() == dtype;
  const bool bf16 = dtype.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && dtype.bits == 16;
  if (alike && dtype == nb::dtype<float>()) return F32;
  if (alike && bf16 && q_dtype == BF16) return BF16;
  throw std::invalid_argument(std::string(names) + (arrays.size() > 1 ? " must have one dtype" : " must have a dtype") +
                              ": q's, or float32");
}

struct Extras {  // everything optional about a call: mask data and score modifiers
  std::optional<Flat<int8_t>> tile_class;
  std::optional<Flat<int32_t>> lo, hi;
  std::optional<Flat<int32_t>> bitmap_index;
  std::optional<Flat<uint8_t>> bitmaps;
  std::optional<Flat<float>> alibi;
  float softcap;
  std::optional<Any> bias;
};

// Sizes are counted in int, rounded up to whole tiles (cdiv) on the way: room is left for that.
constexpr size_t MAX_SIZE = (size_t(1) << 31) - 1024;

Problem make_problem(const Any& q, const Any& k, const Any& v, float scale, int block_q, int block_k, int threads,
                     const Extras& x) {
  Problem p{};
  p.dtype = dtype_of(q, "q");
  if (dtype_of(k, "k") != p.dtype || dtype_of(v, "v") != p.dtype) throw std::invalid_argument("q, k, v dtypes differ");
  p.q = strided(q, "q"), p.k = strided(k, "k"), p.v = strided(v, "v");
  for (const Any* a : {&q, &k, &v})
    for (size_t d = 0; d < 4; ++d)
      if (a->shape(d) > MAX_SIZE) throw std::invalid_argument("a size above 2^31 - 1024: the kernel counts in int");
  p.B = int(q.shape(0)), p.Hq = int(q.shape(1)), p.Lq = int(q.shape(2)), p.D = int(q.shape(3));
  p.Hkv = int(k.shape(1)), p.Lk = int(k.shape(2)), p.Dv = int(v.shape(3));
  p.scale = scale, p.block_q = block_q, p.block_k = block_k, p.num_threads = threads;
  if (x.tile_class) p.mask.tile_class = x.tile_class->data();
  if (x.lo && x.hi) {
    p.mask.lo = x.lo->data(), p.mask.hi = x.hi->data();
    p.mask.lohi_bstride = x.lo->shape(0) > 1 ? p.Lq : 0;
  }
  if (x.bitmap_index && x.bitmaps) p.mask.bitmap_index = x.bitmap_index->data(), p.mask.bitmaps = x.bitmaps->data();
  if (x.alibi) p.mods.alibi_slopes = x.alibi->data();
  p.mods.softcap = x.softcap;
  if (x.bias) {
    if (x.bias->ndim() != 4) throw std::invalid_argument("bias must be 4-D");
    p.mods.bias_bf16 = dtype_of(*x.bias, "bias") == BF16;
    p.mods.bias = x.bias->data();
    p.mods.bias_s0 = x.bias->shape(0) > 1 ? x.bias->stride(0) : 0;
    p.mods.bias_s1 = x.bias->shape(1) > 1 ? x.bias->stride(1) : 0;
    p.mods.bias_s2 = x.bias->shape(2) > 1 ? x.bias->stride(2) : 0;
    p.mods.bias_s3 = x.bias->shape(3) > 1 ? x.bias->stride(3) : 0;
  }
  return p;
}

// The kernel's entry points in the instruction set chosen here (one namespace per variant).
struct Kernel {
  void (*forward)(const Forward&);
  void (*backward)(const Backward&);
  // FLOPs of a loop of independent multiply-adds (`flops`, rounded up to whole passes, on
  // `threads` threads); 0 where the variant has no bfloat16 pair products
  double (*peak_loop)(int64_t flops, int threads, bool pairs);
};
#define QKV_KERNEL(ns) Kernel{ns::forward, ns::backward, ns::peak_loop}

const Kernel& kernel() {
  static const Kernel chosen = [] {
    switch (isa()) {  // only the variants built (QKV_BUILT_*: x86 only)
#if defined(QKV_BUILT_AMX)
      case Isa::Amx: return QKV_KERNEL(isa_amx);
#endif
#if defined(QKV_BUILT_AVX512BF16)
      case Isa::Avx512Bf16: return QKV_KERNEL(isa_avx512bf16);
#endif
#if defined(QKV_BUILT_AVX512)
      case Isa::Avx512: return QKV_KERNEL(isa_avx512);
#endif
#if defined(QKV_BUILT_AVX2)
      case Isa::Avx2: return QKV_KERNEL(isa_avx2);
#endif
      default: return QKV_KERNEL(isa_generic);
    }
  }();
  return chosen;
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "qkv's native CPU attention kernel";
  m.def("isa", [] { return name_of(isa()); }, "The instruction set the kernel runs with here.");
  m.def("cpu_isa", [] { return name_of(cpu_best_isa()); },
        "The best instruction set the CPU has; more than isa() where this build left its variant out.");
  m.def("threading", &qkv::threading_name,
        "Whose threads the kernel runs on here: 'openmp' (the process's OpenMP threads, which torch's "
        "own operations share) or 'own pool'.");
  m.def("kept_bytes", &qkv::kept_block_bytes,
        "Bytes of the block the kernel keeps between calls for their large scratch (the backward's packed "
        "operands), so that its pages are not faulted in again on every call; 0 when none is kept.");
  m.def("release_kept", &qkv::release_kept_block,
        "Frees the block the kernel keeps between calls; False (nothing freed) while a call holds it.");
  m.def(
      "peak_loop",
      [](int64_t flops, int threads, const std::string& dtype) {
        if (flops < 0 || threads < 1) throw std::invalid_argument("peak_loop takes flops >= 0 and threads >= 1");
        if (dtype != "float32" && dtype != "bfloat16")
          throw std::invalid_argument("peak_loop's dtype is 'float32' or 'bfloat16', got '" + dtype + "'");
        nb::gil_scoped_release unlocked;
        return kernel().peak_loop(flops, threads, dtype == "bfloat16");
      },
      nb::arg("flops"), nb::arg("threads"), nb::arg("dtype") = "float32",
      "Runs `flops` FLOPs (rounded up to a whole pass over its accumulators) of independent multiply-adds on "
      "`threads` threads, in the instruction set the kernel runs with (float32 FMAs, or with dtype='bfloat16' "
      "pair dot products, VDPBF16PS), and returns the FLOPs done: 0 where that instruction set has no bfloat16 "
      "pair products. Timed, it is the arithmetic's own rate: no loads, and no multiply-add waiting on another.");
  m.def(
      "forward",
      [](Any q, Any k, Any v, Out out, std::optional<FlatOut<float>> lse, float scale, int block_q, int block_k,
         int threads,
         std::optional<Flat<int8_t>> tile_class, std::optional<Flat<int32_t>> lo, std::optional<Flat<int32_t>> hi,
         std::optional<Flat<int32_t>> bitmap_index, std::optional<Flat<uint8_t>> bitmaps,
         std::optional<Flat<float>> alibi, float softcap, std::optional<Any> bias,
         std::optional<FlatOut<int64_t>> tile_counts, bool float32_on_amx, std::optional<FlatOut<float>> lse_lo) {
        Extras x{tile_class, lo, hi, bitmap_index, bitmaps, alibi, softcap, bias};
        Problem p = make_problem(q, k, v, scale, block_q, block_k, threads, x);
        Forward f{p, out.data(), lse ? lse->data() : nullptr, tile_counts ? tile_counts->data() : nullptr,
                  float32_on_amx, written_dtype({&out}, p.dtype, "out")};
        if (lse_lo && lse) f.lse_lo = lse_lo->data();
        nb::gil_scoped_release unlocked;
        kernel().forward(f);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse").none(), nb::arg("scale"),
      nb::arg("block_q"), nb::arg("block_k"), nb::arg("threads"), nb::arg("tile_class").none(),
      nb::arg("lo").none(), nb::arg("hi").none(), nb::arg("bitmap_index").none(), nb::arg("bitmaps").none(),
      nb::arg("alibi").none(), nb::arg("softcap"), nb::arg("bias").none(), nb::arg("tile_counts").none() = nb::none(),
      nb::arg("float32_on_amx") = false, nb::arg("lse_lo").none() = nb::none(),
      "out (B, Hq, Lq, Dv), in q's dtype or float32, and lse (B, Hq, Lq) float32 must be contiguous and are "
      "written in place (lse=None: not written). lse_lo (B, Hq, Lq) float32, where given with lse, gets what "
      "lse's rounding lost (for the backward). With "
      "float32_on_amx, where AMX runs, float32 products run on it as sums of bfloat16 parts (else on the FMA units).");
  m.def(
      "backward",
      [](Any q, Any k, Any v, Any dout, Flat<float> lse, Flat<float> delta, Out dq, Out dk, Out dv, float scale,
         int block_q, int block_k, int threads, std::optional<Flat<int8_t>> tile_class,
         std::optional<Flat<int32_t>> lo, std::optional<Flat<int32_t>> hi, std::optional<Flat<int32_t>> bitmap_index,
         std::optional<Flat<uint8_t>> bitmaps, std::optional<Flat<float>> alibi, float softcap,
         std::optional<Any> bias, std::optional<Flat<float>> lse_lo) {
        Extras x{tile_class, lo, hi, bitmap_index, bitmaps, alibi, softcap, bias};
        Problem p = make_problem(q, k, v, scale, block_q, block_k, threads, x);
        Backward b{p, strided(dout, "dout"), lse.data(), lse_lo ? lse_lo->data() : nullptr, delta.data(),
                   dq.data(), dk.data(), dv.data(),
                   written_dtype({&dq, &dk, &dv}, p.dtype, "dq, dk and dv")};
        nb::gil_scoped_release unlocked;
        kernel().backward(b);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("dout"), nb::arg("lse"), nb::arg("delta"), nb::arg("dq"),
      nb::arg("dk"), nb::arg("dv"), nb::arg("scale"), nb::arg("block_q"), nb::arg("block_k"), nb::arg("threads"),
      nb::arg("tile_class").none(), nb::arg("lo").none(), nb::arg("hi").none(), nb::arg("bitmap_index").none(),
      nb::arg("bitmaps").none(), nb::arg("alibi").none(), nb::arg("softcap"), nb::arg("bias").none(),
      nb::arg("lse_lo").none() = nb::none(),
      "dq, dk, dv must be contiguous, in q's dtype or float32, and are written in place; delta = rowsum(dO*O) - "
      "dlse; lse_lo (or None: zeros) is the forward's.");
}
