// The kernel for one instruction set (flags in CMakeLists.txt).

#define QKV_ISA_NS qkv::isa_generic
#include "kernel.h"
