"""qkv.distributed: ring attention across processes against single-process qkv.attention.

The ranks are real processes on this machine (gloo backend, file rendezvous in a
temporary folder). The parent writes the cases and full-sequence inputs, each rank runs
``ring_attention`` on its shards (forward and backward) and writes its results, and the
parent unshards them and compares with ``qkv.attention`` on the whole sequence:
float64 to round-off, float32 within the rule of DESIGN.md. A rank that fails or runs
past the deadline makes the test fail with its output, never hang.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import qkv  # noqa: E402
from qkv import distributed as qd  # noqa: E402
from qkv._processes import RanksFailed  # noqa: E402
from qkv._processes import run_ranks as launch  # noqa: E402

from helpers import ATOL, max_err, reference_grads, to64  # noqa: E402

TESTS = Path(__file__).resolve().parent
RUN_TIMEOUT = 120.0  # seconds for a whole multi-process run
GROUP_TIMEOUT = 60  # seconds torch.distributed waits for a peer
F64 = 1e-10  # float64 round-off allowed (merging blocks reorders the sums)


# ======================================================================================
# The multi-process harness
# ======================================================================================
WORKER = ("import sys; sys.path.insert(0, sys.argv[1]); import test_distributed as t; "
          "t.worker_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])")


def run_ranks(world: int, cases: list[dict], folder: Path, timeout: float = RUN_TIMEOUT) -> list[list[dict]]:
    """Run `cases` on `world` processes; returns results[rank][case] (RanksFailed on a failure or hang)."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(cases, folder / "cases.pt")
    env = dict(os.environ, OMP_NUM_THREADS="1", QKV_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    commands = [[sys.executable, "-c", WORKER, str(TESTS), str(rank), str(world), str(folder)] for rank in range(world)]
    launch(commands, folder, timeout, env)
    return [torch.load(folder / f"result{rank}.pt") for rank in range(world)]


def worker_main(rank: int, world: int, folder: str) -> None:
    """One process: join the world, run every case, write result{rank}.pt.

    A case with "ranks" runs on the process group of those (global) ranks; the
    processes outside it record None for that case.
    """
    from datetime import timedelta

    torch.set_num_threads(1)
    folder = Path(folder)
    dist.init_process_group("gloo", init_method=f"file://{folder / 'rendezvous'}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=GROUP_TIMEOUT))
    try:
        cases = torch.load(folder / "cases.pt")
        groups = {}  # every process creates every group, in the same order
        for case in cases:
            ranks = tuple(case.get("ranks") or range(world))
            if ranks not in groups:
                groups[ranks] = None if len(ranks) == world else dist.new_group(list(ranks))
        results = []
        for case in cases:
            ranks = tuple(case.get("ranks") or range(world))
            inside = rank in ranks
            results.append(run_case(case, ranks.index(rank), len(ranks), groups[ranks]) if inside else None)
    finally:
        dist.destroy_process_group()
    torch.save(results, folder / f"result{rank}.pt")


def run_case(case: dict, rank: int, world: int, group=None) -> dict:
    """This rank's part of one case: its shards through ring_attention, forward and backward."""
    if case.get("crash_rank") == rank:
        raise RuntimeError("deliberate failure on this rank")
    if case.get("hang_rank") == rank:
        time.sleep(3600)
    layout = case["layout"]
    local = {name: qd.shard(case[name], rank, world, layout, dim=-1 if name == "dlse" else -2)
             for name in ("q", "k", "v", "dout", "dlse")}
    if "local_q" in case:  # a rank that passes shards unlike the others'
        local["q"] = case["local_q"][rank]
    for name, per_rank in case.get("local", {}).items():  # q, k and v of each rank's own making
        local[name] = per_rank[rank]
    grad = rank in case.get("grad_ranks", range(world))
    q, k, v = (local[n].clone().requires_grad_(grad) for n in ("q", "k", "v"))
    stats = qd.RingStats()
    try:
        out, lse = qd.ring_attention(q, k, v, make_mask(case), layout=layout, group=group, return_lse=True,
                                     stats=stats)
    except (TypeError, ValueError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    forward = (stats.bytes_sent, stats.blocks_computed, stats.blocks_skipped)
    ((out * local["dout"]).sum() + (torch.where(lse.isinf(), 0, lse) * local["dlse"]).sum()).backward()
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "forward": forward, "bytes_total": stats.bytes_sent}


def make_mask(case: dict):
    kind = case["mask"]
    causal = qkv.causal(case.get("align", "bottom_right"))
    padding = qkv.padding(case["kv_lengths"], case.get("q_lengths")) if "padding" in kind else None
    return {"none": None, "causal": causal, "padding": padding,
            "causal_padding": padding if padding is None else causal & padding}[kind]


# ======================================================================================
# Cases and their single-process answers
# ======================================================================================
def make_case(mask="none", layout="contiguous", dtype="float64", lead=(2,), hq=4, hkv=2, lq=48, lk=None,
              d=8, dv=None, seed=0, **extra) -> dict:
    """Full-sequence inputs: q (*lead, hq, lq, d), k (*lead, hkv, lk, d), v (*lead, hkv, lk, dv)."""
    lk, dv = lk or lq, dv or d
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dt)  # noqa: E731
    batch = math.prod(lead)
    case = dict(mask=mask, layout=layout, dtype=dtype, q=rand(*lead, hq, lq, d), k=rand(*lead, hkv, lk, d),
                v=rand(*lead, hkv, lk, dv), dout=rand(*lead, hq, lq, dv), dlse=rand(*lead, hq, lq))
    if "padding" in mask:
        case["kv_lengths"] = [lk - 5 - 7 * i for i in range(batch)]
        case["q_lengths"] = [lq - 3 * i for i in range(batch)]
    case.update(extra)
    return case


def single_process(case: dict, backend: str = "torch", dtype: str = "float64") -> dict:
    """qkv.attention on the whole sequence (with autograd) in `dtype`: out, lse, dq, dk, dv."""
    dt = getattr(torch, dtype)
    q, k, v = (case[n].to(dt).requires_grad_(backend != "reference") for n in ("q", "k", "v"))
    out, lse = qkv.attention(q, k, v, make_mask(case), backend=backend, return_lse=True)
    if backend == "reference":
        return {"out": out, "lse": lse}
    dlse = case["dlse"].to(lse.dtype)
    ((out * case["dout"].to(dt)).sum() + (torch.where(lse.isinf(), 0, lse) * dlse).sum()).backward()
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def oracle(case: dict) -> dict:
    """out, lse, dq, dk, dv of the whole sequence from the float64 reference (the oracle)."""
    q, k, v = (to64(case[n]) for n in ("q", "k", "v"))
    mask = make_mask(case)
    out, lse = qkv.attention(q, k, v, mask, backend="reference", return_lse=True)
    dlse = np.where(np.isinf(lse), 0, to64(case["dlse"]))
    dout = to64(case["dout"])  # the backward takes them as 4-D (B, H, L, ...), as it made them
    grads = reference_grads([q, k, v], dout.reshape(-1, *out.shape[-3:]), dlse.reshape(-1, *lse.shape[-2:]),
                            dict(mask=mask))
    named = {"out": out, "lse": lse} | {n: g.reshape(x.shape) for n, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v))}
    return {name: torch.from_numpy(np.ascontiguousarray(x)) for name, x in named.items()}


def gathered(results: list[list[dict]], index: int, case: dict) -> dict:
    """Case `index` from the ranks that ran it, unsharded back to the whole sequence."""
    per_rank = [r[index] for r in results if r[index] is not None]
    if "error" in per_rank[0]:
        return per_rank[0]
    return {name: qd.unshard([r[name] for r in per_rank], case["layout"], dim=-1 if name == "lse" else -2)
            for name in ("out", "lse", "dq", "dk", "dv")}


def check_case(case: dict, got: dict) -> None:
    """The rank results against the float64 oracle: float64 to round-off, else the rule."""
    label = f"{case['mask']} / {case['layout']} / {case['dtype']}"
    assert "error" not in got, f"{label}: {got['error']}"
    want = oracle(case)
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert torch.isfinite(got[name][~got[name].isinf()]).all(), f"{label}: NaN in {name}"
    if case["dtype"] == "float64":
        for name in ("out", "lse", "dq", "dk", "dv"):
            err = max_err(got[name], want[name])
            assert err <= F64, f"{label}: {name} differs from single-process attention by {err:.2e}"
        return
    # float32: err(ring) <= 2 * err(single process in float32) + atol; output against the reference backend
    ref32 = single_process(case, backend="reference", dtype=case["dtype"])
    same32 = single_process(case, backend="torch", dtype=case["dtype"])
    for name, ref in (("out", ref32), ("lse", ref32), ("dq", same32), ("dk", same32), ("dv", same32)):
        err, ref_err = max_err(got[name], want[name]), max_err(ref[name], want[name])
        bound = 2 * ref_err + ATOL[case["dtype"]]
        assert err <= bound, f"{label}: {name} error {err:.2e} > 2 * {ref_err:.2e} + {ATOL[case['dtype']]:.0e}"


def check_all(cases: list[dict], results: list[list[dict]]) -> None:
    for i, case in enumerate(cases):
        check_case(case, gathered(results, i, case))


MASKS = ("none", "causal", "padding", "causal_padding")


def _cases_of_world_2():
    """On the group of processes 1 and 3 (its ranks are not the world's): every mask, layout, dtype."""
    cases = [make_case(m, layout, seed=i) for i, (m, layout) in
             enumerate((m, lay) for m in MASKS for lay in qd.LAYOUTS)]
    cases += [
        make_case("causal", "zigzag", align="top_left", seed=20),
        make_case("causal_padding", "zigzag", lq=24, lk=48, seed=21),  # Lq != Lk, bottom-right
        make_case("causal", "contiguous", lq=48, lk=24, align="top_left", seed=22),
        make_case("padding", "zigzag", lead=(2, 1), hq=2, hkv=2, dv=6, seed=23),  # two batch dims, Dv != D
        make_case("causal", "zigzag", lead=(), hq=3, hkv=3, seed=24),  # 3-D (H, L, D) inputs
        make_case("none", "contiguous", dtype="float32", seed=30),
        make_case("causal", "zigzag", dtype="float32", seed=31),
        make_case("causal_padding", "contiguous", dtype="float32", seed=32),
    ]
    return [dict(c, ranks=(1, 3)) for c in cases]


def _cases_of_world_3():
    cases = [
        make_case("causal", "zigzag", seed=40),
        make_case("causal_padding", "contiguous", seed=41),
        make_case("none", "zigzag", hq=6, hkv=2, seed=42),
        make_case("causal", "contiguous", lq=24, lk=48, seed=43),
        make_case("padding", "zigzag", dtype="float32", seed=44),
        make_case("none", "zigzag", dtype="bfloat16", lead=(1,), hq=4, hkv=4, lq=384, d=64, seed=45),
    ]
    return [dict(c, ranks=(0, 1, 2)) for c in cases]


def _cases_of_world_4():
    return [
        make_case("causal", "zigzag", seed=50),
        make_case("causal", "contiguous", seed=51),
        make_case("padding", "contiguous", hq=2, hkv=1, seed=52),
        make_case("causal_padding", "zigzag", dtype="float32", seed=53),
        make_case("causal", "zigzag", dtype="bfloat16", lq=256, seed=54),
    ]


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    """One run of four processes for the worlds of 2, 3 and 4 ranks (process start-up is the slow part)."""
    parts = {2: _cases_of_world_2(), 3: _cases_of_world_3(), 4: _cases_of_world_4()}
    cases = [c for world in (2, 3, 4) for c in parts[world]]
    results = run_ranks(4, cases, tmp_path_factory.mktemp("ring"))
    out, start = {}, 0
    for world in (2, 3, 4):
        n = len(parts[world])
        out[world] = (parts[world], [r[start:start + n] for r in results])
        start += n
    return out


# ======================================================================================
# Multi-process runs
# ======================================================================================
def test_world_2_every_mask_layout_and_dtype(shared_run):
    cases, results = shared_run[2]
    check_all(cases, results)
    ranks = [results[p] for p in cases[0]["ranks"]]
    # every byte sent in the forward is one K/V shard per step: (P - 1) steps
    kv_bytes = (cases[0]["k"].numel() + cases[0]["v"].numel()) // 2 * 8
    assert all(r[0]["forward"][0] == kv_bytes for r in ranks)
    # backward: K/V travel once more, dK/dV travel P steps back to their owner
    assert all(r[0]["bytes_total"] == kv_bytes + kv_bytes + 2 * kv_bytes for r in ranks)
    # blocks count (query chunk, key chunk) pairs, also where one call computes a whole shard
    unmasked_zigzag = qd.LAYOUTS.index("zigzag")  # the cases run masks (none first) by layouts
    assert cases[unmasked_zigzag]["mask"] == "none" and cases[unmasked_zigzag]["layout"] == "zigzag"
    assert all(r[unmasked_zigzag]["forward"][1:] == (2 * 2 * 2, 0) for r in ranks)  # 2 steps of 2 x 2 chunks


def test_world_3(shared_run):
    cases, results = shared_run[3]
    check_all(cases, results)
    # bfloat16 blocks merged unrounded: the ring's output is as exact as one process's (rounding
    # each block's output before the merge had made its mean error 1.54x as large)
    case = cases[-1]
    want, single = oracle(case)["out"], qkv.attention(case["q"], case["k"], case["v"])
    mean_error = lambda out: (out.double() - want).abs().mean().item()  # noqa: E731
    assert mean_error(gathered(results, len(cases) - 1, case)["out"]) <= 1.05 * mean_error(single)


def test_world_4_zigzag_balances_causal_work(shared_run):
    cases, results = shared_run[4]
    check_all(cases, results)
    zigzag = [r[0]["forward"][1:] for r in results]  # (computed, skipped) blocks per rank
    contiguous = [r[1]["forward"][1:] for r in results]
    assert len({c for c, _ in zigzag}) == 1, f"zigzag causal work is unbalanced: {zigzag}"
    assert all(s > 0 for _, s in zigzag), zigzag
    assert [c for c, _ in contiguous] == [1, 2, 3, 4], contiguous  # rank r computes r + 1 blocks


def test_world_of_two_processes_and_ranks_that_disagree(tmp_path):
    """A world of exactly two processes (the default group); ranks with unlike shards all raise."""
    good = make_case("causal_padding", "zigzag", seed=60)
    q = good["q"]
    shorter = make_case("causal", "contiguous", seed=61, local_q=[q[..., :24, :], q[..., :22, :]])
    odd = make_case("causal", "zigzag", seed=62,
                    local_q=[qd.shard(q, 0, 2, "zigzag"), qd.shard(q, 1, 2, "zigzag")[..., :23, :]])
    grad_on_one = make_case("none", "contiguous", seed=64, grad_ranks=[0])  # only rank 0 records autograd
    after = make_case("none", "contiguous", dtype="float32", seed=63)  # the group still works after errors
    meta = make_case("none", "contiguous", seed=65)
    meta["local"] = {name: [qd.shard(meta[name], 0, 2, "contiguous"), qd.shard(meta[name], 1, 2, "contiguous").to("meta")]
                     for name in ("q", "k", "v")}
    sparse = make_case("none", "contiguous", seed=66)
    sparse["local_q"] = [qd.shard(sparse["q"], r, 2, "contiguous") for r in range(2)]
    sparse["local_q"][0] = sparse["local_q"][0].to_sparse()
    dims = make_case("none", "contiguous", lead=(1,), hq=2, hkv=2, seed=67)  # rank 1 passes (H, L, D), rank 0 (1, H, L, D)
    dims["local"] = {name: [qd.shard(dims[name], r, 2, "contiguous")[(0,) * r] for r in range(2)]
                     for name in ("q", "k", "v")}
    results = run_ranks(2, [good, shorter, odd, grad_on_one, meta, sparse, dims, after], tmp_path)
    check_case(good, gathered(results, 0, good))
    assert all("disagree" in r[1]["error"] and "Lq/P per rank [24, 22]" in r[1]["error"] for r in results)
    assert "must be divisible by 2" in results[1][2]["error"]
    assert "rank(s) [1] of the group rejected" in results[0][2]["error"]
    assert all("needs grad per rank [True, False]" in r[3]["error"] for r in results)
    assert "q is on the meta device, which holds no values to attend over" in results[1][4]["error"]
    assert "q must be a dense (strided) tensor, got layout torch.sparse_coo" in results[0][5]["error"]
    assert "rank(s) [1] of the group rejected" in results[0][4]["error"]
    assert "rank(s) [0] of the group rejected" in results[1][5]["error"]
    assert all("batch dims (hash) per rank" in r[6]["error"] for r in results), [r[6] for r in results]
    check_case(after, gathered(results, 7, after))


def test_a_failing_rank_fails_the_run_with_its_message(tmp_path):
    case = make_case("causal", "contiguous", crash_rank=1)
    with pytest.raises(RanksFailed, match=r"rank\(s\) \[(0, )?1\] of 2 failed") as failure:
        run_ranks(2, [case], tmp_path)
    rank1 = str(failure.value).split("--- rank 1 output")[1].split("--- rank 0 output")[0]
    assert "RuntimeError: deliberate failure on this rank" in rank1


def test_a_hanging_rank_is_killed_and_reported(tmp_path):
    case = make_case("causal", "contiguous", hang_rank=1)
    with pytest.raises(RanksFailed, match=r"rank\(s\) \[0, 1\] of 2 did not finish within 6 s and were killed"):
        run_ranks(2, [case], tmp_path, timeout=6)


# ======================================================================================
# One process: a world of 1, shard / unshard, errors
# ======================================================================================
@pytest.fixture
def world_of_one(tmp_path):
    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def ring_of_one(case: dict) -> dict:
    """The case through ring_attention on this process alone (zigzag: two chunks a side), forward and backward."""
    q, k, v = (case[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    out, lse = qd.ring_attention(q, k, v, make_mask(case), layout="zigzag", return_lse=True)
    ((out * case["dout"]).sum() + (torch.where(lse.isinf(), 0, lse) * case["dlse"]).sum()).backward()
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("mask", MASKS)
def test_world_of_one_is_plain_attention(world_of_one, mask):
    case = make_case(mask, "zigzag", seed=70)
    check_case(case, ring_of_one(case))


@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
@pytest.mark.parametrize("mask", ["causal", "causal_padding"])
def test_causal_diagonals_at_every_block_border(world_of_one, align, mask):
    """Chunks of 1-4 rows a side: the causal diagonal enters, leaves or grazes every block,
    and padded query rows lie before, inside and after the rows a block drops."""
    for lq in (2, 4, 6, 8):
        for lk in (2, 4, 6, 8):
            case = make_case(mask, "zigzag", hq=2, hkv=2, lq=lq, lk=lk, align=align, seed=80 + lq + 10 * lk,
                             kv_lengths=[lk, max(1, lk - 3)], q_lengths=[lq, max(1, lq - 5)])
            check_case(case, ring_of_one(case))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_backward_in_torch_ops_where_no_fused_backward(world_of_one, monkeypatch, dtype):
    """The block gradients without a backend's run_backward (float64 always takes this path)."""
    monkeypatch.setattr(qd, "_kernel_block_grads", lambda *args: None)
    case = make_case("causal_padding", "zigzag", dtype=dtype, seed=72)
    monkeypatch.setattr(qd, "BACKWARD_PIECE_ELEMENTS", 2 * 4 * 24 * 5)  # pieces of 5 query rows
    check_case(case, ring_of_one(case))


def test_blocks_of_a_backend_without_run_forward(world_of_one, monkeypatch):
    """A backend that only has forward (triton) hands its blocks over in q's dtype."""
    from types import SimpleNamespace

    from qkv import dispatch

    choose, forwards = dispatch.choose, []

    def without_run_forward(inp, *args, **kwargs):
        chosen = choose(inp, *args, **kwargs).backend
        forward = lambda inp: forwards.append(inp) or chosen.forward(inp)  # noqa: E731
        return dispatch.Choice(SimpleNamespace(name=chosen.name, forward=forward,
                                               run_backward=getattr(chosen, "run_backward", None)))

    monkeypatch.setattr(dispatch, "choose", without_run_forward)
    case = make_case("causal_padding", "zigzag", seed=76)
    check_case(case, ring_of_one(case))
    assert forwards  # the blocks went through forward


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_block_outputs_reach_the_ring_unrounded(backend):
    """The ring merges blocks' outputs in float32: a bfloat16 forward hands them over in float32,
    and rounded they are the output anyone else gets."""
    from qkv import dispatch, inputs

    if dispatch.REGISTRY[backend].missing():
        pytest.skip(dispatch.REGISTRY[backend].missing())
    case = make_case("causal", dtype="bfloat16", lq=80, seed=74)
    inp = inputs.prepare(case["q"], case["k"], case["v"], qkv.causal())
    plain, plain_lse, plain_lo = dispatch.REGISTRY[backend].run_forward(inp, inp.q, inp.k, inp.v)
    wide, wide_lse, wide_lo = dispatch.REGISTRY[backend].run_forward(inp, inp.q, inp.k, inp.v, float32_out=True)
    assert plain.dtype == torch.bfloat16 and wide.dtype == torch.float32
    assert torch.equal(wide.to(torch.bfloat16), plain) and torch.equal(wide_lse, plain_lse)
    assert torch.equal(wide_lo, plain_lo)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_block_gradients_reach_the_ring_unrounded(backend):
    """The ring sums each block's gradients in float32: a bfloat16 backward hands them over in
    float32, and rounded they are the gradients the backward gives anyone else."""
    from qkv import dispatch, inputs

    if dispatch.REGISTRY[backend].missing():
        pytest.skip(dispatch.REGISTRY[backend].missing())
    case = make_case("causal", dtype="bfloat16", lq=80, seed=73)
    q, k, v, dout = (case[n] for n in ("q", "k", "v", "dout"))
    out, lse = qkv.attention(q, k, v, qkv.causal(), backend=backend, return_lse=True)
    inp = inputs.prepare(q, k, v, qkv.causal())
    run_backward = dispatch.REGISTRY[backend].run_backward
    plain = run_backward(inp, q, k, v, out, lse, dout, case["dlse"].float())
    wide = run_backward(inp, q, k, v, out, lse, dout, case["dlse"].float(), float32_grads=True)
    for name, p, w in zip(("dq", "dk", "dv"), plain, wide):
        assert p.dtype == torch.bfloat16 and w.dtype == torch.float32, name
        assert torch.equal(w.to(torch.bfloat16), p), name


def test_world_of_one_without_grad_and_custom_scale(world_of_one):
    case = make_case("causal", seed=71)
    out = qd.ring_attention(case["q"], case["k"], case["v"], qkv.causal(), scale=0.3)
    want = qkv.attention(case["q"], case["k"], case["v"], qkv.causal(), scale=0.3, backend="reference")
    assert out.grad_fn is None and max_err(out, want) <= F64


@pytest.mark.parametrize("layout", qd.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_unshard_round_trip(layout, world):
    x = torch.arange(2 * 3 * 24 * 5).reshape(2, 3, 24, 5)
    shards = [qd.shard(x, r, world, layout) for r in range(world)]
    assert all(s.shape == (2, 3, 24 // world, 5) and s.is_contiguous() for s in shards)
    assert torch.equal(qd.unshard(shards, layout), x)
    lse = np.arange(3 * 24).reshape(3, 24)  # NumPy too, along the last dim
    assert np.array_equal(qd.unshard([qd.shard(lse, r, world, layout, dim=-1) for r in range(world)], layout, -1), lse)
    for r, s in enumerate(shards):  # each shard holds the tokens `positions` names
        assert torch.equal(s, x[:, :, torch.from_numpy(qd.positions(r, world, 24, layout))])


def test_zigzag_deals_front_and_mirror_chunks():
    assert qd.positions(0, 2, 8, "zigzag").tolist() == [0, 1, 6, 7]
    assert qd.positions(1, 2, 8, "zigzag").tolist() == [2, 3, 4, 5]
    assert qd.positions(1, 2, 8, "contiguous").tolist() == [4, 5, 6, 7]


def test_disagreements_are_shown_as_values():
    """What _agree compares as integers reads back as the arguments the ranks passed."""
    shown = {name: qd._META_VALUES[name] for name in ("dtype", "layout", "scale", "needs grad", "causal alignment")}
    assert shown["dtype"](qkv.inputs.FLOAT_DTYPES.index("bfloat16")) == "bfloat16"
    assert shown["layout"](qd.LAYOUTS.index("zigzag")) == "zigzag"
    assert shown["scale"](qd._float_bits(0.125)) == 0.125 and shown["needs grad"](1) is True
    assert [shown["causal alignment"](c) for c in qd._MaskSpec(causal_align="top_left").code()[:1]] == ["top_left"]


@pytest.mark.parametrize("call, message", [
    (lambda: qd.shard(torch.zeros(1, 10, 4), 0, 3), r"x.shape\[-2\] = 10 must be divisible .* world 3 = 3"),
    (lambda: qd.shard(torch.zeros(1, 12, 4), 0, 3, "zigzag", dim=-1), r"x.shape\[-1\] = 4 must be divisible .* = 6"),
    (lambda: qd.shard(torch.zeros(1, 12, 4), 2, 2), r"rank must be an integer in \[0, world\) = \[0, 2\), got 2"),
    (lambda: qd.shard(torch.zeros(1, 12, 4), 0, 0), "world must be a positive integer"),
    (lambda: qd.shard(torch.zeros(1, 12, 4), 0, 2, "diagonal"), "layout must be one of"),
    (lambda: qd.shard(torch.zeros(1, 12, 4), 0, 2, dim=3), r"dim must be an integer in \[-3, 3\)"),
    (lambda: qd.unshard([torch.zeros(1, 6, 4), torch.zeros(1, 4, 4)]), "every shard must have the same shape"),
    (lambda: qd.unshard([torch.zeros(1, 3, 4)] * 2, "zigzag"), r"shape\[-2\] = 3\) must be divisible by 2"),
    (lambda: qd.unshard([]), "shards must be a non-empty list"),
    (lambda: qd.positions(0, 3, 8, "zigzag"), "length = 8 must be divisible .* = 6"),
    (lambda: qd.rank_chunks(3, 2, "zigzag"), r"rank must be an integer in \[0, world\) = \[0, 2\), got 3"),
    (lambda: qd.rank_chunks(-1, 2, "contiguous"), r"rank must be an integer in \[0, world\)"),
])
def test_shard_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("shards", [[np.zeros((2, 3)), torch.zeros(2, 3)],
                                    [torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 3)], [1, 2]])
def test_unshard_refuses_shards_of_mixed_kinds_or_dtypes(shards):
    with pytest.raises(TypeError, match="every shard must be an array of one kind and dtype"):
        qd.unshard(shards)


def test_ring_attention_errors_before_any_communication():
    q = k = v = torch.zeros(1, 2, 6, 4)
    with pytest.raises(ValueError, match=r"ring_attention supports mask=None, qkv.causal\(\).*got mask window"):
        qd.ring_attention(q, k, v, qkv.window(3))
    with pytest.raises(ValueError, match=r"ring_attention supports .*got mask .*an array of shape \(6, 6\)"):
        qd.ring_attention(q, k, v, torch.ones(6, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"got mask \(causal.*\| padding"):
        qd.ring_attention(q, k, v, qkv.causal() | qkv.padding([3]))
    with pytest.raises(ValueError, match=r"q's local length \(q.shape\[-2\] = 5\) must be divisible by 2"):
        qd.ring_attention(torch.zeros(1, 2, 5, 4), k, v, layout="zigzag")
    with pytest.raises(TypeError, match="ring_attention takes torch tensors"):
        qd.ring_attention(np.zeros((1, 2, 6, 4)), np.zeros((1, 2, 6, 4)), np.zeros((1, 2, 6, 4)))
    with pytest.raises(TypeError, match="share one dtype"):
        qd.ring_attention(q, k.double(), v)
    with pytest.raises(RuntimeError, match="init_process_group"):
        qd.ring_attention(q, k, v, qkv.causal() & qkv.padding([6]))


def test_without_torch_a_ring_call_gets_its_own_error():
    """It was told its torch lacked torch.distributed: the argument error came second."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "import numpy as np, qkv.distributed as qd\n"
            "qd.ring_attention(*[np.zeros((1, 2, 4, 8), np.float32)] * 3)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "TypeError: ring_attention takes torch tensors" in done.stderr, done.stderr


def test_padding_lengths_are_checked_against_the_global_length(world_of_one):
    q = k = v = torch.zeros(1, 2, 6, 4)
    with pytest.raises(ValueError, match="kv_lengths must be at most Lk = 6"):
        qd.ring_attention(q, k, v, qkv.padding([7]))


def test_benchmark_reports_time_memory_and_bytes():
    from qkv.bench_distributed import format_table, run_distributed_bench

    rows = run_distributed_bench(2, [256], repeat=1, heads=2, kv_heads=1, head_dim=8)
    (row,) = rows
    kv_bytes_per_rank = 2 * 1 * 128 * 8 * 4  # K and V: Hkv = 1, L/P = 128, D = 8, float32
    assert row["sent_mib_per_rank"] * 2**20 == kv_bytes_per_rank  # one ring step for 2 ranks
    assert row["blocks_per_rank"] == [5, 5] and row["skipped_per_rank"] == [3, 3]  # zigzag causal
    assert {"single_s", "ring_s", "rank_peak_mib"} <= set(row)  # times are reported, never asserted
    assert "sent MiB/rank" in format_table(rows, dict(row, layout="zigzag", mask="causal", dtype="float32",
                                                       batch=1, heads=2, kv_heads=1, head_dim=8, backward=False,
                                                       repeat=1))


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "1002"], "each length = 1002 must be divisible by the number of chunks of layout 'zigzag'"),
    (["--heads", "3", "--kv-heads", "2"], "heads = 3 must be a multiple of kv_heads = 2"),
    (["--repeat", "0"], "argument --repeat: must be a positive integer, got '0'"),
    (["--world", "0"], "argument --world: must be a positive integer, got '0'"),
])
def test_benchmark_arguments_are_checked_before_any_process_starts(monkeypatch, capsys, argv, message):
    from qkv import bench_distributed

    monkeypatch.setattr(bench_distributed, "_launch", lambda *a: pytest.fail("started processes"))
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(SystemExit) as exc:
        bench_distributed.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_benchmark_help_shows_every_options_default(capsys):
    from qkv import bench_distributed

    with pytest.raises(SystemExit):
        bench_distributed.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: [2048, 4096, 8192])", "(default: float32)", "(default: causal)",
                  "(default: zigzag)", "(the best is reported) (default: 3)"):
        assert shown in text


def test_benchmark_kv_heads_default_to_the_query_heads(monkeypatch):
    """--heads alone never fails on a --kv-heads the user did not set."""
    from qkv import bench_distributed

    asked = {}
    monkeypatch.setattr(bench_distributed, "run_distributed_bench", lambda world, lengths, **o: asked.update(o))
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert bench_distributed.main(["--heads", "2", "--lengths", "256"]) == 0
    assert asked["heads"] == asked["kv_heads"] == 2
    assert bench_distributed.with_defaults({"heads": 6}, [256])["kv_heads"] == 6
    assert bench_distributed.with_defaults({"heads": 6, "kv_heads": 3}, [256])["kv_heads"] == 3


def test_benchmark_options_are_checked_before_any_process_starts(monkeypatch):
    from qkv import bench_distributed

    monkeypatch.setattr(bench_distributed, "_launch", lambda *a: pytest.fail("started processes"))
    with pytest.raises(ValueError, match="repeat must be a positive integer"):
        bench_distributed.run_distributed_bench(2, [256], repeat=0)
    with pytest.raises(ValueError, match="dtype must be one of 'float32', 'float64', 'bfloat16', 'float16'"):
        bench_distributed.run_distributed_bench(2, [256], dtype="int32")


def test_what_ranks_compare_tells_any_two_masks_and_scales_apart():
    """The per-rank description compares padding lengths and the scale exactly (a weighted sum
    modulo 2**31 and the scale rounded to 1e-6 let unlike arguments through)."""
    from qkv.distributed import _float_bits, _MaskSpec

    def code(kv_lengths):
        return _MaskSpec("bottom_right", np.array(kv_lengths)).code()

    for a, b in (([2, 1], [0, 2]), ([3, 3], [5, 2]), ([0], [2**31])):
        assert code(a) != code(b)
    assert code([3, 3]) == code([3, 3])
    assert _float_bits(0.1) != _float_bits(0.1000004) and _float_bits(0.125) == _float_bits(1 / 8)


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc to find the process")
def test_a_rank_that_cannot_start_stops_the_ranks_already_running(tmp_path):
    marker = "987.654"  # a sleep no other process here runs

    def sleeping():
        return [p for p in Path("/proc").glob("[0-9]*") if _cmdline(p) == ["sleep", marker]]

    with pytest.raises(FileNotFoundError):
        launch([["sleep", marker], [str(tmp_path / "no-such-program")]], tmp_path, timeout=30, env=dict(os.environ))
    assert sleeping() == []


def _cmdline(proc: Path) -> list:
    try:
        return proc.joinpath("cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:  # the process ended meanwhile
        return []


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_large_scores_merge_and_backward_exactly(world_of_one, mask):
    """Blocks merge by lse + lse_lo in float64, and the backward gets the merged lse_lo. Merged
    by their float32 lse alone, the causal output was off by 1.9e-5 (bound 2.9e-6)."""
    case = make_case(mask, "zigzag", dtype="float32", d=16, seed=90)
    gen = torch.Generator().manual_seed(91)
    for name in ("q", "k"):  # integer entries, scale 1/4: scores exact in any summation order
        case[name] = torch.randint(-20, 21, case[name].shape, generator=gen).float()
    check_case(case, ring_of_one(case))
