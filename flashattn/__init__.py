"""flashattn: FlashAttention forward and backward in Triton, with a PyTorch reference beside them.

``import flashattn`` imports neither triton nor any GPU state: the kernels are imported the first time a
CUDA tensor (or, under ``TRITON_INTERPRET=1``, a CPU tensor) reaches :func:`attention`. The names
below are imported at their first use (``flashattn.attention``, ``from flashattn import attention``),
so ``import flashattn.schedule`` runs only what the schedule and the custom operators (registered
with torch at import) need.
"""

import importlib
import importlib.util
from typing import TYPE_CHECKING

from flashattn import custom_ops as _custom_ops  # noqa: F401  (registers torch.ops.flashattn.* at import)

if TYPE_CHECKING:  # what static tools (type checkers, the API reference) read; at run time see __getattr__
    from flashattn import distributed, reference, schedule  # noqa: F401
    from flashattn.api import attention  # noqa: F401
    from flashattn.compat import (  # noqa: F401
        flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
        flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache,
    )
    from flashattn.decode import attention_with_kvcache  # noqa: F401
    from flashattn.fp8 import attention_fp8  # noqa: F401
    from flashattn.varlen import attention_varlen  # noqa: F401
    from flashattn.precompile import warmup  # noqa: F401

# public name -> the module that defines it
_NAMES = {
    "attention": "api",
    "attention_varlen": "varlen",
    "attention_with_kvcache": "decode",
    "attention_fp8": "fp8",
    "flash_attn_func": "compat",
    "flash_attn_kvpacked_func": "compat",
    "flash_attn_qkvpacked_func": "compat",
    "flash_attn_varlen_func": "compat",
    "flash_attn_varlen_kvpacked_func": "compat",
    "flash_attn_varlen_qkvpacked_func": "compat",
    "flash_attn_with_kvcache": "compat",
    "warmup": "precompile",
}
_MODULES = ("distributed", "reference", "schedule")

__all__ = sorted([*_NAMES, *_MODULES])
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _NAMES:
        value = getattr(importlib.import_module(f"flashattn.{_NAMES[name]}"), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"flashattn.{name}") is not None:
        value = importlib.import_module(f"flashattn.{name}")  # any submodule, as after an eager import
    else:
        raise AttributeError(f"module 'flashattn' has no attribute {name!r}")
    globals()[name] = value  # found directly from now on
    return value


def __dir__():
    return sorted({*globals(), *__all__})
