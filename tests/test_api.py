"""The public API: the input contract, the CPU path through autograd, and the flash_attn-style entry."""

import math
import subprocess
import sys

import pytest
import torch

import flashattn
from flashattn.reference import naive_attention
from flashattn.testing import random_qkv


def qkv(n=8, m=8, d=16, h_q=4, h_kv=2, dtype=torch.float32):
    return random_qkv(1, h_q, h_kv, n, m, d, dtype=dtype, generator=torch.Generator().manual_seed(0))


q0, k0, v0 = qkv()

BAD_INPUTS = [
    # (description, call, exception type, words the message must contain)
    ("q not a tensor", lambda: flashattn.attention(q0.numpy(), k0, v0), TypeError, ["q", "torch.Tensor"]),
    ("k not a tensor", lambda: flashattn.attention(q0, [1.0], v0), TypeError, ["k", "torch.Tensor"]),
    ("q rank 3", lambda: flashattn.attention(q0[0], k0, v0), ValueError, ["q", "4-D"]),
    ("v rank 5", lambda: flashattn.attention(q0, k0, v0[None]), ValueError, ["v", "4-D"]),
    ("integer dtype", lambda: flashattn.attention(*(x.long() for x in (q0, k0, v0))), TypeError, ["q", "floating"]),
    ("dtype mismatch", lambda: flashattn.attention(q0, k0.double(), v0), TypeError, ["dtype", "k"]),
    ("k/v shape mismatch", lambda: flashattn.attention(q0, k0, v0[:, :, :5]), ValueError, ["k", "v", "shape"]),
    ("batch mismatch", lambda: flashattn.attention(q0, torch.cat([k0, k0]), torch.cat([v0, v0])), ValueError, ["batch"]),
    ("head dim mismatch", lambda: flashattn.attention(q0, k0[..., :8], v0[..., :8]), ValueError, ["head dim", "D"]),
    ("heads not a multiple", lambda: flashattn.attention(*qkv(h_q=4, h_kv=3)), ValueError, ["heads", "multiple"]),
    ("query heads, no key/value head", lambda: flashattn.attention(*qkv(h_q=4, h_kv=0)), ValueError, ["heads", "multiple"]),
    ("head dim too small", lambda: flashattn.attention(*qkv(d=8)), ValueError, ["head dim", "16"]),
    ("head dim too large", lambda: flashattn.attention(*qkv(d=264)), ValueError, ["head dim", "256"]),
    ("NaN scale", lambda: flashattn.attention(q0, k0, v0, scale=float("nan")), ValueError, ["scale"]),
    ("negative scale", lambda: flashattn.attention(q0, k0, v0, scale=-0.5), ValueError, ["scale", "non-negative"]),
    ("infinite scale", lambda: flashattn.attention(q0, k0, v0, scale=float("inf")), ValueError, ["scale", "finite"]),
    ("scale a string", lambda: flashattn.attention(q0, k0, v0, scale="0.1"), TypeError, ["scale"]),
    ("scale a tensor", lambda: flashattn.attention(q0, k0, v0, scale=torch.tensor(0.1)), TypeError, ["scale"]),
    ("causal not bool", lambda: flashattn.attention(q0, k0, v0, causal=1), TypeError, ["causal", "bool"]),
    ("deterministic not bool", lambda: flashattn.attention(q0, k0, v0, deterministic=0), TypeError,
     ["deterministic", "bool"]),
    ("flash: deterministic not bool", lambda: flashattn.flash_attn_func(q0, k0, v0, deterministic="no"), TypeError,
     ["deterministic", "bool"]),
    ("return_lse not bool", lambda: flashattn.attention(q0, k0, v0, return_lse="yes"), TypeError, ["return_lse"]),
    ("complex dtype", lambda: flashattn.attention(*(x.to(torch.complex64) for x in (q0, k0, v0))), TypeError, ["floating"]),
    ("meta device", lambda: flashattn.attention(*(x.to("meta") for x in (q0, k0, v0))), ValueError, ["device"]),
    ("device mismatch", lambda: flashattn.attention(q0, k0.to("meta"), v0), ValueError, ["device", "k"]),
    ("flash: dropout", lambda: flashattn.flash_attn_func(q0, k0, v0, dropout_p=1.0), ValueError, ["dropout_p"]),
    ("flash: window", lambda: flashattn.flash_attn_func(q0, k0, v0, window_size=4), TypeError, ["window_size"]),
    ("flash: alibi", lambda: flashattn.flash_attn_func(q0, k0, v0, alibi_slopes=torch.ones(3)), ValueError, ["alibi_slopes"]),
    ("flash: softcap", lambda: flashattn.flash_attn_func(q0, k0, v0, softcap=-1.0), ValueError, ["softcap"]),
    ("flash: rank", lambda: flashattn.flash_attn_func(q0[0], k0, v0), ValueError, ["q", "(B, N, H, D)"]),
    # shapes printed as the caller passed them, (B, N, H, D), not as attention sees them
    ("flash: k/v shapes", lambda: flashattn.flash_attn_func(torch.zeros(1, 20, 4, 16), torch.zeros(1, 25, 2, 16),
                                                            torch.zeros(1, 26, 2, 16)),
     ValueError, ["k", "v", "(1, 25, 2, 16)", "(1, 26, 2, 16)", "(B, M, Hkv, D)"]),
]


@pytest.mark.parametrize("call,exc,words", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_a_clear_error(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for word in words:
        assert word in str(info.value), f"message {str(info.value)!r} does not name {word!r}"


ALIASES = [
    # (a valid keyword value, an invalid one that compares and hashes equal to it)
    ("causal", True, 1),
    ("causal", False, 0),
    ("return_lse", False, 0),
    ("scale", 1.0, True),
    ("softcap", 1.0, True),
    ("dropout_p", 0.0, False),
    ("window", (1, 2), (True, 2)),
    ("window", (0, None), (False, None)),
    ("deterministic", False, 0),
]


@pytest.mark.parametrize("name,valid,alias", ALIASES, ids=[f"{n}={a!r}" for n, _, a in ALIASES])
def test_a_valid_call_does_not_let_an_equal_invalid_value_through(name, valid, alias):
    """A call with the signature of an earlier valid one reuses its checks (flashattn.api._described):
    values that are equal to a valid one but of another type must still be refused."""
    flashattn.attention(q0, k0, v0, **{name: valid})
    flashattn.attention(q0, k0, v0, **{name: valid})
    with pytest.raises(TypeError, match=name.split("_")[0]):
        flashattn.attention(q0, k0, v0, **{name: alias})


def test_bad_inputs_raise_after_valid_calls_of_their_shapes():
    """Every contract error still fires after valid calls that warmed the checks' cache."""
    for _, call, exc, _ in BAD_INPUTS:
        flashattn.attention(q0, k0, v0)
        flashattn.attention(q0, k0, v0, causal=True, scale=0.5)
        with pytest.raises(exc):
            call()


def test_repeated_calls_reuse_one_description():
    from flashattn import api
    from flashattn.problem import Problem

    api._DESCRIBED.clear()
    flashattn.attention(q0, k0, v0, causal=True, window=(3, 0), softcap=2.0)
    flashattn.attention(q0, k0, v0, causal=True, window=(3, 0), softcap=2.0)
    assert list(api._DESCRIBED.values()) == [Problem.of(q0, k0, True, None, window=(3, 0), softcap=2.0)]
    flashattn.attention(q0, k0, v0, causal=True, window=[3, 0], softcap=2.0)  # a list: checked, not cached
    assert len(api._DESCRIBED) == 1


def test_a_negative_zero_scale_is_the_zero_scale():
    """scale=-0.0 and scale=0.0 hash alike, so a call of one may reuse the other's cached description:
    both describe +0.0, and the results (zero gradients' signs included) do not depend on which came first."""
    import math

    from flashattn import api
    from flashattn.problem import Problem

    assert math.copysign(1.0, Problem.of(q0, k0, False, -0.0).scale) == 1.0
    api._DESCRIBED.clear()
    runs = []
    for order in ((0.0, -0.0), (-0.0, 0.0)):
        api._DESCRIBED.clear()
        for scale in order:
            q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
            o = flashattn.attention(q, k, v, scale=scale)
            runs.append((scale, [t.view(torch.int32) for t in (o, *torch.autograd.grad(o.sum(), (q, k)))]))
    by_scale = {}
    for scale, bits in runs:
        by_scale.setdefault(math.copysign(1.0, scale), []).append(bits)
    for same in by_scale.values():
        assert all(torch.equal(a, b) for a, b in zip(*same))


def test_import_is_cheap():
    """Importing flashattn imports no triton (no GPU query, no compilation)."""
    code = "import sys, flashattn; assert 'triton' not in sys.modules, 'triton imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_path_gradients_match_float64_autograd(causal, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = random_qkv(2, 6, 2, 29, 41, 24, generator=torch.Generator().manual_seed(1), requires_grad=True,
                         layout="bnhd")
    o, lse = flashattn.attention(q, k, v, causal=causal, scale=0.2, return_lse=True)
    do = torch.randn_like(o)
    dlse = torch.randn_like(lse)
    o_ref, lse_ref = naive_attention(q, k, v, causal, 0.2)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse, lse_ref, rtol=0, atol=1e-10)
    # through O alone, through the LSE alone, and through both: the LSE's gradient joins D
    for outputs, outputs_ref, seeds in (((o,), (o_ref,), (do,)), ((lse,), (lse_ref,), (dlse,)),
                                        ((o, lse), (o_ref, lse_ref), (do, dlse))):
        grads = torch.autograd.grad(outputs, (q, k, v), seeds, retain_graph=True, materialize_grads=True)
        grads_ref = torch.autograd.grad(outputs_ref, (q, k, v), seeds, retain_graph=True, materialize_grads=True)
        for g, g_ref in zip(grads[:2], grads_ref[:2]):
            assert g_ref.abs().max() > 1e-3  # a gradient that is really there
            torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-10)
        torch.testing.assert_close(grads[2], grads_ref[2], rtol=0, atol=1e-10)  # dV = 0 through the LSE


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=["kernels", "reference"])
@pytest.mark.parametrize("q_shape, kv_shape", [
    ((0, 4, 6, 16), (0, 2, 9, 16)),  # no batch
    ((2, 0, 6, 16), (2, 2, 9, 16)),  # no query head
    ((2, 0, 6, 16), (2, 0, 9, 16)),  # no head at all
    ((2, 4, 0, 16), (2, 2, 9, 16)),  # no query
    ((2, 4, 6, 16), (2, 2, 0, 16)),  # no key: every query sees none
])
def test_empty_inputs_give_empty_or_zero_results(dtype, q_shape, kv_shape):
    """No batch, head or query gives empty outputs, and no key gives what a query that sees no key
    gets (output 0, LSE -inf, zero gradients), as SDPA does, through autograd, without autograd, and
    from flash_attn_func; float16 runs the kernels' entry (on DEVICE), float64 the reference's."""
    from devices import DEVICE

    device = DEVICE if dtype == torch.float16 else "cpu"
    q = torch.randn(q_shape, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(kv_shape, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    for causal in (False, True):
        o, lse = flashattn.attention(q, k, v, causal=causal, return_lse=True)
        assert o.shape == q.shape and lse.shape == q_shape[:3] and not o.any()
        assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert bool((lse == -torch.inf).all())  # vacuous unless there is a row (no key)
        do, dlse = torch.randn_like(o), torch.randn_like(lse)
        grads = torch.autograd.grad((o, lse), (q, k, v), (do, dlse))
        assert all(g.shape == x.shape and not g.any() for g, x in zip(grads, (q, k, v)))
        with torch.no_grad():
            assert torch.equal(flashattn.attention(q, k, v, causal=causal), o)
    if q_shape[2] and kv_shape[2] == 0:  # SDPA's own answer without a key: zeros
        want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
        assert torch.equal(want, torch.zeros_like(want))
    out = flashattn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert out.shape == q.transpose(1, 2).shape and not out.any()


@pytest.mark.parametrize("entry", ["attention", "varlen"])
def test_kernel_gradients_refuse_a_second_backward(entry):
    """With create_graph=True the kernels' backward (float16 on DEVICE: the GPU, or the interpreter)
    gives bitwise the gradients of a plain backward, and a second backward through them raises, whether
    the first backward's incoming gradient depends on the inputs (a loss of o^2) or not (a loss of o),
    instead of treating them as constants and dropping their terms."""
    from devices import DEVICE

    q, k, v = (x.to(DEVICE, torch.float16).requires_grad_() for x in qkv(n=12, m=20, d=16))
    if entry == "attention":
        run = lambda: flashattn.attention(q, k, v, causal=True)  # noqa: E731
    else:  # two packed sequences of 5 and 7 queries, 9 and 11 keys, one head group
        cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=DEVICE) for c in ([0, 5, 12], [0, 9, 20]))
        q, k, v = (x[0].transpose(0, 1).detach().requires_grad_() for x in (q, k, v))  # (L, H, D)
        run = lambda: flashattn.attention_varlen(q, k, v, cu_q, cu_k, 7, 11, causal=True)  # noqa: E731
    for loss in (lambda o: (o.float() ** 2).sum(), lambda o: o.float().sum()):
        plain = torch.autograd.grad(loss(run()), (q, k, v))
        graphed = torch.autograd.grad(loss(run()), (q, k, v), create_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(plain, graphed))
        penalty = sum((g.float() ** 2).sum() for g in graphed) + (q.float() ** 2).sum()
        with pytest.raises(RuntimeError, match="not differentiable"):  # by backward, as a training step does
            penalty.backward(retain_graph=True)
        for kw in ({}, {"allow_unused": True}):  # by autograd.grad with the inputs named
            with pytest.raises(RuntimeError, match="not differentiable"):
                torch.autograd.grad(penalty, (q,), retain_graph=True, **kw)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_path_differentiates_twice(causal, monkeypatch):
    """float64 CPU inputs run the PyTorch reference, whose backward is differentiable: second
    derivatives match finite differences (gradgradcheck)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = random_qkv(1, 2, 1, 5, 7, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda a, b, c: flashattn.attention(a, b, c, causal=causal), (q, k, v))


def test_default_scale_is_inverse_sqrt_d():
    q, k, v = qkv(d=40, dtype=torch.float64)
    torch.testing.assert_close(flashattn.attention(q, k, v), flashattn.attention(q, k, v, scale=1 / math.sqrt(40)))


def test_matches_sdpa_is_causal_when_n_equals_m():
    q, k, v = qkv(n=33, m=33, h_q=2, h_kv=2, dtype=torch.float64)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(flashattn.attention(q, k, v, causal=True), want, rtol=0, atol=1e-12)


def test_flash_attn_func_matches_attention():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 21, 4, 16, dtype=torch.float64, generator=gen)  # (B, N, H, D)
    k = torch.randn(2, 30, 2, 16, dtype=torch.float64, generator=gen)
    v = torch.randn(2, 30, 2, 16, dtype=torch.float64, generator=gen)
    out, lse, probs = flashattn.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, return_attn_probs=True)
    want, want_lse = flashattn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                         scale=0.3, return_lse=True)
    assert out.shape == q.shape and probs is None
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_cpu_path_keeps_dtype(dtype, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = qkv(n=20, m=24, dtype=dtype)
    o, lse = flashattn.attention(q, k, v, causal=True, return_lse=True)
    assert o.dtype == dtype and lse.dtype == torch.float32
    o_ref = naive_attention(q.double(), k.double(), v.double(), True)[0]
    assert (o.double() - o_ref).abs().max() < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["reference", "fp16"])
def test_calls_without_gradient_skip_autograd_and_match(dtype, monkeypatch):
    """A call no gradient can flow through (torch.no_grad, inference_mode, inputs that do not require
    grad) runs the forward without autograd.Function and gives bitwise what a training call gives;
    a training call still records the backward. float16 on the CPU is the kernels' path under
    TRITON_INTERPRET=1 and the reference's otherwise."""
    q, k, v = (x.to(dtype) for x in qkv(n=24, m=40, d=16))
    kw = dict(causal=True, return_lse=True, window=(16, None), softcap=5.0, dropout_p=0.25, seed=11)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    o_train, lse_train = flashattn.attention(qg, kg, vg, **kw)
    assert o_train.grad_fn is not None and "AttentionFunction" in type(o_train.grad_fn).__name__

    def no_apply(*args):
        raise AssertionError("a call without gradient went through autograd.Function.apply")

    from flashattn.autograd import AttentionFunction
    monkeypatch.setattr(AttentionFunction, "apply", no_apply)
    with torch.no_grad():
        o_ng, lse_ng = flashattn.attention(qg, kg, vg, **kw)
    with torch.inference_mode():
        o_inf, lse_inf = flashattn.attention(q, k, v, **kw)
    o_plain, lse_plain = flashattn.attention(q, k, v, **kw)
    for o, lse in ((o_ng, lse_ng), (o_inf, lse_inf), (o_plain, lse_plain)):
        assert o.grad_fn is None and not o.requires_grad
        assert torch.equal(o, o_train.detach()) and torch.equal(lse, lse_train.detach())


def test_deterministic_reaches_the_problem_and_changes_no_bit_where_no_atomic_kernel_runs(monkeypatch):
    """attention's and flash_attn_func's ``deterministic`` end up in the call's Problem (default True;
    flash_attn's own default is False, this one's True), and where no atomic kernel runs (here: the
    kernels on DEVICE, the Hopper dK/dV kernel not among them off sm_90) False gives the default's bits."""
    from devices import DEVICE
    from flashattn import autograd

    seen = []
    real = autograd.attend
    monkeypatch.setattr(flashattn.api, "attend", lambda q, k, v, problem, *a: seen.append(problem) or real(q, k, v, problem, *a))
    q, k, v = (x.to(DEVICE, torch.float16).requires_grad_() for x in qkv(n=40, m=56, d=16, h_q=4, h_kv=2))
    do = torch.randn_like(q)
    grads = {}
    for deterministic in (True, False):
        o = flashattn.attention(q, k, v, causal=True, deterministic=deterministic)
        grads[deterministic] = torch.autograd.grad(o, (q, k, v), do)
    assert [p.deterministic for p in seen] == [True, False]
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
    seen.clear()
    for kw in ({}, {"deterministic": False}, {"deterministic": True}):
        flashattn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw)
    assert [p.deterministic for p in seen] == [True, False, True]


def test_drop_in_window_alibi_and_generator_reach_the_kernels():
    """flash_attn_func's window_size=(0, 0) lets each query see its own key only (out == v at N = M);
    its dropout follows the generator passed; ALiBi slopes given as a non-contiguous (B, Hq) view
    give the contiguous slopes' result (float16 on DEVICE: the kernels)."""
    from devices import DEVICE

    q, k, v = (x.to(DEVICE, torch.float16).transpose(1, 2) for x in qkv(n=10, m=10, d=16, h_q=2, h_kv=2))
    out = flashattn.flash_attn_func(q, k, v, window_size=(0, 0))
    torch.testing.assert_close(out, v, rtol=0, atol=1e-3)
    runs = [flashattn.flash_attn_func(q, k, v, dropout_p=0.5, generator=torch.Generator(DEVICE).manual_seed(s))
            for s in (1, 1, 2)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    slopes = (torch.rand(1, 4, dtype=torch.float32, device=DEVICE) * 4)[:, ::2]  # (B, Hq), every other slope
    assert not slopes.is_contiguous()
    a = flashattn.flash_attn_func(q, k, v, alibi_slopes=slopes)
    b = flashattn.flash_attn_func(q, k, v, alibi_slopes=slopes.contiguous())
    assert torch.equal(a, b)


def test_a_cached_description_does_not_let_other_dtypes_through():
    """After a valid call, the same shapes with q or the ALiBi slopes in another dtype still raise."""
    slopes = torch.ones(4)
    flashattn.attention(q0, k0, v0, alibi_slopes=slopes)
    with pytest.raises(TypeError):
        flashattn.attention(q0.double(), k0, v0, alibi_slopes=slopes)
    with pytest.raises((TypeError, ValueError)):
        flashattn.attention(q0, k0, v0, alibi_slopes=slopes.double())


def test_head_dims_at_both_ends_of_the_range_run():
    """D = 16 and D = 256, the ends of the accepted range, run (the reference path here)."""
    for d in (16, 256):
        q, k, v = qkv(d=d)
        o = flashattn.attention(q, k, v, causal=True)
        torch.testing.assert_close(o.double(), naive_attention(q.double(), k.double(), v.double(), True)[0],
                                   rtol=1e-5, atol=1e-5)


def test_a_call_without_dropout_draws_nothing_from_the_global_generator():
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    flashattn.attention(q0, k0, v0)
    flashattn.flash_attn_func(q0.transpose(1, 2), k0.transpose(1, 2), v0.transpose(1, 2), dropout_p=0.0)
    assert torch.equal(torch.rand(3), want)


def test_the_description_cache_is_bounded(monkeypatch):
    """Descriptions are kept per call signature; a loop over ever new shapes starts the cache over
    instead of growing it without bound."""
    from flashattn import _memo, api

    monkeypatch.setattr(_memo, "LIMIT", 50)
    api._DESCRIBED.clear()
    for b in range(1, 120):
        q = torch.empty(b, 1, 1, 16)
        api._described(q, q, q, False, None, False, None, 0.0, None, 0.0)
    assert 0 < len(api._DESCRIBED) <= 50


def test_remember_starts_a_full_table_over(monkeypatch):
    from flashattn import _memo

    monkeypatch.setattr(_memo, "LIMIT", 3)
    table = {}
    assert [_memo.remember(table, i, -i) for i in range(3)] == [0, -1, -2]
    assert table == {0: 0, 1: -1, 2: -2}
    _memo.remember(table, 1, 5)  # full: starts over, then stores
    assert table == {1: 5}


def test_every_memo_table_fills_through_remember():
    """The package's per-call tables (descriptions, plans, Gluon choices, tuned configs, recipes,
    compiled kernels) take entries only through ``remember``, so each is bounded: no line of the
    package stores into one directly."""
    import pathlib
    import re

    tables = ("_DESCRIBED", "_PROBLEMS", "_PLANS", "_GLUON", "_TUNED", "_RECIPES", "_COMPILED")
    package = pathlib.Path(flashattn.__file__).parent
    stores = re.compile(r"\b(%s)\[[^\]]*\]\s*=(?!=)|\b(%s)\.(setdefault|update)\(" % ("|".join(tables), "|".join(tables)))
    found = {name: 0 for name in tables}
    for path in package.glob("*.py"):
        text = path.read_text()
        assert not stores.search(text), f"{path.name}: {stores.search(text).group(0)}"
        for name in tables:
            found[name] += len(re.findall(r"remember\(%s," % name, text))
    assert all(found.values()), found


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["reference", "kernels"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_dropout_under_checkpoint(reentrant, dtype):
    """torch.utils.checkpoint recomputes the forward in the backward: with seed= or torch's default
    generators (whose states checkpoint restores) the recomputation draws the same mask and the gradients
    equal the plain run's bitwise; with a generator of the caller's own, which checkpoint cannot
    restore, the recomputation raises instead of pairing another mask with the first call's output
    (float16 on DEVICE: the kernels)."""
    from torch.utils.checkpoint import checkpoint

    from devices import DEVICE

    device = DEVICE if dtype == torch.float16 else "cpu"
    q0, k0, v0 = (x.to(device, dtype) for x in qkv(n=12, m=12, d=16))
    w = torch.randn_like(q0)

    def grads(ckpt, **dropout):
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        generator = dropout.pop("generator", None)
        if generator is not None:
            generator.manual_seed(5)
        torch.manual_seed(3)

        def block(q, k, v):
            return flashattn.attention(q, k, v, causal=True, dropout_p=0.3, generator=generator, **dropout)

        o = checkpoint(block, q, k, v, use_reentrant=reentrant) if ckpt else block(q, k, v)
        (o * w).sum().backward()
        return [x.grad for x in (q, k, v)]

    defaults = [dict(seed=11), {}, dict(generator=torch.default_generator)]
    if device == "cuda":
        defaults.append(dict(generator=torch.cuda.default_generators[torch.cuda.current_device()]))
    for dropout in defaults:
        plain, checkpointed = grads(False, **dict(dropout)), grads(True, **dict(dropout))
        assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed)), dropout
    assert grads(False, generator=torch.Generator(device))  # outside checkpoint a generator of one's own is fine
    with pytest.raises(RuntimeError, match="checkpoint"):
        grads(True, generator=torch.Generator(device))
