"""PyTorch references for attention: a naive one and a tile-by-tile online one.

* :func:`naive_attention` materializes the score matrix S and the probabilities P. It is the ground
  truth of the tests (run it in float64) and costs O(N * M) memory.
* :func:`online_forward` / :func:`online_backward` walk the same tiles, in the same order, with the same
  running state and the same masks as the Triton kernels in :mod:`flashattn.forward` and
  :mod:`flashattn.backward`. They exist so the site can explain each kernel line on a CPU.

Shapes follow ``torch.nn.functional.scaled_dot_product_attention``: q is (B, Hq, N, D), k and v are
(B, Hkv, M, D) with ``Hq % Hkv == 0``. Query head ``h`` reads key/value head ``h // (Hq // Hkv)``.
Causal masking is bottom-right aligned (see :mod:`flashattn.schedule`).
"""

from __future__ import annotations

import math

import torch

from flashattn import schedule
from flashattn.schedule import decode_split_range
from flashattn.constants import LN2, LOG2E


def causal_mask(n: int, m: int, device=None) -> torch.Tensor:
    """Boolean (n, m) mask, True where query i may see key j: ``j <= i + m - n`` (bottom-right)."""
    rows = torch.arange(n, device=device)[:, None]
    cols = torch.arange(m, device=device)[None, :]
    return schedule.visible(rows, cols, n, m, True)


def _group(x: torch.Tensor, h_kv: int) -> torch.Tensor:
    # (B, Hq, N, D) -> (B, Hkv, G, N, D): the G query heads of a group share one K/V head,
    # and broadcasting K/V over G avoids materializing repeated copies.
    b, h_q, n, d = x.shape
    return x.reshape(b, h_kv, h_q // h_kv, n, d)


def naive_attention(q, k, v, causal: bool = False, scale: float | None = None, *, window=None,
                    softcap: float | None = 0.0, alibi_slopes=None, dropout_p: float = 0.0, seed: int | None = None,
                    dropout_mask=None, batch_offset: int = 0, sinks=None):
    """Attention by the definition: S = scale * Q K^T, P = softmax(S), O = P V.

    Returns ``(o, lse)`` with ``lse`` the natural-log log-sum-exp of each row of S, shape (B, Hq, N).
    Computes in the dtype of the inputs (use float64 for a ground truth). Differentiable by autograd.
    A row that sees no key gets ``o = 0`` and ``lse = -inf``, with finite (zero) gradients.

    The variants, in the order they act on a score: ``softcap`` c > 0 turns s into c * tanh(s / c);
    ``alibi_slopes`` (Hq,) or (B, Hq) adds -slope * |i + M - N - j|; ``window = (left, right)``
    (``None`` = unbounded on that side) hides keys outside i + M - N - left <= j <= i + M - N + right.
    ``dropout_p`` > 0 zeroes entries of P (those where ``dropout_mask`` (B, Hq, N, M) is False, or the
    kernels' Philox mask of ``seed``, :func:`dropout_keep_mask`) and scales the rest by 1 / (1 - p);
    the LSE is that of the scores, before dropout. ``batch_offset`` is the batch index of q's first
    entry for the Philox mask (a packed sequence draws the mask of its index, :func:`varlen_attention`).
    ``sinks`` (Hq,): one more logit per head in every row's softmax, with no value (attention sinks):
    it takes probability mass from the keys, and the LSE counts it.
    """
    b, h_q, n, d = q.shape
    h_kv, m = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = _group(q, h_kv)  # (B, Hkv, G, N, D)
    s = scale * (qg @ k.unsqueeze(2).transpose(-1, -2))  # (B, Hkv, G, N, M)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        s = s - _slopes(alibi_slopes, b, h_kv, s.dtype) * _distance(n, m, q.device, s.dtype)
    rows = torch.arange(n, device=q.device)[:, None]
    cols = torch.arange(m, device=q.device)[None, :]
    visible = schedule.visible(rows, cols, n, m, causal)
    if window is not None:
        left, right = schedule.window_bounds(n, m, causal, tuple(window))
        visible = visible & schedule.in_window(rows, cols, n, m, left, right)
    if causal or window is not None:
        s = s.masked_fill(~visible, float("-inf"))
    # The pivot only keeps exp in range; it is detached because P does not depend on it.
    row_max = s.amax(dim=-1, keepdim=True).detach()
    sink = None
    if sinks is not None:  # (Hq,) -> (1, Hkv, G, 1, 1), in the scores' dtype
        sink = sinks.to(s.dtype).reshape(1, h_kv, -1, 1, 1)
        row_max = torch.maximum(row_max, sink.detach())
    pivot = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(s - pivot)
    l = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        l = l + torch.exp(sink - pivot)  # the sink's share of the denominator; it has no value
    p = e / torch.where(l > 0, l, torch.ones_like(l))  # empty rows: e == 0, so p == 0
    if dropout_p > 0:
        if dropout_mask is None:
            dropout_mask = dropout_keep_mask(seed, b, h_q, n, m, dropout_p, q.device, batch_offset)
        p = p * dropout_mask.reshape(p.shape).to(p.dtype) / (1.0 - dropout_p)
    o = p @ v.unsqueeze(2)  # (B, Hkv, G, N, D)
    lse = (pivot + torch.log(l)).reshape(b, h_q, n)  # log(0) = -inf for empty rows
    return o.reshape(b, h_q, n, v.shape[-1]), lse.to(_acc_dtype(q))


def _slopes(alibi_slopes, b, h_kv, dtype):
    """ALiBi slopes (Hq,) or (B, Hq) shaped to broadcast over (B, Hkv, G, N, M) scores."""
    slopes = alibi_slopes.to(dtype)
    return slopes.reshape(slopes.shape[0] if slopes.dim() == 2 else 1, h_kv, -1, 1, 1)


def _distance(n, m, device, dtype, rows=None, cols=None):
    """|i + M - N - j|: how far key j lies from query i's diagonal, (N, M) or over given indices."""
    rows = torch.arange(n, device=device)[:, None] if rows is None else rows
    cols = torch.arange(m, device=device)[None, :] if cols is None else cols
    return (rows + (m - n) - cols).abs().to(dtype)


# --8<-- [start:philox]
# Philox-4x32-10 (Salmon et al., SC 2011) in int64 torch arithmetic on 32-bit words, as Triton's
# tl.philox computes it: the kernels and this reference draw the same bits for the same counters.
_M32 = 0xFFFFFFFF
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85


def _mul_hi_lo(a: int, x: torch.Tensor):
    """(high, low) 32-bit words of the 64-bit product of the constant ``a`` and the words ``x``,
    without ever forming a product past 2^63: ``a`` is split into 16-bit halves."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    hi_part, lo_part = a_hi * x, a_lo * x  # each < 2^48
    high = (hi_part + (lo_part >> 16)) >> 16
    low = (((hi_part & 0xFFFF) << 16) + lo_part) & _M32
    return high, low


def philox(seed: int, c0, c1, c2, c3, rounds: int = 10):
    """The four output words of Philox-4x32 for the counters (c0, c1, c2, c3) (int64 tensors holding
    32-bit values) under the 64-bit key ``seed``: Triton's ``tl.philox(seed, c0, c1, c2, c3)``."""
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(rounds):
        hi_b, lo_b = _mul_hi_lo(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _M32, (k1 + _PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


def dropout_keep_at(seed: int, i_bh, rows, cols, p: float) -> torch.Tensor:
    """The kernels' keep decision (:func:`flashattn.device_helpers.dropout_keep`) for broadcastable index
    tensors, entry by entry: the draw counted by (j // 8, i, b * Hq + h, 0), its lane j % 8 = 2 w + h
    (half h of word w), dropped when that 16-bit lane is below floor(p * 2^16)."""
    from flashattn.problem import dropout_threshold

    rows, cols, i_bh = (torch.as_tensor(x).to(torch.int64) for x in (rows, cols, i_bh))
    shape = torch.broadcast_shapes(rows.shape, cols.shape, i_bh.shape)
    c0, c1, c2 = (x.expand(shape) for x in (cols // 8, rows, i_bh))
    words = torch.stack(philox(seed, c0, c1, c2, torch.zeros_like(c0)), dim=-1)  # [..., 4]
    lane = (cols % 8).expand(shape)
    word = words.gather(-1, (lane // 2).unsqueeze(-1)).squeeze(-1)
    bits = (word >> (16 * (lane % 2))) & 0xFFFF
    return bits >= dropout_threshold(p)
# --8<-- [end:philox]


def dropout_keep_mask(seed: int, batch: int, heads: int, n: int, m: int, p: float, device=None,
                      batch_offset: int = 0) -> torch.Tensor:
    """Boolean (B, Hq, N, M): True where the kernels keep an entry of P for this ``seed``, for the
    batch entries ``batch_offset .. batch_offset + B - 1``."""
    if seed is None:
        raise ValueError("dropout needs a seed (or a dropout_mask)")
    i_bh = torch.arange(batch_offset * heads, (batch_offset + batch) * heads, device=device).reshape(batch, heads, 1, 1)
    rows = torch.arange(n, device=device).reshape(1, 1, n, 1)
    cols = torch.arange(m, device=device).reshape(1, 1, 1, m)
    return dropout_keep_at(seed, i_bh, rows, cols, p)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    # The kernels accumulate in float32; a float64 input keeps float64 so the reference can be exact.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _load_rows(x: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """Rows ``start : start + size`` along dim -2, zero-padded past the end.

    This mirrors ``tl.load(ptrs, mask=offs < N, other=0.0)``: a ragged last block is full size, and its
    padding rows are zeros that later code must mask or drop, never trust.
    """
    block = x[..., start : start + size, :]
    pad = size - block.shape[-2]
    if pad:
        block = torch.nn.functional.pad(block, (0, 0, 0, pad))
    return block


def _load_vec(x: torch.Tensor, start: int, size: int, fill: float) -> torch.Tensor:
    block = x[..., start : start + size]
    pad = size - block.shape[-1]
    if pad:
        block = torch.nn.functional.pad(block, (0, pad), value=fill)
    return block


def _score_mask(start_m, start_n, block_m, block_n, n, m, causal, device, window=None):
    """(block_m, block_n) mask of the pairs a tile may use: the schedule's visibility test, and the
    window's (``window`` = the kernels' (left, right)) when there is one."""
    rows = start_m + torch.arange(block_m, device=device)[:, None]
    cols = start_n + torch.arange(block_n, device=device)[None, :]
    mask = schedule.visible(rows, cols, n, m, causal)
    if window is not None:
        mask = mask & schedule.in_window(rows, cols, n, m, *window)
    return mask


class _Mods:
    """The score variants of one call, as the tile-by-tile loops apply them (the kernels' score_mods,
    softcap-grad and dropout-mask sections): everything in base 2, like the kernels."""

    def __init__(self, q, h_kv, n, m, scale, acc_dtype, softcap, alibi_slopes, dropout_p, seed, batch_offset=0):
        b, h_q = q.shape[0], q.shape[1]
        self.n, self.m, self.scale, self.softcap = n, m, scale, softcap or 0.0
        self.qk_scale = scale * LOG2E
        self.slopes2 = None if alibi_slopes is None else _slopes(alibi_slopes, b, h_kv, acc_dtype) * LOG2E
        self.dropout_p, self.seed = dropout_p, seed
        if dropout_p > 0 and seed is None:
            raise ValueError("dropout needs a seed")
        # b * Hq + h of every (B, Hkv, G) head, the third Philox counter word
        self.i_bh = torch.arange(batch_offset * h_q, (batch_offset + b) * h_q, device=q.device).reshape(
            b, h_kv, h_q // h_kv, 1, 1)

    def scores(self, b_q, b_k, start_m, start_n):
        """(base-2 scores, tanh of the softcap or None) of one tile."""
        qk = b_q @ b_k.transpose(-1, -2)  # [.., BLOCK_M, BLOCK_N]
        t = None
        if self.softcap:
            t = torch.tanh(qk * (self.scale / self.softcap))  # the capped score is softcap * t
            s = t * (self.softcap * LOG2E)
        else:
            s = qk * self.qk_scale
        if self.slopes2 is not None:
            rows = start_m + torch.arange(b_q.shape[-2], device=b_q.device)[:, None]
            cols = start_n + torch.arange(b_k.shape[-2], device=b_q.device)[None, :]
            s = s - self.slopes2 * _distance(self.n, self.m, b_q.device, s.dtype, rows, cols)
        return s, t

    def keep(self, start_m, start_n, block_m, block_n, device):
        """The tile's dropout keep mask (the kernels' Philox draw), or None without dropout."""
        if self.dropout_p == 0:
            return None
        rows = start_m + torch.arange(block_m, device=device)[:, None]
        cols = start_n + torch.arange(block_n, device=device)[None, :]
        return dropout_keep_at(self.seed, self.i_bh, rows, cols, self.dropout_p)


def _tile_setup(q, k, causal, scale, window, softcap, alibi_slopes, dropout_p, seed, batch_offset):
    """What both tile-by-tile loops start from: the scale (1/sqrt(D) by default), the accumulation dtype,
    the variants' score modifications (:class:`_Mods`) and the window as the kernels take it."""
    (_, _, n, d), (h_kv, m) = q.shape, k.shape[1:3]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    acc_dtype = _acc_dtype(q)
    mods = _Mods(q, h_kv, n, m, scale, acc_dtype, softcap, alibi_slopes, dropout_p, seed, batch_offset)
    return scale, acc_dtype, mods, _kernel_window(n, m, causal, window)


def _kernel_window(n, m, causal, window):
    """The kernels' (left, right) of a user window, or None where it hides nothing causal does not."""
    if window is None:
        return None
    left, right = schedule.window_bounds(n, m, causal, tuple(window))
    return None if left >= m - 1 and right >= (0 if causal else n - 1) else (left, right)


# --8<-- [start:online-forward]
def _key_walk(start_m, block_m, block_n, n, m, causal, win, for_dq=False):
    """``(lo, full_start, full_end, hi)``: the key blocks one query block walks and the fully visible
    ones among them, from the schedule's boundary functions (``win``: the window's clipped bounds). The
    dQ walk is the forward's, except that a ragged last query block masks every tile."""
    if win is None:
        walk = schedule.dq_key_range if for_dq else schedule.forward_key_range
        full_end, hi = walk(start_m, block_m, block_n, n, m, causal)
        return 0, 0, full_end, hi
    walk = schedule.window_dq_key_range if for_dq else schedule.window_key_range
    return walk(start_m, block_m, block_n, n, m, *win)


def online_forward(q, k, v, causal: bool = False, scale: float | None = None, block_m: int = 64, block_n: int = 64,
                   *, window=None, softcap: float | None = 0.0, alibi_slopes=None, dropout_p: float = 0.0,
                   seed: int | None = None, batch_offset: int = 0):
    """Tile-by-tile forward: the loops of the Triton forward kernel, written in PyTorch.

    For each query block, walk the key blocks that :func:`flashattn.schedule.forward_key_range` names
    (:func:`flashattn.schedule.window_key_range` under a window), keeping the running row max ``m_i``
    (base 2), the running sum ``l_i`` and the unnormalized output ``acc``. Returns ``(o, lse)`` like
    :func:`naive_attention`, which also describes the variants' keyword arguments and ``batch_offset``.
    """
    b, h_q, n, d = q.shape
    h_kv, m = k.shape[1], k.shape[2]
    scale, acc_dtype, mods, win = _tile_setup(q, k, causal, scale, window, softcap, alibi_slopes, dropout_p, seed,
                                              batch_offset)
    qg = _group(q, h_kv).to(acc_dtype)  # (B, Hkv, G, N, D)
    kf, vf = k.unsqueeze(2).to(acc_dtype), v.unsqueeze(2).to(acc_dtype)  # (B, Hkv, 1, M, D)
    d_v = v.shape[-1]  # D unless the head dims are split
    o = torch.empty(qg.shape[:-1] + (d_v,), dtype=q.dtype, device=q.device)
    lse = torch.empty(qg.shape[:-1], dtype=acc_dtype, device=q.device)
    for start_m in range(0, n, block_m):
        b_q = _load_rows(qg, start_m, block_m)  # [.., BLOCK_M, D]
        m_i = torch.full(b_q.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)  # [.., BLOCK_M]
        l_i = torch.zeros_like(m_i)  # [.., BLOCK_M]
        acc = b_q.new_zeros(b_q.shape[:-1] + (d_v,))  # [.., BLOCK_M, D_v]
        lo, full_start, full_end, hi = _key_walk(start_m, block_m, block_n, n, m, causal, win)
        for start_n in range(lo, hi, block_n):
            b_k = _load_rows(kf, start_n, block_n)  # [.., BLOCK_N, D]
            b_v = _load_rows(vf, start_n, block_n)  # [.., BLOCK_N, D]
            s, _ = mods.scores(b_q, b_k, start_m, start_n)  # [.., BLOCK_M, BLOCK_N], base-2 scores
            if not full_start <= start_n < full_end:
                # Out-of-range keys go to -inf *before* the max: a zero-padded key would score 0,
                # inflate l_i by 2^(-m_i) and become the max of a row whose real scores are negative.
                mask = _score_mask(start_m, start_n, block_m, block_n, n, m, causal, q.device, win)
                s = s.masked_fill(~mask, float("-inf"))
            m_new = torch.maximum(m_i, s.amax(dim=-1))
            # A row that has seen only masked keys has m_new = -inf; exp2(-inf - (-inf)) would be NaN,
            # so such a row pivots at 0 and keeps p = exp2(-inf) = 0.
            m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            p = torch.exp2(s - m_safe[..., None])  # [.., BLOCK_M, BLOCK_N]
            alpha = torch.exp2(m_i - m_safe)  # rescales the old state to the new pivot
            l_i = l_i * alpha + p.sum(dim=-1)  # the softmax's sum counts every entry, dropped or not
            keep = mods.keep(start_m, start_n, block_m, block_n, q.device)
            if keep is not None:
                p = torch.where(keep, p, torch.zeros_like(p))  # 1 / (1 - p) joins once, in the epilogue
            acc = acc * alpha[..., None] + p @ b_v
            m_i = m_new
        # Epilogue: normalize, and store the log-sum-exp (natural log) for the backward pass.
        empty = l_i == 0  # rows that saw no key: o = 0, lse = -inf
        b_o = acc / torch.where(empty, torch.ones_like(l_i), l_i)[..., None]
        if dropout_p > 0:
            b_o = b_o * (1.0 / (1.0 - dropout_p))
        b_lse = (m_i + torch.log2(l_i)) * LN2  # log2(0) = -inf keeps empty rows at -inf
        rows = slice(start_m, min(start_m + block_m, n))
        width = rows.stop - rows.start  # a ragged last block stores only its real rows
        o[..., rows, :] = b_o[..., :width, :].to(q.dtype)
        lse[..., rows] = b_lse[..., :width]
    return o.reshape(b, h_q, n, d_v), lse.reshape(b, h_q, n)
# --8<-- [end:online-forward]


# --8<-- [start:online-backward]
def online_backward(
    do, q, k, v, o, lse, causal: bool = False, scale: float | None = None, block_m: int = 64, block_n: int = 64,
    dlse=None, *, window=None, softcap: float | None = 0.0, alibi_slopes=None, dropout_p: float = 0.0,
    seed: int | None = None, batch_offset: int = 0,
):
    """Tile-by-tile backward: preprocess D, then the dK/dV loop and the dQ loop, recomputing P from lse.

    Returns ``(dq, dk, dv)`` with the shapes and dtypes of q, k, v. dK and dV of a key/value head sum the
    contributions of every query head of its group. ``dlse`` (B, Hq, N), when given, is the gradient
    that reached the LSE output; it joins delta (dS = P * (dP - (delta - dLSE))). The variants take the
    forward's arguments (``batch_offset`` too); the ALiBi slopes get no gradient.
    """
    b, h_q, n, d = q.shape
    h_kv, m = k.shape[1], k.shape[2]
    scale, acc_dtype, mods, win = _tile_setup(q, k, causal, scale, window, softcap, alibi_slopes, dropout_p, seed,
                                              batch_offset)
    inv_keep = 1.0 / (1.0 - dropout_p)
    qg, dog, og = (_group(x, h_kv).to(acc_dtype) for x in (q, do, o))  # (B, Hkv, G, N, D)
    kf, vf = k.unsqueeze(2).to(acc_dtype), v.unsqueeze(2).to(acc_dtype)  # (B, Hkv, 1, M, D)
    lse2 = lse.reshape(qg.shape[:-1]).to(acc_dtype) * LOG2E  # base-2 log-sum-exp per row

    # Preprocess: D_i = rowsum(dO_i * O_i) equals rowsum(P_i * dP_i) (the D identity), an N x d
    # reduction instead of an N x M one. With dropout, O is the dropped output and the identity holds
    # with dP the gradient of the undropped P (Z * dO V^T / (1 - p)).
    delta = (dog * og).sum(dim=-1)  # (B, Hkv, G, N)
    if dlse is not None:
        delta = delta - dlse.reshape(delta.shape).to(acc_dtype)  # dLSE_i / dS_ij = P_ij

    def recompute_p(b_q, b_k, b_lse2, start_m, start_n, masked):
        s, t = mods.scores(b_q, b_k, start_m, start_n)  # [.., BLOCK_M, BLOCK_N]
        # A row with no visible key has lse = -inf; pivoting it at 0 keeps exp2 finite, and the mask
        # below zeroes the row anyway (it lies entirely in masked tiles).
        b_lse2 = torch.where(b_lse2 == float("-inf"), torch.zeros_like(b_lse2), b_lse2)
        p = torch.exp2(s - b_lse2[..., None])
        if masked:
            mask = _score_mask(start_m, start_n, block_m, block_n, n, m, causal, q.device, win)
            p = torch.where(mask, p, torch.zeros_like(p))
        return p, t

    def scores_grad(p, dp, b_delta, t, keep):
        """dS of the raw scores scale * q.k from P, dP = dO V^T and D."""
        p_used = p  # the P that multiplied V
        if keep is not None:
            dp = torch.where(keep, dp * inv_keep, torch.zeros_like(dp))  # dP of the undropped P
            p_used = torch.where(keep, p * inv_keep, torch.zeros_like(p))
        ds = p * (dp - b_delta[..., None])  # dS = P * (dP - delta)
        if t is not None:
            ds = ds * (1 - t * t)  # through the softcap: d(c tanh(s / c)) / ds = 1 - tanh^2
        return ds, p_used

    dk = torch.empty(kf.shape[:2] + (m, d), dtype=k.dtype, device=k.device)
    dv = torch.empty(kf.shape[:2] + (m, v.shape[-1]), dtype=v.dtype, device=v.device)
    # dK/dV: one key block at a time; loop over the query blocks that can see it.
    for start_n in range(0, m, block_n):
        b_k = _load_rows(kf, start_n, block_n)  # [.., BLOCK_N, D]
        b_v = _load_rows(vf, start_n, block_n)  # [.., BLOCK_N, D]
        b_dk = torch.zeros(qg.shape[:3] + (block_n, d), dtype=acc_dtype, device=q.device)
        b_dv = torch.zeros(qg.shape[:3] + (block_n, v.shape[-1]), dtype=acc_dtype, device=q.device)
        if win is None:
            lo, full_start, full_end = schedule.backward_query_range(start_n, block_m, block_n, n, m, causal)
            hi = n
        else:
            lo, full_start, full_end, hi = schedule.window_query_range(start_n, block_m, block_n, n, m, *win)
        for start_m in range(lo, hi, block_m):
            # Tiles on the diagonal, on the ragged last query block, or on a ragged key block are masked.
            # Padding rows (>= n) must contribute nothing: unmasked, their P could overflow and turn
            # dS = P * (dP - delta) into NaN even though their dO is zero.
            masked = start_m < full_start or start_m >= full_end
            b_q = _load_rows(qg, start_m, block_m)
            b_do = _load_rows(dog, start_m, block_m)
            b_lse2 = _load_vec(lse2, start_m, block_m, 0.0)
            b_delta = _load_vec(delta, start_m, block_m, 0.0)
            p, t = recompute_p(b_q, b_k, b_lse2, start_m, start_n, masked)  # [.., BLOCK_M, BLOCK_N]
            dp = b_do @ b_v.transpose(-1, -2)  # dP = dO V^T
            ds, p_used = scores_grad(p, dp, b_delta, t, mods.keep(start_m, start_n, block_m, block_n, q.device))
            b_dv += p_used.transpose(-1, -2) @ b_do  # dV = P^T dO (the dropped, rescaled P)
            b_dk += ds.transpose(-1, -2) @ b_q  # dK = scale * dS^T Q (scale applied once, below)
        cols = slice(start_n, min(start_n + block_n, m))
        width = cols.stop - cols.start
        dk[..., cols, :] = (b_dk.sum(dim=2) * scale)[..., :width, :].to(k.dtype)  # sum the group's heads
        dv[..., cols, :] = b_dv.sum(dim=2)[..., :width, :].to(v.dtype)

    dq = torch.empty(qg.shape, dtype=q.dtype, device=q.device)
    # dQ: one query block at a time; the same key walk as the forward.
    for start_m in range(0, n, block_m):
        b_q = _load_rows(qg, start_m, block_m)
        b_do = _load_rows(dog, start_m, block_m)
        b_lse2 = _load_vec(lse2, start_m, block_m, 0.0)
        b_delta = _load_vec(delta, start_m, block_m, 0.0)
        b_dq = torch.zeros_like(b_q)  # [.., BLOCK_M, D]
        lo, full_start, full_end, hi = _key_walk(start_m, block_m, block_n, n, m, causal, win, for_dq=True)
        for start_n in range(lo, hi, block_n):
            b_k = _load_rows(kf, start_n, block_n)
            b_v = _load_rows(vf, start_n, block_n)
            masked = not full_start <= start_n < full_end
            p, t = recompute_p(b_q, b_k, b_lse2, start_m, start_n, masked)
            dp = b_do @ b_v.transpose(-1, -2)
            ds, _ = scores_grad(p, dp, b_delta, t, mods.keep(start_m, start_n, block_m, block_n, q.device))
            b_dq += ds @ b_k  # dQ = scale * dS K (scale applied once, below)
        rows = slice(start_m, min(start_m + block_m, n))
        width = rows.stop - rows.start
        dq[..., rows, :] = (b_dq * scale)[..., :width, :].to(q.dtype)
    return dq.reshape(b, h_q, n, d), dk, dv
# --8<-- [end:online-backward]


# --8<-- [start:varlen-reference]
def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool = False, scale: float | None = None, *,
                     window=None, softcap: float | None = 0.0, alibi_slopes=None, dropout_p: float = 0.0,
                     seed: int | None = None, sinks=None):
    """Packed sequences by the definition: :func:`naive_attention` on each sequence alone.

    q is (total_q, Hq, D) and k, v are (total_k, Hkv, D), the sequences one after the other; sequence
    ``i`` holds rows ``cu_seqlens_q[i] : cu_seqlens_q[i + 1]`` of q and ``cu_seqlens_k[i] :
    cu_seqlens_k[i + 1]`` of k and v, and attends to nothing else (causal: bottom-right within the
    sequence). Returns ``(o, lse)``: o (total_q, Hq, D), lse (Hq, total_q), the layout of
    ``flash_attn_varlen_func``. A sequence without keys gives o = 0, lse = -inf. Computes in the dtype
    of the inputs (float64 for a ground truth); differentiable by autograd. Reads the lengths on the host.

    The variants act inside each sequence as :func:`naive_attention`'s do on a batch entry of its own:
    the window and ALiBi distances are sequence-local, ``alibi_slopes`` (B, Hq) gives sequence ``i`` row
    ``i``, and sequence ``i`` draws the dropout mask of batch entry ``i`` (``batch_offset=i``).
    """
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    total_q, h_q, d = q.shape
    o_parts, lse_parts = [], []
    for i in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        n, m = rows.stop - rows.start, keys.stop - keys.start
        if n == 0:
            continue
        if m == 0:  # no key at all: o = 0, and the LSE is the sink's (-inf without one)
            o_parts.append(q.new_zeros((n, h_q, v.shape[-1])))
            lse_parts.append(torch.full((h_q, n), float("-inf"), dtype=_acc_dtype(q), device=q.device)
                             if sinks is None else sinks.to(_acc_dtype(q))[:, None].expand(h_q, n))
            continue
        heads = (lambda x: x.transpose(0, 1)[None])  # (L, H, D) -> (1, H, L, D)
        o_i, lse_i = naive_attention(heads(q[rows]), heads(k[keys]), heads(v[keys]), causal=causal, scale=scale,
                                     sinks=sinks, **sequence_variants(i, window, softcap, alibi_slopes, dropout_p, seed))
        o_parts.append(o_i[0].transpose(0, 1))
        lse_parts.append(lse_i[0])
    if not o_parts:
        return q.new_zeros((total_q, h_q, v.shape[-1])), torch.empty((h_q, 0), dtype=_acc_dtype(q), device=q.device)
    return torch.cat(o_parts, 0), torch.cat(lse_parts, 1)
# --8<-- [end:varlen-reference]


def sequence_variants(i: int, window, softcap, alibi_slopes, dropout_p, seed) -> dict:
    """The variant keywords of the references for packed sequence ``i`` alone (its ALiBi row, its
    dropout counters)."""
    slopes = alibi_slopes[i] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
    return dict(window=window, softcap=softcap, alibi_slopes=slopes, dropout_p=dropout_p,
                seed=seed if dropout_p > 0 else None, batch_offset=i)


# ----------------------------------------------------------------------------------------------
# Decoding against a KV cache (flashattn.decode): the cache append, attention per sequence, and the
# split-KV partials and their merge. Layout of flash_attn's ``flash_attn_with_kvcache``: q is
# (B, Nq, Hq, D); the cache is (B, Mmax, Hkv, D), or paged (num_pages, page_size, Hkv, D) with a
# (B, max_pages) block table whose row b lists the pages of sequence b in order.
# ----------------------------------------------------------------------------------------------


def _cache_rows(cache: torch.Tensor, b: int, length: int, block_table=None) -> torch.Tensor:
    """Rows ``0 .. length`` of sequence ``b`` as a (length, Hkv, D) tensor, through the pages if any."""
    if block_table is None:
        return cache[b, :length]
    page_size = cache.shape[1]
    pages = block_table[b, : (length + page_size - 1) // page_size].long()  # the sequence's pages, in order
    return cache[pages].flatten(0, 1)[:length]  # (pages, page_size, Hkv, D) -> (length, Hkv, D)


def kvcache_append_reference(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table=None):
    """The caches after writing ``k_new[b, t]`` / ``v_new[b, t]`` at position ``cache_seqlens[b] + t``.

    Returns new tensors (the inputs are cloned first); one row at a time, so it shares no indexing code
    with the kernels' launcher.
    """
    k_out, v_out = k_cache.clone(), v_cache.clone()
    if k_new is None:
        return k_out, v_out
    page_size = k_cache.shape[1]
    for b in range(k_new.shape[0]):
        for t in range(k_new.shape[1]):
            pos = int(cache_seqlens[b]) + t
            if block_table is None:
                k_out[b, pos], v_out[b, pos] = k_new[b, t], v_new[b, t]
            else:
                page = int(block_table[b, pos // page_size])
                k_out[page, pos % page_size], v_out[page, pos % page_size] = k_new[b, t], v_new[b, t]
    return k_out, v_out


def kvcache_attention_reference(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, causal=True,
                                scale=None, block_table=None):
    """Decoding by the definition: append on a copy, then :func:`naive_attention` per sequence.

    Sequence b attends to its first ``L_b = cache_seqlens[b] + Nnew`` keys; with ``causal`` the
    alignment is bottom-right within the sequence (query i sees key j when ``j <= i + L_b - Nq``).
    Computes in the dtype of the inputs (float64 for a ground truth). Returns ``(o, lse, k_cache',
    v_cache')``: o (B, Nq, Hq, D), lse (B, Hq, Nq) natural log, and the appended caches.
    """
    k_cache, v_cache = kvcache_append_reference(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
    n_new = 0 if k_new is None else k_new.shape[1]
    batch, n_q, h_q, d = q.shape
    o = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((batch, h_q, n_q), float("-inf"), dtype=_acc_dtype(q), device=q.device)
    for b in range(batch):
        length = int(cache_seqlens[b]) + n_new
        if length == 0:
            continue  # no key at all: o = 0, lse = -inf
        keys = _cache_rows(k_cache, b, length, block_table).transpose(0, 1)[None]  # (1, Hkv, L, D)
        values = _cache_rows(v_cache, b, length, block_table).transpose(0, 1)[None]
        o_b, lse_b = naive_attention(q[b : b + 1].transpose(1, 2), keys, values, causal=causal, scale=scale)
        o[b] = o_b[0].transpose(0, 1)
        lse[b] = lse_b[0]
    return o, lse, k_cache, v_cache


# --8<-- [start:split-kv-partials]
def kvcache_options_reference(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, causal=True, scale=None,
                              *, window=None, softcap=0.0, alibi_slopes=None, sinks=None, rotary_cos=None,
                              rotary_sin=None, rotary_interleaved=False, cache_leftpad=None, cache_batch_idx=None):
    """``flash_attn_with_kvcache``'s options by their definitions, one sequence at a time: rotate q and
    k_new (:func:`flashattn.rotary.apply_rotary`, at ``cache_seqlens`` onwards, the rows they land in; q
    all at that position when neither causal nor windowed), append into cache entry ``cache_batch_idx[b]``,
    then :func:`naive_attention` over rows ``cache_leftpad[b] .. L_b`` with the variants. Non-paged
    cache; returns ``(o (B, Nq, Hq, D), lse (B, Hq, Nq), k_cache, v_cache)`` (new caches, inputs kept)."""
    from flashattn.rotary import apply_rotary

    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    batch, n_q = q.shape[:2]
    n_new = 0 if k_new is None else k_new.shape[1]
    outs, lses = [], []
    for b in range(batch):
        entry = int(cache_batch_idx[b]) if cache_batch_idx is not None else b
        pad = int(cache_leftpad[b]) if cache_leftpad is not None else 0
        length = int(cache_seqlens[b])
        q_b = q[b:b + 1]
        k_b = None if k_new is None else k_new[b:b + 1]
        if rotary_cos is not None:
            start = length
            steps = torch.arange(n_q) if (causal or window is not None) else torch.zeros(n_q, dtype=torch.long)
            q_b = apply_rotary(q_b, rotary_cos, rotary_sin, (start + steps)[None].to(q.device), rotary_interleaved)
            if k_b is not None:
                k_b = apply_rotary(k_b, rotary_cos, rotary_sin, (start + torch.arange(n_new))[None].to(q.device),
                                   rotary_interleaved)
        if k_b is not None:
            k_cache[entry, length:length + n_new] = k_b[0]
            v_cache[entry, length:length + n_new] = v_new[b]
        keys = slice(pad, length + n_new)
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        heads = (lambda x: x.transpose(-3, -2))  # (.., L, H, D) <-> (.., H, L, D)
        o, lse = naive_attention(heads(q_b), heads(k_cache[entry, keys])[None], heads(v_cache[entry, keys])[None],
                                 causal=causal, scale=scale, window=window, softcap=softcap, alibi_slopes=slopes,
                                 sinks=sinks)
        outs.append(heads(o))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), k_cache, v_cache


def split_kv_partials(q, k, v, n_splits, block_n, causal=True, scale=None):
    """The partial results of split-KV decoding for one sequence, each over one split's keys.

    q is (Hq, Nq, D); k, v are (Hkv, L, D), the sequence's keys after the append. Split s sees the
    keys :func:`decode_split_range` gives it (the causal mask still uses their positions in the whole
    sequence). Returns ``(o_parts, lse_parts)`` of shapes (S, Hq, Nq, D) and (S, Hq, Nq): each
    partial is normalized over its own keys, and a split with no visible key has o = 0, lse = -inf.
    """
    h_q, n_q, d = q.shape
    h_kv, length = k.shape[0], k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    group = h_q // h_kv
    s_all = scale * (q.reshape(h_kv, group, n_q, d) @ k.unsqueeze(1).transpose(-1, -2))  # (Hkv, G, Nq, L)
    if causal:
        s_all = s_all.masked_fill(~causal_mask(n_q, length, q.device), float("-inf"))
    o_parts, lse_parts = [], []
    for split in range(n_splits):
        lo, hi = decode_split_range(split, n_splits, length, block_n)
        hi = min(hi, length)
        s = s_all[..., lo:max(lo, hi)]  # (Hkv, G, Nq, keys of this split)
        lse = torch.logsumexp(s, dim=-1) if s.shape[-1] else s.new_full(s.shape[:-1], float("-inf"))
        # rows that see no key of this split: lse = -inf, and their weights exp(-inf - (-inf)) are NaN
        safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        p = torch.exp(s - safe[..., None])
        o_parts.append((p @ v[:, lo:max(lo, hi)].unsqueeze(1)).reshape(h_q, n_q, d))
        lse_parts.append(lse.reshape(h_q, n_q))
    return torch.stack(o_parts), torch.stack(lse_parts)
# --8<-- [end:split-kv-partials]


# --8<-- [start:merge-partials]
def merge_partials(o_parts, lse_parts):
    """Merge partial results over disjoint key sets into the result over their union.

    With LSE = log(sum of exp of the scores), the union has LSE = log sum_s exp(LSE_s), and its
    output is the average of the partial outputs weighted by exp(LSE_s - LSE): each partial's share
    of the total softmax mass. The weights are computed against a pivot (the largest LSE_s), which
    any finite value could be; partials with LSE_s = -inf get weight 0, and a row where every
    partial is empty gets o = 0 and LSE = -inf instead of 0/0.
    """
    m = lse_parts.amax(dim=0)  # the pivot
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse_parts - m_safe)  # (S, ...): exp(-inf) = 0 for empty partials
    total = w.sum(dim=0)
    o_weighted = (w[..., None] * torch.where(w[..., None] > 0, o_parts, torch.zeros_like(o_parts))).sum(dim=0)
    o = o_weighted / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    return o, m_safe + torch.log(total)  # log(0) = -inf for rows no split saw
# --8<-- [end:merge-partials]


def split_kv_attention_reference(q, k_cache, v_cache, cache_seqlens, n_splits, block_n, causal=True, scale=None,
                                 block_table=None):
    """Decoding (without an append) as split-KV does it: partials per split, then the merge.

    Same arguments and results (o, lse) as :func:`kvcache_attention_reference`, for a cache that
    already holds the keys; equal to it up to rounding for any ``n_splits`` and ``block_n``.
    """
    batch, n_q, h_q, d = q.shape
    o = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((batch, h_q, n_q), float("-inf"), dtype=_acc_dtype(q), device=q.device)
    for b in range(batch):
        length = int(cache_seqlens[b])
        keys = _cache_rows(k_cache, b, length, block_table).transpose(0, 1)  # (Hkv, L, D)
        values = _cache_rows(v_cache, b, length, block_table).transpose(0, 1)
        o_parts, lse_parts = split_kv_partials(q[b].transpose(0, 1), keys, values, n_splits, block_n, causal, scale)
        o_b, lse_b = merge_partials(o_parts, lse_parts)
        o[b], lse[b] = o_b.transpose(0, 1).to(q.dtype), lse_b.to(lse.dtype)
    return o, lse
