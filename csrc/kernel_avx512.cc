// The kernel for one instruction set (flags in CMakeLists.txt).
#define QKV_AVX512 1
#define QKV_ISA_NS qkv::isa_avx512
#include "kernel.h"
