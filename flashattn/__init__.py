"""flashattn: FlashAttention forward and backward in Triton, with a PyTorch reference beside them.

``import flashattn`` imports neither triton nor any GPU state: the kernels are imported the first time a
CUDA tensor (or, under ``TRITON_INTERPRET=1``, a CPU tensor) reaches :func:`attention`.
"""

from flashattn import distributed, reference, schedule
from flashattn.api import attention
from flashattn.compat import (
    flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache,
)
from flashattn.decode import attention_with_kvcache
from flashattn.varlen import attention_varlen

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "distributed", "flash_attn_func",
           "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
           "reference", "schedule"]
__version__ = "0.1.0"
