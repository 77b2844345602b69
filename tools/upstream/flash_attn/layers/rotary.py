"""``flash_attn.layers.rotary.apply_rotary_emb`` on top of :func:`flashattn.rotary.apply_rotary`.

flash_attn's convention (v2.8.3 docstring and Triton kernel): token t of sequence b sits at position
``t + seqlen_offsets[b]`` (an int offset applies to every sequence); only the first ``rotary_dim =
2 * cos.shape[1]`` dims rotate; a position past the end of the cos/sin tables is left unrotated
(cos 1, sin 0). With ``cu_seqlens`` the input is packed (total, H, D) and t counts from each
sequence's start.
"""

from __future__ import annotations

import torch

from flashattn.rotary import apply_rotary


def _identity_padded(table: torch.Tensor, fill: float) -> torch.Tensor:
    """The table with one extra row of ``fill``: where positions past its end are sent."""
    return torch.cat((table, table.new_full((1, table.shape[1]), fill)), dim=0)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                     inplace: bool = False, seqlen_offsets: int | torch.Tensor = 0,
                     cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None) -> torch.Tensor:
    """x (B, N, H, D), or (total, H, D) with ``cu_seqlens`` (B + 1,); cos, sin (seqlen_ro, R / 2);
    ``seqlen_offsets`` an int or a (B,) integer tensor. Returns the rotated tensor (x itself, written
    over, with ``inplace``)."""
    seqlen_ro, half = cos.shape
    if sin.shape != cos.shape:
        raise ValueError(f"cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if 2 * half > x.shape[-1]:
        raise ValueError(f"rotary_dim {2 * half} must be <= the head dim {x.shape[-1]}")
    device = x.device
    if cu_seqlens is None:
        batch, seqlen = x.shape[0], x.shape[1]
        t = torch.arange(seqlen, device=device).expand(batch, seqlen)
        packed = x
    else:
        # packed rows: position within its own sequence, then the same (B=1, total) call
        total = x.shape[0]
        starts = cu_seqlens[:-1].long()
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        seq_of_row = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths, output_size=total)
        t = (torch.arange(total, device=device) - starts[seq_of_row]).unsqueeze(0)
        packed = x.unsqueeze(0)
    if isinstance(seqlen_offsets, torch.Tensor):
        offsets = seqlen_offsets.to(device=device, dtype=torch.long)
        offsets = offsets[seq_of_row].unsqueeze(0) if cu_seqlens is not None else offsets.unsqueeze(1)
    else:
        offsets = int(seqlen_offsets)
    positions = (t + offsets).clamp(max=seqlen_ro)  # seqlen_ro: the identity row appended below
    out = apply_rotary(packed, _identity_padded(cos, 1.0), _identity_padded(sin, 0.0), positions, interleaved)
    if cu_seqlens is not None:
        out = out.squeeze(0)
    if inplace:
        x.copy_(out)
        return x
    return out
