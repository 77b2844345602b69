"""Who is measured: flashattn and its peers, each as ``prepare(setting, device) -> fn(q, k, v) -> o``.

Every ``fn`` takes q, k, v of shape (B, H, N, D), applies the default scale 1/sqrt(D), and returns o
with an autograd graph, so the same calls time the forward and (through ``o.backward``) the backward.
A provider that cannot run a setting raises; :mod:`benchmarks.run` records the error and goes on.
"""

from __future__ import annotations

import functools


class Unsupported(RuntimeError):
    """The provider cannot run this setting (recorded as ``unsupported``, never as a zero)."""


class Provider:
    name = ""
    label = ""
    ours = False
    # False: measured only where ``Setting.peers`` is True (the peers do not run D = 256 here).
    runs_ours_only_settings = False

    def skip_reason(self, setting) -> str | None:
        """Why this provider is not run at ``setting`` by design; None when it is run."""
        if not setting.peers and not self.runs_ours_only_settings:
            return f"head dim {setting.head_dim} is measured for flashattn only"
        return None

    def prepare(self, setting, device):
        raise NotImplementedError

    def describe(self) -> dict:
        return {"label": self.label, "ours": self.ours, "how": " ".join((self.__doc__ or "").split())}


class FlashAttn(Provider):
    """flashattn.attention (the Triton kernels, through torch.autograd)."""

    name, label, ours, runs_ours_only_settings = "flashattn", "flashattn (ours)", True, True

    def prepare(self, setting, device):
        import flashattn

        return functools.partial(flashattn.attention, causal=setting.causal)


class SDPA(Provider):
    """torch.nn.functional.scaled_dot_product_attention restricted to one backend by torch.nn.attention.sdpa_kernel."""

    def __init__(self, name: str, label: str, backend: str):
        self.name, self.label, self.backend = name, label, backend

    def describe(self) -> dict:
        return {**super().describe(), "backend": f"SDPBackend.{self.backend}"}

    def prepare(self, setting, device):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, self.backend)
        causal = setting.causal

        def fn(q, k, v):
            # The backend is chosen when the forward runs; its backward node is fixed in the graph.
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return fn


def _causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx  # N == M in the grid: top-left and bottom-right alignment agree


class Flex(Provider):
    """torch.nn.attention.flex_attention.flex_attention under torch.compile(dynamic=False), one compile per shape; causal runs take a block mask from create_block_mask so fully masked blocks are skipped."""

    name, label = "flex", "FlexAttention (compiled)"

    def prepare(self, setting, device):
        import torch
        import torch._dynamo
        import torch._functorch.config
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        # One compiled graph alive at a time: the guards of every earlier shape would otherwise be
        # checked on each call (and past the recompile limit dynamo falls back to eager).
        torch._dynamo.reset()
        # The backward is timed as o.backward(do, retain_graph=True); AOTAutograd refuses
        # retain_graph for a backward compiled with donated buffers.
        if hasattr(torch._functorch.config, "donated_buffer"):
            torch._functorch.config.donated_buffer = False
        compiled = torch.compile(flex_attention, dynamic=False)
        block_mask = None
        if setting.causal:
            n = setting.seqlen
            block_mask = create_block_mask(_causal_mask_mod, None, None, n, n, device=device)

        def fn(q, k, v):
            return compiled(q, k, v, block_mask=block_mask)

        return fn


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
