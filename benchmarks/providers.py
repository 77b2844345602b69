"""Who is measured: flashattn and its peers, each as ``prepare(setting, device) -> fn(q, k, v) -> o``.

Every ``fn`` takes q of shape (B, Hq, N, D) and k, v of shape (B, Hkv, N, D), applies the default
scale 1/sqrt(D), and returns o with an autograd graph, so the same calls time the forward and
(through ``o.backward``) the backward. A provider that cannot run a setting raises;
:mod:`benchmarks.run` records the error and goes on.

Grouped-query attention (Hq > Hkv): flashattn and FlexAttention take the Hkv heads as they are
(``enable_gqa=True`` for Flex); an SDPA backend gets ``enable_gqa=True`` when it accepts it, and
otherwise k and v repeated to Hq heads (``repeat_interleave``, inside the timed call, as a user of
that backend would have to); the ``gqa`` field of each record says which.

For the latency section (:mod:`benchmarks.latency`) each provider also hands out its call in parts,
:meth:`Provider.latency_parts`, so the section can wrap the same call in ``torch.compile``.
"""

from __future__ import annotations

import functools
import types


class Unsupported(RuntimeError):
    """The provider cannot run this setting (recorded as ``unsupported``, never as a zero)."""


class LatencyParts:
    """What :mod:`benchmarks.latency` needs to call a provider: ``inner(q, k, v, *extras) -> o``, a
    plain function; ``extras`` (tensors made once per shape, e.g. a block mask); ``context()`` entered
    around a whole timing loop (an SDPA backend choice), or None; ``eager`` the call of the eager mode
    when it is not ``inner`` itself (FlexAttention is only ever called compiled); ``compiled`` the
    function the compiled modes hand to ``torch.compile`` when it is not ``inner``."""

    def __init__(self, inner, extras=(), context=None, eager=None, compiled=None, note=""):
        self.inner, self.extras, self.context = inner, tuple(extras), context
        self.eager, self.compiled, self.note = eager or inner, compiled or inner, note


_OWN_CODE: dict = {}  # (code object, provider name) -> that code under a name of the provider's own


def own_code(fn, name: str):
    """``fn`` with a code object kept for provider ``name`` alone, the same at every call.

    Dynamo keeps its compiled graphs on the code object they were traced from, and checks guards to
    pick one. The latency section's compiled modes keep every provider's graphs at once (the providers
    take turns at each shape), and the three SDPA providers' functions come from one ``def``: with
    one code object among them a provider could find another's graph whenever the guards cannot tell
    the backends apart. A code object per provider, reused across shapes, keeps each provider's graphs
    to itself and still lets ``dynamic=True`` reuse them from one shape to the next."""
    key = (fn.__code__, name)
    code = _OWN_CODE.get(key)
    if code is None:
        code = _OWN_CODE[key] = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{name}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class Provider:
    name = ""
    label = ""
    ours = False
    # Why the latency section's compiled modes do not compile this provider's call; None: they do.
    not_compiled_again: str | None = None
    # False: measured only where ``Setting.peers`` is True.
    runs_ours_only_settings = False

    def skip_reason(self, setting) -> str | None:
        """Why this provider is not run at ``setting`` by design; None when it is run."""
        if not setting.peers and not self.runs_ours_only_settings:
            return f"head dim {setting.head_dim} is measured for flashattn only"
        return None

    def prepare(self, setting, device):
        raise NotImplementedError

    def latency_parts(self, setting, device, compile_fn) -> LatencyParts:
        """The call in parts for :mod:`benchmarks.latency`; ``compile_fn`` is ``torch.compile`` or a stand-in."""
        fn = self.prepare(setting, device)
        return LatencyParts(lambda q, k, v: fn(q, k, v))

    def describe(self) -> dict:
        return {"label": self.label, "ours": self.ours, "how": " ".join((self.__doc__ or "").split())}


class FlashAttn(Provider):
    """flashattn.attention (the Triton kernels, through torch.autograd)."""

    name, label, ours, runs_ours_only_settings = "flashattn", "flashattn (ours)", True, True
    OPTIONS: dict = {}  # more keyword arguments of every call

    def prepare(self, setting, device):
        import flashattn

        fn = functools.partial(flashattn.attention, causal=setting.causal, **self.OPTIONS)
        fn.gqa = "native" if setting.gqa else None
        return fn

    def latency_parts(self, setting, device, compile_fn) -> LatencyParts:
        import flashattn

        causal, options = setting.causal, self.OPTIONS

        def inner(q, k, v):
            return flashattn.attention(q, k, v, causal=causal, **options)

        return LatencyParts(inner)


class FlashAttnTuned(FlashAttn):
    """flashattn.attention inside ``flashattn._config.tuning(**TUNING)``: flashattn timed against itself
    with one launch choice changed (the autograd function keeps the tuning for the backward). Not in
    the default run."""

    TUNING: dict = {}

    def prepare(self, setting, device):
        from flashattn import _config

        inner = super().prepare(setting, device)
        tuning = self.TUNING

        def fn(q, k, v):
            with _config.tuning(**tuning):
                return inner(q, k, v)

        fn.gqa = inner.gqa
        return fn


class FlashAttnPortable(FlashAttnTuned):
    """flashattn.attention with the Hopper kernels in Gluon turned off (flashattn._config.tuning(gluon=False)): the portable Triton kernels alone, for A/B runs on sm_90; elsewhere the same as flashattn. Not in the default run."""

    name, label, ours, TUNING = "flashattn_portable", "flashattn, portable kernels only", False, {"gluon": False}


class FlashAttnOneStream(FlashAttnTuned):
    """flashattn.attention with the backward's dQ kernel always after dK/dV on one stream (flashattn._config.tuning(overlap_dq=False)), never beside it on a second stream: for A/B runs of that choice. Not in the default run."""

    name, label, ours = "flashattn_one_stream", "flashattn, dQ after dK/dV on one stream", False
    TUNING = {"overlap_dq": False}


class FlashAttnNondeterministic(FlashAttnTuned):
    """flashattn.attention(..., deterministic=False) inside ``flashattn._config.tuning(atomic_dq=True)``: the
    backward sums dQ with TMA reductions inside the Hopper dK/dV kernel where that kernel runs at D = 128
    (elsewhere the same kernels as flashattn). Not in the default run."""

    name, label, ours = "flashattn_nondet", "flashattn, deterministic=False, atomic dQ", False
    TUNING, OPTIONS = {"atomic_dq": True}, {"deterministic": False}


class SDPA(Provider):
    """torch.nn.functional.scaled_dot_product_attention restricted to one backend by torch.nn.attention.sdpa_kernel; GQA by enable_gqa=True where the backend takes it, else K/V repeated."""

    def __init__(self, name: str, label: str, backend: str):
        self.name, self.label, self.backend = name, label, backend

    def describe(self) -> dict:
        return {**super().describe(), "backend": f"SDPBackend.{self.backend}"}

    def _backend(self):
        from torch.nn.attention import SDPBackend

        return getattr(SDPBackend, self.backend)

    def _accepts_gqa(self, setting, device) -> bool:
        """Whether the backend runs ``enable_gqa=True`` at this head layout (a tiny probe call)."""
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        dtype = getattr(torch, setting.dtype)
        q = torch.randn(1, setting.heads, 128, setting.head_dim, device=device, dtype=dtype)
        kv = torch.randn(1, setting.h_kv, 128, setting.head_dim, device=device, dtype=dtype)
        try:
            with sdpa_kernel(self._backend()):
                F.scaled_dot_product_attention(q, kv, kv, is_causal=setting.causal, enable_gqa=True)
            return True
        except torch.cuda.OutOfMemoryError:  # a RuntimeError too, but says nothing about GQA
            raise
        except RuntimeError:  # "No available kernel": this backend does not take enable_gqa here
            return False

    def prepare(self, setting, device):
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        backend = self._backend()
        causal = setting.causal
        group = setting.heads // setting.h_kv
        gqa = None
        if group > 1:
            gqa = "enable_gqa=True" if self._accepts_gqa(setting, device) else "k, v repeated (repeat_interleave)"

        def fn(q, k, v):
            # The backend is chosen when the forward runs; its backward node is fixed in the graph.
            with sdpa_kernel(backend):
                if gqa == "enable_gqa=True":
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
                if gqa is not None:
                    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        fn.gqa = gqa
        return fn

    def latency_parts(self, setting, device, compile_fn) -> LatencyParts:
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        if setting.gqa:
            raise Unsupported("the latency section measures plain attention only")
        backend, causal = self._backend(), setting.causal

        def inner(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def chosen(q, k, v):  # what torch.compile traces: the backend choice is part of the graph
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        # The backend flags are global state: set once around the timing loop (and the compile),
        # as a user who picks a backend for a model does, not entered again at every call.
        return LatencyParts(inner, context=lambda: sdpa_kernel(backend), compiled=own_code(chosen, self.name))


def _causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx  # N == M in the grid: top-left and bottom-right alignment agree


class Flex(Provider):
    """torch.nn.attention.flex_attention.flex_attention under torch.compile(dynamic=False), one compile per shape; causal runs take a block mask from create_block_mask so fully masked blocks are skipped; GQA by enable_gqa=True."""

    name, label = "flex", "FlexAttention (compiled)"
    not_compiled_again = "eager = torch.compile(flex_attention, dynamic=True) called from eager code"

    def prepare(self, setting, device):
        import torch
        import torch._dynamo
        import torch._functorch.config
        from torch.nn.attention.flex_attention import flex_attention

        # One compiled graph alive at a time: the guards of every earlier shape would otherwise be
        # checked on each call (and past the recompile limit dynamo falls back to eager).
        torch._dynamo.reset()
        _allow_retain_graph()
        compiled = torch.compile(flex_attention, dynamic=False)
        block_mask = self._block_mask(setting, device)
        gqa = bool(setting.gqa)

        def fn(q, k, v):
            return compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa)

        fn.gqa = "enable_gqa=True" if gqa else None
        return fn

    @staticmethod
    def _block_mask(setting, device):
        from torch.nn.attention.flex_attention import create_block_mask

        if not setting.causal:
            return None
        n = setting.seqlen
        return create_block_mask(_causal_mask_mod, None, None, n, n, device=device)

    def latency_parts(self, setting, device, compile_fn) -> LatencyParts:
        from torch.nn.attention.flex_attention import flex_attention

        if setting.gqa:
            raise Unsupported("the latency section measures plain attention only")
        import torch._dynamo

        # One shape's graphs at a time, as in prepare: the section calls this once per shape, and
        # every compile wrapper of flex_attention shares dynamo's cache for its code, so by the
        # ninth graph (the latency section's D = 128 causal shapes) dynamo hit its recompile limit
        # and ran flex_attention unfused, milliseconds per call (runs 16 and 17).
        torch._dynamo.reset()
        _allow_retain_graph()
        block_mask = self._block_mask(setting, device)
        extras = () if block_mask is None else (block_mask,)

        def inner(q, k, v, *block_mask):
            return flex_attention(q, k, v, block_mask=block_mask[0] if block_mask else None)

        # Eager FlexAttention is a slow reference path: flex_attention is meant to be called compiled,
        # so the eager column holds the compiled flex_attention called from eager code (as in the grid),
        # and compiling the whole call with fullgraph=True would compile the same graph again.
        compiled = compile_fn(flex_attention, dynamic=True)

        def eager(q, k, v, *block_mask):
            return compiled(q, k, v, block_mask=block_mask[0] if block_mask else None)

        return LatencyParts(inner, extras, eager=eager, note=self.not_compiled_again)


def _allow_retain_graph():
    # The backward is timed as o.backward(do, retain_graph=True); AOTAutograd refuses retain_graph for a
    # backward compiled with donated buffers.
    import torch._functorch.config

    if hasattr(torch._functorch.config, "donated_buffer"):
        torch._functorch.config.donated_buffer = False


class Reference(Provider):
    """flashattn.reference.naive_attention: materializes S and P. For CPU tests of the harness, never in a GPU run by default."""

    name, label, runs_ours_only_settings = "reference", "naive reference", True

    def prepare(self, setting, device):
        from flashattn.reference import naive_attention

        causal = setting.causal
        return lambda q, k, v: naive_attention(q, k, v, causal=causal)[0]


PROVIDERS = {
    p.name: p
    for p in (
        FlashAttn(),
        FlashAttnPortable(),
        FlashAttnOneStream(),
        FlashAttnNondeterministic(),
        SDPA("sdpa_flash", "SDPA flash (FlashAttention 2)", "FLASH_ATTENTION"),
        SDPA("sdpa_cudnn", "SDPA cuDNN", "CUDNN_ATTENTION"),
        SDPA("sdpa_efficient", "SDPA memory-efficient", "EFFICIENT_ATTENTION"),
        Flex(),
        Reference(),
    )
}
DEFAULT = ("flashattn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex")
PEERS = DEFAULT[1:]


def get(names) -> list[Provider]:
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown:
        raise ValueError(f"unknown provider(s) {unknown}; choose from {sorted(PROVIDERS)}")
    return [PROVIDERS[n] for n in names]
