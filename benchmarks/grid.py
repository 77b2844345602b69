"""The benchmark grid: which shapes are measured.

Every setting holds the number of tokens (batch x sequence length) and the model width
(heads x head dim) fixed, as FlashAttention's own benchmarks do: a longer sequence means a smaller
batch, and a larger head dim fewer heads. Each setting then does the same work per token, so
TFLOP/s across N show how well a kernel handles length, not how much work it was given.

One extra row leaves the width convention on purpose: grouped-query attention as large models run
it (32 query heads sharing 8 key/value heads, D = 128, bfloat16, causal), still at batch x N = 16k
tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

TOKENS = 16384  # batch * seqlen
HIDDEN = 2048  # heads * head_dim
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128, 256)  # every provider
HEAD_DIMS_OURS_ONLY = ()  # flashattn alone: the peers are recorded as skipped there
CAUSAL = (False, True)
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)

# The GQA row: (query heads, key/value heads), head dim, dtype, mask, and its lengths. The first
# length is also the correctness check's shape (float64 S of 32 x 32 x 512 x 512 is 2 GiB).
GQA_HEADS = (32, 8)
GQA_HEAD_DIM = 128
GQA_DTYPE = "bfloat16"
GQA_CAUSAL = True
GQA_SEQLENS = (512, 2048, 8192)

# --quick: one dtype, three lengths; still every head dim, both masks and every provider; no GQA row.
QUICK_DTYPES = ("float16",)
QUICK_SEQLENS = (1024, 4096, 16384)


@dataclass(frozen=True)
class Setting:
    """One shape of the grid: q is (batch, heads, seqlen, head_dim), k and v (batch, kv_heads, seqlen,
    head_dim), all of ``dtype``. ``kv_heads`` None means as many as ``heads`` (plain attention)."""

    dtype: str
    head_dim: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    peers: bool = True  # False: only flashattn is measured here
    kv_heads: int | None = None

    @property
    def h_kv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def gqa(self) -> str:
        """'' for plain attention, else 'Hq:Hkv' (part of the group: the GQA row is its own line)."""
        return "" if self.h_kv == self.heads else f"{self.heads}:{self.h_kv}"

    @property
    def key(self) -> tuple:
        return (*self.group, self.seqlen)

    @property
    def group(self) -> tuple:
        """The plotted line a setting belongs to: everything but the length."""
        return (self.dtype, self.head_dim, self.causal, self.gqa)

    def label(self) -> str:
        mask = "causal" if self.causal else "non-causal"
        heads = f"H={self.heads}" if not self.gqa else f"GQA {self.gqa}"
        return f"{self.dtype} D={self.head_dim} {mask} N={self.seqlen} (B={self.batch}, {heads})"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Setting":
        return cls(**{name: d[name] for name in cls.__dataclass_fields__ if name in d})


def make_setting(dtype: str, head_dim: int, causal: bool, seqlen: int, *, tokens: int = TOKENS,
                 hidden: int = HIDDEN, peers: bool = True, heads: int | None = None,
                 kv_heads: int | None = None) -> Setting:
    """A setting at ``tokens`` = batch x seqlen; heads = hidden / head_dim unless ``heads`` is given."""
    if tokens % seqlen:
        raise ValueError(f"seqlen {seqlen} must divide the token count {tokens}")
    if heads is None:
        if hidden % head_dim:
            raise ValueError(f"head_dim {head_dim} must divide the hidden size {hidden}")
        heads = hidden // head_dim
    if kv_heads is not None and (kv_heads < 1 or heads % kv_heads):
        raise ValueError(f"kv_heads {kv_heads} must divide the number of query heads {heads}")
    return Setting(dtype, head_dim, causal, seqlen, batch=tokens // seqlen, heads=heads, peers=peers,
                   kv_heads=None if kv_heads == heads else kv_heads)


def make_grid(*, dtypes=DTYPES, head_dims=HEAD_DIMS, head_dims_ours_only=HEAD_DIMS_OURS_ONLY, causal=CAUSAL,
              seqlens=SEQLENS, tokens: int = TOKENS, hidden: int = HIDDEN, gqa_seqlens=GQA_SEQLENS,
              gqa_heads=GQA_HEADS, gqa_head_dim=GQA_HEAD_DIM, gqa_dtype=GQA_DTYPE,
              gqa_causal=GQA_CAUSAL) -> list[Setting]:
    """All settings, in the order they run: dtype, head dim, mask, then length (shortest first);
    then the flashattn-only head dims, then the GQA row (none when ``gqa_seqlens`` is empty)."""
    grid = []
    for peers, dims in ((True, head_dims), (False, head_dims_ours_only)):
        for dtype in dtypes:
            for d in dims:
                for c in causal:
                    for n in sorted(seqlens):
                        grid.append(make_setting(dtype, d, c, n, tokens=tokens, hidden=hidden, peers=peers))
    for n in sorted(gqa_seqlens):
        grid.append(make_setting(gqa_dtype, gqa_head_dim, gqa_causal, n, tokens=tokens, heads=gqa_heads[0],
                                 kv_heads=gqa_heads[1]))
    return grid


def grid_description(*, dtypes, head_dims, head_dims_ours_only, causal, seqlens, tokens, hidden,
                     gqa_seqlens=(), gqa_heads=GQA_HEADS, gqa_head_dim=GQA_HEAD_DIM, gqa_dtype=GQA_DTYPE,
                     gqa_causal=GQA_CAUSAL) -> dict:
    """The grid as the results file records it."""
    out = {
        "dtypes": list(dtypes),
        "head_dims": list(head_dims),
        "head_dims_ours_only": list(head_dims_ours_only),
        "causal": list(causal),
        "seqlens": sorted(seqlens),
        "tokens": tokens,
        "hidden": hidden,
    }
    if gqa_seqlens:
        out["gqa"] = {"heads": gqa_heads[0], "kv_heads": gqa_heads[1], "head_dim": gqa_head_dim,
                      "dtype": gqa_dtype, "causal": gqa_causal, "seqlens": sorted(gqa_seqlens)}
    return out
