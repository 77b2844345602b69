"""Helpers the tests and the benchmark share: random inputs and error measured as a ratio.

A low-precision kernel is judged the way FlashAttention's own tests judge it: its error against a
float64 reference may be at most a small multiple of the error PyTorch's own computation in the same
low precision makes against that reference. No magic absolute tolerances.
"""

from __future__ import annotations

import torch


def random_qkv(b, h_q, h_kv, n, m, d, *, dtype=torch.float64, device="cpu", layout="bhnd", generator=None,
               requires_grad=False, std=1.0):
    """Fresh random q (B, Hq, N, D), k and v (B, Hkv, M, D).

    ``layout="bnhd"`` allocates (B, N, H, D) storage and returns ``.transpose(1, 2)`` views: the
    non-contiguous layout a model that keeps heads innermost hands over.
    """
    def make(h, length):
        if layout == "bnhd":
            x = torch.randn(b, length, h, d, dtype=dtype, device=device, generator=generator).transpose(1, 2)
        else:
            x = torch.randn(b, h, length, d, dtype=dtype, device=device, generator=generator)
        x = x * std
        return x.requires_grad_(requires_grad) if requires_grad else x

    return make(h_q, n), make(h_kv, m), make(h_kv, m)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| over the finite entries of ``ref`` (float64); inf when x has a NaN or inf there."""
    ref = ref.detach().double()
    x = x.detach().double()
    finite = torch.isfinite(ref)
    if not torch.isfinite(x[finite]).all():
        return float("inf")
    diff = (x[finite] - ref[finite]).norm().item()
    scale = ref[finite].norm().item()
    return diff / scale if scale > 0 else diff


def assert_close_ratio(name, out, ref, lowp, *, factor=2.0, floor=1e-5):
    """Assert ``rel_err(out, ref) <= factor * rel_err(lowp, ref) + floor``, and that ``out`` has no NaN.

    ``ref`` is the float64 answer, ``lowp`` PyTorch's own answer in the kernel's precision.
    Non-finite entries of ``ref`` (an LSE of -inf for a row with no key) must be matched exactly.
    """
    assert not torch.isnan(out).any(), f"{name}: NaN in output"
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(out)), f"{name}: non-finite entries differ from the reference"
    if (~finite).any():
        assert torch.equal(out[~finite].double(), ref[~finite].double()), f"{name}: infinities differ"
    err, base = rel_err(out, ref), rel_err(lowp, ref)
    assert err <= factor * base + floor, f"{name}: error {err:.3e} > {factor} x torch's {base:.3e} + {floor:.0e}"
    return err, base


def assert_block_grid_is_exact(mask: torch.Tensor, grid, block_m: int, block_n: int) -> None:
    """A block grid (:func:`flashattn.schedule.block_grid`) against the dense (N, M) visibility mask it
    stands for: skipped tiles hold no visible pair, full tiles are whole and hold no hidden one, and
    the visited tiles cover every visible pair."""
    from flashattn import schedule

    covered = torch.zeros_like(mask)
    for bi, row in enumerate(grid):
        for bj, kind in enumerate(row):
            rows, cols = slice(bi * block_m, (bi + 1) * block_m), slice(bj * block_n, (bj + 1) * block_n)
            tile = mask[rows, cols]
            if kind == schedule.SKIPPED:
                assert not tile.any(), f"tile ({bi}, {bj}) is skipped but holds a visible pair"
            else:
                covered[rows, cols] = True
            if kind == schedule.FULL:
                assert tile.all() and tile.shape[1] == block_n, f"tile ({bi}, {bj}) is full but not whole"
    assert not (mask & ~covered).any(), "a visible pair lies in no visited tile"
