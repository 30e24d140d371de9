"""Compile the triton backend's kernels for an NVIDIA target without a GPU (run as a script).

The interpreter runs kernels as NumPy, so it cannot catch what only the compiler rejects
(non-constexpr globals, type mismatches between branches, shared memory beyond the target).
Prints one line per kernel: name, shared memory bytes. Usage: triton_compile.py ARCH (e.g. 90)
"""
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from qkv.backends import _triton_kernels as kernels  # noqa: E402
from qkv.backends.triton import LADDERS  # noqa: E402

POINTERS = {"LSE": "*fp32", "LSE_LO": "*fp32", "DELTA": "*fp32", "SLOPES": "*fp32", "LO": "*i32", "HI": "*i32",
            "QFIRST": "*i32", "QEND": "*i32", "QID": "*i64", "KID": "*i64"}
TENSORS = ("Q", "K", "V", "O", "DO", "GRAD_Q", "GRAD_K", "GRAD_V")


def signature(fn, dtype: str, constants: dict, out_dtype: str) -> dict:
    def kind(name):
        if name in constants:
            return "constexpr"
        if name == "O":
            return "*" + out_dtype
        if name in TENSORS:
            return "*" + dtype
        return POINTERS.get(name, "fp32" if name in ("sm_scale", "softcap") else "i32")
    return {name: kind(name) for name in fn.arg_names}


VARIANTS = ("plain", "masks+mods", "causal", "ones")

#: Triton compiles an int argument equal to 1 as a constant: decoding (Lq = 1), one key, one head.
ONES = dict(Lq=1, Lk=1, Hq=1)


def compile_kernel(fn, blocks, arch: int, dtype="bf16", head_dim=128, variant="plain") -> int:
    """variant: "plain", "masks+mods" (every feature, bounds loaded, a float32 output), "causal"
    (bounds computed) or "ones" (plain, with the ints Triton makes constants when they are 1)."""
    every = variant == "masks+mods"
    flags = dict(HAS_INTERVAL=every or variant == "causal", HAS_CAUSAL=variant == "causal", HAS_IDS=every,
                 HAS_ALIBI=every, HAS_SOFTCAP=every)
    constants = dict(D=head_dim, DV=head_dim, GROUP=2, BLOCK_M=blocks.m, BLOCK_N=blocks.n, BLOCK_D=head_dim,
                     BLOCK_DV=head_dim, DOT="ieee" if dtype == "fp32" else "native", **flags)
    if variant == "ones":
        constants.update({k: v for k, v in ONES.items() if k in fn.arg_names})
    out_dtype = "fp32" if every else dtype  # a forward under autograd writes its output in float32
    source = ASTSource(fn=fn, signature=signature(fn, dtype, constants, out_dtype), constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=blocks.warps, num_stages=blocks.stages))
    return compiled.metadata.shared


def main(arch: int) -> None:
    for name, fn in (("forward", kernels.attention_forward), ("dkdv", kernels.attention_backward_dkdv),
                     ("dq", kernels.attention_backward_dq)):
        for variant in VARIANTS:
            shared = compile_kernel(fn, LADDERS[name][128][0], arch, variant=variant)
            print(name, variant, shared, flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
