"""The drop-in guarantees: the custom operators, torch.compile, autocast, device placement, any grid.

On the CPU the operators run the reference (float64) or the kernels under the interpreter (float16);
the GPU-marked tests repeat what needs a device: compile with Inductor and CUDA graphs, autocast,
tensors on a non-current GPU, threads on two GPUs, B * H past 65 535, and more than 2^31 elements.
"""

from __future__ import annotations

import threading

import pytest
import torch

import flashattn
from flashattn import custom_ops, schedule
from flashattn.autograd import dense_like
from flashattn.reference import naive_attention
from flashattn.testing import assert_close_ratio, random_qkv

from devices import HAS_CUDA, gpu, needs_cuda

needs_two_gpus = pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def _qkv(b, h_q, h_kv, n, m, d, dtype, device="cpu", seed=0, layout="bhnd"):
    gen = torch.Generator(device=device).manual_seed(seed)
    return random_qkv(b, h_q, h_kv, n, m, d, dtype=dtype, device=device, generator=gen, layout=layout)


def test_operators_are_registered():
    assert hasattr(torch.ops.flashattn, "attention_forward")
    assert hasattr(torch.ops.flashattn, "attention_backward")


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_on_the_reference_path(causal, layout, monkeypatch):
    """torch.library.opcheck: schema, fake tensors, autograd registration and AOT dispatch agree."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _qkv(1, 4, 2, 7, 11, 16, torch.float64, layout=layout)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.library.opcheck(torch.ops.flashattn.attention_forward.default, (q, k, v, causal, 0.3))
    o, lse = torch.ops.flashattn.attention_forward(q, k, v, causal, 0.3)
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    args = (do, q.detach(), k.detach(), v.detach(), o.detach(), lse.detach())
    torch.library.opcheck(torch.ops.flashattn.attention_backward.default, (*args, dlse, causal, 0.3))
    torch.library.opcheck(torch.ops.flashattn.attention_backward.default, (*args, None, causal, 0.3))


def test_fake_outputs_have_the_real_shapes_dtypes_and_layouts(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    real = _qkv(2, 4, 1, 9, 13, 24, torch.float64, layout="bnhd")
    o, lse = torch.ops.flashattn.attention_forward(*real, True, 0.5)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(x) for x in real]
        fo, flse = torch.ops.flashattn.attention_forward(*fake, True, 0.5)
    for f, r in ((fo, o), (flse, lse)):
        assert f.shape == r.shape and f.dtype == r.dtype and f.stride() == r.stride()


@pytest.mark.parametrize("causal", [False, True])
def test_compile_fullgraph_traces_forward_and_backward(causal, monkeypatch):
    """No graph break (fullgraph=True) and the compiled gradients equal the eager ones, with dynamic N."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch._dynamo.reset()

    def step(q, k, v, do):
        o, lse = flashattn.attention(q, k, v, causal=causal, return_lse=True)
        return (o * do).sum() + lse.sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    for n, m in ((5, 9), (8, 12), (13, 6)):
        q, k, v = (x.requires_grad_() for x in _qkv(1, 2, 1, n, m, 16, torch.float64, seed=n))
        do = torch.randn(q.shape, dtype=q.dtype)
        eager = torch.autograd.grad(step(q, k, v, do), (q, k, v))
        got = torch.autograd.grad(compiled(q, k, v, do), (q, k, v))
        for g, e in zip(got, eager):
            torch.testing.assert_close(g, e, rtol=0, atol=1e-12)


def test_operator_problems_are_kept_per_signature_and_never_mixed():
    """The operators keep the Problem of each argument signature: the same arguments give the same
    object, and every argument that describes a call gives a Problem of its own, equal to a fresh one."""
    q, k, v = _qkv(2, 4, 2, 8, 12, 16, torch.float16, seed=1)
    base = (q, k, v, True, 0.25, -1, -1, 0.0, None, 0.0)
    assert custom_ops._problem(*base) is custom_ops._problem(*base)
    variants = [base, (q, k, v, False, *base[4:]), (q, k, v, True, 0.5, *base[5:]), (*base[:5], 3, 0, *base[7:]),
                (*base[:7], 30.0, None, 0.0), (*base[:8], torch.ones(4), 0.0), (*base[:9], 0.25),
                (q[:, :, :5], *base[1:]), (q, k[:, :, :7], v[:, :, :7], *base[3:]), (q.float(), *base[1:]),
                (q, k, v[..., :8], *base[3:])]  # v's head dim of its own: another problem
    got = [custom_ops._problem(*args) for args in variants]
    got.append(custom_ops._problem(*base, deterministic=False))  # a permission of its own, not the default's
    variants.append(None)
    assert len(set(got)) == len(variants) and not got[-1].deterministic and got[0].deterministic
    for args, problem in zip(variants[:-1], got):
        custom_ops._PROBLEMS.clear()
        assert custom_ops._problem(*args) == problem


def test_compiled_call_carries_deterministic_to_the_backward_operator(monkeypatch):
    """attention(..., deterministic=False) under torch.compile (fullgraph) reaches the backward operator
    as deterministic=False, and the default as True: the saved options carry it; the gradients equal
    the eager ones (the reference path of float64 inputs)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch._dynamo.reset()
    seen = []
    real = custom_ops._problem

    def spy(*args, **kwargs):
        problem = real(*args, **kwargs)
        seen.append(problem.deterministic)
        return problem

    monkeypatch.setattr(custom_ops, "_problem", spy)
    q, k, v = (x.requires_grad_() for x in _qkv(1, 2, 1, 7, 9, 16, torch.float64, seed=3))
    for deterministic in (False, True):
        seen.clear()
        step = torch.compile(lambda q, k, v: flashattn.attention(q, k, v, causal=True, deterministic=deterministic).sum(),
                             fullgraph=True, backend="aot_eager")
        got = torch.autograd.grad(step(q, k, v), (q, k, v))
        eager = torch.autograd.grad(flashattn.attention(q, k, v, causal=True).sum(), (q, k, v))
        assert seen and set(seen) == {deterministic}  # the forward and the backward operator alike
        for g, e in zip(got, eager):
            torch.testing.assert_close(g, e, rtol=0, atol=1e-12)


def test_compiled_graph_takes_no_float_input_without_dropout():
    """A call with no dropout hands the operator the constant 0.0: dynamo would otherwise make the
    float it reads (dropout_p's default) a graph input, a tensor built from it on every call. The
    default scale reaches it as None (1 / sqrt(D) inside): computed from the symbolic head dim it
    would be a symbolic float, which AOTAutograd turns into a tensor on every call as well. The
    graph's inputs are q, k, v and their symbolic sizes."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda q, k, v: flashattn.attention(q, k, v, causal=True), fullgraph=True, dynamic=True,
                       backend=backend)
    q, k, v = (x.requires_grad_() for x in _qkv(1, 2, 1, 6, 9, 16, torch.float64, seed=4))
    fn(q, k, v)
    (gm,) = graphs
    inputs = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
    assert sum(isinstance(x, torch.Tensor) for x in inputs) == 3
    assert all(isinstance(x, torch.Tensor) and x.dim() == 4 or isinstance(x, torch.SymInt) for x in inputs), inputs
    op = torch.ops.flashattn.attention_forward
    (call,) = [n for n in gm.graph.nodes if n.target in (op, op.default)]
    assert call.args[9] == 0.0 and type(call.args[9]) is float  # dropout_p
    # and no float computed from the symbolic sizes: the default scale 1 / sqrt(D) is the operator's
    assert call.args[4] is None
    assert not any(isinstance(n.meta.get("example_value"), torch.SymFloat) for n in gm.graph.nodes)


def _guard_lines(fn) -> list[str]:
    """The guards dynamo installed for the compiled ``fn`` (one line per guard or accessor)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return [line for entry in _debug_get_cache_entry_list(fn.__code__)
            for line in str(entry.guard_manager).splitlines()]


@pytest.mark.parametrize("entry", ["attention", "flash_attn_func"])
def test_compiled_call_reads_no_float_default(entry):
    """Dynamo reads an entry point's defaults as sourced values, and under dynamic=True a float one
    becomes an unspecialized float: torch 2.11 then checks it on every call with a guard that builds
    a tensor from it (seen on the GPU machines: ``___as_tensor(...__kwdefaults__['dropout_p']).item()
    == 0.0``). The defaults that are off are the int 0, so no guard of a compiled call that leaves
    them out reads a float default."""
    torch._dynamo.reset()
    if entry == "attention":
        def inner(q, k, v):
            return flashattn.attention(q, k, v, causal=True)
    else:
        def inner(q, k, v):
            return flashattn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    q, k, v = (x.requires_grad_() for x in _qkv(1, 2, 1, 6, 9, 16, torch.float64, seed=5))
    torch.compile(inner, fullgraph=True, dynamic=True, backend="eager")(q, k, v)
    lines = _guard_lines(inner)
    assert any("__kwdefaults__" in line or "__defaults__" in line for line in lines)  # the defaults are guarded
    read_as_float = [line for line in lines if ("__kwdefaults__" in line or "__defaults__" in line)
                     and "type=<class 'float'>" in line]
    assert not read_as_float, read_as_float
    assert not any("as_tensor" in line for line in lines)
    torch._dynamo.reset()


def test_compile_fullgraph_takes_a_float_scale_or_softcap_that_is_a_graph_input(monkeypatch):
    """A float option passed into the compiled function, or computed from a dynamic shape (the usual
    ``1 / math.sqrt(q.shape[-1])``), traces without a graph break (the checks' finiteness test is
    traceable) and gives the eager result."""
    import math

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _qkv(1, 2, 2, 8, 8, 16, torch.float64, seed=4)
    cases = [(lambda q, k, v, s: flashattn.attention(q, k, v, scale=s), dict(dynamic=True), (0.1, 0.2)),
             (lambda q, k, v, s: flashattn.attention(q, k, v, scale=s), {}, (0.1, 0.2)),
             (lambda q, k, v, s: flashattn.attention(q, k, v, softcap=s), dict(dynamic=True), (2.0, 3.0)),
             (lambda q, k, v, s: flashattn.attention(q, k, v, scale=1 / math.sqrt(q.shape[-1])), dict(dynamic=True), (0,))]
    for fn, options, values in cases:
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", **options)
        for value in values:
            torch.testing.assert_close(compiled(q, k, v, value), fn(q, k, v, value), rtol=0, atol=1e-12)
    with pytest.raises(Exception, match="scale must be finite"):  # still checked while tracing
        torch._dynamo.reset()
        torch.compile(cases[0][0], fullgraph=True, backend="aot_eager", dynamic=True)(q, k, v, float("inf"))


@pytest.mark.parametrize("path", ["reference", "kernels"])
def test_outputs_and_gradients_keep_the_fake_layout(path, monkeypatch):
    """Eager and compiled calls, and the operators' fake tensors, agree on the outputs' layout: q's
    own where its last dim is dense, contiguous otherwise, also for answers made without a kernel
    (no key) and for the reference (which computes contiguous tensors), so a ``.view`` that works
    in one works in the other and Inductor's stride asserts hold."""
    if path == "reference":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    elif HAS_CUDA:
        pytest.skip("interpreter variant")
    dtype = torch.float64 if path == "reference" else torch.float16
    cases = [(torch.randn(1, 9, 2, 16, dtype=dtype).transpose(1, 2), torch.randn(1, 2, 11, 16, dtype=dtype)),  # (B, N, H, D)
             (torch.randn(1, 5, 16, 2, dtype=dtype).permute(0, 3, 1, 2), torch.randn(1, 2, 0, 16, dtype=dtype)),  # D strided, M = 0
             (torch.randn(1, 5, 16, 2, dtype=dtype).permute(0, 3, 1, 2), torch.randn(1, 2, 7, 16, dtype=dtype))]
    for q, k in cases:
        q, k, v = q.requires_grad_(), k.clone().requires_grad_(), k.clone().requires_grad_()
        want = [dense_like(x).stride() for x in (q, k, v)]
        o = flashattn.attention(q, k, v, causal=True)
        grads = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
        assert o.stride() == want[0] and [g.stride() for g in grads] == want
        torch.library.opcheck(torch.ops.flashattn.attention_forward.default, (q, k, v, True, None))
        torch._dynamo.reset()
        compiled = torch.compile(lambda q, k, v: flashattn.attention(q, k, v, causal=True) + 1, fullgraph=True)
        torch.testing.assert_close(compiled(q, k, v), o + 1, rtol=0, atol=0)


def test_varlen_reference_backward_keeps_the_fake_layout(monkeypatch):
    """Packed q, k, v with a strided last-but-one dim ((total, H, D) views of (total, D, H) tensors):
    the reference backward's gradients come in the operator's promised (contiguous) layout, so the
    compiled backward and opcheck pass."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = (torch.randn(7, 16, 2, dtype=torch.float64).transpose(1, 2).requires_grad_() for _ in range(3))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    eager = torch.autograd.grad(flashattn.attention_varlen(q, k, v, cu, cu, 4, 4, causal=True).sum(), (q, k, v))
    torch._dynamo.reset()
    step = torch.compile(lambda q, k, v: flashattn.attention_varlen(q, k, v, cu, cu, 4, 4, causal=True).sum(),
                         fullgraph=True)
    for g, e in zip(torch.autograd.grad(step(q, k, v), (q, k, v)), eager):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)
    packing = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4)
    o, lse = torch.ops.flashattn.attention_forward(q, k, v, True, None, **packing)
    args = (torch.randn_like(o), q.detach(), k.detach(), v.detach(), o.detach(), lse.detach(), None, True, None)
    torch.library.opcheck(torch.ops.flashattn.attention_backward.default, args, packing)


def test_cpu_autocast_runs_float32_in_the_autocast_dtype_eager_and_compiled(monkeypatch):
    """Inside torch.autocast("cpu"), float32 inputs run in the autocast dtype and the output comes back
    in it, as with SDPA; eager and compiled calls agree (the reference's own float32 arithmetic is
    not autocast), for attention and attention_varlen; gradients reach the float32 leaves."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = (x.requires_grad_() for x in _qkv(1, 2, 2, 32, 32, 16, torch.float32, seed=6))
    fn = lambda q, k, v: flashattn.attention(q, k, v, causal=True)  # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = fn(q, k, v)
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert eager.dtype == compiled.dtype == sdpa.dtype == torch.bfloat16
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    want = flashattn.attention(*(x.detach().bfloat16().double() for x in (q, k, v)), causal=True)
    assert (eager.double() - want).abs().max() <= 2 ** -8 * want.abs().max()  # a bfloat16 rounding of the exact result
    grads = torch.autograd.grad(eager.float().sum(), (q, k, v))
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    packed = [x.detach()[0].transpose(0, 1) for x in (q, k, v)]  # (total = 32, H, D), one sequence
    cu = torch.tensor([0, 32], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = flashattn.attention_varlen(*packed, cu, cu, 32, 32, causal=True)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o.transpose(0, 1)[None], eager.detach(), rtol=0, atol=2 ** -7)


def test_flash_attn_func_dropout_with_a_seed_compiles(monkeypatch):
    """flash_attn_func takes the explicit dropout seed that torch.compile needs; compiled and eager
    calls with one seed agree bitwise, and equal attention's with that seed."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = (x.transpose(1, 2) for x in _qkv(1, 2, 2, 8, 8, 16, torch.float64, seed=8))
    fn = lambda q, k, v: flashattn.flash_attn_func(q, k, v, dropout_p=0.3, seed=7)  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
    want = flashattn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.3, seed=7)
    assert torch.equal(compiled, fn(q, k, v)) and torch.equal(compiled, want.transpose(1, 2))
    assert not torch.equal(fn(q, k, v), flashattn.flash_attn_func(q, k, v, dropout_p=0.3, seed=8))


def test_compiled_call_runs_the_kernels_under_the_interpreter():
    """float16 CPU tensors under TRITON_INTERPRET=1 reach the Triton kernels through the operator."""
    if HAS_CUDA:
        pytest.skip("interpreter variant")
    torch._dynamo.reset()
    q, k, v = _qkv(1, 2, 2, 19, 23, 16, torch.float16, seed=3)
    fn = torch.compile(lambda q, k, v: flashattn.attention(q, k, v, causal=True), fullgraph=True, backend="aot_eager")
    got = fn(q, k, v)
    o64, _ = naive_attention(q.double(), k.double(), v.double(), causal=True)
    o16, _ = naive_attention(q, k, v, causal=True)
    assert_close_ratio("o", got, o64, o16)


@pytest.mark.parametrize("heads_per_group", [1, 3])
@pytest.mark.parametrize("n_blocks", [1, 4, 7])
def test_one_dimensional_grid_covers_every_tile_once(n_blocks, heads_per_group):
    """The kernels' 1-D grid: program i takes schedule.launch_order(i, ...) and every (block, head)
    pair of n_blocks x B*H is taken exactly once, for any B*H (no 65 535 limit on axis 0)."""
    n_heads = 3 * 5 * heads_per_group
    seen = {schedule.launch_order(pid, n_blocks, heads_per_group) for pid in range(n_blocks * n_heads)}
    assert seen == {(r, h) for r in range(n_blocks) for h in range(n_heads)}


def test_many_heads_under_the_interpreter():
    """B * H = 600 programs per query block on the interpreter: every head lands where it belongs."""
    if HAS_CUDA:
        pytest.skip("interpreter variant; the GPU test runs B * H > 65 535")
    q, k, v = _qkv(30, 20, 10, 3, 5, 16, torch.float16, seed=5)
    got = flashattn.attention(q, k, v, causal=True)
    o64, _ = naive_attention(q.double(), k.double(), v.double(), causal=True)
    o16, _ = naive_attention(q, k, v, causal=True)
    assert_close_ratio("o", got, o64, o16)


# ----------------------------------------------------------------------------------------------------
# GPU


def _gpu_check(q, k, v, causal, do=None):
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = flashattn.attention(qg, kg, vg, causal=causal)
    do = torch.randn_like(o) if do is None else do
    o.backward(do)
    refs = []
    for dtype in (torch.float64, q.dtype):
        qr, kr, vr = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
        o_r, _ = naive_attention(qr, kr, vr, causal=causal)
        o_r.backward(do.to(dtype))
        refs.append((o_r, qr.grad, kr.grad, vr.grad))
    for name, got, want, low in zip(("o", "dq", "dk", "dv"), (o, qg.grad, kg.grad, vg.grad), *refs):
        assert_close_ratio(name, got, want.to(got.device), low.to(got.device))


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 384, 512, 64), (4, 16, 16, 1024, 1024, 128)], ids=["small", "gluon"])
def test_gpu_compile_with_inductor_and_cuda_graphs(mode, shape):
    """Compiled calls (CUDA graphs with reduce-overhead) give the eager call's bits. At the second shape
    (2^33 of causal work) an H100/H200 runs the Gluon causal forward, which allocates a tile counter
    per call: a counter kept past the call would stay in the graph trees' memory pool, whose
    recording then fails (tuning log, "A tile counter per stream, withdrawn")."""
    torch._dynamo.reset()
    q, k, v = _qkv(*shape, torch.bfloat16, device="cuda", seed=11)

    def step(q, k, v):
        return flashattn.attention(q, k, v, causal=True)

    compiled = torch.compile(step, fullgraph=True, mode=mode)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    for _ in range(3):  # CUDA graphs record on a later call; every call must stay right
        o = compiled(qg, kg, vg)
        grads = torch.autograd.grad(o, (qg, kg, vg), torch.ones_like(o))
    o_e = step(qg, kg, vg)
    grads_e = torch.autograd.grad(o_e, (qg, kg, vg), torch.ones_like(o_e))
    assert torch.equal(o, o_e)
    for g, e in zip(grads, grads_e):
        assert torch.equal(g, e)


@gpu
@needs_cuda
def test_gpu_compile_dynamic_lengths():
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: flashattn.attention(q, k, v, causal=True), fullgraph=True, dynamic=True)
    for n in (200, 333, 1000):
        q, k, v = _qkv(1, 4, 4, n, n + 17, 128, torch.float16, device="cuda", seed=n)
        assert torch.equal(compiled(q, k, v), flashattn.attention(q, k, v, causal=True))


@gpu
@needs_cuda
def test_gpu_autocast_runs_float32_in_the_autocast_dtype():
    q, k, v = _qkv(2, 4, 2, 100, 130, 64, torch.float32, device="cuda", seed=2)
    for dtype in (torch.float16, torch.bfloat16):
        with torch.autocast("cuda", dtype=dtype):
            o = flashattn.attention(q, k, v, causal=True)
            ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                                                   v.repeat_interleave(2, 1))
        assert o.dtype == dtype == ref.dtype
        assert torch.equal(o, flashattn.attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True))
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        flashattn.attention(q, k, v)


@gpu
@needs_cuda
def test_gpu_many_heads_past_the_grid_axis_limit():
    """B * H = 70 000 (issue: grid axes 1 and 2 stop at 65 535), forward and backward."""
    q, k, v = _qkv(700, 100, 100, 64, 64, 32, torch.float16, device="cuda", seed=4)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    o = flashattn.attention(qg, kg, vg, causal=True)
    o.sum().backward()
    for sl in (slice(0, 1), slice(699, 700), slice(350, 351)):  # spot-check batches across the grid
        q1, k1, v1 = q[sl].double(), k[sl].double(), v[sl].double()
        o64, _ = naive_attention(q1, k1, v1, causal=True)
        o16, _ = naive_attention(q[sl], k[sl], v[sl], causal=True)
        assert_close_ratio("o", o[sl], o64, o16)
    assert torch.isfinite(qg.grad).all() and torch.isfinite(kg.grad).all() and torch.isfinite(vg.grad).all()


@gpu
@needs_cuda
def test_gpu_more_than_two_to_the_31_elements():
    """A (B, N, H, D) view with 2^31 + elements: offsets past int32 in every load and store."""
    b, n, h, d = 1, 2 ** 17 + 5, 128, 128  # 2.15e9 elements per tensor, in flash_attn's layout
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    assert q.numel() > 2 ** 31
    k = q[:, :1]  # one K/V head (MQA) keeps the memory in bounds
    v = torch.randn(b, 1, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    with torch.no_grad():
        o = flashattn.attention(q, k, v, causal=True)
    # the last heads and the last rows, where the offsets are largest, against float64
    rows = slice(n - 300, n)
    qs = q[:, -2:, rows].double()
    s = (qs @ k.double().transpose(-1, -2)) * d ** -0.5  # rows near the end see (almost) every key
    vis = schedule.visible(torch.arange(n - 300, n, device="cuda")[:, None], torch.arange(n, device="cuda")[None, :],
                           n, n, True)
    s = s.masked_fill(~vis, float("-inf"))
    want = torch.softmax(s, -1) @ v.double()
    err = (o[:, -2:, rows].double() - want).abs().max().item()
    assert err < 2e-2, err


@gpu
@needs_two_gpus
def test_gpu_tensors_on_a_non_current_device():
    torch.cuda.set_device(0)
    q, k, v = _qkv(2, 4, 2, 257, 300, 64, torch.float16, device="cuda:1", seed=8)
    _gpu_check(q, k, v, causal=True)
    assert torch.cuda.current_device() == 0


@gpu
@needs_two_gpus
def test_gpu_two_threads_on_two_devices():
    errors = []

    def work(index):
        try:
            for seed in range(3):
                q, k, v = _qkv(2, 4, 4, 300, 300, 128, torch.bfloat16, device=f"cuda:{index}", seed=seed)
                _gpu_check(q, k, v, causal=bool(seed % 2))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors


def _every_entry_point(device):
    """Forward and backward of each entry point on ``device``, at shapes that reach each kernel family
    (portable, the Gluon forward and backward at D = 128 and 256, variants, packed, decoding)."""
    out = {}
    shapes = {"portable": (2, 4, 2, 257, 300, 64), "gluon_d128": (4, 16, 16, 1024, 1024, 128),
              "gluon_d256": (2, 16, 16, 1024, 1024, 256)}
    for name, shape in shapes.items():
        for causal in (False, True):
            q, k, v = (x.requires_grad_() for x in _qkv(*shape, torch.bfloat16, device=device, seed=21))
            o, lse = flashattn.attention(q, k, v, causal=causal, return_lse=True)
            o.backward(torch.ones_like(o))
            out[name, causal] = (o, lse, q.grad, k.grad, v.grad)
    q, k, v = (x.requires_grad_() for x in _qkv(2, 4, 2, 200, 333, 80, torch.float16, device=device, seed=22))
    o = flashattn.attention(q, k, v, causal=True, window=(64, 8), softcap=20.0, dropout_p=0.1, seed=5,
                            alibi_slopes=torch.full((4,), 0.25, device=device))
    o.backward(torch.ones_like(o))
    out["variants"] = (o, q.grad, k.grad, v.grad)
    q, k, v = _qkv(1, 4, 2, 300, 300, 64, torch.float16, device=device, seed=23, layout="bnhd")
    qv, kv, vv = (x[0].transpose(0, 1).detach().requires_grad_() for x in (q, k, v))  # (300, H, D): 100 + 200
    cu = torch.tensor([0, 100, 300], dtype=torch.int32, device=device)
    o = flashattn.attention_varlen(qv, kv, vv, cu, cu, 200, 200, causal=True)
    o.backward(torch.ones_like(o))
    out["varlen"] = (o, qv.grad, kv.grad, vv.grad)
    q, k_cache, v_cache = (x.transpose(1, 2) for x in _qkv(3, 8, 2, 1, 4096, 128, torch.bfloat16, device=device,
                                                            seed=24, layout="bnhd"))  # (B, N, H, D)
    lengths = torch.tensor([1, 2000, 4096], dtype=torch.int32, device=device)
    out["decode"] = flashattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, return_lse=True)
    return out


@gpu
@needs_two_gpus
def test_gpu_every_entry_point_on_a_non_current_device_gives_the_current_devices_bits():
    """The same GPU model, the same kernels: a call on cuda:1 while cuda:0 is current returns what the
    call on cuda:0 returns, bit for bit, on every kernel family (a launch or scratch buffer on the
    wrong device would fail or differ), and leaves the current device alone."""
    torch.cuda.set_device(0)
    if torch.cuda.get_device_name(0) != torch.cuda.get_device_name(1):
        pytest.skip("two different GPU models")
    on_0, on_1 = _every_entry_point("cuda:0"), _every_entry_point("cuda:1")
    assert torch.cuda.current_device() == 0
    for key, tensors in on_0.items():
        for i, (a, b) in enumerate(zip(tensors, on_1[key])):
            assert b.device == torch.device("cuda:1"), (key, i)
            assert torch.isfinite(b).any() and torch.equal(a.cpu(), b.cpu()), (key, i)


@gpu
@needs_two_gpus
def test_gpu_mixed_devices_raise():
    q, k, v = _qkv(1, 2, 2, 16, 16, 64, torch.float16, device="cuda:0")
    with pytest.raises(ValueError, match="one device"):
        flashattn.attention(q, k.to("cuda:1"), v)


@pytest.mark.parametrize("causal", [False, True])
def test_lse_gradient_reaches_the_kernels(causal):
    """return_lse is differentiable in the kernels too: dLSE folds into D (dS = P * (dP - D + dLSE)).
    Ragged N > M so that causal rows with no key (LSE -inf, zero gradient) occur."""
    dtype = torch.float16
    device = "cuda" if HAS_CUDA else "cpu"
    n, m = (700, 500) if HAS_CUDA else (37, 21)
    q, k, v = _qkv(2, 4, 2, n, m, 40, dtype, device=device, seed=13)
    gen = torch.Generator(device=device).manual_seed(14)
    do = torch.randn(q.shape, dtype=dtype, device=device, generator=gen)
    dlse = torch.randn(q.shape[:-1], dtype=torch.float32, device=device, generator=gen)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    o, lse = flashattn.attention(qg, kg, vg, causal=causal, return_lse=True)
    got = torch.autograd.grad((o, lse), (qg, kg, vg), (do, dlse))
    refs = []
    for ref_dtype in (torch.float64, dtype):
        qr, kr, vr = (x.detach().to(ref_dtype).requires_grad_() for x in (q, k, v))
        o_r, lse_r = naive_attention(qr, kr, vr, causal=causal)
        refs.append(torch.autograd.grad((o_r, lse_r), (qr, kr, vr), (do.to(ref_dtype), dlse.to(lse_r.dtype))))
    for name, g, want, low in zip(("dq", "dk", "dv"), got, *refs):
        assert_close_ratio(name, g, want, low)
    # and the LSE's share is really there: without it dQ changes
    qg2 = q.clone().requires_grad_()
    o2 = flashattn.attention(qg2, kg.detach(), vg.detach(), causal=causal)
    dq_o_only = torch.autograd.grad(o2, qg2, do)[0]
    assert (dq_o_only.double() - got[0].double()).abs().max() > 1e-2


def test_tuning_reaches_a_backward_on_another_thread(monkeypatch):
    """The autograd engine runs a CUDA backward on its own thread: the forward's tuning goes along."""
    from flashattn import _config, autograd

    seen = []
    real = autograd.backend

    def spy(use_kernels):
        forward, backward = real(use_kernels)

        def wrapped(*args):
            seen.append(_config.current_tuning().overlap_dq)
            return backward(*args)

        return forward, wrapped

    monkeypatch.setattr(autograd, "backend", spy)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = (x.requires_grad_() for x in _qkv(1, 2, 2, 5, 7, 16, torch.float64))
    with _config.tuning(overlap_dq=False):
        o = flashattn.attention(q, k, v)
    grads = []
    worker = threading.Thread(target=lambda: grads.append(torch.autograd.grad(o.sum(), (q, k, v))))
    worker.start()
    worker.join(timeout=60)
    assert grads and seen == [False]
