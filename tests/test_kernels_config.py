"""How a problem picks its tiles, plans and launches (flashattn._config, flashattn.backward).

The GPU tile tables (Hopper's by variant, smaller tiles where the grid would leave SMs idle, every
entry a launchable config), the plans made from a tile (dK/dV in two launches with the bits of one,
a bounded plan cache), the backward's launch order (dQ on a second stream only for long problems, the
dQ kernel computing the row statistics in place of the preprocess kernel), autotuning (each candidate
timed once, a pinned tile taken as it is) and the rule that dispatches the Gluon kernels. Rules are
checked with the capability, the SM count and the interpreter switch stubbed, so they run on any
machine; the tests that compare kernel outputs across configs run interpreted on the CPU, and at
larger sizes where they are marked ``gpu``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashattn
from flashattn import _config
from flashattn.backward import launch_backward as attention_backward
from flashattn.forward import launch_forward as attention_forward
from flashattn.problem import Problem
from flashattn.testing import rel_err

from devices import DEVICE, HAS_CUDA, gpu, needs_cuda
from kernel_cases import _check_against_reference, _inputs, _on_hopper, _problem


def test_second_stream_only_for_long_backwards():
    """dQ runs beside dK/dV only when the work is large enough for the overlap to pay."""
    from flashattn.backward import OVERLAP_MIN_WORK, worth_a_second_stream

    def problem(b, h, n, d):
        q = torch.empty(b, h, n, d, device="meta")
        return Problem.of(q, q, True, None)

    assert not worth_a_second_stream(problem(1, 16, 512, 64))  # a short call: one stream
    assert not worth_a_second_stream(problem(8, 16, 512, 128))  # the latency section's longest ones too
    assert not worth_a_second_stream(problem(8, 16, 1024, 64))
    assert worth_a_second_stream(problem(32, 32, 512, 64))  # the grid's shortest setting keeps it
    assert worth_a_second_stream(problem(1, 16, 16384, 128))
    assert 1 * 16 * 512 * 512 * 64 < OVERLAP_MIN_WORK <= 32 * 32 * 512 * 512 * 64


def test_hopper_table_picks_the_forward_tile_by_variant(monkeypatch):
    """On sm_90 the D = 128 forward takes one warpgroup and two stages, except with a window, which
    keeps the two-warpgroup tile, and with dropout, which takes 64 x 64 tiles (both measured); other
    GPUs read their own table. The choice is the host's, so it is checked here with the capability
    and the interpreter switch stubbed."""
    from flashattn import _config

    monkeypatch.setattr(_config, "is_interpreter", lambda: False)
    cuda = torch.device("cuda", 0)

    def get(kernel, d, causal=False, n=4096, **variants):
        return _config.get_config(kernel, Problem(1, 8, 8, n, n, d, torch.float16, causal, d ** -0.5, **variants), cuda)

    def fwd(d, causal=False, n=4096, **variants):
        return get("fwd", d, causal, n, **variants)

    monkeypatch.setattr(_config, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(_config, "_sm_count", lambda index: 132)  # 256 programs and more here: a full grid
    one_warpgroup, two_warpgroups = _config.KernelConfig(128, 64, 4, 2), _config.KernelConfig(128, 128, 8, 3)
    small = _config.KernelConfig(64, 64, 4, 2)
    assert fwd(128) == fwd(128, causal=True) == one_warpgroup
    assert fwd(128, softcap=30.0) == fwd(128, alibi=True) == one_warpgroup
    assert fwd(128, window=(256, 256)) == two_warpgroups
    assert fwd(128, dropout_p=0.1) == fwd(128, causal=True, dropout_p=0.1) == small
    assert fwd(128, dropout_p=0.1, window=(256, 256)) == small  # dropout's tiles come first
    assert fwd(64) == fwd(64, causal=True, n=4096) == _config.KernelConfig(64, 128, 4, 2)
    assert fwd(64, causal=True, n=1024) == _config.KernelConfig(64, 64, 4, 2)
    assert fwd(64, causal=True, n=1025) == fwd(64, causal=True, n=2048) == _config.KernelConfig(64, 128, 4, 2)
    assert fwd(64, dropout_p=0.1) == fwd(32, dropout_p=0.1) == small
    assert fwd(256, dropout_p=0.1) == fwd(256)  # D = 256 keeps its tile
    assert get("bwd_dkdv", 128, dropout_p=0.1) == get("bwd_dkdv", 128, causal=True, dropout_p=0.1) \
        == _config.KernelConfig(32, 128, 8, 3)
    # the causal dK/dV kernel's single loop takes the non-causal tiles from D = 128 up
    assert get("bwd_dkdv", 128) == get("bwd_dkdv", 128, causal=True) == _config.KernelConfig(64, 128, 8, 3)
    # D = 256: dV and dK in two launches on 128-row key blocks
    assert get("bwd_dkdv", 256) == get("bwd_dkdv", 256, causal=True) == _config.KernelConfig(32, 128, 8, 3, True)
    assert get("bwd_dkdv", 64, causal=True) == _config.KernelConfig(32, 64, 4, 3)
    assert get("bwd_dq", 256) == get("bwd_dq", 256, causal=True) == _config.KernelConfig(64, 32, 4, 3)
    # dropout: two stages in the two launches at D = 256, and its own dQ tile
    assert get("bwd_dkdv", 256, causal=True, dropout_p=0.1) == get("bwd_dkdv", 256, dropout_p=0.1) \
        == _config.KernelConfig(32, 128, 8, 2, True)
    assert get("bwd_dq", 256, dropout_p=0.1) == _config.KernelConfig(128, 64, 8, 1)
    assert get("bwd_dq", 128, dropout_p=0.1) == get("bwd_dq", 128)
    assert get("bwd_dq", 64, dropout_p=0.1) == _config.KernelConfig(64, 128, 4, 2) != get("bwd_dq", 64)
    monkeypatch.setattr(_config, "_capability", lambda index: (8, 0))
    assert fwd(128) == fwd(128, dropout_p=0.1) == _config._DEFAULT[("fwd", 128)]


def test_small_grids_take_smaller_tiles_on_hopper(monkeypatch):
    """Where the table tile's programs would leave SMs idle (fewer than the SMs for the forward,
    than half of them for the backward's kernels), the Hopper table gives 64 x 64 tiles: counted per
    query block of a query head (forward, dQ) or per key block of a K/V head (dK/dV). The D = 256
    forward's share depends on the mask (half the SMs without it, all of them with the causal mask).
    Not for variants with their own tiles, packed sequences, the D = 256 backward, or the D <= 64
    forward (64 rows already)."""
    from flashattn import _config

    monkeypatch.setattr(_config, "is_interpreter", lambda: False)
    monkeypatch.setattr(_config, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(_config, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)

    def get(kernel, b, h_q, h_kv, n, d, causal=False, **variants):
        return _config.get_config(kernel, Problem(b, h_q, h_kv, n, n, d, torch.float16, causal, d ** -0.5, **variants), cuda)

    fwd_small, bwd_small = _config.KernelConfig(64, 64, 4, 2), _config.KernelConfig(64, 64, 4, 3)
    table = {kernel: _config.resolve(_config._SM90[(kernel, 128)], False, 4096) for kernel in ("fwd", "bwd_dkdv", "bwd_dq")}
    # forward, 128-row tiles: 8 blocks x 16 heads = 128 < 132 programs; 17 heads make 136
    assert get("fwd", 1, 16, 16, 1024, 128) == get("fwd", 1, 16, 16, 512, 96, causal=True) == fwd_small
    assert get("fwd", 1, 17, 17, 1024, 128) == table["fwd"]
    # backward: 4 blocks x 16 heads = 64 < 66 programs; at N = 1024 128 are too many
    assert get("bwd_dq", 1, 16, 16, 512, 128) == get("bwd_dkdv", 1, 16, 16, 512, 128) == bwd_small
    assert get("bwd_dq", 1, 16, 16, 1024, 128) == table["bwd_dq"]
    assert get("bwd_dkdv", 1, 16, 16, 1024, 128) == table["bwd_dkdv"]
    # dK/dV counts K/V heads: 32 key blocks x 2 heads under GQA; dQ the 16 query heads (512 programs)
    assert get("bwd_dkdv", 1, 16, 2, 4096, 128) == bwd_small and get("bwd_dq", 1, 16, 2, 4096, 128) == table["bwd_dq"]
    # D <= 64: dQ's 128-row tile only; the forward and dK/dV keep the table's
    assert get("bwd_dq", 1, 16, 16, 512, 64) == get("bwd_dq", 2, 4, 4, 300, 40) == bwd_small
    assert get("fwd", 1, 16, 16, 512, 64) == _config.KernelConfig(64, 128, 4, 2)
    assert get("bwd_dkdv", 1, 16, 16, 512, 64, causal=True) == _config.KernelConfig(32, 64, 4, 3)
    # variants with tiles of their own, and the D = 256 backward, keep them
    assert get("fwd", 1, 2, 2, 512, 128, window=(64, 0)) == _config._SM90_WINDOW[("fwd", 128)]
    assert get("fwd", 1, 2, 2, 512, 128, dropout_p=0.1) == _config._SM90_DROPOUT[("fwd", 128)]
    assert get("bwd_dq", 1, 2, 2, 512, 256) == _config.resolve(_config._SM90[("bwd_dq", 256)], False, 512)
    assert get("bwd_dkdv", 1, 2, 2, 512, 256) == _config.resolve(_config._SM90[("bwd_dkdv", 256)], False, 512)
    # D = 256 forward, 128-row tiles: 8 blocks x 8 heads = 64 < 66 programs either way; 8 x 16 = 128
    # programs swap only with the causal mask, and 136 (17 heads) never
    table256 = _config._SM90[("fwd", 256)]
    assert get("fwd", 1, 8, 8, 1024, 256) == get("fwd", 1, 8, 8, 1024, 256, causal=True) == fwd_small
    assert get("fwd", 1, 16, 16, 1024, 256) == table256 and get("fwd", 1, 16, 16, 1024, 256, causal=True) == fwd_small
    assert get("fwd", 1, 17, 17, 1024, 256, causal=True) == table256
    # softcap and ALiBi take the table's tiles, so its small-grid tiles too
    assert get("fwd", 1, 2, 2, 512, 128, softcap=20.0) == get("fwd", 1, 2, 2, 512, 128, alibi=True) == fwd_small
    # packed sequences keep the fixed table (their problem's n is the longest sequence)
    packed = Problem(2, 4, 4, 300, 300, 128, torch.float16, True, 0.1, layout="packed", total_q=400, total_k=400)
    assert _config.get_config("fwd", packed, cuda) == table["fwd"]
    monkeypatch.setattr(_config, "_capability", lambda index: (8, 0))
    assert get("fwd", 1, 16, 16, 512, 128) == _config._DEFAULT[("fwd", 128)]


@settings(max_examples=200, deadline=None)
@given(b=st.integers(1, 8), h_kv=st.integers(1, 32), group=st.sampled_from([1, 2, 4, 8]), n=st.integers(1, 9000),
       m=st.integers(1, 9000), d=st.sampled_from([16, 32, 40, 64, 72, 96, 128, 160, 256]), causal=st.booleans(),
       sms=st.sampled_from([78, 114, 132]))
def test_small_grid_rule_counts_the_programs_plan_for_launches(b, h_kv, group, n, m, d, causal, sms):
    """The small-grid rule of get_config counts programs as plan_for lays out the table tile's grid:
    it swaps the tile exactly when that grid is below the kernel's share of the SMs, and the tile it
    swaps in never makes fewer programs."""
    from flashattn import _config

    problem = Problem(b, h_kv * group, h_kv, n, m, d, torch.float16, causal, d ** -0.5)
    cuda = torch.device("cuda", 0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_config, "is_interpreter", lambda: False)
        mp.setattr(_config, "_capability", lambda index: (9, 0))
        mp.setattr(_config, "_sm_count", lambda index: sms)
        for kernel in ("fwd", "bwd_dkdv", "bwd_dq"):
            table = _config.resolve(_config._SM90[(kernel, problem.block_d)], causal, n)
            small = _config._SM90_SMALL_GRID.get((kernel, problem.block_d))
            programs = _config.plan_for(kernel, problem, cuda, table).grid
            swap = small is not None and programs < _config.resolve(small[0], causal, n) * sms
            got = _config.get_config(kernel, problem, cuda)
            assert got == (small[1] if swap else table), (kernel, programs)
            assert _config.plan_for(kernel, problem, cuda, got).grid >= programs


def test_every_table_entry_resolves_to_a_launchable_config():
    """Each GPU table entry gives one config per (causal, N); tiles are powers of two and fit the rules."""
    from flashattn import _config

    small_grid = {key: tile for key, (share, tile) in _config._SM90_SMALL_GRID.items()
                  if all(0 < _config.resolve(share, causal, None) <= 1 for causal in (False, True))}
    assert len(small_grid) == len(_config._SM90_SMALL_GRID)
    for table in (_config._SM90, _config._SM90_WINDOW, _config._SM90_DROPOUT, _config._DEFAULT, small_grid):
        for (kernel, block_d), entry in table.items():
            for causal in (False, True):
                for n in (1, 2048, 2049, 16384):
                    cfg = _config.resolve(entry, causal, n)
                    assert isinstance(cfg, _config.KernelConfig), (kernel, block_d, causal, n)
                    for size in (cfg.block_m, cfg.block_n):
                        assert size >= 16 and size & (size - 1) == 0
                    assert not cfg.split or kernel == "bwd_dkdv", (kernel, block_d)  # only dK/dV has parts
                    assert cfg.num_warps in (4, 8) and 1 <= cfg.num_stages <= 4
    by_length = _config.ByLength(2048, _config.KernelConfig(64, 64, 4, 3), _config.KernelConfig(64, 128, 4, 3))
    assert by_length.pick(2048).block_n == 64 and by_length.pick(2049).block_n == 128
    assert by_length.pick(None).block_n == 64


SPLIT_CASES = [  # (B, Hq, Hkv, N, M, D), options, layout
    ((2, 4, 2, 37, 53, 40), dict(causal=True), "bnhd"),  # GQA, ragged, N < M, D not a power of two
    ((1, 2, 2, 45, 29, 16), dict(causal=True, window=(9, 2), softcap=5.0), "bhnd"),  # empty rows (N > M)
    ((2, 2, 1, 33, 41, 24), dict(alibi=True), "bhnd"),
    ((1, 2, 2, 40, 40, 32), dict(causal=True, dropout_p=0.25, seed=9), "bnhd"),
    (None, dict(causal=True), "varlen"),  # packed sequences of lengths (q, k): (17, 30), (0, 5), (40, 40)
]
if HAS_CUDA:  # the two tiles of the GPU table's D = 256 entry, and a D = 64 tile, on the same inputs
    SPLIT_CASES = [((1, 4, 2, 300, 517, 256), dict(causal=True), "bnhd"), ((2, 4, 4, 333, 333, 64), {}, "bhnd"),
                   ((1, 2, 2, 400, 257, 256), dict(window=(100, 0), softcap=30.0), "bhnd"),
                   ((1, 2, 2, 256, 256, 256), dict(causal=True, dropout_p=0.1, seed=4), "bhnd")]


def _packed(lens_q, lens_k, dtype, *, seed, std=1.0):
    """q, k, v, dO of packed sequences (D = 32, 4 query heads, 2 K/V heads) and their cu_seqlens."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v, do = (torch.randn(sum(lens), h, 32, dtype=dtype, device=DEVICE, generator=gen) * std
                   for lens, h in ((lens_q, 4), (lens_k, 2), (lens_k, 2), (lens_q, 4)))
    cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
          for lens in (lens_q, lens_k)]
    return q, k, v, do, cu


@gpu  # and interpreted on the CPU
@pytest.mark.parametrize("shape, options, layout", SPLIT_CASES, ids=lambda c: str(c))
def test_dkdv_in_two_launches_is_bitwise_one_launch(shape, options, layout):
    """A dK/dV config with ``split`` (dV in one launch, dK in a second, :attr:`_config.Plan.passes`)
    gives the same bits as one launch with the same tiles: each accumulator is the same sum either
    way. Only dK and dV change with the config; dQ is compared too, as a control on the inputs."""
    from flashattn import _config

    dtype = torch.float16  # on the CPU, half-precision tensors are what runs the kernels (interpreted)
    options = dict(options)
    if layout == "varlen":
        lens_q, lens_k = (17, 0, 40), (30, 5, 40)
        q, k, v, do, cu = _packed(lens_q, lens_k, dtype, seed=3)
        call = lambda q, k, v: flashattn.attention_varlen(q, k, v, *cu, max(lens_q), max(lens_k), **options)  # noqa: E731
    else:
        q, k, v, do = _inputs(*shape, dtype, layout=layout, std=2.0, seed=21)
        if options.pop("alibi", False):
            options["alibi_slopes"] = torch.tensor([0.5, 0.125], device=DEVICE)
        call = lambda q, k, v: flashattn.attention(q, k, v, **options)  # noqa: E731
    d = q.shape[-1]
    if not HAS_CUDA:
        tile = _config.KernelConfig(16, 32, 4, 1)
    elif d == 256:
        tile = _config.KernelConfig(32, 128, 8, 2)  # 2 stages: one launch of both needs the shared memory
    else:
        tile = _config.KernelConfig(64, 64, 4, 3)
    grads = []
    for config in (tile, _config.KernelConfig(tile.block_m, tile.block_n, tile.num_warps, tile.num_stages, True)):
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        with torch.autograd.set_multithreading_enabled(False), _config.tuning(bwd_dkdv=config):
            grads.append(torch.autograd.grad(call(qg, kg, vg), (qg, kg, vg), do))
    for name, one, two in zip(("dq", "dk", "dv"), *grads):
        assert torch.isfinite(two).all(), name
        assert torch.equal(one, two), name


def test_a_split_plan_launches_dv_then_dk():
    """``Plan.passes``: one launch with PART 0, or PART 1 (dV) then PART 2 (dK) for a split config."""
    from flashattn import _config

    problem = Problem(1, 2, 2, 64, 64, 32, torch.float16, True, 0.2)
    cpu = torch.device("cpu")
    one = _config.plan_for("bwd_dkdv", problem, cpu, _config.KernelConfig(16, 32, 4, 1))
    two = _config.plan_for("bwd_dkdv", problem, cpu, _config.KernelConfig(16, 32, 4, 1, True))
    assert [c["PART"] for c in one.passes] == [0] and [c["PART"] for c in two.passes] == [1, 2]
    assert all(list(c)[-1] == "PART" and {**c, "PART": 0} == one.constexprs for c in two.passes)
    assert "PART" not in _config.plan_for("bwd_dq", problem, cpu, _config.KernelConfig(16, 32, 4, 1)).constexprs


ROW_STATS_CASES = [
    # (B, Hq, Hkv, N, M, D), layout, options: causal rows with no key, GQA, a D that is no power of two,
    # a transposed layout, large logits, a gradient for the LSE, the variants, packed sequences
    ((2, 4, 2, 37, 21, 40), "bnhd", dict(causal=True, return_lse=True)),
    ((1, 6, 2, 29, 53, 24), "bhnd", dict(window=(9, 3), softcap=5.0, alibi=True, dropout_p=0.25, seed=7)),
    ((1, 2, 2, 48, 48, 80), "bhnd", dict(causal=True, return_lse=True)),
    (None, "varlen", dict(causal=True, return_lse=True)),
]


@gpu  # and interpreted on the CPU
@pytest.mark.parametrize("shape, layout, options", ROW_STATS_CASES, ids=lambda c: str(c))
def test_row_stats_in_dq_give_the_preprocess_kernels_gradients(shape, layout, options, monkeypatch):
    """Where the dQ kernel runs on the current stream it goes first and computes delta and the base-2
    LSE of its own rows (``ROW_STATS``) in place of the preprocess kernel, one launch fewer: the
    gradients are those of the three-kernel path, bitwise under the interpreter (the same float32 row
    sums) and to within a rounding of delta's sum order on a GPU, and the preprocess kernel is not
    launched."""
    from flashattn import backward as bwd_mod

    dtype = torch.float16  # on the CPU, half-precision tensors are what runs the kernels (interpreted)
    options = dict(options)
    return_lse = options.pop("return_lse", False)
    if layout == "varlen":
        lens_q, lens_k = (17, 0, 40, 9), (30, 5, 40, 0)
        q, k, v, do, cu = _packed(lens_q, lens_k, dtype, seed=4, std=3)
        call = lambda q, k, v: flashattn.attention_varlen(q, k, v, *cu, max(lens_q), max(lens_k),  # noqa: E731
                                                          return_lse=return_lse, **options)
    else:
        q, k, v, do = _inputs(*shape, dtype, layout=layout, std=3.0, seed=22)
        if options.pop("alibi", False):
            options["alibi_slopes"] = torch.linspace(0.05, 0.5, shape[1], device=DEVICE)
        call = lambda q, k, v: flashattn.attention(q, k, v, return_lse=return_lse, **options)  # noqa: E731
    launched = []
    launch = bwd_mod.launch
    monkeypatch.setattr(bwd_mod, "launch", lambda kernel, *a, **kw: launched.append(kernel) or launch(kernel, *a, **kw))
    grads = {}
    for row_stats in (False, True):
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        launched.clear()
        with torch.autograd.set_multithreading_enabled(False), _config.tuning(row_stats_in_dq=row_stats):
            out = call(qg, kg, vg)
            if return_lse:  # a loss that uses the LSE too: dLSE folds into delta
                o, lse = out
                gen = torch.Generator(device=DEVICE).manual_seed(5)
                dlse = torch.randn(lse.shape, device=DEVICE, generator=gen).masked_fill(lse == float("-inf"), 0)
                grads[row_stats] = torch.autograd.grad((o, lse), (qg, kg, vg), (do, dlse))
            else:
                grads[row_stats] = torch.autograd.grad(out, (qg, kg, vg), do)
        assert (bwd_mod._bwd_preprocess_kernel in launched) is not row_stats
        assert launched.count(bwd_mod._bwd_dq_kernel) == 1
    for name, three, two in zip(("dq", "dk", "dv"), grads[False], grads[True]):
        assert torch.isfinite(two).all() and torch.isfinite(three).all(), name
        if HAS_CUDA:
            assert rel_err(two, three) < 1e-3, name
        else:
            assert torch.equal(two, three), name


def test_plan_cache_is_bounded(monkeypatch):
    """Plans are kept per problem; a loop over ever new lengths starts the cache over instead of
    growing it without bound (as the other per-problem caches do)."""
    from flashattn import _memo

    monkeypatch.setattr(_memo, "LIMIT", 50)
    _config._PLANS.clear()
    for n in range(1, 120):
        p = Problem(1, 2, 2, n, n, 64, torch.float16, False, 0.125)
        _config.plan("fwd", p, torch.device("cpu"), None)
    assert 0 < len(_config._PLANS) <= 50


def test_autotuning_times_each_candidate_once_and_a_pinned_tile_wins(monkeypatch):
    """With FLASHATTN_AUTOTUNE=1 on a GPU (faked here, timings included) the first call of a problem
    times every candidate of tuning_space, skips one that fails to launch, keeps the fastest and
    reuses it; a tile pinned with tuning() is taken as it is, with nothing timed."""
    import triton.testing

    monkeypatch.setenv("FLASHATTN_AUTOTUNE", "1")
    monkeypatch.setattr(_config, "is_interpreter", lambda: False)
    monkeypatch.setattr(_config, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(_config, "_sm_count", lambda index: 132)
    monkeypatch.setattr(_config, "_TUNED", {})
    gpu0, p = torch.device("cuda", 0), _problem(n=2048, m=2048, d=64, causal=False)
    space = _config.tuning_space("fwd", p, gpu0)
    assert len(space) > 3
    fastest, broken, launched = space[3], space[1], []

    def launch(cfg):
        launched.append(cfg)
        if cfg == broken:
            raise RuntimeError("out of shared memory")

    def bench(fn, **kwargs):
        fn()
        return 1.0 if launched[-1] == fastest else 2.0

    monkeypatch.setattr(triton.testing, "do_bench", bench)
    assert _config.choose("fwd", p, gpu0, launch) == fastest
    assert launched == space
    assert _config.choose("fwd", p, gpu0, launch) == fastest and launched == space  # remembered
    pinned = _config.KernelConfig(32, 32, 2, 1)
    with _config.tuning(fwd=pinned):
        assert _config.choose("fwd", _problem(n=1024, m=1024, d=64, causal=False), gpu0, launch) == pinned
    assert launched == space  # nothing timed under the pin
    monkeypatch.setenv("FLASHATTN_AUTOTUNE", "0")
    assert _config.choose("fwd", _problem(n=512, m=512, d=64), gpu0, launch) == \
        _config.get_config("fwd", _problem(n=512, m=512, d=64), gpu0)
    assert launched == space


@gpu
@needs_cuda
def test_gpu_autotuned_path(monkeypatch):
    """FLASHATTN_AUTOTUNE=1 times the pruned candidates at the first call, then reuses the winner."""
    from flashattn import _config

    monkeypatch.setenv("FLASHATTN_AUTOTUNE", "1")
    monkeypatch.setattr(_config, "_TUNED", {})
    q, k, v, do = _inputs(2, 8, 2, 1500, 1700, 64, torch.float16, seed=19)
    _check_against_reference(q, k, v, do, True, 64 ** -0.5)
    assert {key[0] for key in _config._TUNED} == {"fwd", "bwd_dkdv", "bwd_dq"}
    o, lse = attention_forward(q, k, v, Problem.of(q, k, True, 64 ** -0.5))
    first = attention_backward(do, q, k, v, o, lse, Problem.of(q, k, True, 64 ** -0.5))
    second = attention_backward(do, q, k, v, o, lse, Problem.of(q, k, True, 64 ** -0.5))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_gluon_rule_takes_the_bars_the_gpu_tests_patch_in(monkeypatch):
    """The Hopper GPU tests open the rule at every size by replacing GLUON_MIN_WORK with a defaultdict of
    zero bars (and GLUON_HEAD_DIMS with their own lists): the rule must read the bars by indexing, so a
    kernel and head dim the dict never listed still finds its zero bar, and a head dim outside the
    lists still answers False without looking a bar up. (The bars were read with dict.get, which a
    defaultdict answers with None, from the float8 commit on: every such GPU test failed.)"""
    import collections

    _on_hopper(monkeypatch)
    monkeypatch.setattr(_config, "GLUON_MIN_WORK", collections.defaultdict(lambda: (0, 0)))
    monkeypatch.setattr(_config, "GLUON_HEAD_DIMS", {"fwd": (128, 256), "bwd_dkdv": (64, 128), "bwd_dq": ()})
    gpu0 = torch.device("cuda", 0)
    tiny = dict(b=1, h_q=2, h_kv=2, n=64, m=200)
    assert _config.gluon_kernel("bwd_dkdv", _problem(d=64, **tiny), gpu0)
    assert _config.gluon_kernel("fwd", _problem(d=256, **tiny), gpu0)
    assert not _config.gluon_kernel("bwd_dq", _problem(d=128, **tiny), gpu0)
    assert not _config.gluon_kernel("fwd", _problem(d=64, **tiny), gpu0)
    monkeypatch.setattr(_config, "GLUON_MIN_WORK", {})  # no bar at all: only head dims outside the lists answer
    assert not _config.gluon_kernel("bwd_dq", _problem(d=96, **tiny), gpu0)


def test_gluon_kernels_run_only_where_the_rule_says(monkeypatch):
    """The dispatch rule: plain attention on sm_90 at a head dim the Gluon kernel is built for, with
    at least the kernel's GLUON_MIN_WORK for the mask; never for a variant, packed sequences, a CPU
    tensor, a pinned tile or with Gluon turned off. (The capability and Gluon's presence are faked:
    this runs on any machine.)"""
    _on_hopper(monkeypatch)
    gpu0 = torch.device("cuda", 0)
    big = _problem()  # 2 * 8 * 4096 * 4096 * 128 = 2^35
    assert all(_config.gluon_kernel(kernel, big, gpu0) for kernel in ("fwd", "bwd_dkdv", "bwd_dq"))
    assert not _config.gluon_kernel("fwd", big, torch.device("cpu"))
    # each bar exactly: B * H * N * M * D at the bar runs Gluon, one query row fewer does not
    for (kernel, d), bars in _config.GLUON_MIN_WORK.items():
        for causal, bar in zip((False, True), bars):
            n = bar // (2 * 8 * 4096 * d)  # m = 4096 keys
            assert 2 * 8 * n * 4096 * d == bar
            assert _config.gluon_kernel(kernel, _problem(n=n, m=4096, d=d, causal=causal), gpu0), (kernel, d, causal)
            assert not _config.gluon_kernel(kernel, _problem(n=n - 1, m=4096, d=d, causal=causal), gpu0)
    # the causal bars are above the unmasked ones: at 2^33 the backward runs Gluon without the mask only
    assert _config.gluon_kernel("bwd_dq", _problem(n=1024, causal=False), gpu0)  # 2^33
    assert not _config.gluon_kernel("bwd_dq", _problem(n=1024, causal=True), gpu0)
    assert _config.gluon_kernel("fwd", _problem(n=1024, causal=True), gpu0)
    assert _config.gluon_kernel("fwd", _problem(n=512, causal=False), gpu0)  # 2^32
    assert not _config.gluon_kernel("fwd", _problem(n=512, causal=True), gpu0)
    for kernel in ("bwd_dkdv", "bwd_dq"):  # the backward's unmasked bar is 2^33, its causal one 2^34
        assert not _config.gluon_kernel(kernel, _problem(n=512, causal=False), gpu0)
        assert _config.gluon_kernel(kernel, _problem(n=2048, causal=True), gpu0)
        assert not _config.gluon_kernel(kernel, _problem(n=2047, causal=True), gpu0)
    assert _config.gluon_kernel("fwd", _problem(n=256, causal=False), gpu0)  # 2^31
    assert not _config.gluon_kernel("fwd", _problem(n=255, causal=False), gpu0)
    for d in (64, 72, 96, 256):
        assert not _config.gluon_kernel("bwd_dkdv", _problem(d=d, n=8192), gpu0)
    for d in (64, 72, 96, 160):
        assert not _config.gluon_kernel("bwd_dq", _problem(d=d, n=8192), gpu0)
    # dQ at D = 256: 2^32 without a mask, 2^34 causal (2 * 8 * n * 1024 * 256 = 2^22 n)
    assert _config.gluon_kernel("bwd_dq", _problem(d=256, n=1024, m=1024, causal=False), gpu0)
    assert not _config.gluon_kernel("bwd_dq", _problem(d=256, n=1023, m=1024, causal=False), gpu0)
    assert _config.gluon_kernel("bwd_dq", _problem(d=256, n=4096, m=1024, causal=True), gpu0)
    assert not _config.gluon_kernel("bwd_dq", _problem(d=256, n=4095, m=1024, causal=True), gpu0)
    for d in (64, 72, 96, 160):
        assert not _config.gluon_kernel("fwd", _problem(d=d, n=8192), gpu0)
    assert _config.gluon_kernel("fwd", _problem(d=256, n=1025, m=1025, causal=False), gpu0)  # 2 * 8 * 1025^2 * 256 >= 2^32
    assert not _config.gluon_kernel("fwd", _problem(d=256, n=1024, m=1023, causal=False), gpu0)
    assert _config.gluon_kernel("fwd", _problem(d=256, n=1449, m=1449), gpu0)  # causal: 2 * 8 * 1449^2 * 256 >= 2^33
    assert not _config.gluon_kernel("fwd", _problem(d=256, n=1448, m=1448), gpu0)
    for variant in (dict(window=(128, 0)), dict(softcap=30.0), dict(alibi=True), dict(dropout_p=0.1)):
        assert not _config.gluon_kernel("fwd", _problem(**variant), gpu0), variant
        assert not _config.gluon_kernel("bwd_dkdv", _problem(**variant), gpu0), variant
        assert not _config.gluon_kernel("bwd_dq", _problem(**variant), gpu0), variant
    # float8 inputs (flashattn.fp8): the forward at GLUON_FP8_HEAD_DIMS from GLUON_FP8_MIN_WORK; no
    # backward (there is none), no D = 256 and no window
    for d in _config.GLUON_FP8_HEAD_DIMS:
        for causal, bar in zip((False, True), _config.GLUON_FP8_MIN_WORK):
            n = bar // (2 * 8 * 4096 * d)
            assert _config.gluon_kernel("fwd", _problem(n=n, m=4096, d=d, causal=causal, descale=True), gpu0)
            assert not _config.gluon_kernel("fwd", _problem(n=n - 1, m=4096, d=d, causal=causal, descale=True), gpu0)
    assert not _config.gluon_kernel("fwd", _problem(d=256, descale=True), gpu0)
    assert not _config.gluon_kernel("fwd", _problem(descale=True, window=(128, 0)), gpu0)
    assert not any(_config.gluon_kernel(kernel, _problem(descale=True), gpu0) for kernel in ("bwd_dkdv", "bwd_dq"))
    for scale in (0.0, -0.125):  # the Gluon kernels assume a positive scale (the row maximum's side)
        assert not any(_config.gluon_kernel(kernel, _problem(scale=scale), gpu0) for kernel in ("fwd", "bwd_dkdv", "bwd_dq"))
    assert _config.gluon_kernel("fwd", _problem(scale=1e-3), gpu0)
    with _config.tuning(gluon=False):
        assert not _config.gluon_kernel("fwd", big, gpu0)
    with _config.tuning(fwd=_config.KernelConfig(128, 64, 4, 2)):
        assert not _config.gluon_kernel("fwd", big, gpu0) and _config.gluon_kernel("bwd_dkdv", big, gpu0)
    monkeypatch.setattr(_config, "_capability", lambda index: (8, 0))
    monkeypatch.setattr(_config, "_GLUON", {})
    assert not _config.gluon_kernel("fwd", big, gpu0)  # Ampere: the portable kernels
