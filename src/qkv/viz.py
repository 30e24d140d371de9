"""Pictures of attention weights: a PNG grid of heatmaps, an interactive HTML head view,
and a heatmap for the terminal. They take any weights array, not only a model's.

Shape legend (what every function accepts, NumPy or torch):
    (Lq, Lk)                       one head
    (heads, Lq, Lk)                one layer
    (layers, heads, Lq, Lk)        a whole model (``MiniLM.attention_map`` gives this)
    tokens: Lq labels of the query rows; key_tokens: Lk labels of the key columns
            (default: tokens when Lq == Lk, else the key positions)

    grid = heatmap_grid(w, tokens, layer=2, path="heads.png")   # needs matplotlib: qkv[viz]
    html = head_view_html(w, tokens, path="heads.html")          # one file, works offline
    print(terminal_heatmap(w, tokens, layer=2, head=5))

The command ``qkv viz`` draws a sentence through MiniLM, random weights or a .npy file.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import textwrap
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import _arrays, inputs
from ._paths import output_file

SHADES = " ░▒▓█"
_TEMPLATE = Path(__file__).parent / "viz_assets" / "head_view.html"


# --------------------------------------------------------------------------------------
# Input: any weights array, with labels
# --------------------------------------------------------------------------------------
@dataclass
class AttentionMaps:
    """Weights as (layers, heads, Lq, Lk) float64, with a label for every query and key."""

    weights: np.ndarray
    tokens: list
    key_tokens: list

    @property
    def layers(self) -> int:
        return self.weights.shape[0]

    @property
    def heads(self) -> int:
        return self.weights.shape[1]


def as_maps(weights, tokens=None, key_tokens=None) -> AttentionMaps:
    """Validate weights of shape (Lq, Lk), (heads, Lq, Lk) or (layers, heads, Lq, Lk) and their labels.
    Labels given with an AttentionMaps replace its own."""
    if isinstance(weights, AttentionMaps):
        return _relabelled(weights, tokens, key_tokens)
    if _arrays.kind_of(weights) is None:
        raise TypeError(f"weights must be a numpy.ndarray or torch.Tensor, got {type(weights).__name__}")
    w = _arrays.to_numpy(weights)
    if w.dtype == bool or not (np.issubdtype(w.dtype, np.floating) or np.issubdtype(w.dtype, np.integer)):
        raise TypeError(f"weights must hold numbers, got dtype {w.dtype}")
    if w.ndim not in (2, 3, 4):
        raise ValueError(f"weights must have shape (Lq, Lk), (heads, Lq, Lk) or (layers, heads, Lq, Lk); "
                         f"got {w.shape}")
    w = w.astype(np.float64).reshape((1,) * (4 - w.ndim) + w.shape)  # (layers, heads, Lq, Lk)
    if 0 in w.shape:
        raise ValueError(f"weights must not be empty, got shape {w.shape}")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("weights must be finite and non-negative (attention weights are in [0, 1])")
    Lq, Lk = w.shape[-2:]
    tokens = _labels("tokens", tokens, Lq)
    if key_tokens is None:
        key_tokens = tokens if Lq == Lk else [str(j) for j in range(Lk)]
    return AttentionMaps(w, tokens, _labels("key_tokens", key_tokens, Lk))


def _relabelled(maps: AttentionMaps, tokens, key_tokens) -> AttentionMaps:
    """maps with the labels given (as as_maps reads them: square maps label keys as queries)."""
    if tokens is None and key_tokens is None:
        return maps
    Lq, Lk = maps.weights.shape[-2:]
    new_tokens = maps.tokens if tokens is None else _labels("tokens", tokens, Lq)
    if key_tokens is None:
        key_tokens = new_tokens if tokens is not None and Lq == Lk else maps.key_tokens
    return AttentionMaps(maps.weights, new_tokens, _labels("key_tokens", key_tokens, Lk))


def _labels(name, labels, n):
    if labels is None:
        return [str(i) for i in range(n)]
    if isinstance(labels, str) or not hasattr(labels, "__len__"):
        raise TypeError(f"{name} must be a list of strings (one per position), got {type(labels).__name__}")
    if len(labels) != n:
        raise ValueError(f"{name} has {len(labels)} labels but the weights have {n} positions on that axis")
    return [str(t) for t in labels]


def _check_index(name, value, size, what, optional=False):
    """An index into `size` things (negative counts from the end); None only where optional."""
    if value is None and optional:
        return None
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not -size <= value < size:
        raise ValueError(f"{name} must be an integer in [0, {size}) or, counting from the end, in [-{size}, 0) "
                         f"({size} {what}), got {value!r}")
    return int(value) % size


# --------------------------------------------------------------------------------------
# Terminal
# --------------------------------------------------------------------------------------
def terminal_heatmap(weights, tokens=None, *, key_tokens=None, layer=0, head=None, scale=None) -> str:
    """One heatmap as text: a row per query token, two characters per key, shaded ' ░▒▓█'.

    Args:
        weights, tokens, key_tokens: as in the module legend.
        layer: which layer (default 0).
        head: which head; None shows the mean over the heads of that layer.
        scale: the weight drawn as '█' (default: the largest weight shown); each cell
            takes the shade nearest to weight / scale in steps of 1/4.

    Returns:
        The picture, with the key labels listed under it and the shades' meaning.
    """
    maps = as_maps(weights, tokens, key_tokens)
    layer = _check_index("layer", layer, maps.layers, "layers")
    head = _check_index("head", head, maps.heads, "heads", optional=True)
    w = maps.weights[layer]  # (heads, Lq, Lk)
    grid = w.mean(0) if head is None else w[head]  # (Lq, Lk)
    top = float(grid.max()) if scale is None else inputs.check_positive_float("scale", scale)
    steps = len(SHADES) - 1
    levels = np.clip(np.rint(grid / top * steps), 0, steps).astype(int) if top > 0 else np.zeros(grid.shape, int)
    which = "mean of heads" if head is None else f"head {head}"
    labels = [_printable(t) for t in maps.tokens]
    width = min(max(_columns(t) for t in labels), 16)
    lines = [f"layer {layer}, {which}  (rows: queries, columns: keys)"]
    lines += [" " * (width + 2) + header for header in _column_headers(grid.shape[1])]
    for label, row in zip(labels, levels):
        lines.append(_right_aligned(label, width) + " │" + "".join(SHADES[v] * 2 for v in row))
    lines.append("keys: " + "  ".join(f"{j} {_printable(t)}" for j, t in enumerate(maps.key_tokens)))
    shades = "  ".join(f"'{SHADES[i]}' {top * i / steps:.3g}" for i in range(1, steps + 1))
    lines.append(f"shades (nearest): {shades}")
    return "\n".join(lines)


def _printable(label: str) -> str:
    """A label on one line: control characters (a newline in a token) as escapes."""
    return "".join(repr(c)[1:-1] if unicodedata.category(c) == "Cc" else c for c in label)


def _char_columns(c: str) -> int:
    """Terminal columns a character takes: 2 for wide East Asian ones, 0 for combining marks."""
    if unicodedata.combining(c):
        return 0
    return 2 if unicodedata.east_asian_width(c) in ("W", "F") else 1


def _columns(text: str) -> int:
    return sum(_char_columns(c) for c in text)


def _right_aligned(label: str, width: int) -> str:
    """label cut to `width` terminal columns and padded on the left to exactly that many."""
    kept, used = [], 0
    for c in label:
        if used + _char_columns(c) > width:
            break
        kept.append(c)
        used += _char_columns(c)
    return " " * (width - used) + "".join(kept)


def _column_headers(n: int) -> list:
    """Key positions over two-character columns, read downwards: a line of units under lines of
    tens, hundreds... which show their digit at every tenth key."""
    places = [10 ** k for k in range(len(str(max(n - 1, 0))) - 1, 0, -1)]  # ..., 100, 10
    lines = ["".join(f"{j // place % 10} " if j >= place and j % 10 == 0 else "  " for j in range(n))
             for place in places]
    return lines + ["".join(f"{j % 10} " for j in range(n))]


# --------------------------------------------------------------------------------------
# PNG grid (matplotlib)
# --------------------------------------------------------------------------------------
def _figure_class():
    """matplotlib's Figure: drawn and saved without pyplot, so no GUI backend is involved."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("the PNG grid needs matplotlib: pip install qkv[viz]") from error
    return Figure


def heatmap_grid(weights, tokens=None, *, key_tokens=None, layer=None, path=None, title=None, cmap="Blues"):
    """A grid of heatmaps, one per head: a chosen layer, or every layer (a row each).

    Args:
        weights, tokens, key_tokens: as in the module legend.
        layer: one layer (its heads fill rows of up to 6 panels); None draws every layer.
        path: where to save the picture, in the format its suffix names (.png, .svg, .pdf;
            none: PNG, with .png added); None: only return the figure.
        title: the figure's title.
        cmap: a matplotlib colormap name; one colour scale for every panel, 0 to the largest weight.

    Returns:
        The matplotlib Figure (no pyplot state is touched).
    """
    Figure = _figure_class()
    maps = as_maps(weights, tokens, key_tokens)
    layer = _check_index("layer", layer, maps.layers, "layers", optional=True)
    panels = _panels(maps, layer)  # [(layer, head)]
    n_rows, n_cols = (maps.layers, maps.heads) if layer is None else (math.ceil(maps.heads / 6), min(maps.heads, 6))
    Lq, Lk = maps.weights.shape[-2:]
    cell = max(1.6, min(3.2, 0.2 * max(Lq, Lk) + 0.8))  # inches per panel
    width = n_cols * cell + 1.2
    fig = Figure(figsize=(width, n_rows * cell + 1.0), dpi=110, layout="constrained")
    axes = fig.subplots(n_rows, n_cols, squeeze=False)
    shown = maps.weights if layer is None else maps.weights[layer]
    top = max(float(shown.max()), 1e-12)  # one colour scale: 0 to the largest weight shown
    image = None
    for index, ax in enumerate(axes.flat):
        if index >= len(panels):
            ax.set_axis_off()
            continue
        lay, head = panels[index]
        image = ax.imshow(maps.weights[lay, head], cmap=cmap, vmin=0.0, vmax=top, interpolation="nearest")
        ax.set_title(f"layer {lay} head {head}" if layer is None else f"head {head}", fontsize=8, parse_math=False)
        _label_axes(ax, maps, left=index % n_cols == 0, bottom=index + n_cols >= len(panels))
    fig.colorbar(image, ax=axes, shrink=0.6, aspect=30, pad=0.01, label="attention weight")
    # wrapped to the figure's width (about 10 characters an inch at this size): one panel is narrow
    fig.suptitle(textwrap.fill(title or _default_title(maps, layer), max(24, int(width * 10))), fontsize=11,
                 parse_math=False)  # a '$' in a title or token is text, not the start of a formula
    if path is not None:
        fig.savefig(path)
    return fig


def _panels(maps, layer):
    layers = range(maps.layers) if layer is None else [layer]
    return [(lay, head) for lay in layers for head in range(maps.heads)]


def _label_axes(ax, maps, *, left: bool, bottom: bool):
    """Token labels on the left column and the bottom row only (up to 48 of them)."""
    Lq, Lk = len(maps.tokens), len(maps.key_tokens)
    size = 7 if max(Lq, Lk) <= 24 else 5
    # no ticks at all where no label shows: a tick per position costs seconds at a thousand
    if left and Lq <= 48:
        ax.set_yticks(range(Lq), maps.tokens, fontsize=size, parse_math=False)
    else:
        ax.set_yticks([])
    if bottom and Lk <= 48:
        ax.set_xticks(range(Lk), maps.key_tokens, fontsize=size, rotation=90, parse_math=False)
    else:
        ax.set_xticks([])
    ax.tick_params(length=0)


def _default_title(maps, layer) -> str:
    which = "every layer" if layer is None else f"layer {layer}"
    return f"attention weights, {which} (rows: queries, columns: keys)"


# --------------------------------------------------------------------------------------
# HTML head view
# --------------------------------------------------------------------------------------
def head_view_html(weights, tokens=None, *, key_tokens=None, layer=0, head=-1, path=None, title=None,
                   digits: int = 4) -> str:
    """A self-contained interactive page: query tokens on the left, keys on the right, lines
    weighted by attention; hover a token to focus it, pick the layer and head.

    Everything (style, script, the weights as JSON) is inline: the page fetches nothing.

    Args:
        weights, tokens, key_tokens: as in the module legend.
        layer: the layer shown first; head: the head shown first (-1 = all heads, in colours).
        path: where to write the page (None: only return it).
        title: the page's heading.
        digits: decimals kept of each weight (the page's size grows with layers*heads*Lq*Lk).

    Returns:
        The HTML text.
    """
    maps = as_maps(weights, tokens, key_tokens)
    layer = _check_index("layer", layer, maps.layers, "layers")
    all_heads = isinstance(head, (int, np.integer)) and not isinstance(head, bool) and head == -1
    head = -1 if all_heads else _check_index("head (or -1, all heads)", head, maps.heads, "heads")
    digits = inputs.check_positive_int("digits", digits)
    data = {
        "title": title or "qkv attention head view",
        "tokens": maps.tokens,
        "key_tokens": maps.key_tokens,
        "layer_names": [f"layer {i}" for i in range(maps.layers)],
        "layer": layer,
        "head": head,
        "weights": np.round(maps.weights, digits).tolist(),  # [layer][head][query][key]
    }
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    text = text.replace("<", "\\u003c")  # no token ("</script>", "<!--<script>") may end or hide the data block
    fills = {"__TITLE__": _escape(data["title"]), "__DATA__": text}
    # one pass: a title or token that reads "__DATA__" stays text
    page = re.sub("__TITLE__|__DATA__", lambda found: fills[found.group()], _TEMPLATE.read_text(encoding="utf-8"))
    if path is not None:
        Path(path).write_text(page, encoding="utf-8")
    return page


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# --------------------------------------------------------------------------------------
# The command: qkv viz
# --------------------------------------------------------------------------------------
HELP = "draw attention weights: a PNG grid, an interactive HTML head view, a terminal heatmap"


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``viz`` command to an argparse subparsers object; returns its parser."""
    parser = subparsers.add_parser("viz", help=HELP, description=HELP + ". The weights come from a "
                                   "sentence through all-MiniLM-L6-v2 (qkv[models]), --random, or --npy.")
    configure_parser(parser)
    parser.set_defaults(func=run)
    return parser


#: Sizes of --random's weights when not given (--causal is off unless given).
RANDOM_DEFAULTS = {"length": 10, "heads": 4, "layers": 2, "seed": 0, "causal": False}


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``qkv viz``."""
    source = parser.add_argument_group("where the weights come from (one of)")
    source.add_argument("sentence", nargs="?", help="a sentence, run through all-MiniLM-L6-v2")
    source.add_argument("--random", action="store_true", help="random queries and keys through qkv.attention_weights")
    source.add_argument("--npy", metavar="FILE",
                        help="a .npy array (Lq, Lk), (heads, Lq, Lk) or (layers, heads, Lq, Lk)")
    source.add_argument("--tokens", help="labels for --npy, separated by spaces")
    for name, what in (("length", "tokens"), ("heads", "heads"), ("layers", "layers"), ("seed", "seed")):
        source.add_argument(f"--{name}", type=int, default=None,
                            help=f"{what} for --random (default {RANDOM_DEFAULTS[name]})")
    source.add_argument("--causal", action="store_true", help="causal mask for --random")
    out = parser.add_argument_group("what to draw")
    out.add_argument("--layer", type=int, default=None,
                     help="the layer to draw (default: every layer in the PNG, layer 0 elsewhere)")
    out.add_argument("--head", type=int, default=None, help="the head for the terminal (default: mean of heads)")
    out.add_argument("--png", metavar="FILE", type=output_file((".png",)),
                     help="write the grid of heatmaps here, a .png file (needs qkv[viz])")
    out.add_argument("--html", metavar="FILE", type=output_file((".html", ".htm")),
                     help="write the interactive head view here, a .html file")
    out.add_argument("--quiet", action="store_true", help="do not print the terminal heatmap")


def _load_npy(path):
    """One array from a .npy file; anything else (text, a .npz archive, pickled objects, a
    damaged file) is named for what it is, not with NumPy's advice to allow pickles."""
    with open(path, "rb") as f:
        is_npy = f.read(6) == b"\x93NUMPY"
    if not is_npy:
        raise ValueError(f"--npy {path}: not a NumPy .npy file (np.save writes one; a .npz archive holds several)")
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as error:  # NumPy refuses object arrays by naming allow_pickle
        what = "holds Python objects, not numbers" if "allow_pickle" in str(error) else "is damaged or cut short"
        raise ValueError(f"--npy {path}: {what} ({error})") from None


def load_weights(args):
    """(weights (layers, heads, Lq, Lk), tokens) for the parsed arguments."""
    chosen = [name for name, given in (("a sentence", args.sentence is not None), ("--random", args.random),
                                       ("--npy", args.npy is not None)) if given]
    if len(chosen) != 1:
        raise ValueError("give exactly one of: a sentence, --random, --npy" +
                         (f" (got {', '.join(chosen)})" if chosen else ""))
    if args.tokens is not None and args.npy is None:
        raise ValueError("--tokens labels the weights of --npy (a sentence and --random label their own)")
    given = {name: value for name in RANDOM_DEFAULTS
             if (value := getattr(args, name)) is not None and value is not False}
    if given and not args.random:
        raise ValueError(f"{', '.join('--' + name for name in given)}: for --random only")
    if args.random:
        size = {**RANDOM_DEFAULTS, **given}
        return random_weights(size["length"], size["heads"], size["layers"], seed=size["seed"], causal=size["causal"])
    if args.npy is not None:
        weights = _load_npy(args.npy)
        tokens = None if args.tokens is None else args.tokens.split()
        return weights, tokens
    from .models import MiniLM

    model = MiniLM.load()
    tokens, weights = model.attention_map(args.sentence)
    if len(tokens) >= model.max_length:
        print(f"qkv viz: {len(tokens)} tokens, the model's limit: a longer sentence is cut there", file=sys.stderr)
    return weights, tokens


def random_weights(length=10, heads=4, layers=2, *, seed=0, causal=False, dim=16):
    """Weights (layers, heads, length, length) of random queries and keys, and labels t0, t1, ..."""
    from .api import attention_weights
    from .masks import causal as causal_mask

    for name, value in (("length", length), ("heads", heads), ("layers", layers)):
        inputs.check_positive_int(name, value)
    inputs.check_nonnegative_int("seed", seed)
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((layers, heads, length, dim)) for _ in range(2))
    weights = attention_weights(q, k, causal_mask() if causal else None, scale=2 / math.sqrt(dim))
    return weights, [f"t{i}" for i in range(length)]


def run(args) -> int:
    """Carry out ``qkv viz`` for parsed arguments; prints what it drew. Returns the exit code."""
    try:
        if args.quiet and not (args.png or args.html):
            raise ValueError("nothing to draw: --quiet leaves out the terminal heatmap, and neither --png nor "
                             "--html is given")
        if args.png:
            _figure_class()  # a missing matplotlib fails the command before it draws anything
        weights, tokens = load_weights(args)
        maps = as_maps(weights, tokens)
        _check_index("layer", args.layer, maps.layers, "layers", optional=True)  # whatever is drawn
        _check_index("head", args.head, maps.heads, "heads", optional=True)
        if not args.quiet:
            print(terminal_heatmap(maps, layer=0 if args.layer is None else args.layer, head=args.head))
        if args.png:
            heatmap_grid(maps, layer=args.layer, path=args.png)
            print(f"wrote {args.png}")
        if args.html:
            head_view_html(maps, layer=0 if args.layer is None else args.layer, path=args.html)
            print(f"wrote {args.html}")
    except BrokenPipeError:
        raise  # the reader left: the qkv command ends quietly
    except (ValueError, TypeError, ImportError, OSError) as error:
        print(f"qkv viz: {error}", file=sys.stderr)
        return 2
    except MemoryError:
        print("qkv viz: not enough memory for these weights (layers x heads x Lq x Lk); draw fewer or shorter",
              file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    """``python -m qkv.viz ...``: the same as ``qkv viz ...``."""
    from .cli import main as qkv_main

    return qkv_main(["viz", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
