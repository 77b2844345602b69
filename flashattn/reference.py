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


def naive_attention(q, k, v, causal: bool = False, scale: float | None = None):
    """Attention by the definition: S = scale * Q K^T, P = softmax(S), O = P V.

    Returns ``(o, lse)`` with ``lse`` the natural-log log-sum-exp of each row of S, shape (B, Hq, N).
    Computes in the dtype of the inputs (use float64 for a ground truth). Differentiable by autograd.
    A row that sees no key gets ``o = 0`` and ``lse = -inf``, with finite (zero) gradients.
    """
    b, h_q, n, d = q.shape
    h_kv, m = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = _group(q, h_kv)  # (B, Hkv, G, N, D)
    s = scale * (qg @ k.unsqueeze(2).transpose(-1, -2))  # (B, Hkv, G, N, M)
    if causal:
        s = s.masked_fill(~causal_mask(n, m, q.device), float("-inf"))
    # The pivot only keeps exp in range; it is detached because P does not depend on it.
    row_max = s.amax(dim=-1, keepdim=True).detach()
    pivot = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(s - pivot)
    l = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(l > 0, l, torch.ones_like(l))  # empty rows: e == 0, so p == 0
    o = p @ v.unsqueeze(2)  # (B, Hkv, G, N, D)
    lse = (pivot + torch.log(l)).reshape(b, h_q, n)  # log(0) = -inf for empty rows
    return o.reshape(b, h_q, n, d), lse.to(_acc_dtype(q))


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


def _score_mask(start_m, start_n, block_m, block_n, n, m, causal, device):
    """(block_m, block_n) mask of the pairs a tile may use: the schedule's visibility test."""
    rows = start_m + torch.arange(block_m, device=device)[:, None]
    cols = start_n + torch.arange(block_n, device=device)[None, :]
    return schedule.visible(rows, cols, n, m, causal)


# --8<-- [start:online-forward]
def online_forward(q, k, v, causal: bool = False, scale: float | None = None, block_m: int = 64, block_n: int = 64):
    """Tile-by-tile forward: the loops of the Triton forward kernel, written in PyTorch.

    For each query block, walk the key blocks that :func:`flashattn.schedule.forward_key_range` names,
    keeping the running row max ``m_i`` (base 2), the running sum ``l_i`` and the unnormalized output
    ``acc``. Returns ``(o, lse)`` like :func:`naive_attention`.
    """
    b, h_q, n, d = q.shape
    h_kv, m = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    acc_dtype = _acc_dtype(q)
    qk_scale = scale * LOG2E  # fold log2(e) into the scale: exp2 on the scores is exp of the real scores
    qg = _group(q, h_kv).to(acc_dtype)  # (B, Hkv, G, N, D)
    kf, vf = k.unsqueeze(2).to(acc_dtype), v.unsqueeze(2).to(acc_dtype)  # (B, Hkv, 1, M, D)
    o = torch.empty(qg.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(qg.shape[:-1], dtype=acc_dtype, device=q.device)
    for start_m in range(0, n, block_m):
        b_q = _load_rows(qg, start_m, block_m)  # [.., BLOCK_M, D]
        m_i = torch.full(b_q.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)  # [.., BLOCK_M]
        l_i = torch.zeros_like(m_i)  # [.., BLOCK_M]
        acc = torch.zeros_like(b_q)  # [.., BLOCK_M, D]
        full_end, hi = schedule.forward_key_range(start_m, block_m, block_n, n, m, causal)
        for start_n in range(0, hi, block_n):
            b_k = _load_rows(kf, start_n, block_n)  # [.., BLOCK_N, D]
            b_v = _load_rows(vf, start_n, block_n)  # [.., BLOCK_N, D]
            s = (b_q @ b_k.transpose(-1, -2)) * qk_scale  # [.., BLOCK_M, BLOCK_N], base-2 scores
            if start_n >= full_end:
                # Out-of-range keys go to -inf *before* the max: a zero-padded key would score 0,
                # inflate l_i by 2^(-m_i) and become the max of a row whose real scores are negative.
                mask = _score_mask(start_m, start_n, block_m, block_n, n, m, causal, q.device)
                s = s.masked_fill(~mask, float("-inf"))
            m_new = torch.maximum(m_i, s.amax(dim=-1))
            # A row that has seen only masked keys has m_new = -inf; exp2(-inf - (-inf)) would be NaN,
            # so such a row pivots at 0 and keeps p = exp2(-inf) = 0.
            m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            p = torch.exp2(s - m_safe[..., None])  # [.., BLOCK_M, BLOCK_N]
            alpha = torch.exp2(m_i - m_safe)  # rescales the old state to the new pivot
            l_i = l_i * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + p @ b_v
            m_i = m_new
        # Epilogue: normalize, and store the log-sum-exp (natural log) for the backward pass.
        empty = l_i == 0  # rows that saw no key: o = 0, lse = -inf
        b_o = acc / torch.where(empty, torch.ones_like(l_i), l_i)[..., None]
        b_lse = (m_i + torch.log2(l_i)) * LN2  # log2(0) = -inf keeps empty rows at -inf
        rows = slice(start_m, min(start_m + block_m, n))
        width = rows.stop - rows.start  # a ragged last block stores only its real rows
        o[..., rows, :] = b_o[..., :width, :].to(q.dtype)
        lse[..., rows] = b_lse[..., :width]
    return o.reshape(b, h_q, n, d), lse.reshape(b, h_q, n)
# --8<-- [end:online-forward]


# --8<-- [start:online-backward]
def online_backward(
    do, q, k, v, o, lse, causal: bool = False, scale: float | None = None, block_m: int = 64, block_n: int = 64,
    dlse=None,
):
    """Tile-by-tile backward: preprocess D, then the dK/dV loop and the dQ loop, recomputing P from lse.

    Returns ``(dq, dk, dv)`` with the shapes and dtypes of q, k, v. dK and dV of a key/value head sum the
    contributions of every query head of its group. ``dlse`` (B, Hq, N), when given, is the gradient
    that reached the LSE output; it joins D (dS = P * (dP - (D - dLSE))).
    """
    b, h_q, n, d = q.shape
    h_kv, m = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    acc_dtype = _acc_dtype(q)
    qk_scale = scale * LOG2E
    qg, dog, og = (_group(x, h_kv).to(acc_dtype) for x in (q, do, o))  # (B, Hkv, G, N, D)
    kf, vf = k.unsqueeze(2).to(acc_dtype), v.unsqueeze(2).to(acc_dtype)  # (B, Hkv, 1, M, D)
    lse2 = lse.reshape(qg.shape[:-1]).to(acc_dtype) * LOG2E  # base-2 log-sum-exp per row

    # Preprocess: D_i = rowsum(dO_i * O_i) equals rowsum(P_i * dP_i) (the D identity), an N x d
    # reduction instead of an N x M one.
    delta = (dog * og).sum(dim=-1)  # (B, Hkv, G, N)
    if dlse is not None:
        delta = delta - dlse.reshape(delta.shape).to(acc_dtype)  # dLSE_i / dS_ij = P_ij

    def recompute_p(b_q, b_k, b_lse2, start_m, start_n, masked):
        s = (b_q @ b_k.transpose(-1, -2)) * qk_scale  # [.., BLOCK_M, BLOCK_N]
        # A row with no visible key has lse = -inf; pivoting it at 0 keeps exp2 finite, and the mask
        # below zeroes the row anyway (it lies entirely in masked tiles).
        b_lse2 = torch.where(b_lse2 == float("-inf"), torch.zeros_like(b_lse2), b_lse2)
        p = torch.exp2(s - b_lse2[..., None])
        if masked:
            mask = _score_mask(start_m, start_n, block_m, block_n, n, m, causal, q.device)
            p = torch.where(mask, p, torch.zeros_like(p))
        return p

    dk = torch.empty(kf.shape[:2] + (m, d), dtype=k.dtype, device=k.device)
    dv = torch.empty_like(dk, dtype=v.dtype)
    # dK/dV: one key block at a time; loop over the query blocks that can see it.
    for start_n in range(0, m, block_n):
        b_k = _load_rows(kf, start_n, block_n)  # [.., BLOCK_N, D]
        b_v = _load_rows(vf, start_n, block_n)  # [.., BLOCK_N, D]
        b_dk = torch.zeros(qg.shape[:3] + (block_n, d), dtype=acc_dtype, device=q.device)
        b_dv = torch.zeros_like(b_dk)
        lo, full_start, full_end = schedule.backward_query_range(start_n, block_m, block_n, n, m, causal)
        for start_m in range(lo, n, block_m):
            # Tiles on the diagonal, on the ragged last query block, or on a ragged key block are masked.
            # Padding rows (>= n) must contribute nothing: unmasked, their P could overflow and turn
            # dS = P * (dP - D) into NaN even though their dO is zero.
            masked = start_m < full_start or start_m >= full_end
            b_q = _load_rows(qg, start_m, block_m)
            b_do = _load_rows(dog, start_m, block_m)
            b_lse2 = _load_vec(lse2, start_m, block_m, 0.0)
            b_delta = _load_vec(delta, start_m, block_m, 0.0)
            p = recompute_p(b_q, b_k, b_lse2, start_m, start_n, masked)  # [.., BLOCK_M, BLOCK_N]
            b_dv += p.transpose(-1, -2) @ b_do  # dV = P^T dO
            dp = b_do @ b_v.transpose(-1, -2)  # dP = dO V^T
            ds = p * (dp - b_delta[..., None])  # dS = P * (dP - D)
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
        # The forward's key walk, except that a ragged last query block masks every tile.
        full_end, hi = schedule.dq_key_range(start_m, block_m, block_n, n, m, causal)
        for start_n in range(0, hi, block_n):
            b_k = _load_rows(kf, start_n, block_n)
            b_v = _load_rows(vf, start_n, block_n)
            p = recompute_p(b_q, b_k, b_lse2, start_m, start_n, start_n >= full_end)
            dp = b_do @ b_v.transpose(-1, -2)
            ds = p * (dp - b_delta[..., None])
            b_dq += ds @ b_k  # dQ = scale * dS K (scale applied once, below)
        rows = slice(start_m, min(start_m + block_m, n))
        width = rows.stop - rows.start
        dq[..., rows, :] = (b_dq * scale)[..., :width, :].to(q.dtype)
    return dq.reshape(b, h_q, n, d), dk, dv
# --8<-- [end:online-backward]
