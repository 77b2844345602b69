"""``flash_attn.flash_attn_interface``: flashattn's compat functions, plus the one private helper the
upstream tests import."""

from flashattn.compat import (  # noqa: F401
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]


class NoAttentionProbabilities(NotImplementedError):
    """Raised where a test needs flash_attn's returned attention probabilities (``S_dmask``), which
    flashattn does not produce; the run reports these items apart from flashattn's own
    NotImplementedError."""


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """In flash_attn: the key-block width of its CUDA kernel, which the tests need to undo the
    per-block scaling of the ``S_dmask`` it returns with ``return_attn_probs=True``. flashattn returns
    no such matrix (the compat functions give None in its place), so there is no layout to describe;
    the tests only call this after reading ``S_dmask``."""
    raise NoAttentionProbabilities(
        "flashattn returns no attention probabilities (S_dmask is None), so there is no block layout "
        "for _get_block_size_n to describe")
