"""flashattn as an attention implementation of Hugging Face transformers models.

    import flashattn.integrations.transformers as fa_transformers
    name = fa_transformers.register()            # "fa_triton"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)

:func:`register` adds :func:`attention` to transformers' ``AttentionInterface`` and, for the mask,
transformers' own padding-mask function (the one its FlashAttention implementations use) to
``AttentionMaskInterface``, under a name that does not contain "flash" (transformers treats such a
name as a kernel to download). The model then hands each layer's attention to flashattn:

* no padding: :func:`flashattn.attention` on the (B, H, N, D) states, causal bottom-right aligned (a
  decoding step of one query against the cache included, which the dense entry point runs on the
  split-KV kernels), with the model's ``sliding_window`` (transformers' window of W keys, the query's
  own included: ``window=(W - 1, 0)``), ``softcap`` and training ``dropout``;
* a padded batch (a 2-D mask of real tokens): the real tokens are gathered into packed sequences and
  run through :func:`flashattn.attention_varlen`, never a loop over the sequences, with the same
  window, softcap and dropout inside each sequence; packed batches whose collator passes
  ``cu_seq_lens_q`` and ``cu_seq_lens_k`` go the same way;
* attention sinks (gpt-oss passes them as ``s_aux``, one logit per head) join every row's softmax on
  either path (``sinks=`` of :func:`flashattn.attention`).
"""

from __future__ import annotations

import torch

from flashattn.api import attention as _dense_attention
from flashattn.varlen import attention_varlen

NAME = "fa_triton"


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def _packed(query, key, value, q_mask, k_mask, causal, scale, variants):
    """Attention of the real tokens of a padded batch: gathered into packed sequences, run by
    :func:`flashattn.attention_varlen`, and scattered back (padded query rows get zeros)."""
    b, h_q, n, d = query.shape
    m = key.shape[2]
    q_rows = q_mask.flatten().nonzero().flatten()
    k_rows = k_mask.flatten().nonzero().flatten()
    lengths_q, lengths_k = q_mask.sum(1, dtype=torch.int32), k_mask.sum(1, dtype=torch.int32)
    stats = torch.stack([lengths_q.max(), lengths_k.max()]).tolist()  # one host sync for both
    q = query.transpose(1, 2).reshape(b * n, h_q, d)[q_rows]
    k = key.transpose(1, 2).reshape(b * m, key.shape[1], d)[k_rows]
    v = value.transpose(1, 2).reshape(b * m, value.shape[1], value.shape[3])[k_rows]
    o = attention_varlen(q, k, v, _cumulative(lengths_q), _cumulative(lengths_k), stats[0], stats[1],
                         causal=causal, scale=scale, validate=False, **variants)
    out = o.new_zeros(b * n, h_q, o.shape[-1])
    out[q_rows] = o
    return out.view(b, n, h_q, -1)


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query (B, Hq, N, D), key and value (B, Hkv, M, D), the mask
    from transformers' padding-mask function (None, or (B, M) with True at real tokens). Returns the
    output as (B, N, Hq, D) and no attention weights."""
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = None
    if sliding_window is not None:  # transformers' window holds W keys, the query's own included
        window = (int(sliding_window) - 1, 0 if causal else int(sliding_window) - 1)
    softcap = float(softcap) if softcap else None
    dropout = float(dropout or 0.0)
    variants = dict(window=window, softcap=softcap, dropout_p=dropout, sinks=kwargs.get("s_aux"))
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None:  # a packed batch from a flattening collator: (1, H, total, D)
        o = attention_varlen(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                             cu_q.to(torch.int32), cu_k.to(torch.int32), int(kwargs["max_length_q"]),
                             int(kwargs["max_length_k"]), causal=causal, scale=scaling, validate=False, **variants)
        return o.unsqueeze(0), None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError("flashattn's transformers attention takes transformers' 2-D padding mask (register() "
                             f"registers the function that makes it), got a mask of shape {tuple(attention_mask.shape)}")
        mask = attention_mask.bool()
        n, m = query.shape[2], key.shape[2]
        return _packed(query, key, value, mask[:, -n:], mask[:, -m:], causal, scaling, variants), None
    o = _dense_attention(query, key, value, causal=causal, scale=scaling, **variants)
    return o.transpose(1, 2), None


def register(name: str = NAME) -> str:
    """Register :func:`attention` and transformers' padding-mask function under ``name`` (which must not
    contain "flash"); returns the name to pass as ``attn_implementation``."""
    if "flash" in name.lower():
        raise ValueError(f"the name must not contain 'flash' (transformers would try to load a kernel of that name), "
                         f"got {name!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
