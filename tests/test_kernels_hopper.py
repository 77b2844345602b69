"""The Gluon kernels for sm_90 (flashattn.hopper).

Against float64, by the error ratio of tests/test_kernels_numerics.py, at D = 64, 128 and 256: the
forward called directly, and forward and backward through the package's dispatch, with the work bar
lowered to every size and at the real bars (bitwise repeatable, also under a CUDA graph). The
persistent forward's walks (static or dynamic, in sections of heads, with one or two Q buffers) give
the bits of one CTA per block; the dynamic walk draws each tile once and leaves its counter at zero,
also on two streams at once; the default walk for each head dimension and mask; the work per CTA that
the Hopper page quotes, against a count from the definition; and the host code of forward and backward
up to the launch. The kernel tests need an sm_90 GPU with Triton 3.6 and skip elsewhere; the walk
models and the host code (kernel and descriptors stubbed) run on the CPU.
"""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashattn import _config
from flashattn.backward import launch_backward as attention_backward
from flashattn.forward import launch_forward as attention_forward
from flashattn.problem import Problem
from flashattn.reference import naive_attention
from flashattn.testing import assert_close_ratio, random_qkv

from devices import gpu, needs_cuda
from kernel_cases import _check_against_reference, _empty_rows_are_zero, _inputs, _stub_gluon_forward_launch


def test_hopper_forward_is_never_supported_off_hopper():
    """The forward's host module declines CPU tensors without touching the driver (and anything but
    float16/bfloat16, D in {64, 128, 256}, on an sm_90 GPU with Triton 3.6)."""
    from flashattn import hopper

    q, k, v = random_qkv(1, 2, 2, 8, 8, 64, dtype=torch.float16)
    assert not hopper.fwd.supported(q, k, v, True)


# Imports the package, the launchers and the Hopper host modules, runs a forward and backward on the
# CPU under the interpreter, then prints which Gluon modules (Triton's, the kernel modules) are loaded.
_GLUON_PROBE = """
import sys
{before}
import torch
import flashattn, flashattn.forward, flashattn.backward
from flashattn import hopper
from flashattn.api import attention
q, k, v = (torch.randn(1, 2, 16, 64, requires_grad=True) for _ in range(3))
attention(q, k, v, causal=True).sum().backward()
assert not hopper.fwd.supported(q, k, v, True)
{after}
print(sorted(m for m, mod in sys.modules.items() if mod is not None and
             m.startswith(("triton.experimental.gluon", "flashattn.hopper.fwd_kernels",
                           "flashattn.hopper.bwd_kernels", "flashattn.hopper.common"))))
"""


def _gluon_modules_loaded(before: str = "", after: str = "") -> list[str]:
    import ast
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-c", _GLUON_PROBE.format(before=before, after=after)],
                          capture_output=True, text=True, timeout=600, cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ast.literal_eval(proc.stdout.strip().splitlines()[-1])


def test_importing_and_running_the_package_off_hopper_never_imports_gluon():
    """In a fresh process under the interpreter (a CPU-only machine's case): importing flashattn,
    its launchers and the Hopper host modules, and a forward and backward through the package,
    import neither Gluon nor the kernel modules, which only a Gluon launch imports."""
    assert _gluon_modules_loaded() == []


def test_the_hopper_host_modules_work_on_a_triton_without_gluon():
    """With ``triton.experimental.gluon`` unimportable, the package imports and runs, the Hopper
    kernels report themselves unavailable and the lazy import keeps its error instead of raising."""
    loaded = _gluon_modules_loaded(
        before="sys.modules['triton.experimental.gluon'] = None  # import raises ImportError",
        after="assert hopper.fwd._get_kernel() is None and isinstance(hopper.fwd._get_kernel.error, ImportError)\n"
              "assert hopper.bwd._get_dq_kernel() is None\n"
              "assert not (hopper.fwd.available() or hopper.bwd.available() or hopper.bwd.dq_available())")
    assert loaded == []


def test_the_gluon_probe_sees_the_lazy_import():
    """Negative control of the two tests above: the same probe, after the host module's lazy import
    of its kernel (what the first Gluon launch runs), sees Gluon and the kernel modules loaded."""
    import importlib.util

    if importlib.util.find_spec("triton.experimental.gluon") is None:
        pytest.skip("this Triton has no Gluon")
    loaded = _gluon_modules_loaded(after="assert hopper.fwd._get_kernel() is not None")
    assert {"triton.experimental.gluon", "flashattn.hopper.fwd_kernels", "flashattn.hopper.common"} <= set(loaded)
    assert "flashattn.hopper.bwd_kernels" not in loaded  # the backward's module waits for its own launch


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("b, h_q, h_kv, n, m, causal, layout, std", [
    (2, 4, 4, 1000, 1000, False, "bhnd", 1.0),
    (2, 4, 4, 300, 777, True, "bhnd", 1.0),
    (2, 4, 2, 777, 300, True, "bnhd", 1.0),  # GQA, N > M: the first 477 rows see no key
    (1, 8, 2, 1024, 1024, True, "bhnd", 3.0),  # large logits
    (1, 2, 1, 130, 3, False, "bnhd", 1.0),
])
def test_hopper_forward_matches_float64(dtype, d, b, h_q, h_kv, n, m, causal, layout, std):
    from flashattn import hopper

    q, k, v = random_qkv(b, h_q, h_kv, n, m, d, dtype=dtype, device="cuda", layout=layout, std=std)
    if not hopper.fwd.supported(q, k, v, causal):
        pytest.skip("the Gluon forward runs on sm_90 with Triton 3.6 only")
    o, lse = hopper.fwd.forward(q, k, v, causal)
    o64, lse64 = naive_attention(q.double(), k.double(), v.double(), causal=causal)
    o16, lse16 = naive_attention(q, k, v, causal=causal)
    assert_close_ratio("o", o, o64, o16)
    assert_close_ratio("lse", lse, lse64, lse16.float())


_WALKS = {  # hopper.fwd.forward's knobs for each way of walking the query blocks
    "static": dict(persistent=True, dynamic=False),
    "static, sections of 3": dict(persistent=True, dynamic=False, section=3),
    "dynamic": dict(persistent=True, dynamic=True),
    "dynamic, head by head": dict(persistent=True, dynamic=True, section=1),
    "dynamic, one section": dict(persistent=True, dynamic=True, section=10**6),
    "static, one Q buffer": dict(persistent=True, dynamic=False, q_buffers=1),
    "dynamic, two Q buffers": dict(persistent=True, dynamic=True, q_buffers=2),
}


@gpu
@needs_cuda
@pytest.mark.parametrize("walk", list(_WALKS))
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("b, h_q, h_kv, n, m", [
    (8, 40, 8, 1000, 1000),  # 2560 query blocks, more than any GPU has SMs: every CTA walks many
    (3, 50, 10, 650, 1300),  # N < M, ragged last block
    (4, 36, 36, 1500, 700),  # N > M: under causal the first 800 rows of a head see no key
    (1, 3, 1, 129, 64),      # fewer blocks than SMs; sections larger than B * H
])
def test_hopper_forward_persistent_matches_float64_and_one_cta_per_block(monkeypatch, walk, d, causal, b, h_q, h_kv,
                                                                         n, m):
    """A persistent launch (CTAs walking query blocks, the K/V ring and the Q and O buffers carried
    from block to block; statically or drawing blocks from a counter, in sections of heads, with one
    or two Q buffers) gives the same bits as one CTA per block, and float64's answer, with either
    mask and where blocks have unequal work; a dynamic walk twice in a row gives them again, drawing
    from one counter that no call zeroes (handed to it here): its last draw leaves it at zero."""
    from flashattn import device_helpers, launch as launch_mod, tensors, hopper

    if _WALKS[walk].get("q_buffers") == 2 and d > 128:
        pytest.skip("two Q buffers fit shared memory up to D = 128")
    q, k, v = random_qkv(b, h_q, h_kv, n, m, d, dtype=torch.bfloat16, device="cuda")
    if not hopper.fwd.supported(q, k, v, causal):
        pytest.skip("the Gluon forward runs on sm_90 with Triton 3.6 only")
    o1, lse1 = hopper.fwd.forward(q, k, v, causal, persistent=False)
    counter = tensors.tile_counter(q.device)
    if _WALKS[walk]["dynamic"]:
        monkeypatch.setattr(tensors, "tile_counter", lambda device: counter)  # one counter for both calls
    for _ in range(2 if _WALKS[walk]["dynamic"] else 1):
        o, lse = hopper.fwd.forward(q, k, v, causal, **_WALKS[walk])
        assert torch.equal(o, o1) and torch.equal(lse, lse1)
        assert counter.item() == 0
    o64, lse64 = naive_attention(q.double(), k.double(), v.double(), causal=causal)
    o16, lse16 = naive_attention(q, k, v, causal=causal)
    assert_close_ratio("o", o, o64, o16)
    assert_close_ratio("lse", lse, lse64, lse16.float())


@gpu
@needs_cuda
def test_hopper_forward_dynamic_walks_on_two_streams_at_once_keep_their_own_counters():
    """Two causal forwards with a dynamic walk running at the same time on two streams (each call
    zeroes a counter of its own) give the bits of one CTA per block."""
    from flashattn import hopper

    inputs = [random_qkv(4, 32, 8, 2048, 2048, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    if not hopper.fwd.supported(*inputs[0], True):
        pytest.skip("the Gluon forward runs on sm_90 with Triton 3.6 only")
    expected = [hopper.fwd.forward(*x, True, persistent=False) for x in inputs]
    _on_two_streams_at_once(lambda x: hopper.fwd.forward(*x, True, persistent=True, dynamic=True), inputs, expected)


def _on_two_streams_at_once(call, inputs, expected, rounds=3):
    """``call(x)`` for each of ``inputs`` on a stream of its own, all queued before one synchronize,
    ``rounds`` times; each round's results must be bitwise ``expected``'s."""
    streams = [torch.cuda.Stream() for _ in inputs]
    torch.cuda.synchronize()
    for _ in range(rounds):
        outs = []
        for stream, x in zip(streams, inputs):
            with torch.cuda.stream(stream):
                outs.append(call(x))
        torch.cuda.synchronize()
        for got, want in zip(outs, expected):
            assert all(torch.equal(a, b) for a, b in zip(got, want))


def _walk_order(batch_heads, num_mb, causal, section):
    """(head, query block) of each tile in the kernel's order, from its description: under causal,
    sections of ``section`` heads one after another, and within one the blocks by length (longest
    first), the heads in order among blocks of one length; else head by head, blocks in order."""
    tiles = [(h, mb) for h in range(batch_heads) for mb in range(num_mb)]
    if causal:
        tiles.sort(key=lambda t: (t[0] // section, -t[1], t[0]))
    return tiles


@pytest.mark.parametrize("batch_heads, n, m, ctas, section", [
    (16, 16384, 16384, 132, 1), (3, 1000, 1300, 5, 1), (4, 700, 300, 7, 1),
    (256, 1024, 1024, 132, 16), (7, 1000, 900, 11, 3), (5, 640, 640, 3, 8)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_persistent_walk_work_counts_the_key_blocks_each_cta_visits(batch_heads, n, m, ctas, section, causal,
                                                                     dynamic):
    """hopper.fwd.walk_work (the Hopper page's figure and numbers) against a count from the definition:
    a 128-row query block visits every key block up to the last one holding a key that one of its
    rows sees (bottom-right causal alignment); the tiles come in the kernel's order (longest block
    first within sections of heads under causal); a static walk gives CTA p tiles p, p + ctas, ...,
    a dynamic one each tile to the CTA that is free first (lowest number on a tie) when every key
    block takes one unit of time."""
    from flashattn import hopper
    from flashattn.schedule import is_visible

    num_mb, num_nb = -(-n // 128), -(-m // 128)

    def blocks(mb):  # key blocks up to the last with a visible key for some row of the block
        last = max((j for i in range(mb * 128, min(n, mb * 128 + 128)) for j in range(m)
                    if is_visible(i, j, n, m, causal)), default=-1)
        return last // 128 + 1

    per_block = {mb: blocks(mb) for mb in range(num_mb)} if n * m <= 2_000_000 else {
        mb: min(num_nb, -(-(mb * 128 + 128 + m - n) // 128)) if causal else num_nb for mb in range(num_mb)}
    expected, busy_until = [0] * ctas, [0] * ctas
    for tile, (_, mb) in enumerate(_walk_order(batch_heads, num_mb, causal, section)):
        p = min(range(ctas), key=lambda c: (busy_until[c], c)) if dynamic else tile % ctas
        expected[p] += per_block[mb]
        busy_until[p] += per_block[mb]
    assert hopper.fwd.walk_work(batch_heads, n, m, ctas, causal, dynamic=dynamic, section=section) == expected
    if (batch_heads, n, causal, dynamic) == (16, 16384, True, False):  # the numbers the Hopper page quotes
        work = expected
        assert (work[0], work[64], max(work)) == (1568, 544, 1568)
        assert round(max(work) / (sum(work) / ctas), 2) == 1.57
    if (batch_heads, n, causal, dynamic) == (256, 1024, True, True):
        assert round(max(expected) / (sum(expected) / ctas), 2) == 1.02


@settings(max_examples=200, deadline=None)
@given(ctas=st.integers(1, 8), extra=st.integers(0, 24), seed=st.integers(0, 2**32 - 1))
def test_dynamic_walk_draws_every_tile_once_and_its_last_draw_resets_the_counter(ctas, extra, seed):
    """The Gluon forward's dynamic walk (hopper.fwd_kernels._fa_producer), run as a model in which each
    CTA's atomic add is one indivisible step and the CTAs' steps interleave at random: from a zero
    counter, every tile is walked exactly once; the draws number as many as the tiles and return
    0 .. tiles - 1; exactly one CTA resets the counter, after the last draw of the launch; and the
    counter ends at zero, as the next launch on the stream needs (the Hopper page's claim)."""
    import random

    tiles = ctas + extra  # the launcher starts at most one CTA per tile
    counter, taken, draws, resets = [0], [], [], []

    def cta(pid):
        tile, drawn = pid, 0
        while tile < tiles:
            taken.append(tile)
            yield  # the tile's work: other CTAs may draw meanwhile
            drawn = counter[0]
            counter[0] += 1  # gl.atomic_add: read and add in one step
            draws.append(drawn)
            tile = ctas + drawn
            yield
        if drawn == tiles - 1:
            counter[0] = 0  # gl.atomic_xchg(counter_ptr, 0)
            resets.append(len(draws))
        yield

    rng = random.Random(seed)
    live = [cta(pid) for pid in range(ctas)]
    while live:
        walker = rng.choice(live)
        try:
            next(walker)
        except StopIteration:
            live.remove(walker)
    assert sorted(taken) == list(range(tiles))
    assert sorted(draws) == list(range(tiles))
    assert resets == [tiles]  # one reset, made when all the launch's draws had been made
    assert counter == [0]


def test_hopper_forward_walks_persistently_where_it_measured_faster():
    """The default walk: persistent and static without a mask at D <= 128, one CTA per query block
    without a mask at D = 256, persistent and dynamic under causal; sections of about one query
    block per CTA."""
    from flashattn import hopper

    assert hopper.fwd.schedule_default(64, False) == hopper.fwd.schedule_default(128, False) == (True, False)
    assert hopper.fwd.schedule_default(256, False) == (False, False)
    assert all(hopper.fwd.schedule_default(d, True) == (True, True) for d in (64, 128, 256))
    assert [hopper.fwd.section_default(256, n, 132) for n in (1024, 2048, 4096, 8192, 16384, 65536)] == [
        16, 8, 4, 2, 1, 1]
    assert hopper.fwd.section_default(3, 1024, 132) == 3 and hopper.fwd.section_default(64, 1000, 132) == 16


@pytest.mark.parametrize("d, causal, kw, grid, dynamic, section, qbufs", [
    (128, True, {}, 132, True, 16, 1),                      # 8 blocks per head, 256 heads: sections of 16
    (128, False, {}, 132, False, 1, 2),                     # static walk, next Q in a second buffer
    (64, False, {}, 132, False, 1, 2),
    (128, False, dict(q_buffers=1), 132, False, 1, 1),
    (128, True, dict(q_buffers=2), 132, True, 16, 2),
    (256, False, {}, 2048, False, 1, 1),                    # one CTA per block
    (256, True, dict(section=5), 132, True, 5, 1),          # O staged in the one Q buffer
    (128, True, dict(persistent=False), 2048, False, 1, 1),
    (128, True, dict(pingpong=True), 2048, False, 1, 1),    # ping-pong: one tile per CTA
])
def test_hopper_forward_host_code_launches_the_walk_it_describes(monkeypatch, d, causal, kw, grid, dynamic,
                                                                 section, qbufs):
    """hopper.fwd.forward's host code up to the launch, on the CPU (the kernel, the descriptors and
    the SM count stubbed): the grid, the walk's constexprs (the Q buffers included), the section and
    for a dynamic walk a zeroed counter of its own, which a recording keeps as the call's counter."""
    from flashattn import device_helpers, launch as launch_mod, tensors, hopper

    launches = []
    _stub_gluon_forward_launch(monkeypatch, launches)
    q, k, v = (torch.randn(32, 8, 1024, d, dtype=torch.bfloat16) for _ in range(3))
    o, lse = hopper.fwd.forward(q, k, v, causal, **kw)
    assert o.shape == q.shape and lse.shape == (32, 8, 1024)
    [(kernel, launched_grid, args, constexprs)] = launches
    assert kernel == "kernel" and launched_grid == grid
    assert constexprs["DYNAMIC"] == dynamic and constexprs["CAUSAL"] == causal and constexprs["QBUFS"] == qbufs
    counter, bh, sect = args[5], args[6], args[11]
    assert bh == 256 and sect == section
    if dynamic:
        assert counter.dtype == torch.int32 and counter.tolist() == [0] and counter is not lse
        record = launch_mod.Recording("key")
        hopper.fwd.forward(q, k, v, causal, record=record, **kw)
        again = launches[-1][2][5]
        assert again.tolist() == [0] and again is not counter  # a counter per call
        assert record.counters == [again]  # a recipe made from it makes each replay's own


@pytest.mark.parametrize("causal", [False, True])
def test_hopper_forward_host_code_launches_float8(monkeypatch, causal):
    """The float8 launch on the CPU (kernel, descriptors, SM count stubbed): FP8 on, V read keys last
    in [D, BLOCK_N] tiles, the factors passed, a bfloat16 o, and the float8 tiles (256-key blocks in two
    stages without a mask, 128-key blocks in three under causal)."""
    from flashattn import hopper, tensors

    launches = []
    _stub_gluon_forward_launch(monkeypatch, launches)
    q, k, v = (torch.randn(2, 8, 1024, 128).to(torch.float8_e4m3fn) for _ in range(3))
    descales = torch.rand(3, 2, 8) + 0.5
    o, lse = hopper.fwd.forward(q, k, tensors.keys_last(v), causal, descales=descales)
    assert o.dtype == torch.bfloat16 and o.shape == q.shape and lse.shape == (2, 8, 1024)
    [(_, _, args, constexprs)] = launches
    block_n, stages = (128, 3) if causal else (256, 2)
    assert constexprs["FP8"] and constexprs["BLOCK_N"] == block_n and constexprs["STAGES"] == stages
    assert args[2] == ("desc", 128, block_n)  # v: [D, keys] tiles
    assert args[1] == ("desc", block_n, None) and args[-1] is descales
    with pytest.raises(AssertionError):  # a float8 v not keys last
        hopper.fwd.forward(q, k, v, causal, descales=descales)
    with pytest.raises(AssertionError):  # D = 256: O has no room in the float8 kernel
        q2, k2, v2 = (torch.zeros(1, 1, 64, 256).to(torch.float8_e4m3fn) for _ in range(3))
        hopper.fwd.forward(q2, k2, tensors.keys_last(v2), causal, descales=torch.ones(3, 1, 1))
    hopper.fwd.forward(*(x.to(torch.bfloat16) for x in (q, k, v)), causal)  # 16-bit: FP8 off, the unused pointer is lse
    assert not launches[-1][3]["FP8"] and launches[-1][2][-1] is launches[-1][2][4]


def test_an_sm_margin_leaves_sms_free_in_persistent_walks_only(monkeypatch):
    """Under ``_config.sm_margin(k)`` a persistent forward launches k CTAs fewer than the SMs (at least
    one), a launch of one CTA per block is unchanged, and the block is not one a recipe may record."""
    from flashattn import _config, hopper

    launches = []
    _stub_gluon_forward_launch(monkeypatch, launches)
    q, k, v = (torch.randn(32, 8, 1024, 128, dtype=torch.bfloat16) for _ in range(3))

    def grid(**kw):
        hopper.fwd.forward(q, k, v, True, **kw)
        return launches[-1][1]

    assert grid() == 132
    with _config.sm_margin(16):
        assert not _config.tuning_is_default()
        assert grid() == 116 and grid(persistent=False) == 2048
        with _config.sm_margin(500):
            assert grid() == 1
    with _config.sm_margin(0):
        assert _config.tuning_is_default() and grid() == 132
    assert grid() == 132 and _config.tuning_is_default()
    with pytest.raises(ValueError, match="sm_margin"):
        with _config.sm_margin(-1):
            pass


@gpu
@needs_cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_an_sm_margin_changes_no_bit(causal):
    """The persistent forward with 16 SMs left free gives the bits it gives on every SM (what ring
    attention's forward runs while its exchanges are in flight)."""
    from flashattn import hopper

    if not hopper.fwd.available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs the Gluon forward (sm_90)")
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 8, 3000, 128, dtype=torch.bfloat16, device="cuda", generator=g) for _ in range(3))
    o, lse = hopper.fwd.forward(q, k, v, causal)
    with _config.sm_margin(16):
        o_m, lse_m = hopper.fwd.forward(q, k, v, causal)
    assert torch.equal(o, o_m) and torch.equal(lse, lse_m)


@pytest.mark.parametrize("which, d", [("dkdv", 128), ("dq", 128), ("dq", 256)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_backward_host_code_launches_one_cta_per_block(monkeypatch, which, d, causal):
    """hopper.bwd.dkdv's and hopper.bwd.dq's host code up to the launch, on the CPU (the kernels and
    the descriptors stubbed): one CTA per block of keys (dK/dV) or of 128 query rows (dQ), the scale
    in base 2 and as given, the outputs described for TMA; dQ's K and V tiles of 64 keys, and of 32 at
    D = 256 (what fits shared memory there)."""
    from flashattn import hopper
    from flashattn.constants import LOG2E

    launches = []
    for name in ("_get_kernel", "_get_dq_kernel"):
        monkeypatch.setattr(hopper.bwd, name, lambda: "kernel")
    monkeypatch.setattr(hopper.fwd, "descriptor", lambda t, rows: ("desc", t.data_ptr(), rows))
    monkeypatch.setattr(hopper.fwd, "launch", lambda *a, **k: launches.append(a))
    b, hq, hkv, n, m = 2, 8, 2, 1000, 700
    q, do = (torch.randn(b, hq, n, d, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, hkv, m, d, dtype=torch.bfloat16) for _ in range(2))
    lse2, delta = (torch.zeros(b, hq, n) for _ in range(2))
    if which == "dkdv":
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        hopper.bwd.dkdv(q, k, v, do, lse2, delta, dk, dv, causal, 0.125)
        outputs, grid = (dk, dv), -(-m // hopper.bwd.BLOCK_N) * b * hkv
    else:
        dq = torch.empty_like(q)
        hopper.bwd.dq(q, k, v, do, lse2, delta, dq, causal, 0.125)
        outputs, grid = (dq,), -(-n // 128) * b * hq
    [(kernel, launched_grid, args, constexprs)] = launches
    assert kernel == "kernel" and launched_grid == grid and constexprs["CAUSAL"] == causal
    described = {a[1] for a in args if isinstance(a, tuple) and a[0] == "desc"}
    assert {x.data_ptr() for x in (q, k, v, do, *outputs)} <= described
    assert args[-2:] == (0.125 * LOG2E, 0.125) and all(any(a is x for a in args) for x in (lse2, delta))
    if which == "dq":
        keys = {a[2] for a in args if isinstance(a, tuple) and a[0] == "desc" and a[1] in (k.data_ptr(), v.data_ptr())}
        assert keys == {32 if d == 256 else hopper.bwd.DQ_BLOCK_N} and constexprs["BLOCK_N"] == keys.pop()
        assert constexprs["STAGES"] == hopper.bwd.DQ_STAGES


def test_hopper_dkdv_host_code_with_a_dq_accumulator(monkeypatch):
    """hopper.bwd.dkdv with ``dq_accum`` (the nondeterministic backward), on the CPU with the launch and
    descriptors stubbed: ATOMIC_DQ on, the float32 accumulator described in [64, D / 2] tiles (one half
    of its columns per warpgroup) where the switch off passes dK's own descriptor; D = 64 and a 16-bit
    accumulator are refused."""
    from flashattn import hopper

    launches = []
    monkeypatch.setattr(hopper.bwd, "_get_kernel", lambda: "kernel")
    monkeypatch.setattr(hopper.fwd, "descriptor", lambda t, rows, cols=None: ("desc", t.data_ptr(), rows, cols))
    monkeypatch.setattr(hopper.fwd, "launch", lambda *a, **k: launches.append(a))
    b, hq, hkv, n, m, d = 2, 4, 2, 300, 200, 128
    q, do = (torch.randn(b, hq, n, d, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, hkv, m, d, dtype=torch.bfloat16) for _ in range(2))
    lse2, delta = (torch.zeros(b, hq, n) for _ in range(2))
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    acc = torch.zeros(b, hq, n, d)
    hopper.bwd.dkdv(q, k, v, do, lse2, delta, dk, dv, True, 0.125)
    hopper.bwd.dkdv(q, k, v, do, lse2, delta, dk, dv, True, 0.125, dq_accum=acc)
    (_, _, off, off_c), (_, _, on, on_c) = launches
    assert not off_c["ATOMIC_DQ"] and on_c["ATOMIC_DQ"]
    assert off[8] == off[4] == ("desc", dk.data_ptr(), hopper.bwd.HALF_N, None)  # never read when off
    assert on[8] == ("desc", acc.data_ptr(), hopper.bwd.BLOCK_M, d // 2)
    assert off[:8] == on[:8] and off[9:] == on[9:]
    with pytest.raises(AssertionError):
        hopper.bwd.dkdv(q, k, v, do, lse2, delta, dk, dv, True, 0.125, dq_accum=acc.bfloat16())
    q64, do64 = q[..., :64], do[..., :64]
    with pytest.raises(AssertionError):
        hopper.bwd.dkdv(q64, k[..., :64], v[..., :64], do64, lse2, delta, dk[..., :64], dv[..., :64], True, 0.125,
                        dq_accum=acc[..., :64])


def test_the_atomic_dq_backward_takes_dq_from_the_accumulator_and_runs_no_dq_kernel(monkeypatch):
    """launch_backward where backward.atomic_dq says so (forced here; the Hopper kernel stubbed by one that
    fills the accumulator, dK and dV): no dQ kernel and no second stream, dQ = scale x the accumulator
    in q's dtype, no recipe kept (such a call is never replayed); the preprocess kernel (interpreter)
    still writes delta and lse2 first. And atomic_dq itself: off for a deterministic problem and off by
    default, on under tuning(atomic_dq=True) on a (stubbed) Hopper GPU."""
    from flashattn import backward, hopper, launch as launch_mod
    from kernel_cases import _on_hopper

    q, k, v, do = _inputs(1, 4, 2, 70, 90, 128, torch.float16, seed=3)
    problem = Problem.of(q, k, True, deterministic=False)
    fills = torch.randn(1, 4, 70, 128)
    calls, launched = [], []

    def fake_dkdv(q, k, v, do, lse2, delta, dk, dv, causal, scale, record=None, dq_accum=None):
        calls.append((lse2.clone(), delta.clone(), dq_accum.shape, dq_accum.dtype, bool((dq_accum == 0).all())))
        dq_accum.copy_(fills)
        dk.fill_(1.0)
        dv.fill_(2.0)

    monkeypatch.setattr(backward, "atomic_dq", lambda p, device: not p.deterministic)
    monkeypatch.setattr(hopper.bwd, "dkdv", fake_dkdv)
    real_launch = backward.launch
    monkeypatch.setattr(backward, "launch", lambda kernel, *a, **kw: launched.append(kernel) or real_launch(kernel, *a, **kw))
    monkeypatch.setattr(backward, "_second_stream", lambda q, p: pytest.fail("no second stream for the atomic dQ"))
    o, lse = attention_forward(q, k, v, problem)
    recipes = len(launch_mod._RECIPES)
    dq, dk, dv = attention_backward(do, q, k, v, o, lse, problem)
    [(lse2, delta, shape, dtype, zeroed)] = calls
    assert shape == q.shape and dtype == torch.float32 and zeroed
    assert launched == [backward._bwd_preprocess_kernel]
    assert torch.isfinite(lse2).all() and delta.abs().sum() > 0
    assert torch.equal(dq, (fills * problem.scale).to(q.dtype)) and dq.dtype == q.dtype
    assert (dk == 1).all() and (dv == 2).all()
    assert len(launch_mod._RECIPES) == recipes
    monkeypatch.undo()
    _on_hopper(monkeypatch)
    monkeypatch.setattr(hopper.bwd, "atomic_available", lambda: True)
    big = Problem(2, 16, 16, 4096, 4096, 128, torch.bfloat16, False, 128 ** -0.5, deterministic=False)
    cuda = torch.device("cuda", 0)
    assert _config.gluon_kernel("bwd_dkdv", big, cuda)
    assert not backward.atomic_dq(big, cuda)  # off by default
    with _config.tuning(atomic_dq=True):
        assert backward.atomic_dq(big, cuda)
        assert not backward.atomic_dq(Problem(2, 16, 16, 4096, 4096, 128, torch.bfloat16, False, 128 ** -0.5), cuda)
        assert not backward.atomic_dq(Problem(2, 16, 16, 4096, 4096, 64, torch.bfloat16, False, 0.125,
                                              deterministic=False), cuda)


# (B, Hq, Hkv, N, M, causal, layout, logit scale) of the Gluon kernels' float64 checks
_GLUON_CASES = [
    (2, 4, 4, 1000, 1000, False, "bhnd", 1.0),
    (2, 4, 4, 300, 777, True, "bhnd", 1.0),  # N < M: every query also sees the prefix
    (2, 4, 2, 777, 300, True, "bnhd", 1.0),  # GQA, N > M: the first 477 rows see no key
    (1, 8, 2, 1024, 1024, True, "bhnd", 3.0),  # large logits
    (1, 6, 1, 130, 3, False, "bnhd", 1.0),  # multi-query, three keys
]


def _gluon_dispatched(q, k, causal, kernels=("fwd", "bwd_dkdv", "bwd_dq")):
    problem = Problem.of(q, k, causal)
    return {kernel: _config.gluon_kernel(kernel, problem, q.device) for kernel in kernels}


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("b, h_q, h_kv, n, m, causal, layout, std", _GLUON_CASES + [
    (1, 2, 2, 64, 200, True, "bhnd", 1.0),  # one query block, ragged key blocks
])
def test_gluon_kernels_match_float64(monkeypatch, dtype, d, b, h_q, h_kv, n, m, causal, layout, std):
    """The package's forward and backward with the Gluon kernels dispatched at every size (the work
    bar lowered to 0) against float64: ragged N != M, empty causal rows, GQA, transposed layouts."""
    monkeypatch.setattr(_config, "GLUON_MIN_WORK", collections.defaultdict(lambda: (0, 0)))
    # the dK/dV kernel is built for D = 64 too (not dispatched: it loses there); the forward is tested
    # at D = 64 above
    monkeypatch.setattr(_config, "GLUON_HEAD_DIMS", {"fwd": (128, 256), "bwd_dkdv": (64, 128), "bwd_dq": ()})
    monkeypatch.setattr(_config, "_GLUON", {})
    q, k, v, do = _inputs(b, h_q, h_kv, n, m, d, dtype, layout=layout, std=std, seed=n + m + d)
    dispatched = _gluon_dispatched(q, k, causal)
    if not any(dispatched.values()):
        pytest.skip("the Gluon kernels run on sm_90 with Triton 3.6 only")
    assert dispatched == {"fwd": d in (128, 256), "bwd_dkdv": d in (64, 128), "bwd_dq": False}
    _, (o, lse, dq, dk, dv) = _check_against_reference(q, k, v, do, causal, d ** -0.5)
    _empty_rows_are_zero(causal, n, m, o, lse, dq)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("b, h_q, h_kv, n, m, causal, layout, std", _GLUON_CASES + [
    (1, 2, 2, 200, 64, True, "bhnd", 1.0),  # one key block, ragged query blocks
])
def test_gluon_dq_kernel_matches_float64(monkeypatch, dtype, d, b, h_q, h_kv, n, m, causal, layout, std):
    """The Gluon dQ kernel (dispatched at D = 128 and 256 by default; built for D = 64 too) with the
    rest of the backward, against float64: the rule is opened to it at every size for this test."""
    monkeypatch.setattr(_config, "GLUON_MIN_WORK", collections.defaultdict(lambda: (0, 0)))
    monkeypatch.setattr(_config, "GLUON_HEAD_DIMS", {"fwd": (), "bwd_dkdv": (), "bwd_dq": (64, 128, 256)})
    monkeypatch.setattr(_config, "_GLUON", {})
    q, k, v, do = _inputs(b, h_q, h_kv, n, m, d, dtype, layout=layout, std=std, seed=n + 3 * m + d)
    if not _gluon_dispatched(q, k, causal, ("bwd_dq",))["bwd_dq"]:
        pytest.skip("the Gluon kernels run on sm_90 with Triton 3.6 only")
    _, (o, lse, dq, dk, dv) = _check_against_reference(q, k, v, do, causal, d ** -0.5)
    _empty_rows_are_zero(causal, n, m, o, lse, dq)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype, b, h_q, h_kv, n, m, causal, layout, std", [
    *((torch.bfloat16, *case) for case in _GLUON_CASES),
    (torch.bfloat16, 1, 2, 2, 64, 200, True, "bhnd", 1.0),  # one query block, ragged key blocks
    (torch.bfloat16, 1, 2, 2, 200, 64, True, "bhnd", 1.0),  # one key block, ragged query blocks
    (torch.float16, *_GLUON_CASES[1]),
    (torch.float16, *_GLUON_CASES[2]),
])
def test_gluon_atomic_dq_matches_float64_and_leaves_dk_dv_bitwise(monkeypatch, dtype, b, h_q, h_kv, n, m, causal,
                                                                  layout, std):
    """deterministic=False under tuning(atomic_dq=True) at D = 128 with the Gluon dK/dV kernel dispatched
    at every size: dQ summed by TMA reductions inside it (no dQ kernel) against float64, rows that see no
    key at exactly 0; dK and dV bitwise those of the deterministic backward (the same products in the
    same order)."""
    from flashattn import backward

    monkeypatch.setattr(_config, "GLUON_MIN_WORK", collections.defaultdict(lambda: (0, 0)))
    monkeypatch.setattr(_config, "GLUON_HEAD_DIMS", {"fwd": (128,), "bwd_dkdv": (128,), "bwd_dq": (128,)})
    monkeypatch.setattr(_config, "_GLUON", {})
    q, k, v, do = _inputs(b, h_q, h_kv, n, m, 128, dtype, layout=layout, std=std, seed=5 * n + m)
    if not _gluon_dispatched(q, k, causal, ("bwd_dkdv",))["bwd_dkdv"]:
        pytest.skip("the Gluon kernels run on sm_90 with Triton 3.6 only")
    problem = Problem.of(q, k, causal, deterministic=False)
    assert not backward.atomic_dq(problem, q.device)  # off unless a tuning turns it on
    with _config.tuning(atomic_dq=True):
        assert backward.atomic_dq(problem, q.device)
        _, (o, lse, dq, dk, dv) = _check_against_reference(q, k, v, do, causal, 128 ** -0.5, deterministic=False)
    _empty_rows_are_zero(causal, n, m, o, lse, dq)
    exact = attention_backward(do, q, k, v, o, lse, Problem.of(q, k, causal))
    assert torch.equal(dk, exact[1]) and torch.equal(dv, exact[2])


@gpu
@needs_cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_public_api_backward_nondeterministic_on_request_only(causal):
    """At the real bar (D = 128) under tuning(atomic_dq=True), attention(..., deterministic=False) and
    flash_attn_func's deterministic=False run the atomic dQ (float64 check through autograd, the
    backward on autograd's thread); the default stays deterministic there: two default backward passes
    are bitwise equal."""
    import flashattn
    from flashattn import backward
    from flashattn.compat import flash_attn_func

    n = 2897
    q, k, v, do = _inputs(2, 8, 2, n, n, 128, torch.bfloat16, seed=29)
    if not _gluon_dispatched(q, k, causal, ("bwd_dkdv",))["bwd_dkdv"]:
        pytest.skip("the Gluon kernels run on sm_90 with Triton 3.6 only")
    with _config.tuning(atomic_dq=True):
        assert backward.atomic_dq(Problem.of(q, k, causal, deterministic=False), q.device)
        assert not backward.atomic_dq(Problem.of(q, k, causal), q.device)
    ref, lowp = [], []
    for dtype, out in ((torch.float64, ref), (q.dtype, lowp)):
        x = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        o, _ = naive_attention(*x, causal=causal, scale=128 ** -0.5)
        out.extend(torch.autograd.grad(o, x, do.to(dtype)))

    def grads(call, *args, **kw):
        x = [t.detach().requires_grad_() for t in args]
        return torch.autograd.grad(call(*x, **kw), x, do if call is flashattn.attention else do.transpose(1, 2))

    with _config.tuning(atomic_dq=True):
        nondeterministic = (grads(flashattn.attention, q, k, v, causal=causal, deterministic=False),
                            [g.transpose(1, 2) for g in grads(flash_attn_func, *(t.transpose(1, 2) for t in (q, k, v)),
                                                              causal=causal, deterministic=False)])
        first = grads(flashattn.attention, q, k, v, causal=causal)
        second = grads(flashattn.attention, q, k, v, causal=causal)
    for got in nondeterministic:
        for name, g, r, lp in zip(("dq", "dk", "dv"), got, ref, lowp):
            assert torch.isfinite(g).all()
            assert_close_ratio(name, g, r, lp, floor=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@gpu
@needs_cuda
def test_gpu_replayed_gluon_causal_forwards_on_two_streams_and_in_a_graph():
    """The public forward's Gluon causal kernel, each call with a tile counter of its own: replayed
    calls on two streams at once, calls on the default stream between the replays of a graph captured
    on a side stream, and the graph's replays all give the bits of the first call."""
    from flashattn import device_helpers, tensors
    from flashattn import launch as launch_mod

    inputs = [_inputs(4, 32, 8, 2048, 2048, 128, torch.bfloat16, seed=41 + i)[:3] for i in range(2)]
    if not _gluon_dispatched(inputs[0][0], inputs[0][1], True, ("fwd",))["fwd"]:
        pytest.skip("the Gluon kernels run on sm_90 with Triton 3.6 only")
    problem = Problem.of(inputs[0][0], inputs[0][1], True)
    expected = [attention_forward(*x, problem) for x in inputs]  # the first records the recipe
    _on_two_streams_at_once(lambda x: attention_forward(*x, problem), inputs, expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attention_forward(*inputs[0], problem)
    for _ in range(2):
        graph.replay()
        eager = attention_forward(*inputs[1], problem)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(captured, expected[0]))
        assert all(torch.equal(a, b) for a, b in zip(eager, expected[1]))
    assert launch_mod._RECIPES  # the calls were replayed, not only recorded


@gpu
@needs_cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [128, 256])
def test_gluon_kernels_at_the_default_bar_match_float64_and_repeat_bitwise(causal, d):
    """At the real dispatch bars (GLUON_MIN_WORK) the public API runs the Gluon kernels (at D = 256
    the forward and dQ; at D = 128 the forward, dK/dV and dQ): float64 check, two backward passes
    bitwise equal, the same bits under a CUDA graph, and the launcher's direct path still on after them."""
    n = 2897 if d == 128 else 2049  # 2 * 8 * n^2 * d just above the highest bar: 2^34 at D = 128 and 256
    q, k, v, do = _inputs(2, 8, 2, n, n, d, torch.bfloat16, seed=23)
    dispatched = _gluon_dispatched(q, k, causal)
    if not any(dispatched.values()):
        pytest.skip("the Gluon kernels run on sm_90 with Triton 3.6 only")
    assert dispatched == {"fwd": True, "bwd_dkdv": d == 128, "bwd_dq": True}
    _check_against_reference(q, k, v, do, causal, d ** -0.5)
    problem = Problem.of(q, k, causal)
    o, lse = attention_forward(q, k, v, problem)
    first = attention_backward(do, q, k, v, o, lse, problem)
    second = attention_backward(do, q, k, v, o, lse, problem)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        og, lseg = attention_forward(q, k, v, problem)
        grads = attention_backward(do, q, k, v, og, lseg, problem)
    for _ in range(2):  # a replay zeroes the causal forward's tile counter again (a captured memset)
        og.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(og, o) and torch.equal(lseg, lse)
        assert all(torch.equal(a, b) for a, b in zip(grads, first))
    from flashattn import launch as launch_mod

    # no launch fell back to Triton's own path for good
    assert all(entry[1] is not None and entry[2] is not None for entry in launch_mod._COMPILED.values())
