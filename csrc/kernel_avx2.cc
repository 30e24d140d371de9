// The kernel for one instruction set (flags in CMakeLists.txt).
#define QKV_AVX2 1
#define QKV_ISA_NS qkv::isa_avx2
#include "kernel.h"
