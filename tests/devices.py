"""Where the test modules' kernels run, and the marks that follow from it (shared, not a test module).

Without CUDA, tests/conftest.py has turned Triton's interpreter on, so ``DEVICE`` is the CPU and the
kernels run interpreted on tiny shapes; with CUDA the ``gpu`` tests run realistic shapes and the
interpreter variants are skipped.
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="interpreter variant; the GPU runs the gpu-marked tests")
