"""The attention variants: sliding window, softcap, ALiBi and dropout, alone and together.

Every kernel result is judged against :func:`flashattn.reference.naive_attention` in float64 with the
ratio rule of :func:`flashattn.testing.assert_close_ratio` (error at most twice PyTorch's own in the
same low precision). Dropout is judged the same way *given the same mask*: the reference draws the
kernels' Philox mask from the same seed, so a kernel that dropped other entries fails by far. Without
CUDA the kernels run under Triton's interpreter on tiny shapes; the ``gpu`` tests repeat the checks
at realistic sizes.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashattn
from flashattn import device_helpers, launch as launch_mod, tensors, reference, schedule
from flashattn.problem import Problem
from flashattn.reference import dropout_keep_at, dropout_keep_mask, naive_attention, online_backward, online_forward
from flashattn.testing import assert_block_grid_is_exact, assert_close_ratio, random_qkv

from devices import DEVICE, cpu_only, gpu, needs_cuda

device_keep = device_helpers.dropout_keep  # a module global, so the test kernel below can call it


def _inputs(b, h_q, h_kv, n, m, d, dtype, *, std=1.0, seed=0, layout="bhnd", device=DEVICE):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = random_qkv(b, h_q, h_kv, n, m, d, dtype=dtype, device=device, generator=gen, std=std, layout=layout)
    do = torch.randn(q.shape, dtype=dtype, device=device, generator=gen)
    return q, k, v, do


def _slopes(b, h_q, per_batch=False, device=DEVICE):
    # The geometric slopes of the ALiBi paper, 2^(-8 h / H), times a per-batch factor when asked.
    base = torch.tensor([2.0 ** (-8.0 * (h + 1) / h_q) for h in range(h_q)], dtype=torch.float32)
    slopes = base[None, :] * torch.linspace(0.5, 2.0, b)[:, None] if per_batch else base
    return slopes.to(device)


def _naive(q, k, v, do, causal, scale, dtype, **variants):
    """(o, lse, dq, dk, dv) of the naive reference in ``dtype``, gradients by autograd."""
    qr, kr, vr = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    o, lse = naive_attention(qr, kr, vr, causal, scale, **variants)
    o.backward(do.to(dtype))
    return o.detach(), lse.detach(), qr.grad, kr.grad, vr.grad


def _check(q, k, v, do, causal=False, scale=None, *, floor=1e-5, **variants):
    """flashattn.attention (forward, LSE and the gradients of o) against float64; returns the outputs."""
    seed = variants.get("seed")
    qa, ka, va = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o, lse = flashattn.attention(qa, ka, va, causal=causal, scale=scale, return_lse=True, **variants)
    o.backward(do)
    got = (o.detach(), lse.detach(), qa.grad, ka.grad, va.grad)
    ref_variants = dict(variants)
    if ref_variants.get("dropout_p", 0) > 0:
        ref_variants["seed"] = seed
    ref = _naive(q, k, v, do, causal, scale, torch.float64, **ref_variants)
    lowp = _naive(q, k, v, do, causal, scale, q.dtype, **ref_variants)
    for name, x, r, lp in zip(("o", "lse", "dq", "dk", "dv"), got, ref, lowp):
        assert torch.isfinite(x[torch.isfinite(r)]).all(), f"{name}: NaN or inf"
        assert_close_ratio(name, x, r, lp, floor=floor)
    return got


def _visible(n, m, causal, window, device=DEVICE):
    rows = torch.arange(n, device=device)[:, None]
    cols = torch.arange(m, device=device)[None, :]
    mask = schedule.visible(rows, cols, n, m, causal)
    if window is not None:
        mask = mask & schedule.in_window(rows, cols, n, m, *schedule.window_bounds(n, m, causal, window))
    return mask


def _empty_rows_are_zero(o, lse, dq, n, m, causal, window):
    """Rows whose window holds no key: o = 0, lse = -inf, dq = 0; every other row has a finite lse."""
    empty = ~_visible(n, m, causal, window, o.device).any(dim=1)
    assert (o[:, :, empty] == 0).all() and (dq[:, :, empty] == 0).all()
    assert (lse[:, :, empty] == float("-inf")).all()
    assert torch.isfinite(lse[:, :, ~empty]).all()
    return int(empty.sum())


# ----------------------------------------------------------------------------------------------
# The schedule under a window: exact, and O(N * w)
# ----------------------------------------------------------------------------------------------

WINDOW_SIDE = st.sampled_from([None, 0, 1, 3, 16, 17, 40, 500])


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 150), m=st.integers(1, 150), block_m=st.sampled_from([16, 32, 64]),
       block_n=st.sampled_from([16, 32, 64]), causal=st.booleans(), left=WINDOW_SIDE, right=WINDOW_SIDE)
def test_window_schedule_is_exact(n, m, block_m, block_n, causal, left, right):
    """Skipped tiles hold no visible pair, full tiles no hidden one, and every walk (forward, dQ, dK/dV)
    covers every visible pair, with block-aligned unmasked ranges."""
    window = (left, right)
    mask = _visible(n, m, causal, window, "cpu")
    grid = schedule.block_grid(n, m, block_m, block_n, causal, window=window)
    assert_block_grid_is_exact(mask, grid, block_m, block_n)
    for bi, row in enumerate(grid):  # a whole tile that sees all its pairs is full (the last, ragged
        for bj, kind in enumerate(row):  # query block's window is taken over block_m rows: not checked)
            tile = mask[bi * block_m:(bi + 1) * block_m, bj * block_n:(bj + 1) * block_n]
            assert kind == schedule.FULL or not (tile.all() and tile.shape == (block_m, block_n)), (bi, bj, kind)
    left_k, right_k = schedule.window_bounds(n, m, causal, window)
    for start_m in range(0, n, block_m):
        lo, full_start, full_end, hi = schedule.window_dq_key_range(start_m, block_m, block_n, n, m, left_k, right_k)
        assert lo <= full_start <= full_end <= hi <= m and lo % block_n == 0
        rows = mask[start_m:start_m + block_m]
        assert not rows[:, :lo].any() and not rows[:, hi:].any()
        for start_n in range(full_start, full_end, block_n):
            tile = rows[:, start_n:start_n + block_n]
            assert start_n % block_n == 0 and tile.shape == (block_m, block_n) and tile.all()
    for start_n in range(0, m, block_n):
        lo, full_start, full_end, hi = schedule.window_query_range(start_n, block_m, block_n, n, m, left_k, right_k)
        assert lo <= full_start <= full_end <= hi <= n and lo % block_m == 0
        cols = mask[:, start_n:start_n + block_n]
        assert not cols[:lo].any() and not cols[hi:].any()
        for start_m in range(full_start, full_end, block_m):
            tile = cols[start_m:start_m + block_m]
            assert start_m % block_m == 0 and tile.shape == (block_m, block_n) and tile.all()


def test_window_costs_o_n_w():
    """A window of w keys visits about (w + block) / block_n key blocks per query block, not M / block_n."""
    n = m = 16384
    block, w = 128, 4096
    grid = schedule.block_grid(n, m, block, block, True, window=(w, 0))
    visited = sum(kind != schedule.SKIPPED for row in grid for kind in row)
    per_row = (w + block) // block + 1  # the window's blocks, plus one for the diagonal and one for the left edge
    assert visited <= (n // block) * per_row
    assert visited < 0.3 * (n // block) * (m // block)  # causal alone would visit about half


def test_window_bounds_and_problem_normalization():
    assert schedule.window_bounds(10, 12, False, (None, None)) == (12, 10)
    assert schedule.window_bounds(10, 12, True, (3, 5)) == (3, 0)  # causal caps the right side at 0
    q, k = torch.zeros(1, 2, 10, 16), torch.zeros(1, 2, 12, 16)
    assert Problem.of(q, k, True, window=(None, 4)).window is None  # the same as causal alone
    assert Problem.of(q, k, False, window=(11, 9)).window is None  # reaches every key
    assert Problem.of(q, k, False, window=(3, None)).window == (3, 10)
    assert Problem.of(q, k, True, window=(3, None)).window == (3, 0)


# ----------------------------------------------------------------------------------------------
# The references: tile-by-tile against naive, float64
# ----------------------------------------------------------------------------------------------

REF_VARIANTS = [
    dict(window=(5, 3)),
    dict(window=(0, 0)),  # only the diagonal key: N > M empties rows
    dict(window=(None, 2)),
    dict(window=(7, None)),
    dict(softcap=2.0),
    dict(alibi="heads"),
    dict(alibi="batch"),
    dict(dropout_p=0.3, seed=1234),
    dict(window=(4, 6), softcap=1.5, alibi="heads", dropout_p=0.2, seed=99),
]


def _materialize(variants, b, h_q, device="cpu"):
    variants = dict(variants)
    if variants.get("alibi"):
        variants["alibi_slopes"] = _slopes(b, h_q, variants.pop("alibi") == "batch", device)
    variants.pop("alibi", None)
    return variants


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variants", REF_VARIANTS, ids=lambda v: "-".join(f"{k}={v[k]}" for k in v))
@pytest.mark.parametrize("shape", [(2, 4, 2, 37, 53, 24), (1, 4, 1, 70, 29, 16)], ids=["N<M-gqa2", "N>M-mqa"])
def test_online_reference_matches_naive(shape, variants, causal):
    b, h_q, h_kv, n, m, d = shape
    variants = _materialize(variants, b, h_q)
    q, k, v, do = _inputs(b, h_q, h_kv, n, m, d, torch.float64, device="cpu", seed=1)
    o, lse, dq, dk, dv = _naive(q, k, v, do, causal, None, torch.float64, **variants)
    o2, lse2 = online_forward(q, k, v, causal, None, 16, 32, **variants)
    dq2, dk2, dv2 = online_backward(do, q, k, v, o2, lse2, causal, None, 16, 32, **variants)
    for name, got, want in (("o", o2, o), ("lse", lse2, lse), ("dq", dq2, dq), ("dk", dk2, dk), ("dv", dv2, dv)):
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got)), name
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-10, atol=1e-10, msg=name)


def test_naive_variants_follow_their_definitions():
    """naive_attention against the formulas written out: a different order of cap, bias and mask fails."""
    q, k, v, _ = _inputs(2, 2, 2, 9, 13, 16, torch.float64, device="cpu", seed=4)
    slopes = _slopes(2, 2, per_batch=True, device="cpu")
    cap, scale, window = 1.5, 0.7, (2, 1)
    s = scale * q @ k.transpose(-1, -2)
    s = cap * torch.tanh(s / cap)
    i = torch.arange(9)[:, None]
    j = torch.arange(13)[None, :]
    s = s - slopes[:, :, None, None] * (i + 13 - 9 - j).abs()
    hidden = (j < i + 4 - 2) | (j > i + 4 + 1)
    p = torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1)
    o, _ = naive_attention(q, k, v, False, scale, window=window, softcap=cap, alibi_slopes=slopes)
    torch.testing.assert_close(o, p @ v, rtol=1e-12, atol=1e-12)
    # the bias before the cap is another function: the check can tell
    s_wrong = scale * q @ k.transpose(-1, -2) - slopes[:, :, None, None] * (i + 4 - j).abs()
    p_wrong = torch.softmax((cap * torch.tanh(s_wrong / cap)).masked_fill(hidden, float("-inf")), dim=-1)
    assert (o - p_wrong @ v).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------
# Philox: the reference's words are Triton's, bit for bit
# ----------------------------------------------------------------------------------------------

@cpu_only
def test_torch_philox_matches_triton_bit_for_bit():
    """Raw Philox words of tl.philox against reference.philox, with counters near 2^32 and a 62-bit seed."""
    import triton
    import triton.language as tl

    @triton.jit
    def words(C0, C1, C2, OUT, seed_lo, seed_hi, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        c0 = tl.load(C0 + offs).to(tl.uint32)
        c1 = tl.load(C1 + offs).to(tl.uint32)
        c2 = tl.load(C2 + offs).to(tl.uint32)
        seed = (seed_hi.to(tl.int64) << 31) | seed_lo.to(tl.int64)
        r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c2 * 0)
        tl.store(OUT + offs, r0.to(tl.int64) & 0xFFFFFFFF)
        tl.store(OUT + 64 + offs, r3.to(tl.int64) & 0xFFFFFFFF)

    gen = torch.Generator().manual_seed(0)
    counters = [torch.randint(0, 2**32, (64,), generator=gen, dtype=torch.int64) for _ in range(3)]
    counters[0][:4] = torch.tensor([0, 1, 2**32 - 1, 2**31])
    for seed in (0, 12345, 2**62 - 1):
        out = torch.empty(128, dtype=torch.int64)
        # int32 views of the unsigned counters, as the kernels hold them
        c32 = [torch.where(c >= 2**31, c - 2**32, c).to(torch.int32) for c in counters]
        words[(1,)](*c32, out, seed & (2**31 - 1), seed >> 31, BLOCK=64)
        r0, _, _, r3 = reference.philox(seed, counters[0], counters[1], counters[2], torch.zeros(64, dtype=torch.int64))
        assert torch.equal(out[:64], r0) and torch.equal(out[64:], r3), f"seed {seed}"


@cpu_only
def test_kernel_keep_mask_matches_the_reference_at_large_counters():
    """The kernels' dropout_keep at (b * H + h, i, j) far past 2^16 each (so B * H * N * M >> 2^32)
    equals the reference's: the counters sit in separate words and never wrap."""
    import triton
    import triton.language as tl

    @triton.jit
    def keep_tile(OUT, seed_lo, seed_hi, i_bh, row0, col0, threshold, BM: tl.constexpr, BN: tl.constexpr,
                  TRANSPOSED: tl.constexpr):
        rows = row0 + tl.arange(0, BM)
        keep = device_keep(seed_lo, seed_hi, i_bh, rows, col0, threshold, BN)
        if TRANSPOSED:  # the dK/dV kernel's orientation: (key, query) tiles
            tl.store(OUT + tl.arange(0, BN)[:, None] * BM + tl.arange(0, BM)[None, :], tl.trans(keep).to(tl.int8))
        else:
            tl.store(OUT + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :], keep.to(tl.int8))

    from flashattn.problem import dropout_threshold

    seed, p = 2**40 + 77, 0.37
    for i_bh, row0, col0 in ((0, 0, 0), (70_000, 1_000_000, 3_000_000), (2**31 - 1, 2**31 - 64, 2**31 - 32)):
        want = dropout_keep_at(seed, i_bh, torch.arange(row0, row0 + 16)[:, None], torch.arange(col0, col0 + 32)[None, :], p)
        for bn in (16, 32):  # one tile or two tiles of keys: the same bits
            for transposed in (False, True):
                out = torch.empty(32 // bn, bn, 16, dtype=torch.int8) if transposed else torch.empty(32 // bn, 16, bn, dtype=torch.int8)
                for t in range(32 // bn):
                    keep_tile[(1,)](out[t], seed & (2**31 - 1), seed >> 31, i_bh, row0, col0 + t * bn,
                                    dropout_threshold(p), BM=16, BN=bn, TRANSPOSED=transposed)
                got = torch.cat([o.T if transposed else o for o in out], dim=1)
                assert torch.equal(got.bool(), want), (i_bh, bn, transposed)


def test_keep_mask_statistics_and_independence():
    """The kept fraction is 1 - p within 5 sigma; heads, rows and seeds draw different masks."""
    p = 0.1
    mask = dropout_keep_mask(2024, 2, 4, 128, 160, p)
    count = mask.numel()
    sigma = math.sqrt(p * (1 - p) / count)
    assert abs(mask.float().mean().item() - (1 - p)) < 5 * sigma
    flat = mask.reshape(8, -1).float()
    assert (flat[0] != flat[1]).any() and (mask[0, 0, 0] != mask[0, 0, 1]).any()
    other = dropout_keep_mask(2025, 2, 4, 128, 160, p)
    # two independent masks agree on p^2 + (1 - p)^2 of the entries
    agree = (mask == other).float().mean().item()
    assert abs(agree - (p * p + (1 - p) ** 2)) < 5 * math.sqrt(0.18 * 0.82 / count)
    # negative control: a counter scheme that ignored the head would repeat the mask across heads
    assert not torch.equal(mask[:, 0], mask[:, 1])
    # eight keys share one draw: neighbours (the two halves of a word, and neighbouring words) are
    # dropped together p^2 of the time, as independent entries are
    for lag in (1, 2):
        both = (~mask[..., :-lag] & ~mask[..., lag:]).float()
        assert abs(both.mean().item() - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / both.numel())


def test_drop_probability_rounds_down_to_sixteen_bits():
    """The drop probability is floor(p * 2^16) / 2^16: exact at multiples of 2^-16, 0 below 2^-16."""
    from flashattn.problem import dropout_threshold

    assert dropout_threshold(0.25) == 2**14 and dropout_threshold(0.1) == 6553
    assert dropout_threshold(2.0**-17) == 0 and dropout_threshold(1 - 2.0**-16) == 2**16 - 1
    # p = 1/4 exactly: over 2^16 entries of one row the count of drops is near 1/4 of them
    keep = dropout_keep_at(7, 0, torch.zeros(1, 1, dtype=torch.int64), torch.arange(2**16)[None, :], 0.25)
    assert abs((~keep).float().mean().item() - 0.25) < 5 * math.sqrt(0.25 * 0.75 / 2**16)
    assert dropout_keep_at(7, 0, torch.zeros(1, 1, dtype=torch.int64), torch.arange(4096)[None, :], 2.0**-17).all()


# ----------------------------------------------------------------------------------------------
# Kernels under the interpreter (tiny shapes; BLOCK_M = 32, BLOCK_N = 16 forward and dQ, 16 x 32 dK/dV)
# ----------------------------------------------------------------------------------------------

# (name, (B, Hq, Hkv, N, M, D), causal, variants)
KERNEL_CASES = [
    ("window-ragged", (1, 2, 2, 37, 53, 24), False, dict(window=(5, 3))),
    ("window-causal-gqa", (1, 4, 2, 45, 45, 40), True, dict(window=(9, None))),
    ("window-empties-rows", (1, 2, 1, 70, 29, 16), False, dict(window=(0, 0))),
    ("window-left-only", (1, 2, 2, 33, 64, 72), False, dict(window=(17, None))),
    ("window-right-only-N>M", (1, 2, 2, 50, 19, 24), False, dict(window=(None, 1))),
    # D > 64: the head dim padded to BLOCK_D = 128, where the backward's window takes its own tiles
    ("window-causal-d80", (1, 2, 1, 45, 61, 80), True, dict(window=(9, None))),
    ("window-both-sides-N>M-d96", (1, 2, 2, 50, 37, 96), False, dict(window=(6, 4))),
    ("softcap", (1, 2, 2, 37, 53, 24), True, dict(softcap=3.0)),
    ("alibi-heads", (1, 4, 2, 37, 53, 24), False, dict(alibi="heads")),
    ("alibi-batch-causal", (2, 2, 1, 29, 29, 16), True, dict(alibi="batch")),
    ("dropout", (1, 2, 2, 37, 53, 24), False, dict(dropout_p=0.3, seed=12345)),
    ("dropout-causal-gqa", (2, 4, 1, 40, 33, 16), True, dict(dropout_p=0.1, seed=2**62 - 1)),
    ("all", (1, 4, 2, 45, 33, 40), False, dict(window=(7, 9), softcap=2.0, alibi="heads", dropout_p=0.2, seed=5)),
    ("all-causal-empty-rows", (1, 2, 1, 60, 24, 24), True,
     dict(window=(3, None), softcap=5.0, alibi="batch", dropout_p=0.15, seed=77)),
]


@cpu_only
@pytest.mark.parametrize("name,shape,causal,variants", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_interpreter_variants_match_float64(name, shape, causal, variants):
    b, h_q, h_kv, n, m, d = shape
    variants = _materialize(variants, b, h_q)
    q, k, v, do = _inputs(b, h_q, h_kv, n, m, d, torch.float16, seed=len(name))
    o, lse, dq, _, _ = _check(q, k, v, do, causal, **variants)
    if "window" in variants:
        _empty_rows_are_zero(o, lse, dq, n, m, causal, variants["window"])


@cpu_only
def test_interpreter_window_rows_emptied_are_zero():
    """N > M with a window that keeps only the diagonal key: 41 rows see nothing."""
    q, k, v, do = _inputs(1, 2, 1, 70, 29, 16, torch.float16, seed=9)
    o, lse, dq, _, _ = _check(q, k, v, do, False, window=(0, 0))
    assert _empty_rows_are_zero(o, lse, dq, 70, 29, False, (0, 0)) == 41


@cpu_only
def test_interpreter_softcap_with_huge_logits():
    """Scores near 100 capped at 20: tanh saturates, nothing overflows, the gradient through the cap vanishes
    where it should and matches float64 elsewhere."""
    q, k, v, do = _inputs(1, 2, 1, 41, 37, 32, torch.float16, std=4.5, seed=3)
    s = 32 ** -0.5 * (q.double() @ k.double().repeat_interleave(2, dim=1).transpose(-1, -2))
    assert s.abs().max() > 60, "inputs do not produce large logits"
    _check(q, k, v, do, True, softcap=20.0)


@cpu_only
def test_interpreter_dropout_drops_exactly_the_reference_entries():
    """With V = I (M <= D) the output row i is P_i * Z_i / (1 - p): its zeros are the dropped entries,
    and they are the reference's mask bit for bit, for every batch and head. The seed draws one lane
    equal to the threshold, which is kept (a draw below it is dropped)."""
    b, h, n, m, d, p, seed = 2, 3, 40, 24, 32, 0.25, 31341
    ties = dropout_keep_mask(seed, b, h, n, m, p) != dropout_keep_mask(seed, b, h, n, m, p + 2 ** -16)
    assert int(ties.sum()) == 1  # the one entry whose lane equals floor(p * 2^16)
    q, k, _, _ = _inputs(b, h, h, n, m, d, torch.float16, std=0.3, seed=2)
    v = torch.zeros(b, h, m, d, dtype=torch.float16)
    v[:, :, torch.arange(m), torch.arange(m)] = 1.0
    o = flashattn.attention(q, k, v, dropout_p=p, seed=seed)
    kept = o[..., :m] != 0
    assert torch.equal(kept, dropout_keep_mask(seed, b, h, n, m, p))
    # and the kept entries are P / (1 - p)
    p_ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) / math.sqrt(d), dim=-1)
    torch.testing.assert_close(o[..., :m].double()[kept], (p_ref / (1 - p))[kept], rtol=2e-3, atol=1e-4)


@cpu_only
def test_interpreter_window_edges_at_every_offset():
    """The window's bounds at every offset of the right (and left) edge against the kernels' key
    blocks (16 keys forward and dQ, 32 dK/dV): a bound off by one key shows up at one residue only,
    so each residue is run, against float64."""
    for n, m in ((32, 32), (20, 37)):
        q, k, v, do = _inputs(1, 1, 1, n, m, 16, torch.float16, seed=n)
        for right in range(33):
            _check(q, k, v, do, window=(None, right))
    q, k, v, do = _inputs(1, 1, 1, 32, 32, 16, torch.float16, seed=3)
    for left in range(33):
        _check(q, k, v, do, causal=True, window=(left, 0))


@gpu
@needs_cuda
def test_gpu_window_edges_at_every_offset():
    """The GPU tiles' version of test_interpreter_window_edges_at_every_offset: the window's right edge
    at every offset up to 129 keys (past the largest key block, 128), and its left edge likewise."""
    q, k, v, do = _inputs(1, 2, 1, 200, 200, 64, torch.bfloat16, seed=4)
    # floor 1e-4: at window (0, 0) each row sees one key, P = 1 and dS = dP - delta cancels to zero in
    # exact arithmetic; torch's bfloat16 reference gets exactly 0 there, the kernels' float32 dP and delta
    # (summed in other orders) leave ~1e-5 in dQ. A bound one key off errs by 1e-2 or more.
    for side in range(130):
        _check(q, k, v, do, window=(None, side), floor=1e-4)
        _check(q, k, v, do, causal=True, window=(side, 0), floor=1e-4)


@cpu_only
def test_interpreter_dropout_is_repeatable_and_seeded():
    q, k, v, do = _inputs(1, 2, 2, 37, 29, 16, torch.float16, seed=8)

    def run(**kw):
        qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
        o, lse = flashattn.attention(qa, ka, va, dropout_p=0.2, return_lse=True, **kw)
        o.backward(do)
        return o.detach(), lse.detach(), qa.grad, ka.grad, va.grad

    first, second = run(seed=42), run(seed=42)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    other = run(seed=43)
    assert not torch.equal(first[0], other[0])
    assert torch.equal(first[1], other[1])  # the LSE does not see dropout
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for a, b in zip(run(generator=gen_a), run(generator=gen_b)):
        assert torch.equal(a, b)
    torch.manual_seed(11)
    default_a = run()
    torch.manual_seed(11)
    for a, b in zip(default_a, run()):
        assert torch.equal(a, b)


@cpu_only
def test_interpreter_flash_attn_func_variants():
    q, k, v, _ = _inputs(1, 4, 2, 30, 30, 16, torch.float16, seed=6, layout="bnhd")
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, N, H, D) tensors, non-contiguous
    slopes = _slopes(1, 4)
    out = flashattn.flash_attn_func(q, k, v, causal=True, window_size=(5, -1), softcap=8.0, alibi_slopes=slopes)
    want = flashattn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                               window=(5, None), softcap=8.0, alibi_slopes=slopes).transpose(1, 2)
    assert torch.equal(out, want)
    plain = flashattn.flash_attn_func(q, k, v, window_size=(-1, -1))
    assert torch.equal(plain, flashattn.flash_attn_func(q, k, v))
    gen = torch.Generator().manual_seed(3)
    dropped = flashattn.flash_attn_func(q, k, v, dropout_p=0.5, generator=gen)
    assert not torch.equal(dropped, plain)


# ----------------------------------------------------------------------------------------------
# The CPU reference path (float32/float64 on the CPU run the tile-by-tile reference), ops, compile
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variants", REF_VARIANTS[:2] + REF_VARIANTS[4:], ids=lambda v: "-".join(f"{k}" for k in v))
def test_cpu_reference_path_gradients_match_float64(variants, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    variants = _materialize(variants, 1, 4)
    q, k, v, do = _inputs(1, 4, 2, 21, 26, 16, torch.float64, device="cpu", seed=12)
    _check(q, k, v, do, True, floor=1e-10, **variants)


def _ops_args(variants):
    window = variants.get("window", (None, None))
    return (-1 if window[0] is None else window[0], -1 if window[1] is None else window[1],
            variants.get("softcap", 0.0), variants.get("alibi_slopes"), variants.get("dropout_p", 0.0),
            variants.get("seed", 0))


@pytest.mark.parametrize("variants", [dict(window=(3, 2)), dict(softcap=2.0, alibi="heads"),
                                      dict(dropout_p=0.3, seed=9, window=(None, 0))], ids=["window", "cap-alibi", "dropout"])
def test_opcheck_with_variants(variants, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    variants = _materialize(variants, 1, 4)
    q, k, v, _ = _inputs(1, 4, 2, 7, 11, 16, torch.float64, device="cpu", layout="bnhd")
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    extra = _ops_args(variants)
    torch.library.opcheck(torch.ops.flashattn.attention_forward.default, (q, k, v, True, 0.3, *extra))
    o, lse = torch.ops.flashattn.attention_forward(q, k, v, True, 0.3, *extra)
    args = (torch.randn_like(o), q.detach(), k.detach(), v.detach(), o.detach(), lse.detach())
    torch.library.opcheck(torch.ops.flashattn.attention_backward.default, (*args, torch.randn_like(lse), True, 0.3, *extra))


def test_compile_fullgraph_with_variants(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch._dynamo.reset()
    slopes = _slopes(1, 2, device="cpu")

    def step(q, k, v, do):
        o, lse = flashattn.attention(q, k, v, causal=True, return_lse=True, window=(4, None), softcap=3.0,
                                     alibi_slopes=slopes, dropout_p=0.2, seed=17)
        return (o * do).sum() + lse.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    q, k, v, do = _inputs(1, 2, 1, 9, 12, 16, torch.float64, device="cpu", seed=3)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    eager = torch.autograd.grad(step(q, k, v, do), (q, k, v))
    got = torch.autograd.grad(compiled(q, k, v, do), (q, k, v))
    for g, e in zip(got, eager):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# Validation: clear errors, before any kernel runs
# ----------------------------------------------------------------------------------------------

q0, k0, v0 = random_qkv(2, 4, 2, 8, 8, 16, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
BAD = [
    ("window not a pair", dict(window=4), TypeError, ["window"]),
    ("window of three", dict(window=(1, 2, 3)), TypeError, ["window"]),
    ("window negative", dict(window=(-1, 2)), ValueError, ["window", "left", ">= 0"]),
    ("window float", dict(window=(1.5, 2)), TypeError, ["window", "left"]),
    ("window bool", dict(window=(1, True)), TypeError, ["window", "right"]),
    ("softcap negative", dict(softcap=-1.0), ValueError, ["softcap"]),
    ("softcap nan", dict(softcap=float("nan")), ValueError, ["softcap"]),
    ("softcap string", dict(softcap="1"), TypeError, ["softcap"]),
    ("alibi list", dict(alibi_slopes=[0.1] * 4), TypeError, ["alibi_slopes", "torch.Tensor"]),
    ("alibi float64", dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), TypeError, ["alibi_slopes", "float32"]),
    ("alibi shape", dict(alibi_slopes=torch.ones(2)), ValueError, ["alibi_slopes", "(Hq,)"]),
    ("alibi batch shape", dict(alibi_slopes=torch.ones(3, 4)), ValueError, ["alibi_slopes", "(B, Hq)"]),
    ("alibi device", dict(alibi_slopes=torch.ones(4, device="meta")), ValueError, ["alibi_slopes", "device"]),
    ("dropout 1", dict(dropout_p=1.0), ValueError, ["dropout_p", "[0, 1)"]),
    ("dropout negative", dict(dropout_p=-0.1), ValueError, ["dropout_p"]),
    ("dropout string", dict(dropout_p="0.1"), TypeError, ["dropout_p"]),
    ("generator not one", dict(dropout_p=0.1, generator=3), TypeError, ["generator"]),
    ("seed and generator", dict(dropout_p=0.1, seed=1, generator=torch.Generator()), ValueError, ["generator", "seed"]),
    ("seed negative", dict(dropout_p=0.1, seed=-1), ValueError, ["seed"]),
    ("seed too large", dict(dropout_p=0.1, seed=2**62), ValueError, ["seed", "2**62"]),
    ("seed float", dict(dropout_p=0.1, seed=1.0), TypeError, ["seed"]),
]


@pytest.mark.parametrize("kwargs,exc,words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_variant_arguments_raise_clear_errors(kwargs, exc, words):
    with pytest.raises(exc) as info:
        flashattn.attention(q0, k0, v0, **kwargs)
    for word in words:
        assert word in str(info.value), f"message {str(info.value)!r} does not name {word!r}"


def test_flash_attn_func_rejects_bad_window_size():
    q, k, v = (x.transpose(1, 2) for x in (q0, k0, v0))
    with pytest.raises(TypeError, match="window_size"):
        flashattn.flash_attn_func(q, k, v, window_size=4)
    with pytest.raises(TypeError, match="window_size"):
        flashattn.flash_attn_func(q, k, v, window_size=(1.0, 2))


def test_alibi_slopes_get_no_gradient(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    slopes = torch.rand(4, requires_grad=True)
    q = q0.clone().requires_grad_()
    flashattn.attention(q, k0, v0, alibi_slopes=slopes).sum().backward()
    assert slopes.grad is None and q.grad is not None


# ----------------------------------------------------------------------------------------------
# GPU: realistic sizes
# ----------------------------------------------------------------------------------------------

# (name, (B, Hq, Hkv, N, M, D), causal, variants)
GPU_CASES = [
    ("window-1k", (2, 8, 8, 1024, 1024, 64), False, dict(window=(256, 256))),
    ("window-causal-gqa", (1, 16, 4, 2048, 2048, 128), True, dict(window=(512, None))),
    # (1, 0), not (0, 0): with one key per row P = 1 and dS = P (dP - delta) is exactly 0, so dQ and dK
    # are rounding residue that no relative error measures; two keys keep the gradients real
    ("window-ragged-N>M-empty", (1, 4, 2, 1500, 700, 96), False, dict(window=(1, 0))),
    ("window-left-kvcache", (2, 8, 2, 300, 2000, 128), True, dict(window=(1000, None))),
    ("softcap", (2, 8, 8, 1024, 1024, 128), True, dict(softcap=30.0)),
    ("softcap-d256", (1, 4, 4, 777, 1025, 256), False, dict(softcap=50.0)),
    ("alibi", (2, 8, 8, 1024, 1024, 64), True, dict(alibi="heads")),
    ("alibi-batch-gqa", (2, 8, 2, 600, 900, 128), False, dict(alibi="batch")),
    ("dropout", (2, 8, 8, 1024, 1024, 64), False, dict(dropout_p=0.1, seed=1)),
    ("dropout-causal-gqa", (2, 8, 2, 1000, 1200, 128), True, dict(dropout_p=0.3, seed=2**61)),
    ("all", (2, 8, 2, 1100, 1300, 128), True,
     dict(window=(300, None), softcap=20.0, alibi="batch", dropout_p=0.1, seed=99)),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name,shape,causal,variants", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_variants_match_float64(name, shape, causal, variants, dtype):
    b, h_q, h_kv, n, m, d = shape
    variants = _materialize(variants, b, h_q, "cuda")
    q, k, v, do = _inputs(b, h_q, h_kv, n, m, d, dtype, seed=len(name))
    o, lse, dq, _, _ = _check(q, k, v, do, causal, **variants)
    if "window" in variants:
        _empty_rows_are_zero(o, lse, dq, n, m, causal, variants["window"])


@gpu
@needs_cuda
def test_gpu_softcap_with_huge_logits():
    q, k, v, do = _inputs(2, 4, 4, 1024, 1024, 64, torch.bfloat16, std=4.5, seed=3)
    _check(q, k, v, do, True, softcap=30.0)


@gpu
@needs_cuda
def test_gpu_dropout_mask_statistics_and_determinism():
    """V = I recovers the mask: it is the reference's bit for bit, its kept fraction is 1 - p within
    5 sigma; the output's mean over seeds approaches the undropped output; same seed, same bits."""
    b, h, n, m, d, p = 4, 16, 1024, 128, 128, 0.1
    q, k, _, _ = _inputs(b, h, h, n, m, d, torch.float16, std=0.3, seed=2)
    v = torch.zeros(b, h, m, d, dtype=torch.float16, device="cuda")
    v[:, :, torch.arange(m), torch.arange(m)] = 1.0
    o = flashattn.attention(q, k, v, dropout_p=p, seed=123)
    kept = o[..., :m] != 0
    assert torch.equal(kept, dropout_keep_mask(123, b, h, n, m, p, "cuda"))
    sigma = math.sqrt(p * (1 - p) / kept.numel())
    assert abs(kept.float().mean().item() - (1 - p)) < 5 * sigma
    assert torch.equal(o, flashattn.attention(q, k, v, dropout_p=p, seed=123))
    # E[O] = O without dropout: average 64 seeds on a random V
    q, k, v, _ = _inputs(1, 4, 4, 256, 256, 64, torch.float16, seed=5)
    plain = flashattn.attention(q, k, v).double()
    mean = sum(flashattn.attention(q, k, v, dropout_p=p, seed=s).double() for s in range(64)) / 64
    spread = torch.stack([flashattn.attention(q, k, v, dropout_p=p, seed=s).double() for s in range(8)]).std(0)
    err = (mean - plain).abs()
    assert (err <= 6 * spread / 8 + 1e-3).float().mean() > 0.99


@gpu
@needs_cuda
def test_gpu_dropout_gradients_are_deterministic():
    q, k, v, do = _inputs(2, 8, 2, 1024, 1024, 128, torch.bfloat16, seed=4)

    def run():
        qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
        flashattn.attention(qa, ka, va, causal=True, dropout_p=0.2, seed=5, window=(256, None)).backward(do)
        return qa.grad, ka.grad, va.grad

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


@gpu
@needs_cuda
def test_gpu_window_compiled_matches_eager():
    torch._dynamo.reset()
    q, k, v, _ = _inputs(1, 8, 8, 2048, 2048, 128, torch.bfloat16, seed=7)
    fn = torch.compile(lambda q, k, v: flashattn.attention(q, k, v, causal=True, window=(256, None), softcap=30.0),
                       fullgraph=True)
    assert torch.equal(fn(q, k, v), flashattn.attention(q, k, v, causal=True, window=(256, None), softcap=30.0))
