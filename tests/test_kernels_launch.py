"""The launch layer between the launchers and the compiled kernels (flashattn.launch, flashattn.tensors).

The public API reaches the launchers these modules test; inputs a TMA descriptor cannot read are
copied, and the descriptor built without Triton's checks equals the checked one; the compiled-kernel
cache's key changes with exactly what Triton specializes on; the direct launch is built only for the
launcher layout it was written for and steps aside while a launch hook is set; a call replayed from its
recipe hands the kernels what the full path hands them (a tile counter of its own zeroed at each
replay, no tensor kept past the call, tensor subclasses and numpy integers handled); the fallback path,
the fast path and CUDA-graph replays give the same bits. Tests without the ``gpu`` mark run anywhere,
several of them with benchmarks.hostcost's no-op launches in place of the GPU's.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import flashattn
from flashattn.backward import launch_backward as attention_backward
from flashattn.forward import launch_forward as attention_forward
from flashattn.problem import Problem
from flashattn.testing import random_qkv

from devices import DEVICE, HAS_CUDA, gpu, needs_cuda
from kernel_cases import _check_against_reference, _inputs, _stub_gluon_forward_launch


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_public_api_reaches_the_kernels(causal, monkeypatch):
    """flashattn.attention, through torch.autograd, calls these very kernels forward and backward."""
    calls = {"fwd": 0, "bwd": 0}
    fwd, bwd = flashattn.forward.launch_forward, flashattn.backward.launch_backward

    def counting_fwd(*args):
        calls["fwd"] += 1
        return fwd(*args)

    def counting_bwd(*args):
        calls["bwd"] += 1
        return bwd(*args)

    monkeypatch.setattr(flashattn.forward, "launch_forward", counting_fwd)
    monkeypatch.setattr(flashattn.backward, "launch_backward", counting_bwd)
    b, h_q, h_kv, n, m, d = (2, 4, 2, 300, 257, 64) if HAS_CUDA else (1, 2, 1, 21, 30, 16)
    q, k, v, do = _inputs(b, h_q, h_kv, n, m, d, torch.float16, seed=7)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    o, lse = flashattn.attention(qg, kg, vg, causal=causal, return_lse=True)
    o.backward(do)
    assert calls == {"fwd": 1, "bwd": 1}
    # the same numbers as calling the launchers directly
    problem = Problem.of(q, k, causal, d ** -0.5)
    o_k, lse_k = fwd(q, k, v, problem)
    dq_k, dk_k, dv_k = bwd(do, q, k, v, o_k, lse_k, problem)
    assert torch.equal(o, o_k) and torch.equal(lse, lse_k)
    assert torch.equal(qg.grad, dq_k) and torch.equal(kg.grad, dk_k) and torch.equal(vg.grad, dv_k)
    # and flash_attn_func's (B, N, H, D) layout reaches them too
    out = flashattn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
    assert torch.equal(out.transpose(1, 2), o_k)


def _misaligned_views(b, h, n, d, dtype, seed=0):
    """Inputs a tensor descriptor cannot read in place, each a different way."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    odd_start = torch.randn(b * h * n * d + 1, dtype=dtype, device=DEVICE, generator=gen)[1:].view(b, h, n, d)
    strided_d = torch.randn(b, h, n, 2 * d, dtype=dtype, device=DEVICE, generator=gen)[..., ::2]
    odd_rows = torch.randn(b, h, n, d + 1, dtype=dtype, device=DEVICE, generator=gen)[..., :d]  # row stride d + 1
    return odd_start, strided_d, odd_rows


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_inputs_descriptors_cannot_read_are_copied(causal):
    """TMA needs a 16-byte aligned start and 16-byte multiples for every stride but the last.

    Inputs that break this (an odd start, a strided head dim, rows of an odd number of elements) are
    copied into padded buffers before the launch; the results must be as exact as for any input.
    D = 20 in fp16 is a 40-byte row: even the contiguous tensor needs the padded copy.
    """
    from flashattn.tensors import addressable as _addressable, describable as _describable

    b, h, n, d = (1, 4, 1000, 64) if HAS_CUDA else (1, 2, 37, 16)
    views = _misaligned_views(b, h, n, d, torch.float16)
    assert not any(_describable(x) for x in views)
    q, k, v = views
    do = torch.randn(q.shape, dtype=q.dtype, device=DEVICE)
    _check_against_reference(q, k, v, do, causal, d ** -0.5)
    for x in views:
        copy = _addressable(x)
        assert _describable(copy) and torch.equal(copy, x)

    q, k, v, do = _inputs(1, 2, 1, 300 if HAS_CUDA else 29, 200 if HAS_CUDA else 23, 20, torch.float16, seed=23)
    assert not _describable(q) and q.is_contiguous()
    _check_against_reference(q, k, v, do, causal, 20 ** -0.5)
    aligned = torch.randn(1, 2, 8, 64, dtype=torch.float16, device=DEVICE)
    assert _describable(aligned) and _addressable(aligned) is aligned  # no copy when none is needed


def test_fast_descriptor_is_the_checked_one(monkeypatch):
    """Off the interpreter, tile_desc fills Triton's TensorDescriptor in without its constructor's
    checks; every field must equal what the checking constructor makes, for dense and strided views."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from flashattn import _config, tensors
    from flashattn import launch as launch_mod

    assert tensors._descriptor_defaults() is not None  # this Triton takes the fast path
    base = torch.randn(2, 24, 3, 64, dtype=torch.float16)
    views = (torch.randn(2, 3, 24, 64, dtype=torch.float16), base.transpose(1, 2), base[:, 8:].transpose(1, 2))
    monkeypatch.setattr(_config, "is_interpreter", lambda: False)
    for x in views:
        assert tensors.describable(x)
        fast = tensors.tile_desc(x, 16, 64)
        checked = TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, 16, 64])
        assert type(fast) is TensorDescriptor and fast.base is x
        assert {k: v for k, v in vars(fast).items() if k not in ("base", "flashattn_key")} == {
            k: v for k, v in vars(checked).items() if k != "base"}
        assert fast.flashattn_key == tensors._descriptor_key(checked)  # the launch cache's key of it
    desc = tensors.Descriptors(64)
    q = views[0]
    assert desc(q, 16) is desc(q, 16) and desc(q, 32) is not desc(q, 16)
    assert desc(views[1], 16) is not desc(q, 16)


def test_launch_signature_separates_what_triton_specializes_on(monkeypatch):
    """The key of the compiled-kernel cache changes with everything a compiled kernel depends on (an
    integer's value, a tensor's dtype and 16-byte alignment, a descriptor's shape, strides and block,
    a constexpr, an option, the device) and with nothing else (a float's value, an unspecialized
    integer within 32 bits, a tensor's data beyond its alignment)."""
    from types import SimpleNamespace

    from flashattn import device_helpers, tensors
    from flashattn import launch as launch_mod

    monkeypatch.setattr(launch_mod, "_current_device", lambda: 0)
    kernel = SimpleNamespace(params=[SimpleNamespace(num=3, do_not_specialize=True)])
    buf = torch.zeros(64, dtype=torch.float16)
    x = torch.zeros(2, 3, 8, 16, dtype=torch.float16)
    desc = tensors.tile_desc(x, 8, 16, checked=True)

    def key(args=None, constexprs=None, options=None):
        args = args if args is not None else (desc, buf, 7, 5, 0.5)
        return launch_mod._signature(kernel, args, constexprs or {"C": True}, options or {"num_warps": 4})

    base = key()
    assert key() == base
    assert key((desc, buf, 7, 6, 0.25)) == base  # unspecialized int (position 3) and float values
    assert key((desc, buf, 7, 2**40, 0.5)) != base  # ... but not its width
    assert key((desc, buf, 8, 5, 0.5)) != base  # a specialized int
    assert key((desc, buf[8:], 7, 5, 0.5)) == base  # 16 bytes further: same alignment
    assert key((desc, buf[1:], 7, 5, 0.5)) != base  # 2 bytes further: not 16-byte aligned
    assert key((desc, buf.float(), 7, 5, 0.5)) != base  # another dtype
    y = torch.zeros(2, 3, 16, 16, dtype=torch.float16)
    assert key((tensors.tile_desc(y, 8, 16, checked=True), buf, 7, 5, 0.5)) != base  # another shape
    assert key((tensors.tile_desc(x, 4, 16, checked=True), buf, 7, 5, 0.5)) != base  # another block
    z = torch.zeros(2, 8, 3, 16, dtype=torch.float16).transpose(1, 2)
    assert key((tensors.tile_desc(z, 8, 16, checked=True), buf, 7, 5, 0.5)) != base  # other strides
    assert key(constexprs={"C": False}) != base and key(options={"num_warps": 8}) != base
    assert key((desc, buf, True, 5, 0.5)) != key((desc, buf, 1, 5, 0.5))  # a bool is not the int it equals
    # a descriptor made elsewhere (no key stored by tile_desc) is keyed the same
    from triton.tools.tensor_descriptor import TensorDescriptor
    assert key((TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, 8, 16]), buf, 7, 5, 0.5)) == base
    monkeypatch.setattr(launch_mod, "_current_device", lambda: 1)
    assert key() != base


@gpu
@needs_cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dq_stream", ["one stream", "side stream"])
def test_gpu_cuda_graph_replay_matches_eager(causal, dq_stream, monkeypatch):
    """Forward and backward captured in one CUDA graph and replayed on new inputs give bitwise the
    results of an eager call on those inputs, with dQ after dK/dV on one stream (this size's path)
    and with dQ on the side stream (the path of large problems, forced here): no call on either
    path synchronizes with the GPU, or the capture would fail."""
    from flashattn import backward

    if dq_stream == "side stream":
        monkeypatch.setattr(backward, "OVERLAP_MIN_WORK", 0)
    shape = (2, 8, 2, 1000, 1000, 64)  # GQA 4, ragged blocks
    q, k, v, do = _inputs(*shape, torch.float16, seed=23)
    sq, sk, sv = (x.clone().requires_grad_() for x in (q, k, v))
    sdo = do.clone()

    def step():
        out = flashattn.attention(sq, sk, sv, causal=causal)
        return (out, *torch.autograd.grad(out, (sq, sk, sv), sdo))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph: compiles kernels, creates streams
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()

    fresh = _inputs(*shape, torch.float16, seed=29)
    with torch.no_grad():
        for x, new in zip((sq, sk, sv, sdo), fresh):
            x.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()  # the same static tensors, now holding the fresh inputs
    for got, want in zip(captured, eager):
        assert torch.isfinite(got).all()
        assert torch.equal(got, want)


def test_a_recipe_zeroes_a_tile_counter_of_its_own_at_every_replay(monkeypatch):
    """A tile counter a call recorded (Recording.add_counter: the Gluon causal forward's) is made
    again and zeroed at each replay, before the launch that reads it, even when the launch before
    left its counter's memory non-zero, and is not returned; the outputs are allocated in their
    recorded layout and not zeroed. A counter a launch on a side stream drew from keeps no recipe.
    Runs on the CPU: the launch is a stand-in that reads, then dirties, the counter's memory
    (benchmarks.hostcost)."""
    import ctypes
    from types import SimpleNamespace

    from benchmarks.hostcost import _NoLaunch
    from flashattn import device_helpers, tensors
    from flashattn import launch as launch_mod

    seen = []

    class Reading(_NoLaunch):
        def __call__(self, *args):  # the generated launcher's arguments: 12 of its own, then the kernel's
            super().__call__(*args)
            value = ctypes.c_int32.from_address(args[-1])
            seen.append(value.value)
            value.value = 7  # as if the kernel had left it non-zero

    kernel = SimpleNamespace(arg_names=["inp", "out", "counter"])
    direct = Reading(capture=True).direct(kernel)
    monkeypatch.setattr(launch_mod, "_RECIPES", {})
    monkeypatch.setattr(launch_mod, "_stream", lambda device: 0)
    monkeypatch.setattr(launch_mod, "_FAST_PATH", [True])  # the stand-in launch is the fast path on any Triton
    empty = torch.empty_strided
    monkeypatch.setattr(torch, "empty_strided", lambda *a, **k: empty(*a, **k).fill_(7))  # stale memory

    inp = torch.randn(4, 8)
    out, counter = torch.empty(8, 4).t(), tensors.tile_counter(inp.device)  # a transposed output layout
    assert counter.dtype == torch.int32 and counter.tolist() == [0]
    record = launch_mod.Recording("key")
    record.add(kernel, direct, (1, 1, 1), (inp, out, counter))
    record.add_counter(counter)
    record.keep((inp,), (out,))
    recipe = launch_mod._RECIPES["key"]
    assert recipe is not None and recipe.n_counters == 1 and len(recipe.layouts) == 1
    for _ in range(3):
        replayed = launch_mod.replay("key", (torch.randn(4, 8),))
        assert len(replayed) == 1 and replayed[0].shape == (4, 8) and replayed[0].stride() == (1, 4)
        assert (replayed[0] == 7).all()  # an output is the kernel's to write: not zeroed
    assert seen == [0, 0, 0]  # each replay's launch found its counter zeroed

    monkeypatch.setattr(launch_mod, "_RECIPES", {})
    record = launch_mod.Recording("side")
    record.side = object()  # the launch goes to a side stream (on_stream)
    record.add(kernel, direct, (1, 1, 1), (inp, out, counter))
    record.add_counter(counter)
    record.keep((inp,), (out,))
    assert "side" not in launch_mod._RECIPES


def _tensors_kept_by_the_package():
    """Tensors reachable from the globals of flashattn's modules (through dicts, lists, tuples, sets
    and objects' attributes, a few levels deep; modules, classes and functions are not followed)."""
    import sys
    import types

    found, seen = [], set()

    def walk(x, depth, path):
        if id(x) in seen or depth > 5:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            found.append(path)
        elif isinstance(x, dict):
            for k_, v_ in list(x.items()):
                walk(k_, depth + 1, f"{path}[key]")
                walk(v_, depth + 1, f"{path}[{k_!r:.40}]")
        elif isinstance(x, (list, tuple, set, frozenset)):
            for i, v_ in enumerate(list(x)):
                walk(v_, depth + 1, f"{path}[{i}]")
        elif isinstance(x, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, str, bytes,
                            int, float, bool)) or x is None or callable(x) and not hasattr(x, "__slots__"):
            return
        else:
            for name in (*getattr(type(x), "__slots__", ()), *getattr(x, "__dict__", {})):
                if hasattr(x, name):
                    walk(getattr(x, name), depth + 1, f"{path}.{name}")

    for mod_name, mod in list(sys.modules.items()):
        if mod_name == "flashattn" or mod_name.startswith("flashattn."):
            for name, value in list(vars(mod).items()):
                if not name.startswith("__"):
                    walk(value, 0, f"{mod_name}.{name}")
    return found


def test_calls_keep_no_tensor_past_their_end(monkeypatch):
    """Nothing the package keeps between calls (recipes, plans, caches) holds a tensor: a tensor kept
    past a call lives in whatever memory pool the call allocated from, and under
    torch.compile(mode="reduce-overhead") that can be a CUDA graph's, whose next recording then fails
    (tuning log, "A tile counter per stream, withdrawn"). Forward and backward, decoding steps, first
    and replayed calls, and the Gluon causal forward's host code (its kernel stubbed), on the CPU with
    benchmarks.hostcost's no-op launches."""
    from benchmarks import hostcost
    from flashattn import device_helpers, launch as launch_mod, tensors, hopper

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the tool refuses the interpreter; kernels count as compiled
    _stub_gluon_forward_launch(monkeypatch, [])
    gen = torch.Generator().manual_seed(3)
    with hostcost.launches_disabled():
        for causal in (False, True):
            for _ in range(3):  # the first call records, the later ones replay
                q, k, v = (torch.randn(2, 4, 96, 64, dtype=torch.float16, generator=gen).requires_grad_()
                           for _ in range(3))
                o, lse = flashattn.attention(q, k, v, causal=causal, return_lse=True)
                torch.autograd.grad((o.float().sum() + lse.sum()), (q, k, v))
        for _ in range(3):  # decoding steps with split-KV scratch, first and replayed
            q = torch.randn(2, 1, 8, 64, dtype=torch.float16, generator=gen)
            cache = [torch.randn(2, 96, 2, 64, dtype=torch.float16, generator=gen) for _ in range(2)]
            flashattn.attention_with_kvcache(q, *cache, cache_seqlens=70, num_splits=2)
        q, k, v = (torch.randn(4, 8, 512, 128, dtype=torch.bfloat16, generator=gen) for _ in range(3))
        record = launch_mod.Recording("gluon")
        hopper.fwd.forward(q, k, v, True, record=record)  # a dynamic walk: its tile counter
        del record, q, k, v, o, lse, cache
        assert launch_mod._RECIPES  # recipes were kept, and hold no tensor
        assert _tensors_kept_by_the_package() == []
    assert _tensors_kept_by_the_package() == []


def test_subclass_and_numpy_arguments_on_the_compiled_path(monkeypatch):
    """On the compiled-kernel path (benchmarks.hostcost's no-op launches, on the CPU): a call with a
    tensor subclass after a plain call of the same problem gets outputs of its subclass, as its first
    call does (a replayed recipe would allocate plain tensors), and a decoding call with numpy integers
    for the lengths and the split count launches like one with Python ints (the launch signature takes
    ints; numpy's crashed its first call)."""
    import numpy as np

    from benchmarks import hostcost
    from flashattn import device_helpers, tensors
    from flashattn import launch as launch_mod

    class Tagged(torch.Tensor):
        pass

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the tool refuses the interpreter; kernels count as compiled
    monkeypatch.setattr(launch_mod, "_RECIPES", {})
    gen = torch.Generator().manual_seed(4)
    with hostcost.launches_disabled():
        q, k, v = (torch.randn(1, 2, 40, 32, dtype=torch.float16, generator=gen) for _ in range(3))
        for _ in range(2):
            assert type(flashattn.attention(q, k, v)) is torch.Tensor
        assert launch_mod._RECIPES  # the plain call's launches were recorded
        for _ in range(2):
            assert type(flashattn.attention(q.as_subclass(Tagged), k, v)) is Tagged
        q = torch.randn(2, 1, 4, 32, dtype=torch.float16, generator=gen)
        cache = [torch.randn(2, 64, 2, 32, dtype=torch.float16, generator=gen) for _ in range(2)]
        launch_mod._RECIPES.clear()
        flashattn.attention_with_kvcache(q, *cache, cache_seqlens=np.int64(40), num_splits=np.int64(2))


def test_direct_launch_only_for_the_launcher_it_knows():
    """The direct launch (flashattn.launch._DirectLaunch) is built only from a compiled kernel whose
    launcher has the layout it was written for; anything else keeps Triton's own launch path. A launch
    hook counts as set unless it is None or an empty hook chain."""
    from types import SimpleNamespace

    from flashattn import device_helpers, tensors
    from flashattn import launch as launch_mod

    assert launch_mod._DirectLaunch.of(SimpleNamespace(), 3) is None  # no launcher at all
    fake_run = type("CudaLauncher", (), {"global_scratch_size": 0, "profile_scratch_size": 0})()
    assert launch_mod._DirectLaunch.of(SimpleNamespace(_run=fake_run), 3) is None  # no generated launch function
    assert launch_mod._no_hook(None) and launch_mod._no_hook(SimpleNamespace(calls=[]))
    assert not launch_mod._no_hook(SimpleNamespace(calls=[print])) and not launch_mod._no_hook(print)


# (B, Hq, Hkv, N, M, D, layout, problem keywords, what the second call passes)
REPLAY_CASES = [
    (1, 4, 2, 37, 53, 24, "bhnd", dict(causal=True), "fresh"),  # GQA, ragged N < M
    (2, 2, 2, 40, 40, 64, "bnhd", dict(window=(8, 4)), "fresh"),  # (B, N, H, D) views, a window
    (1, 4, 4, 33, 65, 40, "bhnd", dict(causal=True, softcap=10.0, alibi=True, dropout_p=0.3), "fresh"),
    (1, 2, 2, 48, 48, 32, "bhnd", dict(causal=True), "aliased"),  # q, k and v one tensor
    (1, 2, 2, 48, 48, 32, "bhnd", dict(causal=True), "fresh after aliased"),  # an aliased call's recipe is not it
    (1, 2, 2, 48, 48, 32, "bhnd", dict(), "misaligned"),  # q starts 2 bytes past a 16-byte boundary
    (1, 4, 2, 37, 53, 24, "bhnd", dict(causal=True), "two streams"),  # dQ beside dK/dV, as large problems run
]


@pytest.mark.parametrize("b, h_q, h_kv, n, m, d, layout, kw, second", REPLAY_CASES)
def test_replayed_launches_are_the_full_paths(monkeypatch, b, h_q, h_kv, n, m, d, layout, kw, second):
    """A launcher call repeated from its recipe (flashattn.launch.Recipe) hands the generated C launcher
    exactly what the full path hands it for the same tensors: every pointer, TMA descriptor, integer,
    float and the call's own dropout seed, for the forward and the backward's three kernels (with a
    gradient for the LSE). A call whose input is misaligned takes the full path; calls that pass
    one tensor as q, k and v replay their own recipes, and never lend them to calls of three tensors.

    Runs on the CPU: benchmarks.hostcost makes every compiled-kernel launch a call that keeps its
    arguments, so the two paths' launches can be compared one by one."""
    from benchmarks import hostcost

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the tool refuses the interpreter; kernels count as compiled
    gen = torch.Generator().manual_seed(5)
    alibi = kw.get("alibi", False)
    variants = dict(window=kw.get("window"), softcap=kw.get("softcap", 0.0), alibi=alibi,
                    dropout_p=kw.get("dropout_p", 0.0))

    def make(seed, how="fresh"):
        q, k, v = random_qkv(b, h_q, h_kv, n, m, d, dtype=torch.float16, layout=layout, generator=gen)
        if how == "aliased":
            k = v = q
        elif how == "misaligned":
            q = torch.randn(q.numel() + 1, dtype=torch.float16, generator=gen)[1:].view(q.shape)
        extra = dict(do=torch.randn(q.shape, dtype=torch.float16, generator=gen),
                     dlse=torch.randn(q.shape[:3], generator=gen),
                     slopes=torch.rand(h_q, generator=gen) if alibi else None, seed=seed)
        return q, k, v, extra

    def run(q, k, v, extra):
        problem = Problem.of(q, k, kw.get("causal", False), None, **variants)
        o, lse = attention_forward(q, k, v, problem, extra["slopes"], extra["seed"])
        attention_backward(extra["do"], q, k, v, o, lse, problem, extra["dlse"], extra["slopes"], extra["seed"])

    two_streams = second == "two streams"
    first = make(11, "aliased" if second == "fresh after aliased" else "fresh")
    later = make(2**40 + 12345, "fresh" if two_streams else second.split()[0])  # another seed in both 31-bit halves
    inputs = (*later[:3], later[3]["do"], later[3]["dlse"], later[3]["slopes"])
    # "aliased": a call with q, k and v one tensor (after a fresh first call) records its own recipes,
    # and the later such call replays them; "fresh after aliased": a call of three tensors finds only
    # the recipes of an aliased call, whose k and v slots are q's, and takes the full path
    got = hostcost.replayed_and_full(run, first, later, inputs, second_stream=two_streams,
                                     before_later=(lambda: run(*make(3, "aliased"))) if second == "aliased" else None)
    if two_streams:  # the side stream (1) waits for the current one (0) before dQ, the current one for it after
        streams = [row[0][1] if row[0][0] is str else row[3][1] for row in got[False]]
        assert streams == [0, 0, "wait", 0, 1, "wait"]
        assert got[False][2] == [(str, "wait"), (int, 1), (int, 0)] and got[False][5] == [(str, "wait"), (int, 0), (int, 1)]
        assert got[True] == got[False]
        for path in (True, False):
            got[path] = [row for row in got[path] if row[0][0] is not str]
    # forward, preprocess, dK/dV, dQ beside it; on one stream forward, dQ (with the row statistics), dK/dV
    assert len(got[True]) == len(got[False]) == (4 if two_streams else 3)
    assert len(got["kept"]) == (4 if "aliased" in second else 2)  # the forward's and the backward's, per key
    full_path = second in ("misaligned", "fresh after aliased")
    assert got["keys"] == (len(got[False]) if full_path else 0)  # replayed: no cache key, no binding
    assert got[True] == got[False]


@gpu
@needs_cuda
def test_gpu_fast_path_matches_tritons_launch(monkeypatch):
    """Launching through the fallback (``kernel[grid](...)`` alone, :func:`flashattn.launch.fast_path`
    off) and through the fast path gives bitwise the same results (forward,
    the backward's three kernels, descriptors of every tile shape, a transposed layout, padded D,
    GQA, a window, softcap and dropout), and steps aside while a launch hook is set, so the hook
    still sees every launch."""
    from flashattn import device_helpers, tensors
    from flashattn import launch as launch_mod

    cases = [((2, 4, 4, 300, 300, 64), dict(causal=True), "bhnd"),
             ((1, 8, 2, 128, 513, 40), dict(causal=True), "bhnd"),
             ((2, 4, 4, 257, 100, 128), dict(window=(32, 8)), "bnhd"),
             ((1, 4, 4, 200, 200, 96), dict(causal=True, dropout_p=0.2, seed=7, softcap=20.0), "bhnd"),
             ((1, 4, 4, 256, 256, 256), dict(causal=True), "bnhd"),
             ((2, 8, 2, 200, 300, 128), dict(causal=True, sinks=torch.randn(8, device="cuda")), "bhnd")]
    for shape, kw, layout in cases:
        q, k, v, do = _inputs(*shape, torch.bfloat16, layout=layout, seed=31)
        runs = []
        for fast in (False, True):
            with launch_mod.fast_path(fast):
                # the first call of a signature compiles, the second records, the next ones replay (from
                # the autograd layer, flashattn.autograd.run_forward, with and without grad)
                for _ in range(4):
                    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
                    o, lse = flashattn.attention(qq, kk, vv, return_lse=True, **kw)
                    with torch.no_grad():
                        o_ng, lse_ng = flashattn.attention(q, k, v, return_lse=True, **kw)
                    runs.append((o, lse, *torch.autograd.grad(o, (qq, kk, vv), do), o_ng, lse_ng))
        for run in runs[1:]:
            for a, b in zip(runs[0], run):
                assert torch.isfinite(a).all() or a.dtype == torch.float32
                assert torch.equal(a, b)
    if not any(entry[2] is not None for entry in launch_mod._COMPILED.values()):
        pytest.skip("this Triton's launcher is not the one _DirectLaunch was written for: nothing launched directly")
    # a backward whose forward ran under a pinned tuning takes the pinned tiles, not a recipe of the table's
    from flashattn import _config
    from flashattn import backward as backward_mod

    replayed = []
    real_replay = backward_mod.replay
    monkeypatch.setattr(backward_mod, "replay", lambda *a: replayed.append(real_replay(*a)) or replayed[-1])
    q, k, v, do = _inputs(1, 4, 4, 300, 300, 64, torch.float16, seed=5)
    pinned = _config.KernelConfig(32, 32, 4, 2)
    grads = []
    for i, pin in enumerate((False, False, False, True, False)):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        with _config.tuning(bwd_dkdv=pinned, bwd_dq=pinned) if pin else contextlib.nullcontext():
            o = flashattn.attention(qq, kk, vv, causal=True)
        replayed.clear()
        grads.append(torch.autograd.grad(o, (qq, kk, vv), do))
        if i >= 2:  # the first call compiles, the second records; then the recipe replays, except under pinned tiles
            assert any(r is not None for r in replayed) != pin
    for a, b in zip(grads[0], grads[4]):
        assert torch.equal(a, b)
    q, k, v, _ = _inputs(1, 4, 4, 128, 128, 64, torch.float16, seed=3)
    assert _launches_a_hook_sees(lambda: flashattn.attention(q, k, v, causal=True)) == 1


def _launches_a_hook_sees(fn) -> int:
    """How many launches Triton's launch-enter hook (a profiler's) sees while ``fn()`` runs."""
    from triton import knobs

    seen = []

    def hook(metadata):
        seen.append(metadata)

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        fn()
        torch.cuda.synchronize()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    return len(seen)


@gpu
@needs_cuda
def test_gpu_replayed_calls_match_the_full_path(monkeypatch):
    """Calls repeated from their recipes (flashattn.launch.Recipe) give bitwise the outputs and
    gradients of the full launch path, in the settings of the direct-launch test plus ALiBi and a
    gradient of the LSE, with another dropout seed on every call, and large calls whose backward runs
    dQ on a second stream and whose kernels are the Gluon ones on an H200; a replayed call makes no
    cache key; and while a launch hook is set the call takes Triton's path, so the hook sees its launch."""
    from flashattn import device_helpers, tensors
    from flashattn import launch as launch_mod

    class NeverKept(dict):
        def __setitem__(self, key, value):  # every call records and keeps nothing: the full path
            pass

    cases = [((2, 4, 4, 300, 300, 64), dict(causal=True), "bhnd"),
             ((1, 8, 2, 128, 513, 40), dict(causal=True), "bhnd"),
             ((2, 4, 4, 257, 100, 128), dict(window=(32, 8)), "bnhd"),
             ((1, 4, 4, 200, 200, 96), dict(causal=True, dropout_p=0.2, softcap=20.0), "bhnd"),
             ((2, 4, 2, 256, 320, 256), dict(causal=True, alibi=True), "bnhd"),
             # large enough for dQ's second stream and, on an H200, the Gluon kernels: the causal
             # forward's tile counter is its stream's, the plain one's walk is static
             ((16, 16, 16, 1024, 1024, 128), dict(causal=True), "bhnd"),
             ((16, 16, 4, 1024, 1024, 128), dict(), "bnhd"),
             ((4, 8, 8, 2048, 2048, 256), dict(causal=True), "bhnd")]
    for shape, kw, layout in cases:
        q, k, v, do = _inputs(*shape, torch.bfloat16, layout=layout, seed=31)
        gen = torch.Generator(device=q.device).manual_seed(1)
        dlse = torch.randn(q.shape[:3], device=q.device, generator=gen)
        if kw.pop("alibi", False):
            kw["alibi_slopes"] = torch.rand(q.shape[1], device=q.device, generator=gen)

        def call(seed):
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            extra = dict(seed=seed) if kw.get("dropout_p") else {}
            o, lse = flashattn.attention(qq, kk, vv, return_lse=True, **kw, **extra)
            return (o, lse, *torch.autograd.grad((o, lse), (qq, kk, vv), (do, dlse)))

        runs = []
        for keep in (False, True):
            monkeypatch.setattr(launch_mod, "_RECIPES", {} if keep else NeverKept())
            call(7), call(8)  # compile, then record
            signatures = []
            with monkeypatch.context() as m:
                m.setattr(launch_mod, "_signature", lambda *a, f=launch_mod._signature: signatures.append(1) or f(*a))
                runs.append(call(2**40 + 9))
            if keep and any(entry[2] is not None for entry in launch_mod._COMPILED.values()):
                assert len([r for r in launch_mod._RECIPES.values() if r is not None]) == 2
                assert signatures == []  # both passes replayed
        for a, b in zip(*runs):
            assert torch.isfinite(a).all() or a.dtype == torch.float32
            assert not torch.isnan(a).any()
            assert torch.equal(a, b)
    if not launch_mod._RECIPES:
        pytest.skip("this Triton's launcher is not the one _DirectLaunch was written for: nothing replayed")
    with torch.no_grad():
        assert _launches_a_hook_sees(lambda: flashattn.attention(q, k, v, **kw)) == 1


def test_the_early_replay_switch_nests_and_restores():
    """``autograd.early_replay`` (the A/B switch of benchmarks.early_replay_ab): on by default, set inside
    its block, the outer setting back after it, also when the block raises."""
    from flashattn import autograd

    assert autograd._EARLY_REPLAY[0]
    with autograd.early_replay(False):
        assert not autograd._EARLY_REPLAY[0]
        with autograd.early_replay(True):
            assert autograd._EARLY_REPLAY[0]
        assert not autograd._EARLY_REPLAY[0]
    assert autograd._EARLY_REPLAY[0]
    with pytest.raises(RuntimeError):
        with autograd.early_replay(False):
            raise RuntimeError("inside")
    assert autograd._EARLY_REPLAY[0]


# -- compiling a launcher call's kernels ahead, on background threads (launch.in_background) ------------------

class _WarmupOnly:
    """Stands in for a jitted kernel: records each ``warmup``; a launch fails the test."""

    def __init__(self, error=None):
        self.warmups, self.error = [], error

    def warmup(self, *args, grid, **kwargs):
        if self.error is not None:
            raise self.error
        self.warmups.append((args, grid, kwargs))

    def __getitem__(self, grid):
        raise AssertionError("in_background launched a kernel")


def _no_cuda_device(monkeypatch):
    from flashattn import launch as L

    monkeypatch.setattr(L, "_on", lambda device: contextlib.nullcontext())


def test_in_background_compiles_each_launch_and_launches_nothing(monkeypatch):
    """A call run by in_background hands each launch to a compile (Triton's warmup, with the launch's
    arguments, grid, constexprs and options) and launches nothing; inside it no recipe is recorded or
    replayed and no stream switch is made, which the same calls outside it do (the controls)."""
    from flashattn import launch as L

    _no_cuda_device(monkeypatch)
    monkeypatch.setattr(L, "_FAST_PATH", [True])
    monkeypatch.setitem(L._RECIPES, ("key",), lambda inputs, free: "replayed")
    kernel = _WarmupOnly()
    seen = {}

    def call():
        seen["recording"] = L.recording(("other key",))
        seen["replay"] = L.replay(("key",), ())
        L.fork(object())  # no stream: making the switch would raise
        L.launch(kernel, 7, (1, 2.0), {"BLOCK": 16}, {"num_warps": 4})
        L.launch(kernel, (2, 3), (3,), {}, {})

    L.in_background(torch.device("cuda", 0), call).result(timeout=60)
    assert kernel.warmups == [((1, 2.0), (7, 1, 1), {"BLOCK": 16, "num_warps": 4}), ((3,), (2, 3, 1), {})]
    assert seen == {"recording": None, "replay": None}
    # the controls: the same calls outside in_background record, replay and switch
    assert L.recording(("other key",)) is not None and L.replay(("key",), ()) == "replayed"
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    with pytest.raises(AttributeError):  # the switch reaches the object, which has no wait_stream
        L.fork(object())


def test_in_background_keeps_errors_in_its_future_and_can_be_off(monkeypatch):
    """A compile that fails leaves its error in the returned future (the real launch meets it again);
    background compiles off, or a CPU device, start nothing."""
    from flashattn import launch as L

    _no_cuda_device(monkeypatch)
    failing = _WarmupOnly(error=ValueError("no such kernel"))
    future = L.in_background(torch.device("cuda", 0), lambda: L.launch(failing, 1, (), {}, {}))
    assert isinstance(future.exception(timeout=60), ValueError)
    calls = []
    with L.background_compile(False):
        assert L.in_background(torch.device("cuda", 0), lambda: calls.append(1)) is None
    assert L.in_background(torch.device("cpu"), lambda: calls.append(1)) is None
    assert calls == []


def test_backward_compiles_ahead_once_per_family_and_device(monkeypatch):
    """autograd.compile_backward_ahead starts one background compile per problem family (dtype, head
    dims, mask, variants, layout) and device, looked at once per problem; none for a CPU tensor or
    under a pinned tuning;
    wait_for_compile_ahead waits for it once. (CUDA tensors are stood in for; the check that a real
    one is a plain CUDA tensor outside graph capture is its own test.)"""
    import types

    from flashattn import _config, autograd

    started = []

    class Future:
        def __init__(self):
            self.waited = 0

        def exception(self):
            self.waited += 1

    def compile_ahead(q, k, v, problem, *rest):
        started.append(problem)
        return Future()

    monkeypatch.setattr(autograd, "launchers", lambda: [None, types.SimpleNamespace(compile_ahead=compile_ahead)])
    monkeypatch.setattr(autograd, "_plain_cuda_outside_capture", lambda q: q.is_cuda)  # no CUDA tensor here
    for name in ("_SEEN", "_FAMILIES", "_PENDING"):
        monkeypatch.setattr(autograd, name, {})
    gpu0 = torch.device("cuda", 0)
    q = types.SimpleNamespace(is_cuda=True, device=gpu0)

    def problem(n=256, d=64, causal=True, **variants):
        return Problem(2, 4, 4, n, n, d, torch.float16, causal, d ** -0.5, **variants)

    autograd.compile_backward_ahead(q, q, q, problem())
    autograd.compile_backward_ahead(q, q, q, problem(n=512))  # another shape of the family: nothing new
    assert started == [problem()]
    autograd.compile_backward_ahead(q, q, q, problem(softcap=30.0))  # another family
    gpu1 = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1))
    autograd.compile_backward_ahead(gpu1, q, q, problem())  # a problem seen already: nothing, on any device
    assert len(started) == 2
    autograd.compile_backward_ahead(gpu1, q, q, problem(n=128))  # the family's first problem on another device
    assert len(started) == 3
    autograd.compile_backward_ahead(types.SimpleNamespace(is_cuda=False, device=torch.device("cpu")), q, q,
                                    problem(d=32))
    with _config.tuning(gluon=False):
        autograd.compile_backward_ahead(q, q, q, problem(d=128))
    no_key = Problem(1, 4, 4, 5, 0, 96, torch.float16, False, 0.1, layout="packed", total_q=5, total_k=0)
    autograd.compile_backward_ahead(q, q, q, no_key)  # a pack with no key: no backward kernel to compile
    assert len(started) == 3
    future = autograd._PENDING[(problem().family, gpu0)]
    autograd.wait_for_compile_ahead(problem(n=1024), q)
    autograd.wait_for_compile_ahead(problem(), q)
    assert future.waited == 1 and (problem().family, gpu0) not in autograd._PENDING


def test_only_plain_cuda_tensors_compile_ahead():
    """A CPU tensor, or a tensor subclass, starts no background compile."""
    from flashattn import autograd

    class Sub(torch.Tensor):
        pass

    assert not autograd._plain_cuda_outside_capture(torch.zeros(2))
    assert not autograd._plain_cuda_outside_capture(torch.zeros(2).as_subclass(Sub))


@gpu
@needs_cuda
def test_gpu_compile_ahead_skips_graph_capture():
    """Inside CUDA-graph capture no background compile starts; outside it a plain CUDA tensor may."""
    from flashattn import autograd

    x = torch.zeros(4, device="cuda")
    assert autograd._plain_cuda_outside_capture(x)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    seen = []
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            seen.append(autograd._plain_cuda_outside_capture(x))
            x.add_(1)
    assert seen == [False]


@gpu
@needs_cuda
def test_gpu_a_first_backward_finds_its_kernels_compiled_ahead():
    """The first forward of a new family that requires a gradient starts compiling its backward's
    kernels on background threads: every backward kernel compiled in that process compiles there, none
    on the backward's own thread, and the gradients are bitwise those of the same call with background
    compiles off."""
    import threading

    import triton

    from flashattn import launch

    compiled = []

    def hook(*args, **kwargs):
        compiled.append((threading.current_thread().name, kwargs["fn"].name))

    before = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        # an unusual family (fp16, D = 56, softcap, causal), so that no earlier test compiled it
        q, k, v, do = (torch.randn(2, 3, 300, 56, device="cuda", dtype=torch.float16) for _ in range(4))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        o = flashattn.attention(q, k, v, causal=True, softcap=7.5)
        grads = torch.autograd.grad(o, (q, k, v), do)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_post_compile_hook = before
    backward = [(thread, name) for thread, name in compiled if "bwd" in name]
    assert backward, compiled
    assert all(thread.startswith("flashattn-compile") for thread, _ in backward), backward
    with launch.background_compile(False):
        again = torch.autograd.grad(flashattn.attention(q, k, v, causal=True, softcap=7.5), (q, k, v), do)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


def test_a_call_that_only_compiles_takes_its_inputs_as_its_gradients(monkeypatch):
    """In a call run by in_background, the backward's gradients are its inputs where a new gradient
    would be laid out the same way (nothing is written, nothing allocated); a gradient of another
    layout is allocated as dense_like lays it out. Outside such a call every gradient is new."""
    from flashattn import backward, launch as L

    _no_cuda_device(monkeypatch)
    dense = torch.zeros(2, 3, 8, 16)
    transposed = torch.zeros(2, 8, 3, 16).transpose(1, 2)  # (B, N, H, D) memory: dense, not contiguous
    gapped = torch.zeros(2, 8, 3, 3, 16)[:, :, 0].transpose(1, 2)  # q of a packed qkv: not dense
    seen = {}

    def call():
        seen.update({name: backward._grad_like(x) for name, x in
                     (("dense", dense), ("transposed", transposed), ("gapped", gapped))})

    L.in_background(torch.device("cuda", 0), call).result(timeout=60)
    assert seen["dense"] is dense and seen["transposed"] is transposed
    real = [backward._grad_like(x) for x in (dense, transposed, gapped)]  # outside: all new
    assert all(g is not x for g, x in zip(real, (dense, transposed, gapped)))
    assert [g.stride() for g in real[:2]] == [dense.stride(), transposed.stride()]
    assert seen["gapped"] is not gapped and seen["gapped"].stride() == real[2].stride() != gapped.stride()


def test_a_backward_that_only_compiles_writes_nothing(monkeypatch):
    """The backward launcher run by in_background on real (CPU, float16) tensors: its gradients are
    q, k and v themselves and no value of them changes, for a dense problem and for a packed one
    whose sequences have no key (which a real backward answers by zeroing its gradients)."""
    from flashattn import backward, launch as L

    _no_cuda_device(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=gen).half() for _ in range(3))
    packed_q = torch.randn(5, 2, 32, generator=gen).half()
    packed_kv = torch.zeros(0, 2, 32, dtype=torch.float16)
    before = [x.clone() for x in (q, k, v, packed_q)]
    got = []

    def call():
        got.append(backward.launch_backward(q, q, k, v, q, torch.zeros(1, 2, 40), Problem.of(q, k, True, None)))
        cu_q, cu_k = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32)
        problem = Problem.packed(packed_q, packed_kv, 1, 5, 0, causal=False)
        got.append(backward.launch_backward(packed_q, packed_q, packed_kv, packed_kv, packed_q, torch.zeros(2, 5),
                                            problem, None, None, 0, (cu_q, cu_k)))

    L.in_background(torch.device("cuda", 0), call).result(timeout=120)
    (dq, dk, dv), (pdq, _, _) = got
    assert dq is q and dk is k and dv is v and pdq is packed_q
    assert all(torch.equal(x, y) for x, y in zip((q, k, v, packed_q), before))
