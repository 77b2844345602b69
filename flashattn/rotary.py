"""Rotary position embedding (RoPE) as ``flash_attn_with_kvcache`` applies it to q and the appended keys.

``cos`` and ``sin`` are (seqlen_ro, R / 2) tables; the first R dims of each head are rotated, the rest
pass unchanged. Non-interleaved (GPT-NeoX): dim i pairs with dim i + R/2. Interleaved (GPT-J): dim 2i
pairs with dim 2i + 1. A pair (x1, x2) at position t becomes
(x1 cos_t - x2 sin_t, x1 sin_t + x2 cos_t), computed in float32 and rounded once to x's dtype.
"""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool = False) -> torch.Tensor:
    """``x`` (B, N, H, D) rotated at ``positions`` (B, N) (integer rows of ``cos`` and ``sin``)."""
    half = cos.shape[1]
    c = cos.float()[positions].unsqueeze(2)  # (B, N, 1, R/2)
    s = sin.float()[positions].unsqueeze(2)
    x_rot = x[..., :2 * half].float()
    if interleaved:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = x_rot[..., :half], x_rot[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half:]), dim=-1)
