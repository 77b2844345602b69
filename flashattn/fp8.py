"""Attention on float8 inputs, for inference: e4m3 q, k, v with per-(batch, K/V head) descale factors.

A quantized tensor holds ``x / descale`` rounded to float8, and ``descale`` (float32, one per batch
entry and K/V head, as FlashAttention 3's interface takes them) brings it back. The forward kernels
multiply q and k in float8 and fold their two factors into the score scale; P is rounded to
float8 for the product with v, whose factor multiplies the output. The output is bfloat16. The
derivation and the error bound are on ``docs/kernels/fp8.md``.
"""

from __future__ import annotations

import torch

from flashattn import _config
from flashattn.api import MAX_HEAD_DIM, attention, check_flag, check_shapes, check_variants
from flashattn.problem import Problem

FP8_DTYPE = torch.float8_e4m3fn
OUT_DTYPE = torch.bfloat16
MIN_HEAD_DIM_FP8 = 32  # float8 tl.dot takes a reduction of at least 32 on Hopper


def _descales(q: torch.Tensor, factors, batch: int, heads_kv: int) -> torch.Tensor:
    """The three factors as one float32 (3, B, Hkv) contiguous tensor on q's device; None is 1."""
    rows = []
    for name, x in zip(("q_descale", "k_descale", "v_descale"), factors):
        if x is None:
            rows.append(torch.ones((batch, heads_kv), dtype=torch.float32, device=q.device))
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}")
        if tuple(x.shape) != (batch, heads_kv):
            raise ValueError(f"{name} must have shape (B, Hkv) = {(batch, heads_kv)}, got {tuple(x.shape)}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {x.device}")
        if x.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {x.dtype}")
        rows.append(x.detach())
    return torch.stack(rows)


def _check(q, k, v, causal, scale, return_lse) -> None:
    check_shapes(q, k, v, causal, scale)
    if q.dtype != FP8_DTYPE:
        raise TypeError(f"attention_fp8 takes {FP8_DTYPE} q, k, v (flashattn.attention takes the others), got {q.dtype}")
    d = q.shape[-1]
    if v.shape[-1] != d:
        raise ValueError(f"v must have the head dim D of q ({d}), got {v.shape[-1]}")
    if d < MIN_HEAD_DIM_FP8:
        raise ValueError(f"float8 attention takes head dims from {MIN_HEAD_DIM_FP8} to {MAX_HEAD_DIM}, got {d}")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"q, k, v must be on a CUDA device or the CPU, got {q.device}")
    if any(x.requires_grad for x in (q, k, v)):
        raise ValueError("attention_fp8 is a forward for inference: q, k and v must not require grad")
    check_flag("return_lse", return_lse)
    if torch.compiler.is_compiling():
        raise RuntimeError("attention_fp8 does not run under torch.compile yet; call it eagerly")


# --8<-- [start:fp8-api]
def attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: torch.Tensor | None = None,
                  k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None, *,
                  causal: bool = False, scale: float | None = None,
                  window: tuple[int | None, int | None] | None = None,
                  return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of float8 (e4m3) q, k, v that stand for ``q * q_descale`` and so on: the forward only.

    Args:
        q: (B, Hq, N, D) ``torch.float8_e4m3fn``, any strides; 32 <= D <= 256.
        k: (B, Hkv, M, D) of the same dtype, ``Hq % Hkv == 0``.
        v: like k. A v whose keys are contiguous (the transpose of a (B, Hkv, D, M) tensor, rows
            16-byte aligned) is read in place; any other v is copied to that layout per call.
        q_descale: float32 (B, Hkv) on q's device: the factor that turns q back into the values it
            stands for, one per K/V head (its query heads share it, as in FlashAttention 3); None
            is 1. The factors must be positive: the kernel's row maximum relies on a score scale
            >= 0, as it does for ``scale``.
        k_descale: k's factors, likewise.
        v_descale: v's factors, likewise.
        causal: as :func:`flashattn.attention` takes it.
        scale: the softmax scale of the dequantized values, ``1 / sqrt(D)`` when None.
        window: as :func:`flashattn.attention` takes it.
        return_lse: also return the LSE.

    Returns:
        ``o`` (B, Hq, N, D) bfloat16 in q's memory layout, or ``(o, lse)`` with the natural-log LSE
        of the dequantized scores, float32 (B, Hq, N).

    On an sm_90 GPU, D = 64 and 128 run the Hopper forward in Gluon (no window, and enough work:
    ``flashattn._config.gluon_kernel``); other CUDA calls run the portable Triton forward kernel, and
    CPU tensors run it under Triton's interpreter (``TRITON_INTERPRET=1``), else the PyTorch
    reference on the dequantized values in float32 (which rounds nothing to float8 beyond the
    inputs). No gradient, no dropout, softcap, ALiBi or sinks, and no ``torch.compile`` yet. Speed
    and accuracy: the float8 page of the kernels section.
    """
    _check(q, k, v, causal, scale, return_lse)
    batch, heads_q = q.shape[:2]
    heads_kv = k.shape[1]
    descales = _descales(q, (q_descale, k_descale, v_descale), batch, heads_kv)
    window, _ = check_variants(q, batch, heads_q, window, None, None, 0.0)
    if q.is_cuda or _config.is_interpreter():
        from flashattn import forward, tensors  # the launchers: imported at the first kernel call

        problem = Problem.of(q, k, causal, scale, window=window, descale=True)
        with tensors.on_device(q):
            o, lse = forward.launch_forward(q, k, v, problem, descales=descales)
        o = o.to(OUT_DTYPE)  # float32 under the interpreter (flashattn.forward._output_dtype)
    else:
        # dequantized: factor (b, h_kv) repeated over the query heads of its group for q
        group = heads_q // heads_kv
        deq = [x.float() * d.repeat_interleave(r, dim=1)[:, :, None, None]
               for x, d, r in zip((q, k, v), descales, (group, 1, 1))]
        o, lse = attention(*deq, causal=causal, scale=scale, window=window, return_lse=True)
        o = o.to(OUT_DTYPE)
    return (o, lse) if return_lse else o
# --8<-- [end:fp8-api]
