"""Decoding against a KV cache: attention_with_kvcache, its split-KV kernels and its references.

Without CUDA the kernels run under Triton's interpreter on tiny shapes, with 3 splits and 16 x 16
tiles (flashattn.decode_kernels), so every case walks several splits, some of them empty; with CUDA
the ``gpu`` tests run realistic decoding shapes. Every result is compared with the float64 reference
(:func:`flashattn.reference.kvcache_attention_reference`) by the error ratio of
:func:`flashattn.testing.assert_close_ratio`.
"""

from __future__ import annotations

import pytest
import torch

import flashattn
import flashattn.autograd
import flashattn.decode_kernels
from flashattn import _memo, reference, schedule
from flashattn.decode import attention_with_kvcache
from flashattn.testing import assert_close_ratio, random_qkv

from devices import DEVICE, HAS_CUDA, cpu_only, gpu, needs_cuda

DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])


def _make(b, n_q, h_q, h_kv, d, m, n_new, dtype, *, seed=0, std=1.0, q_layout="bnhd", pages=None):
    """q, k_cache, v_cache, k_new, v_new on DEVICE; the cache paged into ``pages`` slots when given.

    ``q_layout="bhnd"`` gives q as a transposed view of (B, Hq, Nq, D) storage (not contiguous).
    """
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, dtype=dtype, device=DEVICE, generator=gen) * std

    q = rand(b, h_q, n_q, d).transpose(1, 2) if q_layout == "bhnd" else rand(b, n_q, h_q, d)
    cache_shape = (b, m, h_kv, d) if pages is None else pages
    k_cache, v_cache = rand(*cache_shape), rand(*cache_shape)
    k_new = rand(b, n_new, h_kv, d) if n_new else None
    v_new = rand(b, n_new, h_kv, d) if n_new else None
    return q, k_cache, v_cache, k_new, v_new


def _check(q, k_cache, v_cache, seqlens, k_new, v_new, causal, *, block_table=None, num_splits=None, scale=None,
           floor=1e-5):
    """Call the kernels, compare o, lse and the appended caches with the references; return (o, lse)."""
    lengths = torch.as_tensor(seqlens, dtype=torch.int32).expand(q.shape[0]) if isinstance(seqlens, int) else seqlens
    up = (lambda x: None if x is None else x.double())
    ref = reference.kvcache_attention_reference(up(q), up(k_cache), up(v_cache), lengths.cpu() if HAS_CUDA else lengths,
                                                up(k_new), up(v_new), causal, scale, block_table)
    lowp = reference.kvcache_attention_reference(q, k_cache, v_cache, lengths, k_new, v_new, causal, scale, block_table)
    o, lse = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k_new=k_new, v_new=v_new,
                                    causal=causal, scale=scale, block_table=block_table, num_splits=num_splits,
                                    return_lse=True)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert_close_ratio("o", o, ref[0], lowp[0], floor=floor)
    assert_close_ratio("lse", lse, ref[1], lowp[1], floor=floor)
    # the append happened in place, and wrote exactly what the row-by-row reference writes
    assert torch.equal(k_cache, ref[2].to(q.dtype)) and torch.equal(v_cache, ref[3].to(q.dtype))
    empty = torch.isinf(ref[1])  # (B, Hq, Nq): rows with no visible key
    assert (o.transpose(1, 2)[empty] == 0).all() and (lse[empty] == float("-inf")).all()
    return o, lse


# ----------------------------------------------------------------------------------------------
# Interpreter tests
# ----------------------------------------------------------------------------------------------

# (B, Nq, Hq, Hkv, D, Mmax, Nnew, cache_seqlens, causal, q_layout)
CASES = [
    (3, 1, 4, 4, 64, 40, 1, [0, 17, 39], True, "bnhd"),  # MHA (group 1), one query, lengths 1 / 18 / full
    (3, 1, 4, 2, 40, 40, 0, [0, 23, 40], False, "bnhd"),  # group 2, D = 40, an empty and a full sequence
    (2, 3, 8, 2, 72, 45, 3, [5, 42], True, "bhnd"),  # group 4, three queries (12 packed rows), D = 72, q transposed
    (2, 3, 8, 2, 72, 45, 3, [5, 42], False, "bnhd"),
    (2, 6, 4, 1, 64, 30, 0, [3, 30], True, "bhnd"),  # MQA, 6 queries: 24 rows, 2 tiles; causal rows with no key
    (2, 2, 4, 1, 40, 20, 2, [0, 18], False, "bnhd"),  # MQA; a sequence whose only keys are the appended ones
]


def _case_id(c):
    return "B{}-Nq{}-H{}x{}-D{}-M{}-new{}-{}-{}".format(*c[:7], "causal" if c[8] else "full", c[9])


@cpu_only
@DTYPES
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_interpreter_matches_float64(case, dtype):
    b, n_q, h_q, h_kv, d, m, n_new, seqlens, causal, q_layout = case
    q, k_cache, v_cache, k_new, v_new = _make(b, n_q, h_q, h_kv, d, m, n_new, dtype, q_layout=q_layout)
    assert q.is_contiguous() == (q_layout == "bnhd")
    _check(q, k_cache, v_cache, torch.tensor(seqlens, dtype=torch.int32), k_new, v_new, causal)


def _shuffled_pages(b, capacity_pages, page_size, h_kv, d, dtype, seed):
    """A block table that is a random permutation of the pages, and unused entries set to -1."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = b * capacity_pages + 3  # a few pages no sequence owns
    table = torch.randperm(num_pages, generator=gen)[: b * capacity_pages].view(b, capacity_pages).to(torch.int32)
    return table, (num_pages, page_size, h_kv, d)


@cpu_only
@DTYPES
@pytest.mark.parametrize("page_size", [16, 5], ids=["page16", "page5"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_interpreter_paged_cache_with_shuffled_pages(page_size, causal, dtype):
    """Pages in random order; with 5-slot pages every 16-key block spans several pages."""
    b, n_q, h_q, h_kv, d, n_new = 3, 2, 4, 2, 40, 2
    capacity_pages = 48 // page_size + 1
    table, pages = _shuffled_pages(b, capacity_pages, page_size, h_kv, d, dtype, seed=page_size)
    seqlens = torch.tensor([0, 19, capacity_pages * page_size - n_new], dtype=torch.int32)
    table[1, 5 if page_size == 5 else 2:] = -1  # entries past sequence 1's pages are never used
    q, k_cache, v_cache, k_new, v_new = _make(b, n_q, h_q, h_kv, d, 0, n_new, dtype, pages=pages, seed=1)
    _check(q, k_cache, v_cache, seqlens, k_new, v_new, causal, block_table=table)


@cpu_only
@pytest.mark.parametrize("num_splits, merge_tile", [(1, None), (2, None), (9, None), (9, 256), (9, 128)],
                         ids=["direct", "2", "9-mostly-empty", "9-in-steps-of-2", "9-one-a-step"])
def test_interpreter_splits_and_poisoned_scratch(num_splits, merge_tile, monkeypatch):
    """One split writes the output directly; 9 splits of 3 blocks leave most splits without keys.

    The scratch is handed out filled with NaN: a merge that read an empty partial's output (never
    written) would return NaN. With a merge tile of 256 floats (4 rows x 32 columns x 2 splits) the merge
    takes the 9 splits in five steps, the last one half empty, and with 128 floats one split a step,
    folding each step into the state of the ones before (a later split with a larger LSE rescales it).
    """
    def poisoned(shape, device):
        return torch.full(shape, float("nan"), dtype=torch.float32, device=device)

    monkeypatch.setattr(flashattn.decode_kernels, "_scratch", poisoned)
    if merge_tile is not None:
        monkeypatch.setattr(flashattn.decode_kernels, "MERGE_TILE", merge_tile)
        assert flashattn.decode_kernels.merge_blocks(4, 32, num_splits) == (4, 32, merge_tile // 128)
    _memo.clear()  # no recipe of an earlier case with these shapes may stand in for this one's launches
    q, k_cache, v_cache, k_new, v_new = _make(2, 2, 4, 2, 32, 48, 1, torch.float16, seed=4)
    _check(q, k_cache, v_cache, torch.tensor([40, 0], dtype=torch.int32), k_new, v_new, True, num_splits=num_splits)


@pytest.mark.parametrize("num_splits, paged, int_lengths, append", [
    (1, False, False, False), (3, False, True, False), (2, True, False, False), (3, False, True, True),
    (2, True, True, True), (1, True, False, True)],
    ids=["direct", "splits-int-lengths", "paged", "append-int-lengths", "paged-append-int-lengths", "paged-append"])
def test_replayed_decode_steps_are_the_full_path(monkeypatch, num_splits, paged, int_lengths, append):
    """A decoding step repeated from its recipe (flashattn.launch.Recipe) hands the C launchers exactly
    what the full path hands them for the same tensors: the append kernel's, the split kernel's and the
    merge's pointers, strides and scalars, with one split (no merge, no scratch), with several, with an
    int cache length (a per-call integer: the later step's is one longer, as in a decoding loop), with a
    paged cache, and with new keys appended. On the CPU, through benchmarks.hostcost's no-op launches."""
    from benchmarks import hostcost

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the tool refuses the interpreter; kernels count as compiled
    gen = torch.Generator().manual_seed(2)
    b, n_q, h_q, h_kv, d, m = 2, 2, 8, 2, 64, 96

    def make():
        rand = (lambda *shape: torch.randn(*shape, dtype=torch.float16, generator=gen))
        q = rand(b, n_q, h_q, d)
        if paged:  # 8 pages of 32 rows, each sequence on 3 of them, in a shuffled order
            cache = (rand(8, 32, h_kv, d), rand(8, 32, h_kv, d))
            table = torch.randperm(8, generator=gen)[:6].to(torch.int32).view(b, 3)
        else:
            cache, table = (rand(b, m, h_kv, d), rand(b, m, h_kv, d)), None
        lengths = 70 + calls[0] if int_lengths else torch.tensor([70, 33], dtype=torch.int32)
        new = (rand(b, 2, h_kv, d), rand(b, 2, h_kv, d)) if append else (None, None)
        calls[0] += 1
        return q, *cache, lengths, table, *new

    def run(q, k_cache, v_cache, lengths, table, k_new, v_new):
        attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, num_splits=num_splits,
                               k_new=k_new, v_new=v_new)

    calls = [0]
    first, later = make(), make()
    got = hostcost.replayed_and_full(run, first, later, later[:3] + later[4:])
    assert len(got[True]) == len(got[False]) == (1 if num_splits == 1 else 2) + append
    assert len(got["kept"]) == 1 and got["keys"] == 0  # replayed: no cache key, no binding
    assert got[True] == got[False]
    if int_lengths:  # the later step's own length reached every launch that takes it
        assert sum((int, 71) in launch for launch in got[True]) == 1 + append


@pytest.mark.parametrize("b, h_q, h_kv, n, m, layout, causal", [
    (1, 8, 2, 1, 4096, "bhnd", False), (2, 4, 4, 3, 5000, "bnhd", True), (1, 4, 1, 16, 4100, "bhnd", True)])
def test_a_repeated_split_kv_call_replays_before_its_transposes(monkeypatch, b, h_q, h_kv, n, m, layout, causal):
    """A dense-API call that the split-KV kernels run (few queries, many keys), repeated with new tensors
    of the same shapes and strides, goes from the autograd layer straight to the first call's recipe
    (decode_kernels.replay_split_kv, keyed on the tensors as given): it hands the C launchers exactly
    what the full path hands them (split and merge: every pointer, stride and scalar), and
    launch_decode, with its transposes and its own key, is not called again. On the CPU, through
    benchmarks.hostcost's no-op launches, with the early replay's CUDA-device check made to pass."""
    from benchmarks import hostcost
    from flashattn import autograd, decode_kernels
    from flashattn.problem import Problem

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the tool refuses the interpreter; kernels count as compiled
    monkeypatch.setattr(autograd, "_early", lambda q, use_kernels: use_kernels)
    gen = torch.Generator().manual_seed(b + n)
    full_calls = []
    real = decode_kernels.launch_decode
    monkeypatch.setattr(decode_kernels, "launch_decode", lambda *a, **kw: full_calls.append(1) or real(*a, **kw))

    def make():
        return random_qkv(b, h_q, h_kv, n, m, 64, dtype=torch.float16, layout=layout, generator=gen)

    def run(q, k, v):
        flashattn.attention(q, k, v, causal=causal)

    first, later = make(), make()
    assert Problem.of(first[0], first[1], causal).split_kv
    got = hostcost.replayed_and_full(run, first, later, later)
    assert len(got[True]) == len(got[False]) == 2  # the split kernel and the merge
    assert got[True] == got[False]
    assert len(got["kept"]) == 1 and got["keys"] == 0  # replayed: no cache key, no binding
    full_calls.clear()
    with hostcost.launches_disabled():
        run(*first)
        run(*later)
    assert len(full_calls) == 1  # the first call alone


@cpu_only
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_interpreter_large_logits(causal):
    """scale * q.k up to about 100: exp overflows unless every split and the merge subtract their max."""
    q, k_cache, v_cache, _, _ = _make(2, 2, 4, 2, 32, 40, 0, torch.float16, std=4.5, seed=3)
    s = (q[:, :, :1].double() @ k_cache[:, :, 0].double().transpose(-1, -2)) * 32 ** -0.5
    assert s.abs().max() > 60, "inputs do not produce large logits"
    _check(q, k_cache, v_cache, torch.tensor([33, 40], dtype=torch.int32), None, None, causal)


@cpu_only
def test_interpreter_int_seqlens_custom_scale_and_strided_cache():
    """cache_seqlens as a Python int; a cache that is a slice of a larger head buffer (not contiguous)."""
    gen = torch.Generator().manual_seed(9)
    big_k = torch.randn(2, 30, 5, 24, dtype=torch.float16, generator=gen)
    big_v = torch.randn(2, 30, 5, 24, dtype=torch.float16, generator=gen)
    k_cache, v_cache = big_k[:, :, 1:3], big_v[:, :, 1:3]
    assert not k_cache.is_contiguous()
    q = torch.randn(2, 1, 4, 24, dtype=torch.float16, generator=gen)
    k_new = torch.randn(2, 2, 2, 24, dtype=torch.float16, generator=gen)
    v_new = torch.randn(2, 2, 2, 24, dtype=torch.float16, generator=gen)
    outside = big_k[:, :, [0, 3, 4]].clone()
    _check(q, k_cache, v_cache, 21, k_new, v_new, True, scale=0.31)
    assert torch.equal(big_k[:, :, [0, 3, 4]], outside)  # the append wrote only its own heads


def _strided_index_tensors(dtype, paged):
    """cache_seqlens as every other entry of a buffer whose gaps hold a length the cache cannot take,
    and a block table whose entries are not at unit stride (a transposed copy, then every other column
    of it): the kernels must read the values the views show, not the memory next to them."""
    b, n_q, h_q, h_kv, d, n_new, page_size = 3, 2, 4, 2, 24, 1, 4
    lens = torch.full((2 * b,), 10_000, dtype=torch.int32)
    lens[::2] = torch.tensor([9, 0, 14], dtype=torch.int32)
    seqlens = lens.to(DEVICE)[::2]
    assert seqlens.stride() == (2,)
    table = None
    if paged:
        wide, pages = _shuffled_pages(b, 8, page_size, h_kv, d, dtype, seed=3)
        table = wide.t().contiguous().t()[:, ::2].to(DEVICE)  # (B, 4) with strides (1, 2B)
        assert table.stride(1) != 1
        q, k_cache, v_cache, k_new, v_new = _make(b, n_q, h_q, h_kv, d, 0, n_new, dtype, pages=pages, seed=4)
    else:
        q, k_cache, v_cache, k_new, v_new = _make(b, n_q, h_q, h_kv, d, 16, n_new, dtype, seed=4)
    for causal in (False, True):
        _check(q, k_cache.clone(), v_cache.clone(), seqlens, k_new, v_new, causal, block_table=table)


@cpu_only
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_interpreter_strided_lengths_and_block_table(paged):
    _strided_index_tensors(torch.float16, paged)


@cpu_only
def test_interpreter_public_call_runs_the_kernels(monkeypatch):
    calls = []
    real = flashattn.decode_kernels.launch_decode
    monkeypatch.setattr(flashattn.decode_kernels, "launch_decode", lambda *a: calls.append(1) or real(*a))
    q, k_cache, v_cache, _, _ = _make(1, 1, 2, 1, 16, 20, 0, torch.float16)
    out = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([20], dtype=torch.int32))
    assert calls == [1] and out.shape == q.shape


def test_cpu_float_inputs_run_the_reference():
    """float32/float64 on the CPU take the PyTorch reference path, append included."""
    q, k_cache, v_cache, k_new, v_new = (x.double() for x in _make(2, 2, 4, 2, 16, 12, 1, torch.float32, seed=5))
    if HAS_CUDA:
        q, k_cache, v_cache, k_new, v_new = (x.cpu() for x in (q, k_cache, v_cache, k_new, v_new))
    seqlens = torch.tensor([0, 11], dtype=torch.int32)
    o_ref, lse_ref, k_ref, v_ref = reference.kvcache_attention_reference(q, k_cache, v_cache, seqlens, k_new, v_new)
    o, lse = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k_new=k_new, v_new=v_new,
                                    return_lse=True)
    assert torch.allclose(o, o_ref, atol=1e-12) and torch.equal(lse.isinf(), lse_ref.isinf())
    assert o.dtype == lse.dtype == torch.float64  # float64 stays float64, the LSE included
    seen = ~lse_ref.isinf()
    assert seen.any() and torch.allclose(lse[seen], lse_ref[seen], rtol=0, atol=1e-12)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


# ----------------------------------------------------------------------------------------------
# The references: split + merge equals attention over all keys; the merge has teeth.
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_split_and_merge_reference_equals_the_definition(causal):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, 3, 4, 16, dtype=torch.float64, generator=gen)
    k = torch.randn(3, 40, 2, 16, dtype=torch.float64, generator=gen)
    v = torch.randn(3, 40, 2, 16, dtype=torch.float64, generator=gen)
    seqlens = torch.tensor([0, 2, 40], dtype=torch.int32)  # length 2 < Nq: causal rows with no key
    o, lse, _, _ = reference.kvcache_attention_reference(q, k, v, seqlens, causal=causal)
    for n_splits, block_n in ((1, 16), (3, 8), (4, 16), (50, 4)):  # (4, 16) and (50, 4) have empty splits
        o_s, lse_s = reference.split_kv_attention_reference(q, k, v, seqlens, n_splits, block_n, causal)
        assert torch.allclose(o_s, o, atol=1e-12, rtol=0)
        assert torch.equal(torch.isinf(lse_s), torch.isinf(lse)) and not torch.isnan(lse_s).any()
        finite = torch.isfinite(lse)
        assert torch.allclose(lse_s[finite], lse[finite], atol=1e-12, rtol=0)


def test_merge_weights_by_softmax_mass_not_by_count():
    """Negative control: averaging the partial outputs (a plausible wrong merge) misses the answer."""
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(4, 1, 16, dtype=torch.float64, generator=gen)
    k = torch.randn(2, 30, 16, dtype=torch.float64, generator=gen) * 2
    v = torch.randn(2, 30, 16, dtype=torch.float64, generator=gen)
    o_parts, lse_parts = reference.split_kv_partials(q, k, v, 3, 8, causal=False)
    o, _ = reference.merge_partials(o_parts, lse_parts)
    truth = torch.softmax(q.view(2, 2, 1, 16) @ k[:, None].transpose(-1, -2) / 4, dim=-1) @ v[:, None]
    assert torch.allclose(o, truth.view(4, 1, 16), atol=1e-12)
    assert not torch.allclose(o_parts.mean(dim=0), truth.view(4, 1, 16), atol=1e-3)


def test_merge_of_empty_partials_is_zero_not_nan():
    o_parts = torch.full((3, 2, 1, 4), float("nan"), dtype=torch.float64)  # never written
    o_parts[1, 0] = 1.5
    lse_parts = torch.full((3, 2, 1), float("-inf"), dtype=torch.float64)
    lse_parts[1, 0] = 0.25
    o, lse = reference.merge_partials(o_parts, lse_parts)
    assert torch.equal(o[0], torch.full((1, 4), 1.5, dtype=torch.float64)) and lse[0].item() == 0.25
    assert torch.equal(o[1], torch.zeros(1, 4, dtype=torch.float64)) and lse[1].item() == float("-inf")


def test_split_range_deals_whole_blocks_and_covers_every_key():
    for seq_len in (0, 1, 15, 16, 17, 100):
        for n_splits in (1, 2, 3, 7):
            covered = []
            for s in range(n_splits):
                lo, hi = schedule.decode_split_range(s, n_splits, seq_len, 16)
                assert lo % 16 == 0
                covered += range(lo, min(hi, seq_len))
            assert covered == list(range(seq_len))


def test_merge_launches_as_a_dependent_only_where_it_can(monkeypatch):
    """The merge is a programmatic dependent of the split kernel on sm_90 and later with a Triton that
    has gdc_wait, never under the interpreter, on a CPU tensor or an older GPU."""
    dk = flashattn.decode_kernels
    cuda = torch.device("cuda", 0)
    assert not dk.dependent_launch(torch.device("cpu"))
    monkeypatch.setattr(dk._config, "is_interpreter", lambda: True)
    monkeypatch.setattr(dk._config, "_capability", lambda index: (9, 0))
    assert not dk.dependent_launch(cuda)
    monkeypatch.setattr(dk._config, "is_interpreter", lambda: False)
    assert dk.dependent_launch(cuda) == (dk.gdc_wait is not None)
    monkeypatch.setattr(dk._config, "_capability", lambda index: (8, 0))
    assert not dk.dependent_launch(cuda)
    monkeypatch.setattr(dk._config, "_capability", lambda index: (10, 0))
    assert dk.dependent_launch(cuda) == (dk.gdc_wait is not None)
    monkeypatch.setattr(dk, "gdc_wait", None)
    assert not dk.dependent_launch(cuda)


def test_number_of_splits_follows_the_grid_and_the_keys(monkeypatch):
    """The GPU heuristic (run here on a pretend 132-SM device): split until ~1 program per SM, rounded
    down for programs that take a whole SM, at most one split per 2 key blocks, at most MAX_SPLITS, and
    never below 1; then the D = 128 tile fitted to the grid."""
    dk = flashattn.decode_kernels
    monkeypatch.setattr(dk._config, "is_interpreter", lambda: False)
    monkeypatch.setattr(dk._config, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert dk.choose_num_splits(16 * 8, 8192, 64, cuda) == 2  # 128 programs: 2 splits fill 132 SMs
    assert dk.choose_num_splits(8, 8192, 64, cuda) == 17  # 8 programs: 17 splits
    # programs that take a whole SM: at most one per SM, so no program waits for a second wave
    assert dk.choose_num_splits(16 * 8, 8192, 64, cuda, whole_sm=True) == 1
    assert dk.choose_num_splits(60, 8192, 64, cuda, whole_sm=True) == 2  # 120 programs, where 3 would make 180
    assert dk.choose_num_splits(8, 8192, 64, cuda, whole_sm=True) == 16  # 128 programs
    assert dk.choose_num_splits(200, 8192, 64, cuda, whole_sm=True) == 1
    assert dk.choose_num_splits(8, 1024, 64, cuda) == 8  # but 16 key blocks: 8 splits of 2
    assert dk.choose_num_splits(16 * 8, 100, 64, cuda) == 1  # too short to split
    assert dk.choose_num_splits(1, 1 << 20, 64, cuda) == dk.MAX_SPLITS
    assert dk.choose_num_splits(4096, 1 << 20, 64, cuda) == 1  # the grid alone fills the GPU
    # which tiles take a whole SM: D = 128's three stages of 128 keys do (2 x 64 KB of K and V in flight);
    # D = 64's (half the bytes a key) and D = 256's (32-key blocks, two stages) leave room for more programs
    tile = dk.decode_config(4, 128, cuda)
    assert dk.fills_sm(tile, 128, 2) and not dk.fills_sm(dk.decode_config(4, 64, cuda), 64, 2)
    assert not dk.fills_sm(dk.decode_config(4, 256, cuda), 256, 2)
    # the D = 128 tile fitted to its grid: 128-key blocks, three stages ...
    assert (tile.block_n, tile.num_stages) == (128, 3)
    assert dk.fit_tile(tile, 128, 8, 16384, 16, cuda) == tile  # one sequence, 16 splits of 1024 keys
    assert dk.fit_tile(tile, 128, 128, 4096, 1, cuda) == tile  # 16 sequences: 128 programs, one wave
    # ... two stages where the grid has more programs than SMs (72 KB each: three fit in an SM's 228 KB) ...
    wide = dk.fit_tile(tile, 128, 133, 4096, 1, cuda)
    assert (wide.block_m, wide.block_n, wide.num_stages) == (16, 128, 2) and not dk.fills_sm(wide, 128, 2)
    # ... and 64-key blocks where a split gets at most two blocks of 128 keys
    short = dk.fit_tile(tile, 128, 8, 4096, 16, cuda)
    assert (short.block_m, short.block_n, short.num_stages) == (16, 64, 3)
    assert dk.fit_tile(tile, 128, 8, 4097, 16, cuda) == tile  # 257 keys a split
    # other head dims keep their tiles
    for block_d in (64, 256):
        other = dk.decode_config(4, block_d, cuda)
        assert dk.fit_tile(other, block_d, 8, 4096, 16, cuda) == other
        assert dk.fit_tile(other, block_d, 512, 4096, 1, cuda) == other


# ----------------------------------------------------------------------------------------------
# Validation: every bad input raises before anything is written or launched.
# ----------------------------------------------------------------------------------------------

def _args(**over):
    gen = torch.Generator().manual_seed(0)
    args = dict(
        q=torch.randn(2, 1, 4, 16, dtype=torch.float16, generator=gen),
        k_cache=torch.randn(2, 10, 2, 16, dtype=torch.float16, generator=gen),
        v_cache=torch.randn(2, 10, 2, 16, dtype=torch.float16, generator=gen),
        cache_seqlens=torch.tensor([3, 9], dtype=torch.int32),
    )
    args.update(over)
    return args


def _paged(**over):
    cache = torch.zeros(4, 8, 2, 16, dtype=torch.float16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return _args(**{"k_cache": cache, "v_cache": cache.clone(), "block_table": table, **over})


_new = torch.zeros(2, 2, 2, 16, dtype=torch.float16)
BAD = [
    ("q not a tensor", _args(q=[1.0]), TypeError, ["q", "torch.Tensor"]),
    ("q rank 3", _args(q=torch.zeros(2, 4, 16, dtype=torch.float16)), ValueError, ["q", "(B, Nq, Hq, D)"]),
    ("k_cache rank", _args(k_cache=torch.zeros(2, 10, 16, dtype=torch.float16)), ValueError, ["k_cache", "4-D"]),
    ("integer q", _args(q=torch.zeros(2, 1, 4, 16, dtype=torch.int32)), TypeError, ["q", "floating"]),
    ("dtype mismatch", _args(v_cache=torch.zeros(2, 10, 2, 16)), TypeError, ["v_cache", "dtype"]),
    ("device mismatch", _args(k_cache=torch.zeros(2, 10, 2, 16, dtype=torch.float16, device="meta")),
     ValueError, ["k_cache", "device"]),
    ("k/v shapes", _args(v_cache=torch.zeros(2, 9, 2, 16, dtype=torch.float16)), ValueError, ["k_cache", "v_cache", "shape"]),
    ("head dim mismatch", _args(q=torch.zeros(2, 1, 4, 32, dtype=torch.float16)), ValueError, ["head dim"]),
    ("head dim small", _args(q=torch.zeros(2, 1, 4, 8, dtype=torch.float16), k_cache=torch.zeros(2, 10, 2, 8, dtype=torch.float16),
                             v_cache=torch.zeros(2, 10, 2, 8, dtype=torch.float16)), ValueError, ["head dim", "16", "256"]),
    ("GQA not divisible", _args(q=torch.zeros(2, 1, 3, 16, dtype=torch.float16)), ValueError, ["query heads", "multiple"]),
    ("batch mismatch", _args(q=torch.zeros(3, 1, 4, 16, dtype=torch.float16)), ValueError, ["batch"]),
    ("no queries", _args(q=torch.zeros(2, 0, 4, 16, dtype=torch.float16)), ValueError, ["q", "query"]),
    ("seqlens int64", _args(cache_seqlens=torch.tensor([3, 9])), TypeError, ["cache_seqlens", "int32"]),
    ("seqlens shape", _args(cache_seqlens=torch.tensor([3], dtype=torch.int32)), ValueError, ["cache_seqlens", "(B,)"]),
    ("seqlens float", _args(cache_seqlens=3.0), TypeError, ["cache_seqlens"]),
    ("seqlens bool", _args(cache_seqlens=True), TypeError, ["cache_seqlens"]),
    ("seqlens device", _args(cache_seqlens=torch.tensor([3, 9], dtype=torch.int32, device="meta")),
     ValueError, ["cache_seqlens", "device"]),
    ("seqlens negative", _args(cache_seqlens=torch.tensor([-1, 9], dtype=torch.int32)), ValueError, ["cache_seqlens", "negative"]),
    ("over capacity", _args(cache_seqlens=torch.tensor([3, 11], dtype=torch.int32)), ValueError, ["capacity", "10"]),
    ("append over capacity", _args(cache_seqlens=torch.tensor([3, 9], dtype=torch.int32), k_new=_new, v_new=_new),
     ValueError, ["capacity", "Nnew"]),
    ("int over capacity", _args(cache_seqlens=9, k_new=_new, v_new=_new), ValueError, ["cache_seqlens", "capacity"]),
    ("k_new alone", _args(k_new=_new), ValueError, ["k_new", "v_new"]),
    ("k_new shape", _args(k_new=torch.zeros(2, 2, 1, 16, dtype=torch.float16), v_new=torch.zeros(2, 2, 1, 16, dtype=torch.float16)),
     ValueError, ["k_new", "(B, Nnew, Hkv, D)"]),
    ("k_new dtype", _args(k_new=_new.float(), v_new=_new.float()), TypeError, ["k_new", "dtype"]),
    ("k/v_new shapes", _args(k_new=_new, v_new=_new[:, :1]), ValueError, ["k_new", "v_new", "shape"]),
    ("k_new of one sequence", _args(k_new=_new[:1], v_new=_new[:1]), ValueError, ["k_new", "(2, Nnew, 2, 16)"]),
    ("k_new requires grad", _args(k_new=_new.clone().requires_grad_(), v_new=_new), ValueError, ["k_new", "requires grad"]),
    ("causal not bool", _args(causal=1), TypeError, ["causal", "bool"]),
    ("return_lse not bool", _args(return_lse=None), TypeError, ["return_lse"]),
    ("scale NaN", _args(scale=float("nan")), ValueError, ["scale"]),
    ("scale negative", _args(scale=-1.0), ValueError, ["scale", "non-negative"]),
    ("scale tensor", _args(scale=torch.tensor(0.5)), TypeError, ["scale"]),
    ("num_splits 0", _args(num_splits=0), ValueError, ["num_splits"]),
    ("num_splits float", _args(num_splits=2.0), TypeError, ["num_splits"]),
    ("table int64", _paged(block_table=torch.tensor([[0, 1], [2, 3]])), TypeError, ["block_table", "int32"]),
    ("pages of no slot", _paged(k_cache=torch.zeros(4, 0, 2, 16, dtype=torch.float16), v_cache=torch.zeros(4, 0, 2, 16, dtype=torch.float16)),
     ValueError, ["paged", "at least one slot"]),
    ("table rank", _paged(block_table=torch.tensor([0, 1, 2, 3], dtype=torch.int32)), ValueError, ["block_table", "2-D"]),
    ("table rows", _paged(block_table=torch.tensor([[0, 1]], dtype=torch.int32)), ValueError, ["block_table", "B = 2"]),
    ("table page out of range", _paged(block_table=torch.tensor([[0, 1], [2, 4]], dtype=torch.int32)),
     ValueError, ["block_table", "[0, 4)"]),
    ("table negative page", _paged(block_table=torch.tensor([[-1, 1], [2, 3]], dtype=torch.int32)),
     ValueError, ["block_table", "outside"]),
    ("paged over capacity", _paged(cache_seqlens=torch.tensor([3, 17], dtype=torch.int32)), ValueError, ["capacity", "16"]),
    # an int cache_seqlens: every sequence spans the same first pages of its row, checked the same way
    # where the table is on the CPU (on a GPU the int path skips the check, which would cost a sync)
    ("int seqlens, page out of range", _paged(cache_seqlens=9, block_table=torch.tensor([[0, 1], [2, 4]], dtype=torch.int32)),
     ValueError, ["block_table", "[0, 4)"]),
    ("int seqlens, negative page", _paged(cache_seqlens=3, block_table=torch.tensor([[0, 1], [-1, 3]], dtype=torch.int32)),
     ValueError, ["block_table", "outside"]),
    ("int seqlens, append to a bad page", _paged(cache_seqlens=7, k_new=_new, v_new=_new,
                                                 block_table=torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)),
     ValueError, ["block_table", "outside"]),
    ("grad", _args(q=torch.zeros(2, 1, 4, 16, dtype=torch.float16, requires_grad=True)), ValueError, ["forward only", "q"]),
    ("complex", _args(q=torch.zeros(2, 1, 4, 16, dtype=torch.complex64)), TypeError, ["q", "floating"]),
]


@pytest.mark.parametrize("kwargs,exc,words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_raises_a_clear_error_and_writes_nothing(kwargs, exc, words):
    caches = [(x, x.clone()) for x in (kwargs["k_cache"], kwargs["v_cache"]) if x.device.type != "meta"]
    with pytest.raises(exc) as info:
        attention_with_kvcache(**kwargs)
    for word in words:
        assert word in str(info.value), f"message {str(info.value)!r} does not name {word!r}"
    for after, before in caches:
        assert torch.equal(before, after)


@pytest.mark.parametrize("seqlens", [torch.tensor([3, 8], dtype=torch.int32), 8], ids=["tensor", "int"])
def test_good_paged_input_with_unused_negative_entries_is_accepted(seqlens):
    kwargs = _paged(cache_seqlens=seqlens)
    kwargs["block_table"][0, 1] = -1  # sequence 0 (and with an int, each sequence) uses one page only
    kwargs["block_table"][1, 1] = 9 if isinstance(seqlens, int) else 3
    with torch.no_grad():
        assert attention_with_kvcache(**kwargs).shape == kwargs["q"].shape


# ----------------------------------------------------------------------------------------------
# GPU tests: realistic decoding shapes against float64 per sequence.
# ----------------------------------------------------------------------------------------------

def _ragged(b, top, gen):
    lengths = torch.randint(1, top + 1, (b,), generator=gen, dtype=torch.int32)
    lengths[0], lengths[-1] = 0, top  # an empty sequence and one at full capacity
    return lengths


# (B, Nq, Hq, Hkv, D, Mmax, Nnew, causal, num_splits)
GPU_CASES = [
    (16, 1, 32, 8, 128, 8192, 1, True, None),  # the decoding shape of the issue
    (16, 1, 32, 8, 128, 8192, 0, False, 1),  # one split: the direct path at full size
    (8, 4, 32, 8, 128, 4096, 4, True, None),  # a 4-query chunk: 16 packed rows
    (4, 1, 16, 16, 64, 16384, 1, True, None),  # MHA
    (4, 2, 8, 1, 256, 4096, 2, True, None),  # MQA, D = 256
    (4, 1, 28, 4, 72, 3000, 1, False, 7),  # group 7, D = 72, ragged blocks
]


@gpu
@needs_cuda
@DTYPES
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "B{}-Nq{}-H{}x{}-D{}-M{}-new{}-{}-s{}".format(
    *c[:7], "causal" if c[7] else "full", c[8]))
def test_gpu_matches_float64(case, dtype):
    b, n_q, h_q, h_kv, d, m, n_new, causal, num_splits = case
    gen = torch.Generator().manual_seed(b * m + n_q)
    q, k_cache, v_cache, k_new, v_new = _make(b, n_q, h_q, h_kv, d, m, n_new, dtype, seed=3)
    seqlens = _ragged(b, m - n_new, gen).to(DEVICE)
    _check(q, k_cache, v_cache, seqlens, k_new, v_new, causal, num_splits=num_splits)


@gpu
@needs_cuda
@DTYPES
@pytest.mark.parametrize("page_size", [256, 16], ids=["page256", "page16"])
def test_gpu_paged_cache_matches_float64(page_size, dtype):
    b, n_q, h_q, h_kv, d, n_new = 16, 1, 32, 8, 128, 1
    capacity_pages = 8192 // page_size
    gen = torch.Generator().manual_seed(page_size)
    table, pages = _shuffled_pages(b, capacity_pages, page_size, h_kv, d, dtype, seed=page_size)
    q, k_cache, v_cache, k_new, v_new = _make(b, n_q, h_q, h_kv, d, 0, n_new, dtype, pages=pages, seed=5)
    seqlens = _ragged(b, capacity_pages * page_size - n_new, gen).to(DEVICE)
    _check(q, k_cache, v_cache, seqlens, k_new, v_new, True, block_table=table.to(DEVICE))


@gpu
@needs_cuda
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_gpu_strided_lengths_and_block_table(paged):
    _strided_index_tensors(torch.bfloat16, paged)


@gpu
@needs_cuda
def test_gpu_replayed_decode_steps_match_the_full_path(monkeypatch):
    """A decoding loop whose steps replay their launches (flashattn.launch.Recipe) gives bitwise the
    outputs, LSEs and caches of the same loop on the full launch path: one new key per step with an int
    length that grows, a paged cache with a tensor of lengths, and one split (no merge)."""
    from flashattn import launch as launch_mod

    class NeverKept(dict):
        def __setitem__(self, key, value):  # every step records and keeps nothing: the full path
            pass

    pages = (64, 32, 8, 128)
    for paged, splits in ((False, None), (True, None), (False, 1)):
        q, k_cache, v_cache, k_new, v_new = _make(4, 1, 32, 8, 128, 2048, 1, torch.bfloat16, seed=21,
                                                  pages=pages if paged else None)
        table = torch.randperm(64, device=DEVICE)[:64].to(torch.int32).view(4, 16) if paged else None
        runs = []
        for keep in (False, True):
            monkeypatch.setattr(launch_mod, "_RECIPES", {} if keep else NeverKept())
            kc, vc, out, signatures = k_cache.clone(), v_cache.clone(), [], []
            for step in range(6):
                lengths = (torch.tensor([300, 0, 400, 40], dtype=torch.int32, device=DEVICE) + step if paged
                           else 600 + step)  # 601-606 keys: the same split count every step
                with monkeypatch.context() as m:
                    m.setattr(launch_mod, "_signature", lambda *a, f=launch_mod._signature: signatures.append(step) or f(*a))
                    out += attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, k_new=k_new, v_new=v_new,
                                                  block_table=table, num_splits=splits, return_lse=True)
            if keep and any(entry[2] is not None for entry in launch_mod._COMPILED.values()):
                assert 5 not in signatures  # the last step replayed
            runs.append((*out, kc, vc))
        for a, b in zip(*runs):
            assert not torch.isnan(a).any()
            assert torch.equal(a, b)


@gpu
@needs_cuda
def test_gpu_large_logits_and_poisoned_scratch(monkeypatch):
    def poisoned(shape, device):
        return torch.full(shape, float("nan"), dtype=torch.float32, device=device)

    monkeypatch.setattr(flashattn.decode_kernels, "_scratch", poisoned)
    monkeypatch.setattr(flashattn.launch, "_RECIPES", {})  # a replayed step would allocate its own scratch
    q, k_cache, v_cache, _, _ = _make(8, 1, 32, 8, 128, 4096, 0, torch.bfloat16, std=4.5, seed=8)
    s = (q[:, :, :1].float() @ k_cache[:, :, 0].float().transpose(-1, -2)) * 128 ** -0.5
    assert s.abs().max() > 60, "inputs do not produce large logits"
    seqlens = torch.tensor([0, 1, 63, 64, 65, 1000, 4095, 4096], dtype=torch.int32, device=DEVICE)
    _check(q, k_cache, v_cache, seqlens, None, None, True, num_splits=16)


# ----------------------------------------------------------------------------------------------
# The benchmark's report (its timing needs a GPU: python -m benchmarks.decode --out DIR).
# ----------------------------------------------------------------------------------------------

def test_benchmark_table_reports_ratio_bandwidth_and_wrong_results(tmp_path, monkeypatch):
    from benchmarks import decode as bench

    def row(provider, eager, graph, passed=True):
        return {"B": 16, "M": 8192, "Nq": 1, "provider": provider, "status": "ok", "check": {"passed": passed},
                "gqa": "enable_gqa", "layout": "view",
                "eager": {"us": eager, "copy_fraction": 0.5}, "graph": {"us": graph, "copy_fraction": 0.8}}

    result = {"what": "test", "device": "none", "versions": {"torch": "x", "triton": "y"}, "copy_bandwidth_gbps": 4000,
              "modes": ["eager", "graph"],
              "rows": [row("flashattn", 100.0, 50.0), row("sdpa_flash", 150.0, 60.0),
                       row("sdpa_cudnn", 120.0, 40.0, passed=False),
                       {"B": 16, "M": 8192, "Nq": 1, "provider": "flex", "status": "error", "error": "boom"}]}
    table = bench.markdown(result)
    # each mode compares flashattn with the fastest peer of that mode (a WRONG one still counts)
    assert "| 16 | 8192 | 1 | 100 | 150 | 120 (WRONG) | error | 1.20x | 50% |" in table
    assert "| 16 | 8192 | 1 | 50 | 60 | 40 (WRONG) | error | 0.80x | 80% |" in table
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--out", str(tmp_path)]) == 2


# -- the dense entry point hands few queries to the split-KV kernels (Problem.split_kv) ----------------


def test_split_kv_rule_regions():
    """From 512 keys: up to 32 queries on any number of K/V heads, up to 64 on at most 32 of them; from
    128 keys, up to 32 queries on 128 K/V heads or more."""
    from flashattn.problem import split_kv_wins

    assert split_kv_wins(1, 512, 8) and split_kv_wins(32, 600, 128) and split_kv_wins(64, 4096, 32)
    assert split_kv_wins(16, 1 << 20, 4096) and split_kv_wins(33, 512, 1)
    assert not split_kv_wins(1, 511, 8) and not split_kv_wins(4, 300, 127)  # few keys, few K/V heads
    assert split_kv_wins(1, 128, 128) and split_kv_wins(32, 511, 4096)  # few keys, many K/V heads
    assert not split_kv_wins(1, 127, 4096) and not split_kv_wins(33, 511, 128)
    assert not split_kv_wins(33, 4096, 33) and not split_kv_wins(64, 1 << 20, 128)  # the dense grid is full
    assert not split_kv_wins(65, 1 << 20, 1)  # too many queries


@pytest.mark.parametrize("b, h_q, h_kv, n, m, d, causal, layout, split_kv", [
    (1, 4, 2, 1, 4096, 32, False, "bhnd", True),
    (1, 4, 1, 3, 4100, 40, True, "bnhd", True),
    (1, 2, 1, 40, 4097, 16, True, "bhnd", True),  # more queries, few K/V heads, a long cache
    (1, 4, 2, 1, 600, 32, True, "bhnd", True),  # a shorter cache, one query
    (2, 2, 2, 4, 100, 64, True, "bhnd", False),  # a short cache: the dense forward
    (1, 8, 2, 2, 1, 16, True, "bhnd", False),  # M < N: a causal row that sees no key
])
def test_dense_entry_point_hands_few_queries_to_split_kv(b, h_q, h_kv, n, m, d, causal, layout, split_kv,
                                                        monkeypatch):
    """``flashattn.attention`` with a few queries against many keys runs the split-KV kernels: its
    output and LSE meet the float64 reference by the ratio rule (a row that sees no key gets o = 0,
    LSE -inf), keep q's memory layout, repeat bitwise, and the gradients come from the dense backward
    with the split-KV forward's o and LSE, as close to float64 as the dense forward's."""
    from flashattn.problem import Problem
    from flashattn.reference import naive_attention
    from flashattn.testing import random_qkv

    if HAS_CUDA:  # the GPU sizes of the same cases: longer caches, wider heads
        m, d = m * 4, d * 2
    gen = torch.Generator().manual_seed(n * 100 + m)
    q, k, v = (x.to(DEVICE) for x in random_qkv(b, h_q, h_kv, n, m, d, dtype=torch.float16, layout=layout,
                                                generator=gen))
    expected = split_kv
    assert Problem.of(q, k, causal).split_kv == expected
    launched = []
    real = flashattn.decode_kernels.launch_decode
    monkeypatch.setattr(flashattn.decode_kernels, "launch_decode", lambda *a, **kw: launched.append(1) or real(*a, **kw))
    o, lse = flashattn.attention(q, k, v, causal=causal, return_lse=True)
    assert len(launched) == int(expected)
    assert o.stride() == torch.empty_like(q).stride()  # q's layout, as the dense kernel keeps it
    ref = naive_attention(q.double(), k.double(), v.double(), causal=causal)
    lowp = naive_attention(q.float(), k.float(), v.float(), causal=causal)
    assert_close_ratio("o", o, ref[0], lowp[0].half())
    assert_close_ratio("lse", lse, ref[1], lowp[1])
    o2, lse2 = flashattn.attention(q, k, v, causal=causal, return_lse=True)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)

    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    do = torch.randn(o.shape, generator=gen).to(DEVICE, torch.float16)
    grads = torch.autograd.grad(flashattn.attention(qg, kg, vg, causal=causal), (qg, kg, vg), do)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref_grads = torch.autograd.grad(naive_attention(q64, k64, v64, causal=causal)[0], (q64, k64, v64), do.double())
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    low_grads = torch.autograd.grad(naive_attention(q32, k32, v32, causal=causal)[0], (q32, k32, v32), do.float())
    for name, g, r, lp in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_close_ratio(name, g, r, lp.half(), factor=3.0)


# ----------------------------------------------------------------------------------------------
# flash_attn_with_kvcache's other options: variants, sinks, rotary, left padding, a batch index
# ----------------------------------------------------------------------------------------------

def _rotary_tables(rows, half, seed):
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(rows, half, generator=gen, dtype=torch.float64) * 6
    return angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)


OPTION_CASES = [  # (name, causal, options); the cache has 5 entries for 3 sequences when batch_idx is used
    ("window", True, dict(window=(6, 0))),
    ("window-not-causal", False, dict(window=(4, 3))),
    ("softcap", False, dict(softcap=2.0)),
    ("alibi-per-sequence", True, dict(alibi_slopes="rows")),
    ("sinks", True, dict(sinks=True)),
    ("rotary-neox", True, dict(rotary=False)),
    ("rotary-gptj-not-causal", False, dict(rotary=True)),
    ("leftpad", True, dict(cache_leftpad=[0, 3, 5])),
    ("everything", True, dict(cache_batch_idx=[4, 0, 2], cache_leftpad=[1, 0, 2], window=(5, 1), sinks=True,
                              rotary=True, softcap=5.0, alibi_slopes="heads")),
]


def _options(options, h_q, d):
    kw, i32 = {}, (lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE))
    for key, value in options.items():
        if key == "alibi_slopes":
            kw[key] = torch.rand((3, h_q) if value == "rows" else (h_q,), device=DEVICE)
        elif key == "sinks":
            kw[key] = torch.randn(h_q, device=DEVICE)
        elif key == "rotary":
            kw["rotary_cos"], kw["rotary_sin"] = _rotary_tables(64, d // 4, seed=1)
            kw["rotary_interleaved"] = value
        elif key in ("cache_leftpad", "cache_batch_idx"):
            kw[key] = i32(value)
        else:
            kw[key] = value
    return kw


@pytest.mark.parametrize("name,causal,options", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
def test_cache_options_match_their_definitions(name, causal, options):
    """Each option alone and all together against kvcache_options_reference (float64), the in-place
    append included (float32 CPU: the reference path; fp16 under the interpreter: the kernels)."""
    dtype = torch.float16 if DEVICE == "cuda" or flashattn.autograd.use_kernels(torch.empty(0, dtype=torch.float16)) \
        else torch.float32
    h_q, h_kv, d = 4, 2, 32
    entries = 5 if "cache_batch_idx" in options else 3
    torch.manual_seed(0)
    kw = _options(options, h_q, d)
    q, k_cache, v_cache, k_new, v_new = _make(3, 2, h_q, h_kv, d, 40, 3, dtype, seed=2)
    if entries != 3:
        k_cache, v_cache = (torch.randn(entries, 40, h_kv, d, dtype=dtype, device=DEVICE) for _ in range(2))
    lengths = torch.tensor([10, 20, 7], dtype=torch.int32, device=DEVICE)
    ref_kw = {key: (val.double() if isinstance(val, torch.Tensor) and val.is_floating_point() else val)
              for key, val in kw.items()}
    ref = reference.kvcache_options_reference(q.double(), k_cache.double(), v_cache.double(), lengths.cpu(),
                                              k_new.double(), v_new.double(), causal, **ref_kw)
    low = reference.kvcache_options_reference(q, k_cache, v_cache, lengths.cpu(), k_new, v_new, causal,
                                              **{key: (val.to(dtype) if key == "sinks" else val) for key, val in kw.items()})
    with torch.no_grad():
        o, lse = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k_new=k_new, v_new=v_new,
                                        causal=causal, return_lse=True, **kw)
    assert_close_ratio("o", o, ref[0], low[0])
    fin = torch.isfinite(ref[1])
    assert_close_ratio("lse", lse[fin], ref[1][fin], low[1][fin])
    # the appended (rotated) keys landed where the definition puts them, to the rounding of their dtype
    torch.testing.assert_close(k_cache.double(), ref[2], rtol=0, atol=2e-3 if dtype != torch.float32 else 1e-6)
    torch.testing.assert_close(v_cache, low[3], rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(cache_leftpad=torch.tensor([0, 9], dtype=torch.int32)), ValueError, "cache_leftpad must lie"),
    (dict(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)), ValueError, "cache_batch_idx must lie"),
    (dict(cache_batch_idx=torch.tensor([0, 1])), TypeError, "cache_batch_idx must be an int32"),
    (dict(rotary_cos=torch.zeros(8, 4)), ValueError, "together"),
    (dict(rotary_cos=torch.zeros(8, 9), rotary_sin=torch.zeros(8, 9)), ValueError, "rotary_dim"),
    (dict(sinks=torch.zeros(3)), ValueError, "sinks must have shape"),
    (dict(window=(-1, 0)), ValueError, "window left"),
    (dict(rotary_cos=torch.zeros(8, 4), rotary_sin=torch.zeros(8, 4)), ValueError, "rotary_cos has 8 rows"),
])
def test_bad_cache_options_are_refused(kwargs, error, words):
    dtype = torch.float16 if HAS_CUDA else torch.float32  # the GPU refuses float32 before the option checks
    q = torch.zeros(2, 1, 2, 16, device=DEVICE, dtype=dtype)
    cache = torch.zeros(2, 8, 2, 16, device=DEVICE, dtype=dtype)
    kwargs = {key: (val.to(DEVICE, dtype if val.is_floating_point() else val.dtype) if isinstance(val, torch.Tensor)
                    else val) for key, val in kwargs.items()}
    with pytest.raises(error, match=words):
        attention_with_kvcache(q, cache, cache.clone(), cache_seqlens=torch.tensor([3, 8], dtype=torch.int32,
                                                                                     device=DEVICE), **kwargs)


@gpu
@needs_cuda
@pytest.mark.parametrize("name,causal,options", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
def test_gpu_cache_options_match_their_definitions(name, causal, options):
    test_cache_options_match_their_definitions(name, causal, options)


def test_rotary_with_an_int_cache_seqlens_is_the_tensor_call():
    """Rotary alone keeps the split-KV path; an int cache_seqlens gives the bits of the same lengths as a
    tensor, and a rotary table too short for the positions is refused before anything is written."""
    q, k_cache, v_cache, k_new, v_new = _make(2, 1, 4, 2, 32, 40, 2, torch.float16, seed=3)
    cos, sin = _rotary_tables(64, 8, seed=2)
    runs = []
    for lengths in (12, torch.tensor([12, 12], dtype=torch.int32, device=DEVICE)):
        kc, vc = k_cache.clone(), v_cache.clone()
        with torch.no_grad():
            o = attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, k_new=k_new, v_new=v_new, rotary_cos=cos,
                                       rotary_sin=sin)
        runs.append((o, kc))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    kc = k_cache.clone()
    with pytest.raises(ValueError, match="rotary_cos has 13 rows"):
        attention_with_kvcache(q, kc, v_cache.clone(), cache_seqlens=12, k_new=k_new, v_new=v_new,
                               rotary_cos=cos[:13], rotary_sin=sin[:13])
    assert torch.equal(kc, k_cache)
