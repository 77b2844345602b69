"""``flash_attn.bert_padding``: move between a padded batch (B, N, ...) and the packed rows
(total, ...) of its valid tokens, which the varlen functions take.

Written from flash_attn's documented behaviour: token (b, s) is row ``b * N + s`` of the flattened
batch; ``indices`` lists the kept rows in that order; ``cu_seqlens`` is the int32 running total of
kept tokens per sequence with a leading 0. Plain indexing, so autograd reaches the padded tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """``hidden_states`` (B, N, ...) and ``attention_mask`` (B, N) (nonzero: a valid token) ->
    (packed (total, ...), indices (total,) int64, cu_seqlens (B + 1,) int32, max_seqlen int,
    seqused (B,) int32). Tokens marked in ``unused_mask`` are kept as rows too (allocated but unused):
    they count in ``cu_seqlens`` and ``max_seqlen``, not in ``seqused``."""
    kept = attention_mask.bool() if unused_mask is None else (attention_mask.bool() | unused_mask.bool())
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    rows = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return rows[indices], indices, cu_seqlens, int(seqlens.max().item()), seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of :func:`unpad_input`: packed rows (total, ...) back to (batch, seqlen, ...), zeros
    where no row lands."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out = out.index_put((indices,), hidden_states)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
