"""The benchmark grid: which shapes are measured.

Every setting holds the number of tokens (batch x sequence length) and the model width
(heads x head dim) fixed, as FlashAttention's own benchmarks do: a longer sequence means a smaller
batch, and a larger head dim fewer heads. Each setting then does the same work per token, so
TFLOP/s across N show how well a kernel handles length, not how much work it was given.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

TOKENS = 16384  # batch * seqlen
HIDDEN = 2048  # heads * head_dim
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128)  # every provider
HEAD_DIMS_OURS_ONLY = (256,)  # flashattn alone: the peers are not run there
CAUSAL = (False, True)
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)

# --quick: one dtype, three lengths; still both head dims, both masks and every provider.
QUICK_DTYPES = ("float16",)
QUICK_SEQLENS = (1024, 4096, 16384)


@dataclass(frozen=True)
class Setting:
    """One shape of the grid: q, k, v are (batch, heads, seqlen, head_dim) of ``dtype``."""

    dtype: str
    head_dim: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    peers: bool = True  # False: only flashattn is measured here (D = 256)

    @property
    def key(self) -> tuple:
        return (self.dtype, self.head_dim, self.causal, self.seqlen)

    @property
    def group(self) -> tuple:
        """The plotted line a setting belongs to: everything but the length."""
        return (self.dtype, self.head_dim, self.causal)

    def label(self) -> str:
        mask = "causal" if self.causal else "non-causal"
        return f"{self.dtype} D={self.head_dim} {mask} N={self.seqlen} (B={self.batch}, H={self.heads})"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Setting":
        return cls(**{name: d[name] for name in cls.__dataclass_fields__})


def make_setting(dtype: str, head_dim: int, causal: bool, seqlen: int, *, tokens: int = TOKENS,
                 hidden: int = HIDDEN, peers: bool = True) -> Setting:
    if tokens % seqlen:
        raise ValueError(f"seqlen {seqlen} must divide the token count {tokens}")
    if hidden % head_dim:
        raise ValueError(f"head_dim {head_dim} must divide the hidden size {hidden}")
    return Setting(dtype, head_dim, causal, seqlen, batch=tokens // seqlen, heads=hidden // head_dim, peers=peers)


def make_grid(*, dtypes=DTYPES, head_dims=HEAD_DIMS, head_dims_ours_only=HEAD_DIMS_OURS_ONLY, causal=CAUSAL,
              seqlens=SEQLENS, tokens: int = TOKENS, hidden: int = HIDDEN) -> list[Setting]:
    """All settings, in the order they run: dtype, head dim, mask, then length (shortest first).

    The flashattn-only head dims come last, so the side-by-side part of the grid finishes first.
    """
    grid = []
    for peers, dims in ((True, head_dims), (False, head_dims_ours_only)):
        for dtype in dtypes:
            for d in dims:
                for c in causal:
                    for n in sorted(seqlens):
                        grid.append(make_setting(dtype, d, c, n, tokens=tokens, hidden=hidden, peers=peers))
    return grid


def grid_description(*, dtypes, head_dims, head_dims_ours_only, causal, seqlens, tokens, hidden) -> dict:
    """The grid as the results file records it."""
    return {
        "dtypes": list(dtypes),
        "head_dims": list(head_dims),
        "head_dims_ours_only": list(head_dims_ours_only),
        "causal": list(causal),
        "seqlens": sorted(seqlens),
        "tokens": tokens,
        "hidden": hidden,
    }
