"""A stand-in for the ``flash_attn`` package that routes flash_attn's own test file to flashattn.

Only the names ``tests/test_flash_attn.py`` (v2.8.3) imports exist here; each public function is
flashattn's compat function of the same name, unchanged, so what the upstream tests see is exactly
what a user porting code from flash_attn gets. Not installed anywhere: ``tools/upstream/run.py`` puts
this folder first on ``sys.path``.
"""

from flash_attn.flash_attn_interface import *  # noqa: F401,F403  (its __all__: the compat functions)

# Marks this package as the shim, so a run can tell it from a real flash_attn found first on the path.
IS_FLASHATTN_SHIM = True
__version__ = "2.8.3+flashattn-shim"
