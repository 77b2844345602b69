"""Packed variable-length batches: attention_varlen, its program-to-sequence map and its reference.

Without CUDA the kernels run under Triton's interpreter on tiny packs (BLOCK_M = 32, BLOCK_N = 16
forward and dQ, 16 x 32 dK/dV), so sequences span several tiles, end mid-tile and sit next to empty
ones; with CUDA the ``gpu`` tests run realistic packs. Every result is compared with the float64
per-sequence reference (:func:`flashattn.reference.varlen_attention`) by the error ratio of
:func:`flashattn.testing.assert_close_ratio`.
"""

from __future__ import annotations

import pytest
import torch

import flashattn
from flashattn import reference, schedule
from flashattn.testing import assert_close_ratio

from devices import DEVICE, cpu_only, gpu, needs_cuda


def _cu(lengths, device=DEVICE):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _pack(lens_q, lens_k, h_q, h_kv, d, dtype, *, layout="contiguous", seed=0, std=1.0):
    """q (total_q, Hq, D), k and v (total_k, Hkv, D), do like q, on DEVICE.

    ``layout="qkv"`` slices q, k, v out of one packed (total, Hq + 2 Hkv, D) buffer (needs equal totals);
    ``layout="strided"`` gives (H, total, D) storage viewed as (total, H, D). Both are non-contiguous.
    """
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    total_q, total_k = sum(lens_q), sum(lens_k)

    def rand(*shape):
        return torch.randn(*shape, dtype=dtype, device=DEVICE, generator=gen) * std

    if layout == "qkv":
        assert total_q == total_k
        buf = rand(total_q, h_q + 2 * h_kv, d)
        q, k, v = buf[:, :h_q], buf[:, h_q:h_q + h_kv], buf[:, h_q + h_kv:]
    elif layout == "strided":
        q = rand(h_q, total_q, d).transpose(0, 1)
        k, v = rand(h_kv, total_k, d).transpose(0, 1), rand(h_kv, total_k, d).transpose(0, 1)
    else:
        q, k, v = rand(total_q, h_q, d), rand(total_k, h_kv, d), rand(total_k, h_kv, d)
    return q, k, v, rand(total_q, h_q, d)


def _references(q, k, v, do, cu_q, cu_k, causal, scale, dlse, variants):
    """(float64, PyTorch low precision) results of the per-sequence reference: (o, lse, dq, dk, dv) each."""
    out = []
    for dtype in (torch.float64, q.dtype):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        o, lse = reference.varlen_attention(*leaves, cu_q, cu_k, causal, scale, **variants)
        grads = [None] * 3
        if o.requires_grad:  # else no sequence has both queries and keys
            grads = torch.autograd.grad([o, lse], leaves, [do.to(dtype), dlse.to(lse.dtype)], allow_unused=True)
        grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]
        out.append((o.detach(), lse.detach(), *grads))
    return out


def _check(lens_q, lens_k, h_q, h_kv, d, causal, dtype, *, layout="contiguous", seed=0, std=1.0, floor=1e-5,
           variants=None):
    """attention_varlen forward and backward (o and lse both used) against float64, with the variants
    (``window``, ``softcap``, ``alibi_slopes``, ``dropout_p`` and its ``seed``) given to both; returns the
    outputs."""
    variants = variants or {}
    q, k, v, do = _pack(lens_q, lens_k, h_q, h_kv, d, dtype, layout=layout, seed=seed, std=std)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    scale = d ** -0.5
    ref_lse = reference.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, causal, scale,
                                         **variants)[1]
    # a gradient on every LSE row that sees a key (an empty row's LSE is -inf and has no gradient)
    dlse = torch.where(torch.isfinite(ref_lse), torch.randn(ref_lse.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).to(ref_lse.device), 0.0).float()
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    o, lse = flashattn.attention_varlen(qg, kg, vg, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                        return_lse=True, **variants)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (h_q, q.shape[0]) and lse.dtype == torch.float32
    dq, dk, dv = torch.autograd.grad([o, lse], (qg, kg, vg), [do, dlse])
    ref, lowp = _references(q, k, v, do, cu_q, cu_k, causal, scale, dlse, variants)
    for name, got, r, lp in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv), ref, lowp):
        assert got.shape == r.shape, name
        assert_close_ratio(name, got.detach(), r, lp, floor=floor)
    empty = torch.isinf(ref[1])  # (Hq, total_q): rows that see no key
    assert (o.detach().transpose(0, 1)[empty] == 0).all() and (dq.transpose(0, 1)[empty] == 0).all()
    return o, lse, dq, dk, dv


# ----------------------------------------------------------------------------------------------
# The program -> sequence map, on the host (the function the kernels compile)
# ----------------------------------------------------------------------------------------------

PACKS = [
    ([5, 0, 40, 1, 33], [7, 3, 40, 0, 20]),
    ([0, 0, 64], [16, 0, 64]),
    ([1] * 9, [1] * 9),
    ([100], [37]),
]


@pytest.mark.parametrize("block", [16, 32, 128])
@pytest.mark.parametrize("pack", PACKS, ids=lambda p: "-".join(map(str, p[0])))
def test_every_tile_has_exactly_one_program_and_padding_none(pack, block):
    """The varlen launch: each row of each sequence lies in exactly one working program's tile, the
    number of working programs is sum_i cdiv(N_i, block) (nothing for padding to max N), and the
    spare programs, which stop at once, are at most one per sequence."""
    lens_q, lens_k = pack
    cu_q, cu_k = _cu(lens_q, "cpu").tolist(), _cu(lens_k, "cpu").tolist()
    programs = schedule.packed_programs(cu_q, cu_k, block)
    working = [p for p in programs if p is not None]
    assert len(working) == sum(-(-n // block) for n in lens_q)
    assert len(programs) - len(working) <= len(lens_q)
    covered = []
    for seq, start, q_start, k_start, n, m in working:
        assert (q_start, k_start, n, m) == (cu_q[seq], cu_k[seq], lens_q[seq], lens_k[seq])
        assert 0 <= start < n and start % block == 0
        covered += range(q_start + start, q_start + min(start + block, n))
    assert covered == list(range(cu_q[-1]))  # every packed row once, in order
    # padding every sequence to the longest would launch B * cdiv(max N, block) programs
    assert len(working) <= len(lens_q) * -(-max(lens_q) // block)


@pytest.mark.parametrize("block", [16, 32])
def test_tile_offsets_on_the_device_match_the_host_mirror(block):
    for lens, _ in PACKS:
        cu = _cu(lens)
        assert tile_offsets(cu, block).tolist() == schedule.packed_tile_offsets(cu.tolist(), block)
        assert tile_offsets(cu, block).dtype == torch.int32


def test_sequence_of_tile_never_lands_on_an_empty_sequence():
    offsets = schedule.packed_tile_offsets([0, 0, 5, 5, 5, 40, 40], 16)  # sequences 0, 2, 3, 5 are empty
    seqs = [schedule.sequence_of_tile(t, offsets, 6) for t in range(offsets[-1])]
    assert seqs == [1, 4, 4, 4]


import triton  # noqa: E402  (after conftest chose the interpreter)
import triton.language as tl  # noqa: E402

from flashattn.device_helpers import packed_tile
from flashattn.tensors import tile_offsets  # noqa: E402


@triton.jit
def _probe_packed_tile(OUT, TILE_OFFSETS, CU_Q, CU_K, N_SEQS, BLOCK: tl.constexpr):
    """Writes what packed_tile gives program ``tile``: (seq, start, q_start, k_start, n, m)."""
    tile = tl.program_id(0)
    seq, start, q_start, k_start, n, m = packed_tile(tile, BLOCK, TILE_OFFSETS, CU_Q, CU_K, N_SEQS)
    tl.store(OUT + tile * 6 + 0, seq)
    tl.store(OUT + tile * 6 + 1, start)
    tl.store(OUT + tile * 6 + 2, q_start)
    tl.store(OUT + tile * 6 + 3, k_start)
    tl.store(OUT + tile * 6 + 4, n)
    tl.store(OUT + tile * 6 + 5, m)


@pytest.mark.parametrize("pack", PACKS, ids=lambda p: "-".join(map(str, p[0])))
def test_compiled_packed_tile_matches_the_host_mirror(pack):
    """The jitted packed_tile (flashattn.device_helpers) gives every program what the host function gives it."""
    lens_q, lens_k = pack
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    block = 16
    grid = -(-sum(lens_q) // block) + len(lens_q)
    out = torch.full((grid, 6), -1, dtype=torch.int32)
    out = out.to(DEVICE)
    _probe_packed_tile[(grid,)](out, tile_offsets(cu_q, block), cu_q, cu_k, len(lens_q), BLOCK=block)
    offsets = schedule.packed_tile_offsets(cu_q.tolist(), block)
    expected = [list(schedule.packed_tile(t, block, offsets, cu_q.tolist(), cu_k.tolist(), len(lens_q)))
                for t in range(grid)]
    assert out.cpu().tolist() == expected


# ----------------------------------------------------------------------------------------------
# Interpreter tests: the kernels against float64
# ----------------------------------------------------------------------------------------------

# (lens_q, lens_k, Hq, Hkv, D, causal, layout)
CASES = [
    ([5, 0, 40, 1, 33], [7, 3, 40, 0, 20], 4, 2, 24, False, "contiguous"),  # empty on each side, N != M
    ([5, 0, 40, 1, 33], [7, 3, 40, 0, 20], 4, 2, 24, True, "contiguous"),  # causal: rows with no key (33 > 20)
    ([17, 0, 48, 9], [17, 0, 48, 9], 2, 2, 40, True, "qkv"),  # slices of one packed qkv buffer, D = 40
    ([3, 1, 30], [45, 30, 2], 4, 1, 72, True, "strided"),  # multi-query, D = 72, N < M and N > M causal
    ([20, 0], [0, 25], 2, 1, 16, False, "contiguous"),  # a sequence with no key, and one with no query
]


def _case_id(c):
    return "q{}-k{}-H{}x{}-D{}-{}-{}".format("_".join(map(str, c[0])), "_".join(map(str, c[1])), c[2], c[3], c[4],
                                            "causal" if c[5] else "full", c[6])


@cpu_only
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_interpreter_matches_float64(case):
    lens_q, lens_k, h_q, h_kv, d, causal, layout = case
    _check(lens_q, lens_k, h_q, h_kv, d, causal, torch.float16, layout=layout)


def _slopes(rows, h_q, seed):
    """ALiBi slopes: (Hq,) for rows = 0, else one row per sequence."""
    gen = torch.Generator().manual_seed(seed)
    shape = (h_q,) if rows == 0 else (rows, h_q)
    return (torch.rand(shape, generator=gen) * 0.5).to(DEVICE)


# (name, causal, variants): each variant alone, then stacked; the packs hold empty sequences on each
# side, N != M and windows that leave rows with no key
VARIANT_CASES = [
    ("window", False, dict(window=(6, 3))),
    ("window-left-causal", True, dict(window=(9, None))),
    ("window-right-only", False, dict(window=(None, 0))),
    ("softcap", False, dict(softcap=1.5)),
    ("alibi-per-head", True, dict(alibi_slopes=("heads",))),
    ("alibi-per-sequence", False, dict(alibi_slopes=("sequences",))),
    ("dropout", False, dict(dropout_p=0.25, seed=1234)),
    ("dropout-causal", True, dict(dropout_p=0.4, seed=2**40 + 7)),
    ("stacked", True, dict(window=(12, 2), softcap=4.0, alibi_slopes=("sequences",), dropout_p=0.2, seed=77)),
]


def _variants_of(options, n_seqs, h_q):
    variants = dict(options)
    if "alibi_slopes" in variants:
        variants["alibi_slopes"] = _slopes(0 if variants["alibi_slopes"][0] == "heads" else n_seqs, h_q, n_seqs)
    return variants


@cpu_only
@pytest.mark.parametrize("name,causal,options", VARIANT_CASES, ids=[c[0] for c in VARIANT_CASES])
def test_interpreter_variants_match_float64(name, causal, options):
    lens_q, lens_k = [5, 0, 40, 1, 33], [7, 3, 40, 0, 20]
    _check(lens_q, lens_k, 4, 2, 24, causal, torch.float16, std=2.0, variants=_variants_of(options, len(lens_q), 4))


@cpu_only
@pytest.mark.parametrize("causal,window", [(False, (6, 3)), (True, (9, 0))], ids=["window", "window-causal"])
def test_interpreter_windows_at_a_wide_head_dim(causal, window):
    """A window with the head dim padded to BLOCK_D = 128 (D = 80), where the backward takes the window's
    own tiles: packed."""
    lens_q, lens_k = [5, 0, 40, 1, 33], [7, 3, 40, 0, 20]
    _check(lens_q, lens_k, 4, 2, 80, causal, torch.float16, std=2.0, variants=dict(window=window))


@cpu_only
def test_interpreter_variants_on_sequences_of_equal_length_give_the_dense_bits():
    """Packed sequences of one length are a dense batch: with every variant (sequence i draws batch
    entry i's dropout mask and takes row i of the slopes) the kernels give the dense call's bits."""
    b, n, h_q, h_kv, d = 3, 37, 4, 2, 24
    q, k, v, do = _pack([n] * b, [n] * b, h_q, h_kv, d, torch.float16, seed=9)
    options = dict(window=(10, 3), softcap=3.0, alibi_slopes=_slopes(b, h_q, 3), dropout_p=0.3, seed=99)
    dense = lambda x: x.reshape(b, n, *x.shape[1:]).transpose(1, 2)  # (B*N, H, D) -> (B, H, N, D)
    runs = []
    for packed in (True, False):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        if packed:
            o = flashattn.attention_varlen(*leaves, _cu([n] * b), _cu([n] * b), n, n, causal=True, **options)
        else:
            o = flashattn.attention(*(dense(x) for x in leaves), causal=True, **options).transpose(1, 2).reshape(q.shape)
        runs.append((o.detach(), *torch.autograd.grad(o, leaves, do)))
    assert runs[0][0].abs().max() > 0
    for name, a, bb in zip(("o", "dq", "dk", "dv"), *runs):
        assert torch.equal(a, bb), name


def test_reference_sequence_draws_its_batch_entrys_dropout_mask():
    """In float64 the per-sequence reference with dropout equals the dense reference on a batch of
    equal sequences, and a different seed gives a different result (the mask is really drawn)."""
    b, n, h = 2, 11, 2
    q, k, v = (torch.randn(b * n, h, 16, dtype=torch.float64) for _ in range(3))
    cu = _cu([n] * b, "cpu")
    heads = lambda x: x.reshape(b, n, h, 16).transpose(1, 2)
    o = reference.varlen_attention(q, k, v, cu, cu, dropout_p=0.5, seed=3)[0]
    o_dense = reference.naive_attention(heads(q), heads(k), heads(v), dropout_p=0.5, seed=3)[0]
    torch.testing.assert_close(o, o_dense.transpose(1, 2).reshape(o.shape), rtol=0, atol=1e-12)
    other = reference.varlen_attention(q, k, v, cu, cu, dropout_p=0.5, seed=4)[0]
    assert (other - o).abs().max() > 1e-3


def test_cpu_reference_path_takes_the_variants(monkeypatch):
    """float32 CPU tensors (the reference backend, no interpreter): variants reach the per-sequence
    reference, forward and backward, and agree with float64 autograd."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    lens_q, lens_k = [6, 0, 13], [9, 4, 13]
    q, k, v, do = (x.cpu() for x in _pack(lens_q, lens_k, 4, 2, 16, torch.float32, seed=8))
    cu_q, cu_k = _cu(lens_q, "cpu"), _cu(lens_k, "cpu")
    options = dict(window=(4, 1), softcap=2.0, alibi_slopes=_slopes(3, 4, 1).cpu(), dropout_p=0.3, seed=5)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = flashattn.attention_varlen(*leaves, cu_q, cu_k, 13, 13, causal=True, **options)
    grads = torch.autograd.grad(o, leaves, do)
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    o64 = reference.varlen_attention(*ref_leaves, cu_q, cu_k, True, **options)[0]
    ref_grads = torch.autograd.grad(o64, ref_leaves, do.double())
    for got, r in zip((o, *grads), (o64, *ref_grads)):
        torch.testing.assert_close(got.double(), r, rtol=1e-4, atol=1e-5)


@cpu_only
def test_interpreter_bfloat16_and_large_logits():
    """bfloat16, and scores near 100 in natural units: every max must be subtracted, also in tiles
    whose rows past the sequence's end belong to the next sequence."""
    _check([30, 11, 26], [19, 40, 26], 2, 1, 32, True, torch.bfloat16, std=4.5, seed=5)


@cpu_only
def test_interpreter_no_key_or_no_query_anywhere():
    """total_k = 0 (every query sees nothing) and total_q = 0: nothing to launch, still right."""
    q, k, v, _ = _pack([4, 3], [0, 0], 2, 2, 16, torch.float16)
    o, lse = flashattn.attention_varlen(q, k, v, _cu([4, 3]), _cu([0, 0]), 4, 0, return_lse=True)
    assert (o == 0).all() and (lse == float("-inf")).all() and lse.shape == (2, 7)
    q, k, v, _ = _pack([0, 0], [5, 1], 2, 2, 16, torch.float16)
    q.requires_grad_()
    k.requires_grad_()
    o = flashattn.attention_varlen(q, k, v, _cu([0, 0]), _cu([5, 1]), 0, 5)
    assert o.shape == (0, 2, 16)
    (dk,) = torch.autograd.grad(o.sum(), (k,), allow_unused=True)
    assert dk is None or (dk == 0).all()


def _strided_cu_seqlens_give_the_contiguous_bits(dtype):
    """cu_seqlens given as every other entry of a buffer whose gaps hold a boundary past the totals:
    forward and backward give the bits of the same call with contiguous cu_seqlens."""
    lens_q, lens_k = [5, 0, 12, 7], [9, 3, 12, 0]
    q, k, v, do = _pack(lens_q, lens_k, 4, 2, 24, dtype, seed=6)
    runs = []
    for strided in (False, True):
        cu_q, cu_k = _cu(lens_q), _cu(lens_k)
        if strided:
            cu_q, cu_k = (torch.full((2 * c.shape[0],), 99, dtype=torch.int32, device=c.device).index_copy_(
                0, torch.arange(0, 2 * c.shape[0], 2, device=c.device), c)[::2] for c in (cu_q, cu_k))
            assert cu_q.stride() == (2,) and cu_q.tolist() == _cu(lens_q).tolist()
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        o = flashattn.attention_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
        runs.append((o.detach(), *torch.autograd.grad(o, leaves, do)))
    assert runs[0][0].abs().max() > 0
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@cpu_only
def test_interpreter_strided_cu_seqlens():
    _strided_cu_seqlens_give_the_contiguous_bits(torch.float16)


@cpu_only
def test_interpreter_equals_dense_kernels_on_one_sequence():
    """One sequence packed is the dense problem: the VARLEN kernels give the dense kernels' bits."""
    q, k, v, do = _pack([45], [37], 4, 2, 24, torch.float16, seed=2)
    cu_q, cu_k = _cu([45]), _cu([37])
    for causal in (False, True):
        o, lse = flashattn.attention_varlen(q, k, v, cu_q, cu_k, 45, 37, causal=causal, return_lse=True)
        o_d, lse_d = flashattn.attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         causal=causal, return_lse=True)
        assert torch.equal(o, o_d[0].transpose(0, 1)) and torch.equal(lse, lse_d[0])


def test_cpu_reference_path_matches_float64(monkeypatch):
    """Without the interpreter CPU tensors run the per-sequence reference (float32 here), with autograd."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    lens_q, lens_k = [6, 0, 13], [9, 4, 13]
    q, k, v, do = _pack(lens_q, lens_k, 4, 2, 16, torch.float32, seed=7)
    q, k, v, do = (x.cpu() for x in (q, k, v, do))
    cu_q, cu_k = _cu(lens_q, "cpu"), _cu(lens_k, "cpu")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = flashattn.attention_varlen(*leaves, cu_q, cu_k, 13, 13, causal=True, return_lse=True)
    grads = torch.autograd.grad([o, lse], leaves, [do, torch.ones_like(lse)])
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    o64, lse64 = reference.varlen_attention(*ref_leaves, cu_q, cu_k, True)
    ref_grads = torch.autograd.grad([o64, lse64], ref_leaves, [do.double(), torch.ones_like(lse64)])
    for got, r in zip((o, lse, *grads), (o64, lse64, *ref_grads)):
        torch.testing.assert_close(got.double(), r, rtol=1e-4, atol=1e-5)


def test_flash_attn_varlen_func_layout_and_options():
    lens = [9, 4]
    q, k, v, _ = _pack(lens, lens, 2, 1, 16, torch.float16, seed=1)
    cu = _cu(lens)
    out, lse, probs = flashattn.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True, return_attn_probs=True)
    o, lse_a = flashattn.attention_varlen(q, k, v, cu, cu, 9, 9, causal=True, return_lse=True)
    assert torch.equal(out, o) and torch.equal(lse, lse_a) and probs is None
    slopes = torch.rand(2, 2, device=DEVICE)
    for ours, theirs in ((dict(window=(4, 0)), dict(window_size=(torch.tensor(4), -1))),
                         (dict(softcap=30.0), dict(softcap=30.0)),
                         (dict(alibi_slopes=slopes), dict(alibi_slopes=slopes))):
        o = flashattn.attention_varlen(q, k, v, cu, cu, 9, 9, causal=True, **ours)
        assert torch.equal(flashattn.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True, **theirs), o)
    torch.manual_seed(5)  # flash_attn_varlen_func draws its dropout seed from torch's default generator
    dropped = flashattn.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, dropout_p=0.5)
    torch.manual_seed(5)
    assert torch.equal(dropped, flashattn.attention_varlen(q, k, v, cu, cu, 9, 9, dropout_p=0.5))
    assert not torch.equal(dropped, flashattn.attention_varlen(q, k, v, cu, cu, 9, 9))


def _paged(k, lens, page_size, num_pages, seed):
    """k (total, H, D) of packed sequences scattered into shuffled pages: (pages, block_table)."""
    gen = torch.Generator().manual_seed(seed)
    max_pages = max(-(-n // page_size) for n in lens)
    order = torch.randperm(num_pages, generator=gen)
    pages = torch.randn(num_pages, page_size, *k.shape[1:], generator=gen).to(k.dtype).to(k.device)
    table = torch.zeros(len(lens), max_pages, dtype=torch.int32)
    start, used = 0, 0
    for b, n in enumerate(lens):
        for p in range(-(-n // page_size)):
            page = int(order[used])
            used += 1
            table[b, p] = page
            rows = k[start + p * page_size: start + min(n, (p + 1) * page_size)]
            pages[page, :rows.shape[0]] = rows
        start += n
    return pages, table.to(k.device)


@cpu_only
def test_interpreter_paged_keys_give_the_packed_bits():
    """k and v in shuffled pages through a block table (pages partly filled, garbage in the rest, one
    sequence without keys): the packed call's bits, forward and backward, with a window and ALiBi; the
    pages' gradients are the packed keys' gradients in their slots."""
    lens_q, lens_k = [5, 17, 3], [9, 0, 21]
    q, k, v, do = _pack(lens_q, lens_k, 4, 2, 16, torch.float16, seed=4)
    k_pages, table = _paged(k, lens_k, 8, 9, seed=1)
    v_pages, _ = _paged(v, lens_k, 8, 9, seed=1)
    options = dict(causal=True, window=(6, 0), alibi_slopes=_slopes(3, 4, 2))
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    o = flashattn.attention_varlen(*leaves, cu_q, cu_k, 17, 21, **options)
    dq, dk, dv = torch.autograd.grad(o, leaves, do)
    paged = [x.detach().requires_grad_() for x in (q, k_pages, v_pages)]
    o_p = flashattn.flash_attn_varlen_func(paged[0], paged[1], paged[2], cu_q, cu_k, 17, 21, causal=True,
                                           window_size=(6, 0), alibi_slopes=options["alibi_slopes"], block_table=table)
    dq_p, dk_p, dv_p = torch.autograd.grad(o_p, paged, do)
    assert torch.equal(o_p, o) and torch.equal(dq_p, dq)
    slots = torch.cat([table[b, j // 8].long() * 8 + j % 8 for b, n in enumerate(lens_k)
                       for j in torch.arange(n, device=table.device)[None]]) if sum(lens_k) else None
    assert torch.equal(dk_p.flatten(0, 1)[slots], dk) and torch.equal(dv_p.flatten(0, 1)[slots], dv)
    untouched = torch.ones(9 * 8, dtype=torch.bool, device=slots.device)
    untouched[slots] = False
    assert (dk_p.flatten(0, 1)[untouched] == 0).all()


def test_paged_keys_refuse_a_bad_block_table():
    q, k, v, _ = _pack([3, 5], [4, 6], 2, 1, 16, torch.float16)
    pages = k.new_zeros(4, 4, 1, 16)
    cu_q, cu_k = _cu([3, 5]), _cu([4, 6])
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    for bad, error, match in ((table.long(), TypeError, "int32"), (table[:1], ValueError, "one row per sequence"),
                              (table[:, :1], ValueError, "fewer than max_seqlen_k"),
                              (table + 3, ValueError, "outside the cache")):
        with pytest.raises(error, match=match):
            flashattn.attention_varlen(q, pages, pages, cu_q, cu_k, 5, 6, block_table=bad)
    with pytest.raises(ValueError, match="paged cache"):
        flashattn.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, block_table=table)


# ----------------------------------------------------------------------------------------------
# Validation: clear errors before anything is launched
# ----------------------------------------------------------------------------------------------

def _bad_calls():
    q, k, v, _ = _pack([3, 5], [4, 6], 2, 1, 16, torch.float16)
    cu_q, cu_k = _cu([3, 5]), _cu([4, 6])
    i32 = (lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE))
    call = (lambda **kw: (lambda: flashattn.attention_varlen(
        kw.get("q", q), kw.get("k", k), kw.get("v", v), kw.get("cu_q", cu_q), kw.get("cu_k", cu_k),
        kw.get("max_q", 5), kw.get("max_k", 6), **kw.get("opts", {}))))
    return [
        (call(q=q[None]), ValueError, "q must be 3-D"),
        (call(k=k[:, :, :8], v=v[:, :, :8]), ValueError, "head dim"),
        (call(cu_q=cu_q.long()), TypeError, "cu_seqlens_q must be int32"),
        (call(cu_k=[0, 4, 10]), TypeError, "cu_seqlens_k must be an int32 torch.Tensor"),
        (call(cu_q=cu_q[None]), ValueError, "cu_seqlens_q must be 1-D"),
        (call(cu_k=i32([0, 4, 6, 10])), ValueError, "one entry per sequence boundary"),
        (call(cu_q=i32([1, 3, 8])), ValueError, "cu_seqlens_q must start at 0"),
        (call(cu_k=i32([0, 11, 10])), ValueError, "non-decreasing"),
        (call(cu_q=i32([0, 3, 7])), ValueError, "must end at the number of rows of q (8)"),
        (call(max_q=4), ValueError, "max_seqlen_q (4) is smaller than the longest sequence"),
        (call(max_k=6.0), TypeError, "max_seqlen_k must be an int"),
        (call(opts=dict(causal=1)), TypeError, "causal must be a bool"),
        (call(opts=dict(scale=-1.0)), ValueError, "scale must be finite and non-negative"),
        (call(k=k.float(), v=v.float()), TypeError, "share one dtype"),
        (call(cu_q=cu_q[:1], cu_k=cu_k[:1]), ValueError, "cu_seqlens_q must be 1-D with B"),
        (call(max_q=-1), ValueError, "max_seqlen_q must be >= 0"),
        (call(q=q[:, :0]), ValueError, "positive multiple"),
        (call(opts=dict(window=(-2, 0))), ValueError, "window left must be >= 0"),
        (call(opts=dict(alibi_slopes=torch.ones(3, 2, device=DEVICE))), ValueError, "(B, Hq) = (2, 2)"),
        (call(opts=dict(dropout_p=1.0)), ValueError, "dropout_p must be in"),
        (call(opts=dict(dropout_p=0.1, seed=1, generator=torch.Generator())), ValueError, "either a generator"),
    ] + ([  # on the CPU the values are checked even with validate=False (no sync to save there); on a GPU
        # validate=False skips them by design (the API's promise), so the case is the CPU's alone
        (call(cu_q=i32([0, 3, 7]), opts=dict(validate=False)), ValueError, "must end at the number of rows of q (8)"),
    ] if q.device.type == "cpu" else [])


@pytest.mark.parametrize("index", range(22))
def test_bad_input_raises_a_clear_error(index):
    calls = _bad_calls()
    if index >= len(calls):
        pytest.skip("a CPU-only case (validate=False checks values only on the CPU)")
    fn, exc, words = calls[index]
    with pytest.raises(exc, match=words.replace("(", r"\(").replace(")", r"\)")):
        fn()


def test_cu_seqlens_on_another_device_is_rejected():
    q, k, v, _ = _pack([3], [3], 2, 2, 16, torch.float16)
    cu = _cu([3], "meta")
    with pytest.raises(ValueError, match="cu_seqlens_q must be on the device of q"):
        flashattn.attention_varlen(q, k, v, cu, cu, 3, 3)


# ----------------------------------------------------------------------------------------------
# torch.compile: the custom operator
# ----------------------------------------------------------------------------------------------

def test_opcheck_and_compile_fullgraph_on_the_reference_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch._dynamo.reset()
    lens_q, lens_k = [5, 0, 7], [6, 2, 7]
    q, k, v, do = (x.cpu().double() for x in _pack(lens_q, lens_k, 2, 1, 16, torch.float32, seed=3))
    cu_q, cu_k = _cu(lens_q, "cpu"), _cu(lens_k, "cpu")
    leaves = [x.requires_grad_() for x in (q, k, v)]
    torch.library.opcheck(torch.ops.flashattn.attention_forward.default, (*leaves, True, 0.3),
                          dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7, max_seqlen_k=7))

    def step(q, k, v, do):
        o, lse = flashattn.attention_varlen(q, k, v, cu_q, cu_k, 7, 7, causal=True, return_lse=True)
        return (o * do).sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager = torch.autograd.grad(step(*leaves, do), leaves)
    got = torch.autograd.grad(compiled(*leaves, do), leaves)
    for g, e in zip(got, eager):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# GPU tests (realistic packs)
# ----------------------------------------------------------------------------------------------

def _lengths(total, low, high, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(low, high + 1, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - total
    return lengths


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,h_q,h_kv", [(128, 8, 2), (64, 8, 8), (72, 4, 1)], ids=["D128-gqa4", "D64-mha", "D72-mqa"])
def test_gpu_matches_float64(d, h_q, h_kv, causal, dtype):
    lens_q = _lengths(6000, 1, 2000, seed=d)
    lens_k = [max(0, n + delta) for n, delta in zip(lens_q, [0, 37, -50, 0, 300, -1] * len(lens_q))]
    lens_q[1] = 0  # an empty query side
    _check(lens_q, lens_k, h_q, h_kv, d, causal, dtype, layout="strided" if d == 72 else "contiguous")


@gpu
@needs_cuda
@pytest.mark.parametrize("d,h_q,h_kv", [(128, 8, 2), (64, 4, 4)], ids=["D128-gqa4", "D64-mha"])
@pytest.mark.parametrize("name,causal,options", VARIANT_CASES, ids=[c[0] for c in VARIANT_CASES])
def test_gpu_variants_match_float64(name, causal, options, d, h_q, h_kv):
    lens_q = _lengths(3000, 1, 900, seed=d)
    lens_k = [max(0, n + delta) for n, delta in zip(lens_q, [0, 37, -50, 0, 300, -1] * len(lens_q))]
    lens_q[1] = 0
    options = {k: (tuple(w * 40 for w in v) if k == "window" and None not in v else v)  # wider windows
               for k, v in options.items()}
    _check(lens_q, lens_k, h_q, h_kv, d, causal, torch.bfloat16, std=2.0,
           variants=_variants_of(options, len(lens_q), h_q))


@gpu
@needs_cuda
def test_gpu_strided_cu_seqlens():
    _strided_cu_seqlens_give_the_contiguous_bits(torch.bfloat16)


@gpu
@needs_cuda
def test_gpu_qkv_slices_and_large_logits():
    lens = _lengths(4096, 64, 1500, seed=1)
    _check(lens, lens, 8, 2, 128, True, torch.bfloat16, layout="qkv", std=4.5)


@gpu
@needs_cuda
def test_gpu_validation_syncs_only_when_asked():
    lens = [100, 200]
    q, k, v, _ = _pack(lens, lens, 4, 4, 64, torch.float16)
    bad = torch.tensor([0, 100, 250], dtype=torch.int32, device="cuda")  # ends past total
    with pytest.raises(ValueError, match="must end at the number of rows"):
        flashattn.attention_varlen(q, k, v, bad, bad, 200, 200)
    good = _cu(lens)
    o = flashattn.attention_varlen(q, k, v, good, good, 200, 200, validate=False)
    assert torch.equal(o, flashattn.attention_varlen(q, k, v, good, good, 200, 200))


@gpu
@needs_cuda
def test_gpu_poisoned_outputs_are_fully_written():
    """Outputs start as NaN-dirty memory; every row of o, lse, dq, dk, dv is written (and finite)."""
    lens_q, lens_k = [300, 0, 129, 1, 700], [250, 90, 129, 0, 800]
    torch.cuda.empty_cache()
    filler = [torch.full((1 << 24,), float("nan"), device="cuda") for _ in range(4)]
    del filler
    q, k, v, do = _pack(lens_q, lens_k, 8, 2, 128, torch.float16)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    o, lse = flashattn.attention_varlen(*leaves, _cu(lens_q), _cu(lens_k), 700, 800, causal=True, return_lse=True)
    grads = torch.autograd.grad(o, leaves, do)
    for x in (o, lse, *grads):
        assert not torch.isnan(x).any()


@gpu
@needs_cuda
def test_gpu_compile_fullgraph():
    torch._dynamo.reset()
    lens = _lengths(3000, 10, 900, seed=4)
    q, k, v, _ = _pack(lens, lens, 8, 2, 64, torch.bfloat16)
    cu = _cu(lens)
    fn = torch.compile(lambda q, k, v: flashattn.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True),
                       fullgraph=True)
    assert torch.equal(fn(q, k, v), flashattn.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True))
