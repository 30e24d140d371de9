"""The qkv command: qkv demo | info | check | bench | viz."""
from __future__ import annotations

import argparse
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
              f"grad {'yes' if caps.gradients else 'no'}, dropout {'yes' if caps.dropout else 'no'}")
    return 0


def cmd_check(args) -> int:
    """A quick self-test: every available backend against the float64 reference."""
    import qkv
    from qkv import dispatch

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 4, n, 32)) for n in (67, 91, 91))
    want = qkv.attention(q, k, v, qkv.causal(), backend="reference")
    failures = 0
    for name, backend in dispatch.REGISTRY.items():
        if name == "reference" or backend.missing():
            continue
        dtype = "float64" if "float64" in backend.caps.dtypes else "float32"
        arrays = [x.astype(dtype) for x in (q, k, v)]
        on_cpu = backend.accepts_device("cpu")
        if "numpy" not in backend.caps.kinds or not on_cpu:
            arrays = _as_torch(*arrays, device="cpu" if on_cpu else "cuda")
        got = np.asarray(qkv.attention(*arrays, qkv.causal(), backend=name).tolist())
        err = float(np.abs(got - want).max())
        ok = err < (1e-10 if dtype == "float64" else 1e-5)
        failures += not ok
        print(f"{name:<10} {dtype} causal, max error {err:.1e}  {'ok' if ok else 'FAILED'}")
    return 1 if failures else 0


def cmd_bench(args) -> int:
    from qkv import bench

    bench.check_arguments(args.parser, args)
    needs = ("torch", "rich") + (("matplotlib",) if args.plot else ())
    missing = [name for name in needs if importlib.util.find_spec(name) is None]
    if missing:
        print(f"qkv bench needs torch and rich{' and matplotlib' if args.plot else ''}: "
              f"pip install 'qkv[bench]' (missing: {', '.join(missing)})", file=sys.stderr)
        return 1
    return bench.run(args)


def cmd_demo(args) -> int:
    from qkv import demo

    demo.run()
    return 0


def _as_torch(*arrays, device="cpu"):
    import torch

    return tuple(torch.tensor(a, device=device) for a in arrays)


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


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `qkv info | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so exit's flush cannot fail again
        return 141  # as a shell reports a process ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
