// The kernel for CPUs with AVX-512 and its bfloat16 dot products (VDPBF16PS) but no AMX:
// bfloat16 matrix products on the vector units, two products per float32 lane and instruction
// (flags in CMakeLists.txt).
#define QKV_AVX512_BF16 1
#define QKV_ISA_NS qkv::isa_avx512bf16
#include "kernel.h"
