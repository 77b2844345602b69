"""Test-session setup shared by every test module.

Without a CUDA device the Triton kernels run under Triton's CPU interpreter. ``triton.jit`` decides at
decoration time whether a kernel is interpreted, and Triton re-reads ``TRITON_INTERPRET`` at the first
launch, so the variable is set here, once, before any test module imports triton or the kernel
modules (and triton itself is imported here, under it). The public API reads it at call time, so in this process float16/bfloat16 CPU tensors run
the kernels under the interpreter; tests of the CPU reference path unset it with ``monkeypatch``.
"""

from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    # Triton's own language helpers (tl.zeros, tl.cdiv, ...) are jitted when triton is first imported,
    # and torch imports triton on its own (fake tensors, torch.compile) at moments a test may have
    # unset the variable: import it now, under the interpreter, together with the kernel modules.
    import triton  # noqa: F401

    import flashattn.backward  # noqa: F401
    import flashattn.forward  # noqa: F401
