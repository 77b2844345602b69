"""Compile the kernels of a training run's attention calls before the run needs them.

Triton compiles a kernel the first time a configuration of it runs (a dtype, a head dim, a mask, a
variant, a tile), which takes seconds per configuration on a cold cache; compiled kernels are kept on
disk (``TRITON_CACHE_DIR``), so a later process only loads them. :func:`warmup` makes one call of each
shape given, forward and backward, on random inputs: the same launches, the same tiles and therefore
the same compiled kernels as the real calls of those shapes.
"""

from __future__ import annotations

import numbers

import torch

from flashattn.api import attention

_SHAPE_KEYS = ("batch", "heads_q", "heads_kv", "n", "m", "head_dim")


def warmup(shapes, *, dtype: torch.dtype = torch.bfloat16, device="cuda", causal: bool = True,
           backward: bool = True, **options) -> int:
    """Run :func:`flashattn.attention` once for each shape, with its backward, so that every kernel those
    calls launch is compiled (and cached on disk) before training starts. Returns the number of calls.

    Args:
        shapes: an iterable of ``(B, Hq, Hkv, N, M, D)`` tuples, the shapes of the real calls. The tile
            of a call can depend on its sizes, so pass the shapes the run will use, not smaller ones.
        dtype: float16 or bfloat16 (the kernels' dtypes).
        device: the CUDA device the run uses (a CPU device runs the kernels under ``TRITON_INTERPRET=1``,
            which compiles nothing).
        causal: the mask of the real calls.
        backward: also run the backward (a training run needs its kernels too).
        **options: the variants of the real calls, as :func:`flashattn.attention` takes them
            (``window``, ``softcap``, ``alibi_slopes``, ``dropout_p`` with ``seed``, ``scale``).
    """
    calls = 0
    for shape in shapes:
        if len(shape) != len(_SHAPE_KEYS) or not all(isinstance(x, numbers.Integral) for x in shape):
            raise ValueError(f"each shape must be (B, Hq, Hkv, N, M, D) of ints, got {shape!r}")
        b, h_q, h_kv, n, m, d = (int(x) for x in shape)
        gen = torch.Generator(device=device).manual_seed(calls)
        q = torch.randn(b, h_q, n, d, dtype=dtype, device=device, generator=gen, requires_grad=backward)
        k, v = (torch.randn(b, h_kv, m, d, dtype=dtype, device=device, generator=gen, requires_grad=backward)
                for _ in range(2))
        o = attention(q, k, v, causal=causal, **options)
        if backward:
            o.backward(torch.randn(o.shape, dtype=dtype, device=device, generator=gen))
        calls += 1
    return calls
