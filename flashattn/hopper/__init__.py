"""The Hopper (sm_90a) kernels written in Gluon, for Triton 3.6, with their host code.

* :mod:`flashattn.hopper.fwd` and :mod:`flashattn.hopper.bwd`: the host side (tile configurations,
  which inputs the kernels take, the default walks, TMA descriptors, launches: ``fwd.forward``,
  ``bwd.dkdv``, ``bwd.dq``). They import without Gluon, on any Triton or none.
* :mod:`flashattn.hopper.fwd_kernels`, :mod:`flashattn.hopper.bwd_kernels` and
  :mod:`flashattn.hopper.common`: the ``@gluon.jit`` kernels and the helpers they share, at module
  scope. They import Gluon at their top, so the host modules import them only at the first launch,
  where ``available()`` says the installed Triton can define them.
"""

from flashattn.hopper import bwd, fwd  # noqa: F401  (the host side only: neither imports Gluon)
