"""The PyTorch references against PyTorch itself, in float64.

The naive reference is checked against ``scaled_dot_product_attention`` (forward) and its own autograd
(backward); the tile-by-tile online reference, forward and explicit backward, is checked against the
naive one over ragged lengths, N != M, causal with empty rows, GQA, odd head dims, non-contiguous inputs
and block sizes that do and do not divide N and M.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashattn import cost, reference, schedule
from flashattn.reference import causal_mask, naive_attention, online_backward, online_forward
from flashattn.testing import assert_block_grid_is_exact, random_qkv

TOL = 1e-10  # float64 against float64: only rounding separates the two algorithms


def naive_grads(q, k, v, causal, scale, do):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o, lse = naive_attention(q, k, v, causal, scale)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    return o.detach(), lse, dq, dk, dv


def assert_same(name, got, want):
    assert not torch.isnan(got).any(), f"{name} has NaN"
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)), f"{name}: infinities in different places"
    if finite.any():
        err = (got[finite] - want[finite]).abs().max().item()
        assert err < TOL, f"{name}: max abs error {err:.2e}"


def sdpa_reference(q, k, v, causal, scale):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = causal_mask(q.shape[2], k.shape[2]) if causal else None
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


SHAPES = [
    # (B, Hq, Hkv, N, M, D)
    (2, 4, 4, 64, 64, 64),
    (1, 2, 1, 37, 53, 24),  # ragged, N < M, MQA
    (1, 4, 2, 53, 37, 40),  # ragged, N > M: causal rows with no key
    (2, 8, 1, 17, 129, 16),  # MQA, long keys
    (1, 8, 8, 100, 20, 72),  # N >> M
    (1, 4, 1, 33, 33, 96),
    (1, 2, 2, 1, 1, 128),  # one query, one key
    (1, 4, 2, 7, 300, 256),  # decoding-like: few queries, many keys
    (1, 16, 2, 48, 48, 64),  # GQA group of 8
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_naive_matches_sdpa(shape, causal):
    b, h_q, h_kv, n, m, d = shape
    q, k, v = random_qkv(b, h_q, h_kv, n, m, d, generator=torch.Generator().manual_seed(hash(shape) % 2**31))
    o, lse = naive_attention(q, k, v, causal)
    want = sdpa_reference(q, k, v, causal, 1 / math.sqrt(d))
    seen = causal_mask(n, m).any(dim=1) if causal else torch.ones(n, dtype=torch.bool)
    # SDPA leaves rows with no visible key undefined; flashattn defines them as 0 with LSE -inf.
    assert_same("o", o[..., seen, :], want[..., seen, :])
    assert torch.all(o[..., ~seen, :] == 0)
    assert torch.all(lse[..., ~seen] == float("-inf"))
    assert_same("lse", lse[..., seen], torch.logsumexp(
        (q @ k.repeat_interleave(h_q // h_kv, 1).transpose(-1, -2) / math.sqrt(d)).masked_fill(
            ~causal_mask(n, m) if causal else torch.zeros(n, m, dtype=torch.bool), float("-inf")), -1)[..., seen])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("blocks", [(16, 16), (32, 16), (16, 64), (64, 64)])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_online_matches_naive(shape, blocks, causal):
    b, h_q, h_kv, n, m, d = shape
    block_m, block_n = blocks
    gen = torch.Generator().manual_seed(1 + hash((shape, blocks)) % 2**31)
    q, k, v = random_qkv(b, h_q, h_kv, n, m, d, generator=gen, layout="bnhd")  # non-contiguous views
    do = torch.randn(b, h_q, n, d, dtype=torch.float64, generator=gen)
    scale = 0.3
    o, lse, dq, dk, dv = naive_grads(q, k, v, causal, scale, do)
    o2, lse2 = online_forward(q, k, v, causal, scale, block_m, block_n)
    assert_same("o", o2, o)
    assert_same("lse", lse2, lse)
    dq2, dk2, dv2 = online_backward(do, q, k, v, o2, lse2, causal, scale, block_m, block_n)
    assert_same("dq", dq2, dq)
    assert_same("dk", dk2, dk)
    assert_same("dv", dv2, dv)


def test_naive_gradients_match_autograd_of_softmax():
    """The naive reference's autograd agrees with torch.softmax's, so it is a fair ground truth."""
    q, k, v = random_qkv(2, 4, 2, 19, 23, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
    o = naive_attention(q, k, v, causal=True)[0]
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / 4.0
    s = s.masked_fill(~causal_mask(19, 23), float("-inf"))
    o_plain = torch.softmax(s, -1) @ v.repeat_interleave(2, 1)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    grads_plain = torch.autograd.grad(o_plain, (q, k, v), do)
    for g, gp in zip(grads, grads_plain):
        assert_same("grad", g, gp)


def test_empty_rows_have_zero_output_and_gradients():
    """N > M causal: the first N - M queries see no key; output 0, LSE -inf, zero gradients, no NaN."""
    q, k, v = random_qkv(1, 2, 1, 40, 8, 16, generator=torch.Generator().manual_seed(4))
    do = torch.randn(1, 2, 40, 16, dtype=torch.float64)
    o, lse = online_forward(q, k, v, True, 0.25, 16, 16)
    assert torch.all(o[:, :, :32] == 0) and torch.all(lse[:, :, :32] == float("-inf"))
    assert torch.isfinite(lse[:, :, 32:]).all()
    dq, dk, dv = online_backward(do, q, k, v, o, lse, True, 0.25, 16, 16)
    assert torch.all(dq[:, :, :32] == 0)
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()


def test_large_logits_stay_finite():
    """Scores of several hundred (scale * score up to ~400) overflow exp without the running max."""
    q, k, v = random_qkv(1, 2, 2, 50, 70, 32, generator=torch.Generator().manual_seed(5))
    q = q * 20
    do = torch.randn(1, 2, 50, 32, dtype=torch.float64)
    o, lse, dq, dk, dv = naive_grads(q, k, v, True, 1.0, do)
    o2, lse2 = online_forward(q, k, v, True, 1.0, 16, 32)
    assert_same("o", o2, o)
    assert_same("lse", lse2, lse)
    for name, got, want in zip(("dq", "dk", "dv"), online_backward(do, q, k, v, o2, lse2, True, 1.0, 16, 32), (dq, dk, dv)):
        assert_same(name, got, want)


def test_online_forward_float32_accumulates_like_the_kernel():
    """Half-precision inputs accumulate in float32 and land within half-precision rounding of float64."""
    q, k, v = random_qkv(1, 2, 1, 45, 61, 40, generator=torch.Generator().manual_seed(6))
    o, lse = naive_attention(q, k, v, causal=True)
    o16, lse16 = online_forward(q.half(), k.half(), v.half(), True, None, 16, 16)
    assert o16.dtype == torch.float16 and lse16.dtype == torch.float32
    assert (o16.double() - o).abs().max() < 5e-3
    assert (lse16.double() - lse).abs().max() < 5e-3


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 2),
    h_kv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    n=st.integers(1, 90),
    m=st.integers(1, 90),
    d=st.sampled_from([16, 24, 40, 72]),
    causal=st.booleans(),
    block_m=st.sampled_from([16, 32, 64]),
    block_n=st.sampled_from([16, 32, 64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_online_matches_naive_on_random_shapes(b, h_kv, group, n, m, d, causal, block_m, block_n, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = random_qkv(b, h_kv * group, h_kv, n, m, d, generator=gen)
    do = torch.randn(b, h_kv * group, n, d, dtype=torch.float64, generator=gen)
    o, lse, dq, dk, dv = naive_grads(q, k, v, causal, None, do)
    o2, lse2 = online_forward(q, k, v, causal, None, block_m, block_n)
    dq2, dk2, dv2 = online_backward(do, q, k, v, o2, lse2, causal, None, block_m, block_n)
    for name, got, want in (("o", o2, o), ("lse", lse2, lse), ("dq", dq2, dq), ("dk", dk2, dk), ("dv", dv2, dv)):
        assert_same(name, got, want)


def test_block_grid_check_catches_wrong_grids():
    """The checker the schedule tests use fails on a grid that skips a visible tile, calls a masked tile
    full, or leaves a visible pair unvisited."""
    mask = causal_mask(32, 32)
    good = schedule.block_grid(32, 32, 16, 16, True)
    assert_block_grid_is_exact(mask, good, 16, 16)
    for bi, bj, kind in ((1, 1, schedule.SKIPPED), (0, 0, schedule.FULL), (1, 0, schedule.SKIPPED)):
        bad = [list(row) for row in good]
        bad[bi][bj] = kind
        with pytest.raises(AssertionError):
            assert_block_grid_is_exact(mask, bad, 16, 16)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 300), m=st.integers(1, 300), block_m=st.sampled_from([16, 32, 64, 128]),
       block_n=st.sampled_from([16, 32, 64, 128]), causal=st.booleans())
def test_schedule_is_exact(n, m, block_m, block_n, causal):
    """Skipped tiles hold no visible pair, full tiles no masked pair, and the walks cover every visible pair."""
    mask = causal_mask(n, m) if causal else torch.ones(n, m, dtype=torch.bool)
    grid = schedule.block_grid(n, m, block_m, block_n, causal)
    assert_block_grid_is_exact(mask, grid, block_m, block_n)
    assert int(mask.sum()) == cost.visible_pairs(n, m, causal)
    # and no work is wasted on masks: every whole tile that sees all its pairs is marked full
    for bi, row in enumerate(grid):
        for bj, kind in enumerate(row):
            tile = mask[bi * block_m:(bi + 1) * block_m, bj * block_n:(bj + 1) * block_n]
            assert kind == schedule.FULL or not (tile.all() and tile.shape[1] == block_n), (bi, bj, kind)
    # The dK/dV walk: every visible pair lies in a visited query block, and query blocks marked as
    # fully visible really see the whole key block.
    for start_n in range(0, m, block_n):
        lo, full_start, full_end = schedule.backward_query_range(start_n, block_m, block_n, n, m, causal)
        cols = mask[:, start_n:start_n + block_n]
        assert not cols[:lo].any()
        assert cols[full_start:full_end].all()
        assert lo % block_m == 0 and full_start % block_m == 0 and lo <= full_start <= full_end <= n


@settings(max_examples=200, deadline=None)
@given(n_heads=st.integers(1, 40), n_blocks=st.integers(1, 40), programs=st.integers(1, 600))
def test_launch_order_visits_every_block_once_longest_first(n_heads, n_blocks, programs):
    """The causal launch order is a permutation of the grid, and inside a group no program of rank r
    launches before every program of a lower rank has."""
    g = schedule.heads_per_group(n_heads, n_blocks, programs)
    assert n_heads % g == 0 and (g == 1 or g * n_blocks <= programs)
    assert not any(n_heads % h == 0 and h * n_blocks <= programs for h in range(g + 1, n_heads + 1))  # the largest
    order = [schedule.launch_order(pid, n_blocks, g) for pid in range(n_heads * n_blocks)]
    assert sorted(order) == [(r, h) for r in range(n_blocks) for h in range(n_heads)]
    for pid, (rank, head) in enumerate(order):
        group_start = head // g * g * n_blocks
        assert group_start <= pid < group_start + g * n_blocks  # a head stays inside its group
        assert rank == (pid - group_start) // g  # ranks rise one step per g programs


def test_reference_constants():
    assert reference.LOG2E == pytest.approx(1 / math.log(2), abs=0)
    assert reference.LN2 == pytest.approx(math.log(2), abs=0)
