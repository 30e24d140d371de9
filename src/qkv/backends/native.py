"""The native backend: qkv's C++ CPU kernel (csrc/), bound with nanobind.

FlashAttention-2 style forward and backward in float32 and bfloat16 (float32
accumulation), on NumPy arrays and torch CPU tensors without copying them. This module
turns a validated call into the kernel's plain inputs: tile classes, per-query key
intervals for interval masks (causal, window, padding, prefix-LM and their
intersections), bitmaps of the PARTIAL tiles for every other mask, and the score
modifiers the kernel applies inline (ALiBi, a bias, softcap).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
import warnings

import numpy as np

from .. import _arrays, inputs
from .._threads import available_cpus
from ..masks import EVALUATED_AT_ONCE, PARTIAL, Alibi, Bias, IntervalMask, Softcap, runs_user_rule, tile_indices
from . import base
from .base import (Backend, Capabilities, autograd_attention, cdiv, key_intervals,
                   row_tile_classes, saved_output_bytes, softmax_delta, tile_workspace)

def _extension_file_exists() -> bool:
    try:
        return importlib.util.find_spec("qkv._native") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["qkv._native"] = None
        return False


try:
    from .. import _native
except ImportError as error:  # not built (no compiler) or not importable here
    _native, _ON_AMX, _BF16_PRODUCTS = None, False, False
    _import_error = (f"built but cannot be loaded here ({error})" if _extension_file_exists() else
                     "not built: no C++17 compiler or no Python headers were found when qkv was installed, or "
                     "QKV_NATIVE=OFF (install it again with them; `pip install -v` shows the build)")
else:
    _import_error = None
    _ON_AMX = _native.isa() == "amx"  # chosen once, when the kernel loads
    # bfloat16 products on the tile unit or by AVX-512's bfloat16 dot products (VDPBF16PS)
    _BF16_PRODUCTS = _native.isa() in ("amx", "avx512bf16")


def _warn_unmet_isa_request(asked, chosen: str) -> None:
    """QKV_ISA names a lower instruction set to run (tests); say so when it is not what runs."""
    wanted = "".join(asked.split()).lower() if asked is not None else None  # as the kernel reads it
    if asked is None or wanted == chosen or not chosen:
        return
    known = ("generic", "avx2", "avx512", "avx512bf16")
    why = "more than this CPU has or this build holds" if wanted in known \
        else f"not one of {', '.join(known)}"
    warnings.warn(f"QKV_ISA={asked!r} is {why}; the native kernel runs {chosen}", RuntimeWarning, stacklevel=2)


_warn_unmet_isa_request(os.environ.get("QKV_ISA"), _native.isa() if _native else "")

BLOCK_Q, BLOCK_K = 64, 128
# Unmasked forwards on the FMA units take key tiles of 256: fewer passes of the online softmax
# over the output, and longer product loops. Paired medians of 7-9 rounds in one process
# against 128 on Zen 4 (two threads, float32, 8 heads unless stated): L=4096 D=64 1.019-1.020x,
# L=1024 1.018x, L=4096 D=128 1.013x, 4 heads of 8192 1.022x, 2x16 heads of 512 1.016x, L=2048
# D=256 1.001x; AVX2 code 1.032-1.039x; bfloat16 widened on AVX-512 1.021x. Masked calls keep
# 128, which wastes less on the diagonal (causal with 256: 0.98x at L=4096, 0.91x at L=1024).
UNMASKED_BLOCK_K = 256
# Unmasked forwards on bfloat16 products (on_bf16_products). On AMX tiles, key tiles of 256
# halve the loads and stores of the output accumulator per score, and a query tile stacks
# about 128 queries over the group's heads (B=1, H=8, L=4096, D=64, against 64 x 128: 3-12%
# faster with one query head per KV head, 8-9% with 2, 5-9% with 4, 13-14% with 8). Masked
# calls keep 64 x 128, which wastes less on the diagonal (causal was 6% slower with 128 x
# 256). With VDPBF16PS (AMD EPYC, Zen 4) the size matters less: 358-363 GFLOP/s with 128 x
# 256, 359-363 with 64 x 256, 353-358 with 128 x 128, 327-350 with 256 x 256.
BF16_PRODUCT_QUERIES, BF16_PRODUCT_BLOCK_K = 128, 256
# Stacked queries per KV head up to which the kernel takes its decoding path (K and V rows
# read in place, on the FMA units) where the head dims allow it; csrc/kernel.h, few_queries_path.
FEW_QUERIES = {"float32": 8, "bfloat16": 32}
# The decoding path's key tiles: its four runs through a tile (csrc/kernel.h, STREAMS) read
# best when each is long, but not past what the caches hold. Decoding 32768 keys, 32/8 heads of
# 128, on Zen 4, paired medians of 12 rounds in one process against the kernel before the runs
# (tiles of 128, keys in order): float32 1.26-1.29x with 256, 1.25-1.29x with 512, 1.15-1.16x
# with 1024; bfloat16 1.02x with 256, 1.06-1.12x with 512, 1.05-1.09x with 1024.
DECODING_BLOCK_K = 512


#: The most threads QKV_NUM_THREADS may ask for.
MAX_THREADS = 1024
#: The kernel counts sizes in int, rounding them up to whole tiles: binding.cc's MAX_SIZE.
MAX_SIZE = 2**31 - 1024


def default_threads() -> int:
    """QKV_NUM_THREADS when set to an integer from 1 to MAX_THREADS, else every CPU this process
    may run on; another value is ignored with a warning (importing qkv must not fail over it)."""
    env = os.environ.get("QKV_NUM_THREADS", "").strip()
    if env:
        try:
            asked = int(env)
        except ValueError:
            asked = None
        if asked is not None and 1 <= asked <= MAX_THREADS:
            return asked
        warnings.warn(f"QKV_NUM_THREADS={env!r} is not an integer from 1 to {MAX_THREADS}; the native kernel "
                      f"uses {available_cpus()} threads (every CPU)", RuntimeWarning, stacklevel=2)
    return available_cpus()


def kept_memory_bytes() -> int:
    """Bytes of the block the kernel keeps between calls for a call's large scratch (the
    backward's packed operands: 46 MiB for 8 heads of 4096 x 64), so that repeated calls do not
    fault its pages in again; it grows to the largest such scratch up to 256 MiB (larger ones
    come from malloc and go back after the call). 0 where none is kept or there is no kernel."""
    return _native.kept_bytes() if _native is not None else 0


def release_kept_memory() -> bool:
    """Free the kernel's kept block (kept_memory_bytes); the next call that needs it allocates
    it again. False (nothing freed) while a call holds it, or where there is no kernel."""
    return _native.release_kept() if _native is not None else False


def in_data_loader_worker() -> bool:
    """Whether this process is a worker of a torch DataLoader (which sets torch's threads to 1
    there, so that the workers do not fight over the CPUs)."""
    data = sys.modules.get("torch.utils.data")
    return data is not None and data.get_worker_info() is not None


class NativeBackend(Backend):
    name = "native"
    caps = Capabilities(kinds=("numpy", "torch"), devices=("cpu",), dtypes=("float32", "bfloat16"),
                        max_head_dim=256, gradients=True, inline_mods=(Alibi, Bias, Softcap))
    rereads_rules = True

    def __init__(self):
        self.num_threads = default_threads()  # fixed work split: results do not depend on it
        # True: where AMX runs, float32 forward products run on it as exact sums of bfloat16
        # parts (csrc/kernel.h, amx_matmul_parts). Off by default: on the shared 2-CPU machine
        # qkv is measured on it ran 0.75-1.37x as fast as the FMA units (paired calls, L=4096)
        # and lost below about 2048 queries per KV head, where splitting K and V costs more
        # than it saves (README, "Speed"). The backward, on the FMA units, then rebuilds the
        # weights from scores rounded otherwise than the forward's, so lse_lo helps it less.
        self.float32_on_amx = False

    @property
    def float32_on_amx(self) -> bool:
        return self._float32_on_amx

    @float32_on_amx.setter
    def float32_on_amx(self, on):
        self._float32_on_amx = inputs.check_bool("float32_on_amx", on)

    def missing(self):
        if _native is None:
            return f"the native kernel is {_import_error}"
        return None

    def detail(self):
        if _native is None:
            return None
        left_out = ""
        if _native.cpu_isa() != _native.isa() and "QKV_ISA" not in os.environ:
            left_out = f"; the CPU has {_native.cpu_isa()}, which the compiler that built qkv could not build"
        threads = f"{self.num_threads} thread{'s' * (self.num_threads != 1)}"
        return f"{_native.isa()} instructions{left_out}, {threads} ({_native.threading()})"

    def call_threads(self) -> int:
        """The threads of a call: num_threads, or at most torch's in a DataLoader worker. The
        work split does not depend on it, so neither do the results."""
        if in_data_loader_worker():
            return max(1, min(self.num_threads, sys.modules["torch"].get_num_threads()))
        return self.num_threads

    def extra_reasons(self, inp):
        reasons = []
        arrays = (inp.q, inp.k, inp.v) + tuple(m.array for m in inp.score_mods if isinstance(m, Bias))
        if inp.kind == "numpy" and any(s % x.itemsize for x in arrays for s in x.strides):
            reasons.append("strides that are not whole elements (a field of a structured array)")
        if max(max(x.shape) for x in (inp.q, inp.k, inp.v)) > MAX_SIZE:
            reasons.append(f"a size above {MAX_SIZE} (the kernel counts in 32-bit ints)")
        if inp.kind == "torch":
            import torch

            plain = (torch.Tensor, torch.nn.Parameter)
            subclass = next((type(x) for x in (inp.q, inp.k, inp.v) if type(x) not in plain), None)
            if subclass is not None:  # a FakeTensor has no memory: the kernel would read freed or no memory
                reasons.append(f"a tensor subclass ({subclass.__name__}) whose memory the kernel cannot read")
            elif _tracing_mode_active():
                reasons.append("a tracing dispatch mode is active (make_fx, FakeTensorMode): it would record the "
                               "kernel's output but not the kernel; torch's operators it can trace")
        return reasons

    def on_bf16_products(self, inp):
        """Whether this call's forward products are bfloat16 ones (on AMX tiles, or by
        AVX-512's bfloat16 dot products): bfloat16 inputs where either runs, float32 when AMX
        runs and float32_on_amx is on; never on the decoding path."""
        wanted = inp.dtype == "bfloat16" or (_ON_AMX and self.float32_on_amx)
        return _BF16_PRODUCTS and wanted and not _few_queries(inp)

    def block_sizes(self, inp):
        """The forward's (block_q, block_k); the backward always runs on BLOCK_Q x BLOCK_K."""
        if _few_queries(inp):  # a query tile of the queries there are: a mask's bitmaps hold their rows only
            return max(1, min(BLOCK_Q, inp.Lq)), DECODING_BLOCK_K
        if inp.mask is None and self.on_bf16_products(inp):
            return max(16, BF16_PRODUCT_QUERIES // inp.group), BF16_PRODUCT_BLOCK_K
        if inp.mask is None:
            return BLOCK_Q, UNMASKED_BLOCK_K
        return BLOCK_Q, BLOCK_K

    def forward(self, inp):
        if inp.needs_grad:
            return autograd_attention(functools.partial(self.run_forward, float32_out=True), self.run_backward,
                                      inp.q, inp.k, inp.v, inp, inp.held_tensors())
        out, lse, _ = self.run_forward(inp, inp.q, inp.k, inp.v, with_lse=inp.needs_lse, with_lse_lo=False)
        return out, lse

    def run_forward(self, inp, q, k, v, with_lse=True, float32_out=False, with_lse_lo=True):
        """(out, lse, lse_lo); lse is None without with_lse (a decoding step saves allocating
        it), lse_lo (what lse's rounding lost, for the backward) without either. out is in the
        inputs' dtype, or in float32 with float32_out (ring attention merges the blocks'
        outputs: bfloat16 ones would be rounded before the merge)."""
        out = _empty(inp.kind, "float32" if float32_out else q.dtype, (inp.B, inp.Hq, inp.Lq, inp.Dv))
        lse = _empty(inp.kind, "float32", (inp.B, inp.Hq, inp.Lq)) if with_lse else None
        lse_lo = _empty(inp.kind, "float32", (inp.B, inp.Hq, inp.Lq)) if with_lse and with_lse_lo else None
        counts = None if base.tile_counter is None else np.zeros(2, dtype=np.int64)
        blocks = self.block_sizes(inp)
        *arrays, lo_out = _for_kernel(q, k, v, out, lse, lse_lo)
        _native.forward(*arrays, inp.scale, *blocks, self.call_threads(), **kernel_extras(inp, blocks),
                        tile_counts=counts, float32_on_amx=self.float32_on_amx, lse_lo=lo_out)
        if counts is not None:
            base.count_tiles(computed=int(counts[0]), masked=int(counts[1]))
        return out, lse, lse_lo

    def run_backward(self, inp, q, k, v, out, lse, dout, dlse, float32_grads=False, lse_lo=None):
        """(dq, dk, dv) in the inputs' dtype, or in float32 with float32_grads (ring attention
        sums the blocks' gradients: bfloat16 ones would be rounded before the sum)."""
        import torch

        dout = dout.contiguous()
        delta = softmax_delta(out, dout, dlse)
        lse_lo = None if lse_lo is None else lse_lo.contiguous()
        dq, dk, dv = (torch.empty(x.shape, dtype=torch.float32 if float32_grads else x.dtype) for x in (q, k, v))
        *arrays, lo_in = _for_kernel(q, k, v, dout, lse.contiguous(), delta.contiguous(), dq, dk, dv, lse_lo)
        _native.backward(*arrays, inp.scale, BLOCK_Q, BLOCK_K, self.call_threads(),
                         **kernel_extras(inp, (BLOCK_Q, BLOCK_K)), lse_lo=lo_in)
        return dq, dk, dv

    def workspace_bytes(self, inp):
        threads = self.call_threads()  # the tiles held at once: one per thread of the call
        block_q, block_k = self.block_sizes(inp)
        rows = min(block_q, inp.Lq)  # a query tile holds the queries there are (a decoding step's few)
        return tile_workspace(threads, rows, block_k, inp.group, inp.D, inp.Dv, "float32") + self._split_bytes(inp) \
            + (8 if inp.needs_grad else 4) * inp.B * inp.Hq * inp.Lq + self._packed_bytes(inp) \
            + self._mask_bytes(inp) + saved_output_bytes(inp)  # lse, and lse_lo for the backward

    def _split_bytes(self, inp):
        """The key splits' partial results, at most (csrc/kernel.h, forward): with fewer than 16
        (row, query tile) items, each item's keys split up to 32 / items + 1 ways, and each split
        keeps its tile's maxima, sums and output (rows padded to 32, Dv to 32)."""
        block_q, block_k = self.block_sizes(inp)
        items = inp.B * inp.Hkv * cdiv(inp.Lq, block_q)
        if items >= 16:
            return 0
        splits = min(16, 32 // items + 1, cdiv(inp.Lk, block_k))
        rows = _padded(inp.group * min(block_q, inp.Lq))
        return items * splits * rows * (2 + _padded(inp.Dv)) * 4

    def automatic_refusal(self, inp):
        # A mask that is not key intervals reaches the kernel as a byte per score of its PARTIAL
        # tiles: few for packed documents, every score for a rule that cuts through every tile.
        # Past the size of the inputs and output that is no longer O(N) memory.
        bitmaps, arrays = self._bitmap_bytes(inp), inp.B * (inp.Hq * inp.Lq * (inp.D + inp.Dv)
                                                             + inp.Hkv * inp.Lk * (inp.D + inp.Dv)) * 4
        if bitmaps > max(arrays, 64 * 2**20):
            return (f"this mask needs a byte per score of its partial tiles, {bitmaps / 2**20:.0f} MiB, "
                    "more than the inputs (not O(N) memory; backend='native' runs it anyway)")
        return None

    def _mask_bytes(self, inp):
        """What a mask hands the kernel: a class per tile and the bitmaps of _bitmap_bytes; and
        while they are made, a user's rule's temporaries."""
        if inp.mask is None:
            return 0
        block_q, block_k = self.block_sizes(inp)
        return inp.B * inp.Hkv * cdiv(inp.Lq, block_q) * cdiv(inp.Lk, block_k) + self._bitmap_bytes(inp) \
            + self._rule_bytes(inp)

    def _rule_bytes(self, inp):
        """A user's rule is evaluated for up to EVALUATED_AT_ONCE scores at a time (a key tile of
        a query band at least): its answer, and two int64 index temporaries a score, as the numpy
        backend's estimate assumes of a typical rule."""
        if not runs_user_rule(inp.mask):
            return 0
        band = inp.B * inp.Hq * min(inp.Lq, self.block_sizes(inp)[0])  # scores of one key
        block_k = self.block_sizes(inp)[1]
        scores = max(band * block_k, min(EVALUATED_AT_ONCE, band * cdiv(inp.Lk, block_k) * block_k))
        return scores * (1 + 2 * 8)

    def _bitmap_bytes(self, inp):
        """For masks that are not key intervals: a byte per score of every PARTIAL tile."""
        if inp.mask is None or isinstance(inp.mask, IntervalMask):
            return 0
        blocks = self.block_sizes(inp)
        partial = int((row_tile_classes(inp, *blocks) == PARTIAL).sum())  # (row, query tile, key tile)s
        return partial * inp.group * blocks[0] * blocks[1]

    def _packed_bytes(self, inp):
        """The bfloat16 products' copies of V and, for float32 on AMX, of K, each in 3 parts: a
        whole key tile (block_k rounded up to 32 keys) for every key tile, the last one too."""
        if not self.on_bf16_products(inp):
            return 0
        block_k = self.block_sizes(inp)[1]
        padded_keys = cdiv(inp.Lk, block_k) * _padded(block_k)
        values, keys = (_padded(inp.Dv), 0) if inp.dtype == "bfloat16" else (3 * _padded(inp.Dv), 3 * _padded(inp.D))
        return 2 * inp.B * inp.Hkv * padded_keys * (values + keys)


def _padded(n: int) -> int:
    """n rounded up to 32, as the kernel pads bfloat16 pairs' rows and its partial results."""
    return cdiv(n, 32) * 32


def _few_queries(inp) -> bool:
    """Whether the kernel takes its decoding path (as csrc/kernel.h, few_queries_path, with
    AVX-512's 16-float vectors): few stacked queries, K and V rows contiguous, D and Dv
    multiples of 16."""
    if inp.group * min(inp.Lq, BLOCK_Q) > FEW_QUERIES[inp.dtype] or inp.D % 16 or inp.Dv % 16:
        return False
    if inp.kind == "torch":
        return inp.k.stride(-1) == 1 and inp.v.stride(-1) == 1
    return inp.k.strides[-1] == inp.k.itemsize and inp.v.strides[-1] == inp.v.itemsize


def _for_kernel(*arrays):
    """The arrays as the kernel takes them: NumPy arrays as they are, torch tensors as DLPack
    capsules (the binding would otherwise call each tensor's __dlpack__ method, some 6 µs a
    tensor in Python: a third of a short decoding step). None stays None."""
    if not _arrays.is_torch(arrays[0]):
        return arrays
    to_dlpack = sys.modules["torch"].utils.dlpack.to_dlpack  # torch is loaded: it made them
    # DLPack carries no negative bit (a lazy negation of a view): resolve_neg applies it
    return [a if a is None else to_dlpack(a.resolve_neg()) for a in arrays]


def _empty(kind, dtype, shape):
    """An uninitialised array of this kind ("numpy" or "torch"), dtype (a dtype object or name)."""
    if kind == "torch":
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    return np.empty(shape, dtype=dtype)


def _tracing_mode_active() -> bool:
    """Whether a dispatch mode that traces operators is active: make_fx's (it would record only
    the kernel's empty output, and the traced graph return uninitialised memory) or a
    FakeTensorMode. Other modes (selective checkpointing, FlopCounterMode) see no kernel work
    but get the right results, so the kernel runs under them."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode

    return _arrays.dispatch_mode_active(ProxyTorchDispatchMode, FakeTensorMode)


def kernel_extras(inp, blocks) -> dict:
    """The kernel's keyword arguments for this call's mask and score modifiers, tiled (block_q, block_k)."""
    extras = dict(tile_class=None, lo=None, hi=None, bitmap_index=None, bitmaps=None, alibi=None, softcap=0.0,
                  bias=None)
    for mod in inp.score_mods:
        if isinstance(mod, Alibi):
            extras["alibi"] = mod.slopes.astype(np.float32)
        elif isinstance(mod, Softcap):
            extras["softcap"] = float(mod.cap)
        elif isinstance(mod, Bias):
            extras["bias"] = _kernel_bias(mod, inp.geom)
    if inp.mask is None:
        return extras
    classes = row_tile_classes(inp, *blocks)  # (R, nq, nk)
    extras["tile_class"] = np.ascontiguousarray(classes)
    if isinstance(inp.mask, IntervalMask):
        extras["lo"], extras["hi"] = key_intervals(inp.mask, inp)
    else:
        extras["bitmap_index"], extras["bitmaps"] = _partial_bitmaps(inp, classes, blocks)
    return extras


def _kernel_bias(mod, geom):
    """The bias as the kernel reads it, in place: float32 or bfloat16 (the inputs' dtype), any strides."""
    bias = mod.fitted(geom)  # (B|1, H|1, Lq|1, Lk|1)
    if _arrays.is_torch(bias):
        return bias.detach().resolve_neg()  # DLPack carries no negative bit
    return bias


def _partial_bitmaps(inp, classes, blocks):
    """Allowed pairs of every PARTIAL tile: index (R, nq, nk) -> bitmap (n, G, block_q, block_k) uint8.
    The mask is evaluated a query band at a time, over as many key tiles at once as
    EVALUATED_AT_ONCE allows, and only where some row's tile is PARTIAL."""
    block_q, block_k = blocks
    partial = classes == PARTIAL
    index = np.full(classes.shape, -1, dtype=np.int32)
    index[partial] = np.arange(int(partial.sum()), dtype=np.int32)
    G, nk = inp.group, classes.shape[2]
    bitmaps = np.zeros((int(partial.sum()), G, block_q, block_k), dtype=np.uint8)
    probe = inp.geom.host_probe()
    for t in range(classes.shape[1]):
        q0, q1 = t * block_q, min((t + 1) * block_q, inp.Lq)
        step = max(1, EVALUATED_AT_ONCE // max(1, inp.B * inp.Hq * (q1 - q0) * block_k))  # key tiles at once
        for j0 in range(0, nk, step):
            j1 = min(j0 + step, nk)
            rows_here = partial[:, t, j0:j1]  # (R, j1 - j0)
            if rows_here.any():
                tiles = _band_tiles(inp, probe, q0, q1, j0, j1, block_k)  # (R, j1 - j0, G, rows, bk)
                bitmaps[index[:, t, j0:j1][rows_here], :, : q1 - q0, :] = tiles[rows_here]
    return index, bitmaps


def _band_tiles(inp, probe, q0, q1, j0, j1, block_k):
    """The mask on queries q0..q1 and key tiles j0..j1, as (R, j1 - j0, G, q1 - q0, block_k)."""
    b, h, qi, _ = tile_indices(probe, np.arange(inp.B), np.arange(inp.Hq), q0, q1, 0, 1)
    keys = np.minimum(np.arange(j0 * block_k, j1 * block_k), inp.Lk - 1)  # the last tile's padding reads the last key
    ki = _arrays.like(keys.reshape(1, 1, 1, -1), probe)  # (1, 1, 1, keys)
    allowed = _arrays.to_numpy(inp.mask.allowed(b, h, qi, ki, inp.geom))
    band = np.broadcast_to(allowed, (inp.B, inp.Hq, q1 - q0, keys.size))
    # (B, Hkv, G, rows, n, bk) -> (R, n, G, rows, bk)
    tiles = band.reshape(inp.B, inp.Hkv, inp.group, q1 - q0, j1 - j0, block_k).transpose(0, 1, 4, 2, 3, 5)
    return tiles.reshape(inp.B * inp.Hkv, j1 - j0, inp.group, q1 - q0, block_k)
