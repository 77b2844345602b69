"""flashattn inside transformers models (flashattn.integrations.transformers): tiny random-init models on
the CPU in float32 (flashattn's reference path), compared with transformers' own attention on the same
weights and inputs: logits, gradients and greedy generation, with and without padding.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashattn.integrations.transformers as fa_transformers  # noqa: E402

NAME = fa_transformers.register()
SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, num_hidden_layers=2,
             vocab_size=100, max_position_embeddings=128)


def _model(kind: str, **overrides):
    torch.manual_seed(0)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }[kind]
    model = model_cls(config_cls(**SIZES, **overrides)).eval()
    for name, param in model.named_parameters():
        if name.endswith("self_attn.sinks"):  # initialized to one value: make each head's sink its own
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 2)
    return model


def _inputs(padded: bool, side: str = "left"):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SIZES["vocab_size"], (3, 17), generator=gen)
    mask = torch.ones_like(ids)
    if padded and side == "left":  # as generate() pads
        mask[0, :5] = 0
        mask[2, :2] = 0
    elif padded:  # as a training collator pads
        mask[0, -5:] = 0
        mask[2, -2:] = 0
    return ids, mask


def _logits(model, impl: str, ids, mask):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("kind, overrides, peer", [
    ("llama", {}, "sdpa"),
    ("qwen2", {}, "sdpa"),
    ("mistral", dict(sliding_window=5), "sdpa"),
    ("gemma2", dict(sliding_window=6, head_dim=16, attn_logit_softcapping=2.0, query_pre_attn_scalar=16), "eager"),
])
def test_logits_match_transformers_own_attention(kind, overrides, peer):
    """Without padding every model's logits equal its own attention's to float32 rounding; the window and
    the softcap are taken (the same model without them gives other logits)."""
    model = _model(kind, **overrides)
    ids, mask = _inputs(padded=False)
    ours, theirs = _logits(model, NAME, ids, mask), _logits(model, peer, ids, mask)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)
    if overrides:  # a window wider than the sequence and no softcap: the same weights, other logits
        plain = _model(kind, **{**overrides, "sliding_window": 64,
                                **({"attn_logit_softcapping": None} if "attn_logit_softcapping" in overrides else {})})
        assert (_logits(plain, peer, ids, mask) - theirs).abs().max() > 1e-3


PADDED = [
    ("llama", {}, "sdpa"),
    ("qwen2", {}, "sdpa"),
    ("mistral", dict(sliding_window=5), "sdpa"),
    ("gemma2", dict(sliding_window=6, head_dim=16, attn_logit_softcapping=2.0, query_pre_attn_scalar=16), "eager"),
    ("gpt_oss", dict(sliding_window=5, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0)), "eager"),
]


@pytest.mark.parametrize("kind, overrides, peer", PADDED, ids=[p[0] for p in PADDED])
def test_padded_batches_go_through_packed_sequences(kind, overrides, peer, monkeypatch):
    """A left-padded batch: the real tokens' logits equal transformers' own attention's, through one
    attention_varlen call per layer (never a loop over the sequences) that takes the model's window and
    softcap, and greedy generation makes the same tokens."""
    model = _model(kind, **overrides)
    ids, mask = _inputs(padded=True)
    calls = []
    real_varlen = fa_transformers.attention_varlen
    monkeypatch.setattr(fa_transformers, "attention_varlen",
                        lambda *a, **k: calls.append((a[3], k)) or real_varlen(*a, **k))
    ours, theirs = _logits(model, NAME, ids, mask), _logits(model, peer, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], rtol=0, atol=2e-5)
    assert len(calls) == SIZES["num_hidden_layers"] and all(len(cu) == ids.shape[0] + 1 for cu, _ in calls)
    if "sliding_window" in overrides:  # transformers' W keys, the query's own included: left = W - 1
        assert any(k["window"] == (overrides["sliding_window"] - 1, 0) for _, k in calls)
    if "attn_logit_softcapping" in overrides:
        assert all(k["softcap"] == overrides["attn_logit_softcapping"] for _, k in calls)
    generated = {}
    for impl in (NAME, peer):
        model.set_attn_implementation(impl)
        generated[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(generated[NAME], generated[peer])


@pytest.mark.parametrize("kind, overrides, peer", [PADDED[0], PADDED[3], PADDED[4]], ids=["llama", "gemma2", "gpt_oss"])
def test_gradients_match_transformers_own_attention(kind, overrides, peer):
    """The loss's gradients for every parameter, right-padded batch with the padding out of the loss
    (Gemma 2: window and softcap through the packed path): as transformers' own attention's to float32
    rounding. (Right padding: with left padding the last pad position's logits predict the first real
    token and join the loss, and what a query row with no key outputs differs between implementations.)"""
    ids, mask = _inputs(padded=True, side="right")
    grads = {}
    for impl in (NAME, peer):
        model = _model(kind, **overrides).train()
        model.set_attn_implementation(impl)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        grads[impl] = {n: p.grad for n, p in model.named_parameters()}
    for name, g in grads[peer].items():
        torch.testing.assert_close(grads[NAME][name], g, rtol=1e-4, atol=1e-5, msg=name)


def test_a_name_with_flash_is_refused():
    with pytest.raises(ValueError, match="flash"):
        fa_transformers.register("my_flash_attention")


def test_a_batch_packed_by_a_flattening_collator_attends_within_each_sequence():
    """The attention function on a packed batch (1, H, total, D) with transformers' cu_seq_lens keyword
    arguments: each sequence attends to its own keys only, as full attention per sequence does."""
    import flashattn

    gen = torch.Generator().manual_seed(3)
    lens = [5, 9, 3]
    q, k, v = (torch.randn(1, 4, sum(lens), 16, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    module = torch.nn.Module()
    out, weights = fa_transformers.attention(module, q, k, v, None, scaling=0.25, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                             max_length_q=9, max_length_k=9)
    assert weights is None and out.shape == (1, sum(lens), 4, 16)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        want = flashattn.attention(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], causal=True, scale=0.25)
        torch.testing.assert_close(out[:, start:end], want.transpose(1, 2), rtol=0, atol=1e-6)
