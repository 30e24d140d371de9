"""The qkv command: qkv demo | info | check | bench | viz."""
from __future__ import annotations

import argparse
import codecs
import importlib.util
import os
import platform
import sys

import numpy as np

from qkv._threads import available_cpus, cpu_name


def cmd_info(args) -> int:
    """Versions, the machine, and every backend with whether it can run here and why not."""
    import qkv
    from qkv import dispatch

    print(f"qkv {qkv.__version__}  python {platform.python_version()}  numpy {np.__version__}  "
          f"torch {_torch_version()}")
    print(f"machine: {cpu_name()}, {platform.machine()}, {available_cpus()} CPUs")
    print("backends (automatic choice in this order):")
    for name, backend in dispatch.REGISTRY.items():
        missing = backend.missing()
        detail = backend.detail()
        state = f"unavailable: {missing}" if missing else "available" + (f": {detail}" if detail else "")
        caps = backend.caps
        auto = "" if backend.ever_automatic else " [never automatic]"
        print(f"  {name:<10} {state}{auto}")
        devices = f" on {'/'.join(caps.devices)}" if caps.devices else ""
        print(f"  {'':<10} arrays {'/'.join(caps.kinds)}{devices}, dtypes {', '.join(caps.dtypes)}, "
              f"grad {'yes' if caps.gradients else 'no'}, dropout {'yes' if caps.dropout else 'no'}"
              f"{_limits(caps)}")
    print("qkv.explain(q, k, v, ...) says which backend runs a given call and why the others do not.")
    return 0


def _limits(caps) -> str:
    """The declared limits beyond kinds, dtypes, grad and dropout."""
    head_dims = f", head dims up to {caps.max_head_dim}" if caps.max_head_dim else ""
    if caps.inline_mods is None:
        return head_dims
    from qkv.backends.base import mod_names

    return f"{head_dims}, score modifiers {mod_names(caps.inline_mods)} (each once, softcap last)"


def cmd_check(args) -> int:
    """A quick self-test: every available backend, in each of its dtypes, against the float64
    reference by the tolerance rule, output and lse (a causal grouped-query problem)."""
    from qkv import dispatch

    rng = np.random.default_rng(0)
    arrays64 = [rng.standard_normal(shape) for shape in ((2, 4, 67, 32), (2, 2, 91, 32), (2, 2, 91, 24))]
    failures, references = 0, {}
    for name, backend in dispatch.REGISTRY.items():
        if name == "reference" or backend.missing():
            continue
        for dtype in [d for d in ("float64", "float32", "bfloat16", "float16") if d in backend.caps.dtypes]:
            if dtype == "bfloat16" and importlib.util.find_spec("torch") is None:  # NumPy has no bfloat16
                print(f"{name:<10} {dtype:<9} skipped: bfloat16 arrays are torch tensors (pip install 'qkv[torch]')")
                continue
            try:
                report, ok = _check_one(name, backend, dtype, arrays64, references)
            except Exception as error:  # a backend that fails is reported, and the others still run
                report, ok = f"{type(error).__name__}: {error}", False
            failures += not ok
            print(f"{name:<10} {dtype:<9} causal GQA: {report}  {'ok' if ok else 'FAILED'}")
    return 1 if failures else 0


def _check_one(name, backend, dtype, arrays64, references: dict):
    """(what was measured, whether it is within the rule) for one backend in one dtype.
    references keeps the oracle's two runs per kind of input, which every backend shares."""
    import qkv
    from qkv.backends.base import max_error, within_rule

    on_cpu = backend.accepts_device("cpu")
    as_torch = dtype == "bfloat16" or "numpy" not in backend.caps.kinds or not on_cpu
    arrays = _as_torch(*arrays64, device="cpu" if on_cpu else "cuda", dtype=dtype) if as_torch else \
        [x.astype(dtype) for x in arrays64]
    if (dtype, as_torch) not in references:
        rounded = [np.asarray(_to_cpu(x).tolist()) for x in arrays]  # the inputs as the backend sees them
        references[dtype, as_torch] = (
            qkv.attention(*rounded, qkv.causal(), backend="reference", return_lse=True),  # float64
            qkv.attention(*map(_to_cpu, arrays), qkv.causal(), backend="reference", return_lse=True))  # in dtype
    oracle, in_dtype = references[dtype, as_torch]
    got = qkv.attention(*arrays, qkv.causal(), backend=name, return_lse=True)
    errors = [max_error(_to_cpu(g), want) for g, want in zip(got, oracle)]
    reference_errors = [max_error(_to_cpu(r), want) for r, want in zip(in_dtype, oracle)]
    ok = all(within_rule(e, r, dtype) for e, r in zip(errors, reference_errors))
    return f"max error out {errors[0]:.1e}, lse {errors[1]:.1e} (plain formula in {dtype}: " \
           f"{reference_errors[0]:.1e}, {reference_errors[1]:.1e})", ok


def _to_cpu(x):
    return x.cpu() if hasattr(x, "cpu") else x




def cmd_bench(args) -> int:
    from qkv import bench

    bench.check_arguments(args.parser, args)
    # the ring benchmark (--distributed) draws no table or plot
    needs = ("torch",) + (() if args.distributed else ("rich",)) + (("matplotlib",) if args.plot else ())
    missing = [name for name in needs if importlib.util.find_spec(name) is None]
    if missing:
        print(f"qkv bench needs {' and '.join(needs)}: pip install 'qkv[bench]' (missing: {', '.join(missing)})",
              file=sys.stderr)
        return 1
    return bench.run(args)


def cmd_demo(args) -> int:
    from qkv import demo

    demo.run()
    return 0


def _as_torch(*arrays, device="cpu", dtype=None):
    import torch

    return tuple(torch.tensor(a, device=device, dtype=getattr(torch, dtype) if dtype else None) for a in arrays)


def _torch_version() -> str:
    try:
        import torch
    except ImportError:
        return "not installed"
    return torch.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qkv", description="Exact attention for Python.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, func, text in [
        ("demo", cmd_demo, "walk through the seed examples, masks, decoding and a long sequence"),
        ("info", cmd_info, "versions, machine, and which backends can run here (and why not)"),
        ("check", cmd_check, "check every available backend against the float64 reference"),
        ("bench", cmd_bench, "measure qkv's backends against torch and other peers, side by side"),
    ]:
        command = sub.add_parser(name, help=text, description=text)
        command.set_defaults(func=func, parser=command)
        if name == "bench":
            from qkv.bench import add_arguments

            add_arguments(command)
    from qkv import viz

    viz.add_parser(sub)  # qkv viz: pictures of attention weights
    return parser


# Pictures (masks, heatmaps) are drawn with block characters. Where the output cannot encode
# them (a pipe in a legacy code page, PYTHONIOENCODING=ascii), they come out as ASCII shades.
_ASCII_SHADES = {"█": "#", "▓": "%", "▒": "+", "░": ".", "·": ".", "│": "|"}


def _ascii_shades(error: UnicodeEncodeError):
    text = error.object[error.start:error.end]
    return "".join(_ASCII_SHADES.get(char, "?") for char in text), error.end


codecs.register_error("qkv-ascii-shades", _ascii_shades)


def _draw_in_any_encoding() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            "".join(_ASCII_SHADES).encode(stream.encoding or "ascii")
        except (UnicodeEncodeError, LookupError):
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(errors="qkv-ascii-shades")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    _draw_in_any_encoding()
    try:
        return args.func(args)
    except BrokenPipeError:  # `qkv info | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so exit's flush cannot fail again
        return 141  # as a shell reports a process ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
