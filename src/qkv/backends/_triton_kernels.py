"""Triton kernels of the triton backend: FlashAttention-2 forward, dK/dV and dQ.

Imported only when the backend runs (it needs triton). Scores live in log2 units
(scale * log2(e) folded into one multiply) so the softmax uses exp2; lse is stored in
natural log, with LSE_LO, what its float32 rounding lost (the units are converted in
float64, once per row, so the backward's probabilities do not lose |lse|·1e-7 to them).
Masks arrive as per-query key intervals lo <= j <= hi (causal, window,
padding, prefix-LM, sorted documents; a lone causal mask's are computed here from its
shift) and/or segment ids compared inline (unsorted documents). Each query block walks its
key range in three phases: masked edge tiles, unmasked FULL tiles, masked edge tiles; tiles
outside the range are never visited.
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    """a @ b accumulated in float32. DOT: "ieee" keeps float32 operands in float32 (no tf32);
    "widen" multiplies in float32 (exact for bfloat16 products; the interpreter cannot
    multiply bfloat16); anything else uses the operands' tensor-core path."""
    if DOT == "ieee":
        return tl.dot(a, b, input_precision="ieee")
    elif DOT == "widen":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _ds_dot(ds, b, DOT: tl.constexpr):
    """ds (float32 dS) @ b, accumulated in float32: in b's dtype, except float16's, whose range
    ends at 65504, where dS passes it with large upstream gradients (loss scaling) while dQ and
    dK stay small; there the product is taken in float32."""
    if b.dtype == tl.float16:
        return tl.dot(ds, b.to(tl.float32))
    return _dot(ds.to(b.dtype), b, DOT)


@triton.jit
def _tanh(x):
    """float32 tanh (Cephes tanhf): a polynomial near 0, exp beyond; libdevice is not portable
    to the interpreter."""
    ax = tl.abs(x)
    z = x * x
    small = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z
              + 1.33314422036e-1) * z - 3.33332819422e-1) * z * x + x
    large = 1.0 - 2.0 / (tl.exp(2.0 * ax) + 1.0)
    return tl.where(ax < 0.625, small, tl.where(x < 0, -large, large))


@triton.jit
def _scores(q, kT, offs_m, offs_n, lo, hi, qid, kid, slope, Lq, Lk, sm_scale, softcap,
            DOT: tl.constexpr, MASKED: tl.constexpr, HAS_INTERVAL: tl.constexpr, HAS_IDS: tl.constexpr,
            HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Modified scores of a tile (BM, BN) in log2 units, -inf where masked, and the softcap's
    tanh (for its derivative; the raw dot product when there is no softcap)."""
    qk = _dot(q, kT, DOT)
    if HAS_SOFTCAP or HAS_ALIBI:
        s = qk * sm_scale
        if HAS_ALIBI:
            s -= slope * tl.abs(offs_m[:, None] + (Lk - Lq) - offs_n[None, :]).to(tl.float32)
        if HAS_SOFTCAP:
            t = _tanh(s / softcap)
            s = t * softcap
        else:
            t = qk
        s = s * LOG2E
    else:
        t = qk
        s = qk * (sm_scale * LOG2E)
    if MASKED:
        allowed = offs_n[None, :] < Lk
        if HAS_INTERVAL:
            allowed = allowed & (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] <= hi[:, None])
        if HAS_IDS:
            allowed = allowed & (qid[:, None] == kid[None, :])
        s = tl.where(allowed, s, float("-inf"))
    return s, t


@triton.jit
def _key_range(lo, hi, row_ok, Lk, BLOCK_N: tl.constexpr, HAS_INTERVAL: tl.constexpr, HAS_IDS: tl.constexpr):
    """Key tiles a query block visits: [start, full_start) masked, [full_start, full_end) FULL,
    [full_end, end) masked; every bound but `end` is a multiple of BLOCK_N."""
    start = 0
    end = Lk
    full_start = 0
    full_end = (Lk // BLOCK_N) * BLOCK_N
    if HAS_INTERVAL:
        live = row_ok & (lo <= hi)
        start = (tl.maximum(tl.min(tl.where(live, lo, Lk), 0), 0) // BLOCK_N) * BLOCK_N
        end = tl.minimum(tl.max(tl.where(live, hi, -1), 0) + 1, Lk)
        # keys [every_row_lo, every_row_hi] are allowed for every row of the block (bounds are
        # clipped to [-1, Lk], so hi may be Lk: one past the last key)
        every_row_lo = tl.max(tl.where(row_ok, lo, 0), 0)
        every_row_hi = tl.minimum(tl.min(tl.where(row_ok, hi, Lk - 1), 0), Lk - 1)
        full_start = tl.maximum(tl.cdiv(every_row_lo, BLOCK_N) * BLOCK_N, start)
        full_end = tl.maximum(((every_row_hi + 1) // BLOCK_N) * BLOCK_N, full_start)
    if HAS_IDS:
        full_start = end
        full_end = end
    return start, full_start, full_end, end


@triton.jit
def _load_rows(ptr, offs, n, other):
    return tl.load(ptr + offs, mask=offs < n, other=other)


@triton.jit
def _load_tile(ptr, offs_r, offs_c, stride_r, stride_c, n_r, n_c):
    """ptr[r, c] for rows offs_r < n_r and columns offs_c < n_c (zeros elsewhere). Offsets are
    64-bit on both axes: one head of a (B, L, H, D) layout can span more than 2^31 elements,
    and keys lie along columns in Kᵀ tiles."""
    mask = (offs_r[:, None] < n_r) & (offs_c[None, :] < n_c)
    return tl.load(ptr + _offsets(offs_r, offs_c, stride_r, stride_c), mask=mask, other=0.0)


@triton.jit
def _store_tile(ptr, value, offs_r, offs_c, stride_r, stride_c, n_r, n_c):
    mask = (offs_r[:, None] < n_r) & (offs_c[None, :] < n_c)
    tl.store(ptr + _offsets(offs_r, offs_c, stride_r, stride_c), value, mask=mask)


@triton.jit
def _offsets(offs_r, offs_c, stride_r, stride_c):
    """Element offsets (R, C) of a tile, in int64."""
    return offs_r[:, None].to(tl.int64) * stride_r + offs_c[None, :].to(tl.int64) * stride_c


@triton.jit
def _query_side(LO, HI, QID, SLOPES, b, h, offs_m, Lq, Lk, causal_shift, s_interval_b, s_qid_b,
                HAS_INTERVAL: tl.constexpr, HAS_CAUSAL: tl.constexpr, HAS_IDS: tl.constexpr,
                HAS_ALIBI: tl.constexpr):
    """A query block's key bounds lo/hi (computed for a lone causal mask, loaded for others),
    segment ids and ALiBi slope (placeholders when absent). Bounds are clipped to [-1, Lk]."""
    if HAS_CAUSAL:
        lo = offs_m * 0 - 1
        hi = tl.minimum(tl.maximum(offs_m + causal_shift, -1), Lk)
    else:
        lo = _load_rows(LO + b * s_interval_b, offs_m, Lq, 0) if HAS_INTERVAL else offs_m
        hi = _load_rows(HI + b * s_interval_b, offs_m, Lq, -1) if HAS_INTERVAL else offs_m
    qid = _load_rows(QID + b * s_qid_b, offs_m, Lq, -2) if HAS_IDS else offs_m
    slope = tl.load(SLOPES + h) if HAS_ALIBI else 0.0
    return lo, hi, qid, slope


@triton.jit
def _key_side(k_ptr, kid_ptr, n0, skn, skd, Lk, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              HAS_IDS: tl.constexpr):
    """A key tile from n0: its indices, Kᵀ (BD, BN) and segment ids."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kT = _load_tile(k_ptr, tl.arange(0, BLOCK_D), offs_n, skd, skn, D, Lk)
    kid = _load_rows(kid_ptr, offs_n, Lk, -1) if HAS_IDS else offs_n
    return offs_n, kT, kid


@triton.jit
def _phase(phase: tl.constexpr, start, full_start, full_end, end):
    """Key range [from, to) of phase 0 (masked edge), 1 (FULL tiles) or 2 (masked edge)."""
    if phase == 0:
        return start, tl.minimum(full_start, end)
    elif phase == 1:
        return full_start, full_end
    else:
        return full_end, end


# ---- forward ------------------------------------------------------------------------------
@triton.jit
def _forward_tiles(acc, m_i, l_i, q, k_ptr, v_ptr, skn, skd, svn, svd, kid_ptr, start, end,
                   offs_m, lo, hi, qid, slope, Lq, Lk, sm_scale, softcap,
                   D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, DOT: tl.constexpr, MASKED: tl.constexpr,
                   HAS_INTERVAL: tl.constexpr, HAS_IDS: tl.constexpr, HAS_ALIBI: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr):
    offs_dv = tl.arange(0, BLOCK_DV)
    for n0 in range(start, end, BLOCK_N):
        offs_n, kT, kid = _key_side(k_ptr, kid_ptr, n0, skn, skd, Lk, D, BLOCK_N, BLOCK_D, HAS_IDS)
        s, _ = _scores(q, kT, offs_m, offs_n, lo, hi, qid, kid, slope, Lq, Lk, sm_scale, softcap,
                       DOT, MASKED, HAS_INTERVAL, HAS_IDS, HAS_ALIBI, HAS_SOFTCAP)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a whole tile at -inf: masked, or alibi's slope·distance past float32's range
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new) if MASKED or HAS_ALIBI else m_new
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_ptr, offs_n, offs_dv, svn, svd, Lk, DV)  # (BN, BDV)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def attention_forward(Q, K, V, O, LSE, LSE_LO, LO, HI, QID, KID, SLOPES,
                      sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
                      s_interval_b, s_qid_b, s_kid_b,
                      Hq, Lq, Lk, sm_scale, softcap, causal_shift,
                      D: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                      DOT: tl.constexpr, HAS_INTERVAL: tl.constexpr, HAS_CAUSAL: tl.constexpr, HAS_IDS: tl.constexpr,
                      HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Program (query block, query head, batch row): O (B, Hq, Lq, Dv), LSE and LSE_LO (B, Hq, Lq) float32."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)  # 64-bit: head and batch offsets can pass 2^31
    b = tl.program_id(2).to(tl.int64)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < Lq
    q = _load_tile(Q + b * sqb + h * sqh, offs_m, tl.arange(0, BLOCK_D), sqm, sqd, Lq, D)  # (BM, BD)
    lo, hi, qid, slope = _query_side(LO, HI, QID, SLOPES, b, h, offs_m, Lq, Lk, causal_shift, s_interval_b,
                                     s_qid_b, HAS_INTERVAL, HAS_CAUSAL, HAS_IDS, HAS_ALIBI)
    start, full_start, full_end, end = _key_range(lo, hi, row_ok, Lk, BLOCK_N, HAS_INTERVAL, HAS_IDS)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    k_ptr = K + b * skb + hk * skh
    v_ptr = V + b * svb + hk * svh
    kid_ptr = KID + b * s_kid_b
    for phase in tl.static_range(3):
        lo_n, hi_n = _phase(phase, start, full_start, full_end, end)
        acc, m_i, l_i = _forward_tiles(acc, m_i, l_i, q, k_ptr, v_ptr, skn, skd, svn, svd, kid_ptr, lo_n, hi_n,
                                       offs_m, lo, hi, qid, slope, Lq, Lk, sm_scale, softcap,
                                       D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, DOT, phase != 1,
                                       HAS_INTERVAL, HAS_IDS, HAS_ALIBI, HAS_SOFTCAP)

    empty = l_i == 0.0  # no allowed key: output 0, lse -inf
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse64 = (m_i.to(tl.float64) + tl.log2(l_safe).to(tl.float64)) * LN2
    lse = lse64.to(tl.float32)
    lse_lo = (lse64 - lse.to(tl.float64)).to(tl.float32)
    _store_tile(O + b * sob + h * soh, out.to(O.dtype.element_ty), offs_m, tl.arange(0, BLOCK_DV), som, sod,
                Lq, DV)
    row = (b * Hq + h) * Lq + offs_m
    tl.store(LSE + row, tl.where(empty, float("-inf"), lse), mask=row_ok)
    tl.store(LSE_LO + row, tl.where(empty, 0.0, lse_lo), mask=row_ok)


# ---- backward: dQ per query block, dK/dV per key block (no atomics: deterministic) -------
@triton.jit
def _row_lse2(lse_ptr, lse_lo_ptr, offs_m, Lq):
    """(lse2, lse2_lo): lse + lse_lo in log2 units, as a float32 and what its rounding lost;
    +inf and 0 for rows with no key (and rows past Lq) so their p is 0."""
    lse = tl.load(lse_ptr + offs_m, mask=offs_m < Lq, other=float("-inf"))
    lse_lo = tl.load(lse_lo_ptr + offs_m, mask=offs_m < Lq, other=0.0)
    lse2_64 = (lse.to(tl.float64) + lse_lo.to(tl.float64)) * LOG2E
    lse2 = lse2_64.to(tl.float32)
    lse2_lo = (lse2_64 - lse2.to(tl.float64)).to(tl.float32)
    empty = lse == float("-inf")
    return tl.where(empty, float("inf"), lse2), tl.where(empty, 0.0, lse2_lo)


@triton.jit
def _dq_tiles(dq, q, do, lse2, lse2_lo, delta, k_ptr, v_ptr, skn, skd, svn, svd, kid_ptr, start, end,
              offs_m, lo, hi, qid, slope, Lq, Lk, sm_scale, softcap,
              D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr, DOT: tl.constexpr, MASKED: tl.constexpr,
              HAS_INTERVAL: tl.constexpr, HAS_IDS: tl.constexpr, HAS_ALIBI: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr):
    offs_dv = tl.arange(0, BLOCK_DV)
    for n0 in range(start, end, BLOCK_N):
        offs_n, kT, kid = _key_side(k_ptr, kid_ptr, n0, skn, skd, Lk, D, BLOCK_N, BLOCK_D, HAS_IDS)
        vT = _load_tile(v_ptr, offs_dv, offs_n, svd, svn, DV, Lk)  # (BDV, BN)
        s, t = _scores(q, kT, offs_m, offs_n, lo, hi, qid, kid, slope, Lq, Lk, sm_scale, softcap,
                       DOT, MASKED, HAS_INTERVAL, HAS_IDS, HAS_ALIBI, HAS_SOFTCAP)
        p = tl.math.exp2(s - lse2[:, None] - lse2_lo[:, None])  # (BM, BN)
        ds = p * (_dot(do, vT, DOT) - delta[:, None])  # d loss / d modified score
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += _ds_dot(ds, tl.trans(kT), DOT)
    return dq


@triton.jit
def attention_backward_dq(Q, K, V, DO, LSE, LSE_LO, DELTA, GRAD_Q, LO, HI, QID, KID, SLOPES,
                          sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                          sdob, sdoh, sdom, sdod, sdqb, sdqh, sdqm, sdqd,
                          s_interval_b, s_qid_b, s_kid_b,
                          Hq, Lq, Lk, sm_scale, softcap, causal_shift,
                          D: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_DV: tl.constexpr, DOT: tl.constexpr, HAS_INTERVAL: tl.constexpr,
                          HAS_CAUSAL: tl.constexpr, HAS_IDS: tl.constexpr, HAS_ALIBI: tl.constexpr,
                          HAS_SOFTCAP: tl.constexpr):
    """Program (query block, query head, batch row): DQ, walking the same key range as the forward."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)  # 64-bit: head and batch offsets can pass 2^31
    b = tl.program_id(2).to(tl.int64)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Lq
    q = _load_tile(Q + b * sqb + h * sqh, offs_m, offs_d, sqm, sqd, Lq, D)  # (BM, BD)
    do = _load_tile(DO + b * sdob + h * sdoh, offs_m, tl.arange(0, BLOCK_DV), sdom, sdod, Lq, DV)  # (BM, BDV)
    row = (b * Hq + h) * Lq
    lse2, lse2_lo = _row_lse2(LSE + row, LSE_LO + row, offs_m, Lq)
    delta = _load_rows(DELTA + row, offs_m, Lq, 0.0)
    lo, hi, qid, slope = _query_side(LO, HI, QID, SLOPES, b, h, offs_m, Lq, Lk, causal_shift, s_interval_b,
                                     s_qid_b, HAS_INTERVAL, HAS_CAUSAL, HAS_IDS, HAS_ALIBI)
    start, full_start, full_end, end = _key_range(lo, hi, row_ok, Lk, BLOCK_N, HAS_INTERVAL, HAS_IDS)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_ptr = K + b * skb + hk * skh
    v_ptr = V + b * svb + hk * svh
    kid_ptr = KID + b * s_kid_b
    for phase in tl.static_range(3):
        lo_n, hi_n = _phase(phase, start, full_start, full_end, end)
        dq = _dq_tiles(dq, q, do, lse2, lse2_lo, delta, k_ptr, v_ptr, skn, skd, svn, svd, kid_ptr, lo_n, hi_n,
                       offs_m, lo, hi, qid, slope, Lq, Lk, sm_scale, softcap,
                       D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, DOT, phase != 1,
                       HAS_INTERVAL, HAS_IDS, HAS_ALIBI, HAS_SOFTCAP)
    _store_tile(GRAD_Q + b * sdqb + h * sdqh, (dq * sm_scale).to(GRAD_Q.dtype.element_ty), offs_m, offs_d, sdqm, sdqd,
                Lq, D)


@triton.jit
def _dkdv_tile(dk, dv, kT, vT, q, do, lse2, lse2_lo, delta, offs_m, offs_n, lo, hi, qid, kid, slope, Lq, Lk,
               sm_scale, softcap, DOT: tl.constexpr, MASKED: tl.constexpr, HAS_INTERVAL: tl.constexpr,
               HAS_IDS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    s, t = _scores(q, kT, offs_m, offs_n, lo, hi, qid, kid, slope, Lq, Lk, sm_scale, softcap,
                   DOT, MASKED, HAS_INTERVAL, HAS_IDS, HAS_ALIBI, HAS_SOFTCAP)
    p = tl.math.exp2(s - lse2[:, None] - lse2_lo[:, None])  # (BM, BN)
    dv += _dot(tl.trans(p.to(do.dtype)), do, DOT)  # (BN, BDV)
    ds = p * (_dot(do, vT, DOT) - delta[:, None])
    if HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)
    dk += _ds_dot(tl.trans(ds), q, DOT)  # (BN, BD)
    return dk, dv


@triton.jit
def attention_backward_dkdv(Q, K, V, DO, LSE, LSE_LO, DELTA, GRAD_K, GRAD_V, LO, HI, QID, KID, SLOPES, QFIRST, QEND,
                            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                            sdob, sdoh, sdom, sdod, sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
                            s_interval_b, s_qid_b, s_kid_b, s_qrange_b,
                            Hq, Lq, Lk, sm_scale, softcap, causal_shift,
                            D: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_DV: tl.constexpr, DOT: tl.constexpr, HAS_INTERVAL: tl.constexpr,
                            HAS_CAUSAL: tl.constexpr, HAS_IDS: tl.constexpr, HAS_ALIBI: tl.constexpr,
                            HAS_SOFTCAP: tl.constexpr):
    """Program (key block, kv head, batch row): DK and DV summed over the GROUP query heads sharing it.

    QFIRST/QEND (B|1, nk) bound the query blocks whose keys intervals reach this key block; for
    a lone causal mask the first is computed (query i sees keys up to i + causal_shift).
    """
    pid_n = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    kT = tl.trans(_load_tile(K + b * skb + hk * skh, offs_n, offs_d, skn, skd, Lk, D))  # (BD, BN)
    vT = tl.trans(_load_tile(V + b * svb + hk * svh, offs_n, offs_dv, svn, svd, Lk, DV))  # (BDV, BN)
    kid = _load_rows(KID + b * s_kid_b, offs_n, Lk, -1) if HAS_IDS else offs_n
    keys_full = pid_n * BLOCK_N + BLOCK_N <= Lk
    if HAS_CAUSAL:
        t_start = tl.maximum(pid_n * BLOCK_N - causal_shift, 0) // BLOCK_M
        t_end = tl.cdiv(Lq, BLOCK_M)
    elif HAS_INTERVAL:
        t_start = tl.load(QFIRST + b * s_qrange_b + pid_n)
        t_end = tl.load(QEND + b * s_qrange_b + pid_n)
    else:
        t_start = 0
        t_end = tl.cdiv(Lq, BLOCK_M)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        q_ptr = Q + b * sqb + h * sqh
        do_ptr = DO + b * sdob + h * sdoh
        row = (b * Hq + h) * Lq
        for t in range(t_start, t_end):
            offs_m = t * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = offs_m < Lq
            q = _load_tile(q_ptr, offs_m, offs_d, sqm, sqd, Lq, D)  # (BM, BD)
            do = _load_tile(do_ptr, offs_m, offs_dv, sdom, sdod, Lq, DV)  # (BM, BDV)
            lse2, lse2_lo = _row_lse2(LSE + row, LSE_LO + row, offs_m, Lq)
            delta = _load_rows(DELTA + row, offs_m, Lq, 0.0)
            lo, hi, qid, slope = _query_side(LO, HI, QID, SLOPES, b, h, offs_m, Lq, Lk, causal_shift,
                                             s_interval_b, s_qid_b, HAS_INTERVAL, HAS_CAUSAL, HAS_IDS, HAS_ALIBI)
            if HAS_IDS:
                full = False
            elif HAS_INTERVAL:  # every row of the block allows every key of the tile
                full = keys_full & (tl.max(tl.where(row_ok, lo, 0), 0) <= pid_n * BLOCK_N) \
                    & (tl.min(tl.where(row_ok, hi, Lk - 1), 0) >= pid_n * BLOCK_N + BLOCK_N - 1)
            else:
                full = keys_full
            if full:
                dk, dv = _dkdv_tile(dk, dv, kT, vT, q, do, lse2, lse2_lo, delta, offs_m, offs_n, lo, hi, qid, kid, slope,
                                    Lq, Lk, sm_scale, softcap, DOT, False, HAS_INTERVAL, HAS_IDS, HAS_ALIBI,
                                    HAS_SOFTCAP)
            else:
                dk, dv = _dkdv_tile(dk, dv, kT, vT, q, do, lse2, lse2_lo, delta, offs_m, offs_n, lo, hi, qid, kid, slope,
                                    Lq, Lk, sm_scale, softcap, DOT, True, HAS_INTERVAL, HAS_IDS, HAS_ALIBI,
                                    HAS_SOFTCAP)
    _store_tile(GRAD_K + b * sdkb + hk * sdkh, (dk * sm_scale).to(GRAD_K.dtype.element_ty), offs_n, offs_d, sdkn, sdkd,
                Lk, D)
    _store_tile(GRAD_V + b * sdvb + hk * sdvh, dv.to(GRAD_V.dtype.element_ty), offs_n, offs_dv, sdvn, sdvd, Lk, DV)
