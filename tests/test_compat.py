"""The ``flash_attn``-style entry points (flashattn/compat.py): each is a conversion onto the core entry
points, so each must give bitwise what the call it converts to gives, take flash_attn's spellings
(window sides as 0-d integer tensors, packed qkv / kv, ``cache_seqlens=None``) and refuse what
flashattn does not implement with ``NotImplementedError``.
"""

from __future__ import annotations

import pytest
import torch

import flashattn
from devices import DEVICE

DTYPE = torch.float16  # the kernels (GPU, or CPU under the interpreter)


def _randn(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, DTYPE)


def _grads(out, inputs, seed=9):
    return torch.autograd.grad(out, inputs, _randn(*out.shape, seed=seed))


@pytest.mark.parametrize("window, causal", [((3, 0), True), ((-1, 2), False)])
def test_window_sides_as_0d_integer_tensors_equal_ints(window, causal):
    q, k, v = (_randn(1, 37, 2, 16, seed=s) for s in range(3))
    as_ints = flashattn.flash_attn_func(q, k, v, causal=causal, window_size=window)
    as_tensors = flashattn.flash_attn_func(q, k, v, causal=causal, window_size=tuple(torch.tensor(w) for w in window))
    assert torch.equal(as_ints, as_tensors)
    as_one_tensor = flashattn.flash_attn_func(q, k, v, causal=causal, window_size=torch.tensor(window))  # upstream's tests
    assert torch.equal(as_ints, as_one_tensor)
    full = flashattn.flash_attn_func(q, k, v, causal=causal)
    assert not torch.equal(as_ints, full)  # the window hides keys here: the comparison can fail


@pytest.mark.parametrize("bad", [(torch.tensor(2.0), 0), (torch.tensor([2]), 0), (torch.tensor(True), 0), (1.5, 0),
                                 torch.tensor([2.0, 0.0]), torch.tensor([1, 2, 3])])
def test_window_sides_that_are_not_integers_are_refused(bad):
    q = _randn(1, 8, 2, 16)
    with pytest.raises(TypeError, match="window_size"):
        flashattn.flash_attn_func(q, q, q, window_size=bad)


def test_qkv_and_kv_packed_forms_are_flash_attn_func_on_their_slices():
    qkv = _randn(2, 23, 3, 4, 16).requires_grad_()
    out = flashattn.flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = (x.detach().clone().requires_grad_() for x in qkv.unbind(2))
    ref = flashattn.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, ref)
    (g_packed,) = _grads(out, (qkv,))
    assert torch.equal(g_packed, torch.stack(_grads(ref, (q, k, v)), dim=2))

    q = _randn(2, 5, 4, 16, seed=4)
    kv = _randn(2, 31, 2, 2, 16, seed=5)  # GQA: 4 query heads on 2 K/V heads
    out, lse, probs = flashattn.flash_attn_kvpacked_func(q, kv, return_attn_probs=True)
    ref, ref_lse, _ = flashattn.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], return_attn_probs=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse) and probs is None


def test_varlen_packed_forms_are_flash_attn_varlen_func_on_their_slices():
    lens = [5, 0, 9]
    cu = torch.tensor([0, 5, 5, 14], dtype=torch.int32, device=DEVICE)
    qkv = _randn(sum(lens), 3, 2, 16, seed=1)
    out = flashattn.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True)
    ref = flashattn.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, max(lens), max(lens), causal=True)
    assert torch.equal(out, ref)
    q, kv = _randn(sum(lens), 4, 16, seed=2), _randn(sum(lens), 2, 2, 16, seed=3)
    out = flashattn.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, max(lens), max(lens))
    ref = flashattn.flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu, cu, max(lens), max(lens))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("name, x", [("qkv", (2, 7, 2, 4, 16)), ("qkv", (2, 7, 4, 16))])
def test_packed_tensors_of_the_wrong_layout_are_refused(name, x):
    with pytest.raises(ValueError, match="qkv must be"):
        flashattn.flash_attn_qkvpacked_func(_randn(*x))


def test_flash_attn_with_kvcache_takes_flash_attns_names_and_defaults():
    q = _randn(2, 1, 4, 16)
    k_cache, v_cache = _randn(2, 40, 2, 16, seed=1), _randn(2, 40, 2, 16, seed=2)
    with torch.no_grad():
        # cache_seqlens None: every sequence holds the whole cache; causal defaults to False, as upstream
        whole = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache)
        assert torch.equal(whole, flashattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=40,
                                                                   causal=False))
        # appending k, v in place at cache_seqlens, with the LSE
        k_new, v_new = _randn(2, 3, 2, 16, seed=3), _randn(2, 3, 2, 16, seed=4)
        kc, vc = k_cache.clone(), v_cache.clone()
        lens = torch.tensor([10, 21], dtype=torch.int32, device=DEVICE)
        out, lse = flashattn.flash_attn_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=lens, causal=True,
                                                     num_splits=0, return_softmax_lse=True)
        kc2, vc2 = k_cache.clone(), v_cache.clone()
        ref, ref_lse = flashattn.attention_with_kvcache(q, kc2, vc2, cache_seqlens=lens, k_new=k_new, v_new=v_new,
                                                        causal=True, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert torch.equal(kc, kc2) and torch.equal(kc[0, 10:13], k_new[0])


def test_flash_attn_with_kvcache_passes_its_options_through():
    """rotary_cos/sin (interleaved by default, as upstream), cache_batch_idx, cache_leftpad, window_size
    (ints or 0-d tensors), softcap and alibi_slopes reach attention_with_kvcache under their own names."""
    q = _randn(2, 1, 4, 16)
    k_cache, v_cache = _randn(3, 40, 2, 16, seed=1), _randn(3, 40, 2, 16, seed=2)
    k_new, v_new = _randn(2, 2, 2, 16, seed=3), _randn(2, 2, 2, 16, seed=4)
    angles = torch.rand(64, 4, device=DEVICE)
    lens = torch.tensor([10, 21], dtype=torch.int32, device=DEVICE)
    common = dict(cache_leftpad=torch.tensor([2, 0], dtype=torch.int32, device=DEVICE),
                  cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32, device=DEVICE),
                  alibi_slopes=torch.rand(4, device=DEVICE), softcap=5.0)
    with torch.no_grad():
        kc, vc = k_cache.clone(), v_cache.clone()
        out = flashattn.flash_attn_with_kvcache(q, kc, vc, k=k_new, v=v_new, rotary_cos=angles.cos(),
                                                rotary_sin=angles.sin(), cache_seqlens=lens, causal=True,
                                                window_size=(torch.tensor(7), -1), **common)
        kc2, vc2 = k_cache.clone(), v_cache.clone()
        ref = flashattn.attention_with_kvcache(q, kc2, vc2, cache_seqlens=lens, k_new=k_new, v_new=v_new, causal=True,
                                               rotary_cos=angles.cos(), rotary_sin=angles.sin(),
                                               rotary_interleaved=True, window=(7, None), **common)
    assert torch.equal(out, ref) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert not torch.equal(kc[2, 10:12], k_new[0])  # appended rotated, into entry 2


@pytest.mark.parametrize("kw, error", [
    (dict(num_splits=-1), ValueError),
    (dict(k="append"), ValueError),  # keys to append need cache_seqlens
    (dict(rotary_cos=torch.zeros(1)), ValueError),  # without rotary_sin
])
def test_flash_attn_with_kvcache_refuses_bad_options(kw, error):
    q = _randn(1, 1, 2, 16)
    cache = _randn(1, 8, 2, 16, seed=1)
    if kw.get("k") == "append":
        kw = dict(k=_randn(1, 1, 2, 16, seed=2), v=_randn(1, 1, 2, 16, seed=3))
    with pytest.raises(error):
        flashattn.flash_attn_with_kvcache(q, cache, cache.clone(), **kw)
