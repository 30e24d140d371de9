// The kernel for CPUs with AMX tiles: bfloat16 matrix products on the tile unit, the rest
// as in the AVX-512 variant (flags in CMakeLists.txt).
#define QKV_AMX 1
#define QKV_ISA_NS qkv::isa_amx
#include "kernel.h"
