"""One small, immutable description of an attention call, whatever its entry point.

The entry points (:mod:`flashattn.api`, :mod:`flashattn.varlen`, :mod:`flashattn.decode`) validate the
tensors and options once and build a :class:`Problem`; everything after them (the references,
:mod:`flashattn._config`, the launchers, the custom operator) takes that description instead of a
growing list of loose arguments. Dense tensors, packed sequences and a (paged) KV cache are its
layouts (:data:`LAYOUTS`): how query rows and keys are addressed, not separate problems. The variants
are its fields, each converted once into the one spelling the kernels test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashattn import schedule
from flashattn.constants import LOG2E


def head_dim_block(head_dim: int) -> int:
    """The head dim padded to a power of two of at least 16, as tl.dot and tl.arange need."""
    return max(16, 1 << (head_dim - 1).bit_length())


def _scale(scale, head_dim: int) -> float:
    """The softmax scale: 1 / sqrt(D) for None, and -0.0 as 0.0 (the two hash alike, so a cached
    description of one serves the other)."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale) + 0.0


@dataclass(frozen=True)
class Problem:
    batch: int  # B
    heads_q: int  # Hq
    heads_kv: int  # Hkv, divides Hq
    n: int  # queries per head, N
    m: int  # keys per head, M
    head_dim: int  # D
    dtype: torch.dtype
    causal: bool  # bottom-right aligned: query i sees key j when j <= i + M - N
    scale: float  # softmax scale tau in S = tau Q K^T
    # The variants. Each default is "off", and an "off" variant compiles the kernels without it.
    # window: (left, right) as the kernels test it (flashattn.schedule.window_bounds: query i sees
    # key j when i + M - N - left <= j <= i + M - N + right, causal folded into right), or None
    # when the window hides nothing the causal mask does not already hide.
    window: tuple[int, int] | None = None
    softcap: float = 0.0  # > 0: the score s becomes softcap * tanh(s / softcap)
    alibi: bool = False  # the call passes per-head slopes: -slope * |i + M - N - j| joins the score
    dropout_p: float = 0.0  # probability of dropping an entry of P (the seed is per call, not here)
    # How the rows are addressed (LAYOUTS). "dense": q (B, Hq, N, D), k, v (B, Hkv, M, D).
    # "packed" (flashattn.varlen): batch counts the sequences, n and m are the longest ones
    # (max_seqlen_q, max_seqlen_k), and the tensors hold total_q and total_k rows per head.
    # "cache" (flashattn.decode): q (B, N, Hq, D) against a KV cache of m = capacity keys per sequence,
    # (B, M, Hkv, D), or pages of page_size rows through a block table; n_new keys are appended first.
    layout: str = "dense"
    total_q: int = 0
    total_k: int = 0
    page_size: int = 0
    n_new: int = 0
    # D_v, the head dim of v and o where it differs from q's and k's (e.g. 192 / 128 in DeepSeek's MLA
    # prefill); 0 when they share D
    head_dim_v: int = 0
    sinks: bool = False  # the call passes per-head sink logits (flashattn.autograd.with_sinks)
    # float8 (e4m3) q, k, v with per-(batch, K/V head) descale factors (flashattn.fp8): the forward
    # folds them into the score scale and the output, which is bfloat16
    descale: bool = False
    # False: the backward may sum dQ with floating-point atomics in an order that varies between runs
    # (flashattn.hopper.bwd, where it applies); True: every run gives the same bits
    deterministic: bool = True

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.head_dim_v == self.head_dim:
            object.__setattr__(self, "head_dim_v", 0)  # one spelling per problem, so equal problems hash alike
        # hashed once: a problem keys the launchers' recipes, looked up on every call
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f) for f in self.__dataclass_fields__)))
        varlen = self.layout == "packed"
        object.__setattr__(self, "varlen", varlen)  # read on every launch: an attribute, not a property
        # no batch, head, query or key: nothing for a kernel to do (flashattn.autograd answers it)
        object.__setattr__(self, "empty", not varlen and self.batch * self.heads_q * self.n * self.m == 0)
        object.__setattr__(self, "_constexprs", dict(
            HAS_WINDOW=self.window is not None, SOFTCAP=self.softcap > 0, ALIBI=self.alibi,
            DROPOUT=self.dropout_p > 0, VARLEN=varlen))
        plain = not (self.window is not None or self.softcap or self.alibi or self.dropout_p or self.head_dim_v
                     or self.descale)
        object.__setattr__(self, "_split_kv", self.layout == "dense" and plain and not self.empty and self.scale >= 0
                           and split_kv_wins(self.n, self.m, self.batch * self.heads_kv))
        # the dense forward and backward launchers run it (not packed, empty or split-KV): what the
        # autograd layer's replay of a repeated call (flashattn.autograd.run_forward) checks first
        object.__setattr__(self, "dense_kernels", self.layout == "dense" and not self.empty and not self._split_kv)
        # what selects the kernels' code, not their sizes: problems of one family share most kernels
        # (flashattn.autograd.compile_backward_ahead compiles a family's backward once)
        object.__setattr__(self, "family", (self.dtype, self.head_dim, self.head_dim_v, self.causal, self.layout,
                                            *self._constexprs.values(), self.sinks, self.descale, self.deterministic))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, causal: bool = False, scale: float | None = None, *,
           window=None, softcap: float | None = 0.0, alibi: bool = False, dropout_p: float = 0.0,
           head_dim_v: int = 0, sinks: bool = False, descale: bool = False,
           deterministic: bool = True) -> "Problem":
        """The description of attention of q (B, Hq, N, D) over k (B, Hkv, M, D); the caller validates.

        ``window = (left, right)`` takes ``None`` on a side for unbounded; ``softcap`` 0 or None is off;
        ``head_dim_v`` is v's head dim (0: D).
        """
        batch, heads_q, n, head_dim = q.shape
        m = k.shape[2]
        return cls(batch, heads_q, k.shape[1], n, m, head_dim, q.dtype, bool(causal), _scale(scale, head_dim),
                   *_variants(n, m, causal, window, softcap, alibi, dropout_p), head_dim_v=int(head_dim_v),
                   sinks=bool(sinks), descale=bool(descale), deterministic=bool(deterministic))

    @classmethod
    def packed(cls, q: torch.Tensor, k: torch.Tensor, n_seqs: int, max_seqlen_q: int, max_seqlen_k: int,
               causal: bool = False, scale: float | None = None, *, window=None, softcap: float | None = 0.0,
               alibi: bool = False, dropout_p: float = 0.0, head_dim_v: int = 0, sinks: bool = False) -> "Problem":
        """The description of packed attention of q (total_q, Hq, D) over k (total_k, Hkv, D); the
        variants as :meth:`of` takes them, each acting inside every sequence alone."""
        total_q, heads_q, head_dim = q.shape
        n, m = int(max_seqlen_q), int(max_seqlen_k)
        return cls(n_seqs, heads_q, k.shape[1], n, m, head_dim, q.dtype, bool(causal), _scale(scale, head_dim),
                   *_variants(n, m, causal, window, softcap, alibi, dropout_p),
                   layout="packed", total_q=total_q, total_k=k.shape[0], head_dim_v=int(head_dim_v),
                   sinks=bool(sinks))

    @classmethod
    def cache(cls, q: torch.Tensor, k_cache: torch.Tensor, capacity: int, causal: bool = True,
              scale: float | None = None, page_size: int = 0, n_new: int = 0) -> "Problem":
        """The description of decoding: q (B, Nq, Hq, D) against a KV cache of ``capacity`` keys per
        sequence, k_cache (B, Mmax, Hkv, D) or pages (num_pages, page_size, Hkv, D)."""
        batch, n_q, heads_q, head_dim = q.shape
        return cls(batch, heads_q, k_cache.shape[2], n_q, int(capacity), head_dim, q.dtype, bool(causal),
                   _scale(scale, head_dim), layout="cache", page_size=int(page_size), n_new=int(n_new))

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 for multi-head, Hq for multi-query attention)."""
        return self.heads_q // self.heads_kv

    @property
    def qk_scale(self) -> float:
        """The scale of base-2 scores: exp(tau * s) = exp2(tau * log2(e) * s)."""
        return self.scale * LOG2E

    @property
    def block_d(self) -> int:
        """The head dim padded to a power of two of at least 16 (:func:`head_dim_block`)."""
        return head_dim_block(self.head_dim)

    @property
    def dv(self) -> int:
        """The head dim of v and o: D_v where the head dims are split, else D."""
        return self.head_dim_v or self.head_dim

    @property
    def block_dv(self) -> int:
        """D_v padded like :attr:`block_d`."""
        return head_dim_block(self.dv)

    @property
    def softcap_in(self) -> float:
        """What multiplies q . k inside the softcap's tanh: scale / softcap."""
        return self.scale / self.softcap if self.softcap else 0.0

    @property
    def softcap_out(self) -> float:
        """What multiplies the tanh to give base-2 scores: softcap * log2(e)."""
        return self.softcap * LOG2E

    @property
    def dropout_threshold(self) -> int:
        """An entry is dropped when its 16-bit Philox lane is below this: floor(p * 2^16)."""
        return dropout_threshold(self.dropout_p)

    @property
    def split_kv(self) -> bool:
        """Whether the forward runs the split-KV decoding kernels rather than the dense one: a dense
        call with no variant but the causal mask where :func:`split_kv_wins`. The dense forward gives
        each (query block, head) one program that walks every key alone, and a query block of a few
        rows leaves its tile nearly empty; the split-KV kernels pack a group's query heads into one
        tile and deal the keys out to several programs."""
        return self._split_kv


LAYOUTS = ("dense", "packed", "cache")


def _variants(n: int, m: int, causal, window, softcap, alibi, dropout_p) -> tuple:
    """The variant fields ``(window, softcap, alibi, dropout_p)`` in the kernels' spelling, for queries
    and keys of at most ``n`` and ``m`` (a packed batch's longest sequences: a window that reaches
    every key of those reaches every key of a shorter one too, so it is dropped for all of them)."""
    if window is not None:
        left, right = schedule.window_bounds(n, m, bool(causal), tuple(window))
        # left >= m - 1 and right >= n - 1 (0 when causal) reach every key already
        if left >= m - 1 and right >= (0 if causal else n - 1):
            window = None
        else:
            window = (int(left), int(right))
    return window, float(softcap or 0.0), bool(alibi), float(dropout_p)

# The dense entry point hands a call to the split-KV kernels (:func:`split_kv_wins`; benchmarks.split_kv_rule
# times both paths around these bounds): from SPLIT_KV_MIN_KEYS keys, up to SPLIT_KV_QUERIES queries, or up
# to SPLIT_KV_MAX_QUERIES on at most SPLIT_KV_FEW_HEADS K/V heads; from SPLIT_KV_WIDE_MIN_KEYS keys, up to
# SPLIT_KV_QUERIES queries on at least SPLIT_KV_WIDE_HEADS K/V heads.
SPLIT_KV_MAX_QUERIES = 64
SPLIT_KV_QUERIES = 32
SPLIT_KV_FEW_HEADS = 32
SPLIT_KV_MIN_KEYS = 512
SPLIT_KV_WIDE_HEADS = 128
SPLIT_KV_WIDE_MIN_KEYS = 128


def split_kv_wins(n: int, m: int, kv_heads: int) -> bool:
    """Whether the split-KV kernels beat the dense forward on ``n`` queries against ``m`` keys per
    head, ``kv_heads`` = B * Hkv: from 512 keys, up to 32 queries, or up to 64 where few K/V heads
    (at most 32) leave the dense grid mostly idle; from 128 keys, up to 32 queries on 128 K/V heads or
    more. Two sweeps on an H200 (causal, D = 128, one run) agreed on these regions; with 64 queries on
    128 K/V heads the dense forward was faster, and below 512 keys on fewer K/V heads neither won
    clearly (docs/kernels/decoding.md#the-dense-entry-point)."""
    if n > SPLIT_KV_MAX_QUERIES:
        return False
    if m >= SPLIT_KV_MIN_KEYS:
        return n <= SPLIT_KV_QUERIES or kv_heads <= SPLIT_KV_FEW_HEADS
    return m >= SPLIT_KV_WIDE_MIN_KEYS and n <= SPLIT_KV_QUERIES and kv_heads >= SPLIT_KV_WIDE_HEADS


def variant_abi(problem: Problem, alibi_slopes=None, seed: int = 0, dummy=None) -> tuple[dict, tuple]:
    """The variants as the kernels take them: ``(constexprs, args)``.

    ``constexprs`` are the compile-time switches (all False for plain attention, which then compiles
    to the code it has without any variant); ``args`` the runtime arguments in the kernels' order: the window's (left, right), the softcap's two factors,
    the ALiBi slopes (pointer and batch stride), the dropout seed as two 31-bit halves, its threshold
    and 1 / (1 - p). A variant that is off passes harmless values that its compiled-out code never
    reads (``dummy``, any tensor of the call, stands in for the slopes)."""
    p = problem
    left, right = p.window if p.window is not None else (0, 0)
    if p.alibi and alibi_slopes is not None:
        slopes, stride_b = alibi_slopes, (alibi_slopes.shape[-1] if alibi_slopes.dim() == 2 else 0)
    else:  # no ALiBi, or a call for the constexprs alone (a plan), which leaves the tensors out
        slopes, stride_b = dummy, 0
    inv_keep = 1.0 / (1.0 - p.dropout_p)
    return p._constexprs, (left, right, p.softcap_in, p.softcap_out, slopes, stride_b,
                           *seed_halves(p, seed), p.dropout_threshold, inv_keep)


def seed_halves(problem: Problem, seed: int) -> tuple[int, int]:
    """The dropout seed as the kernels take it, two 31-bit halves (low, high); (0, 0) without dropout.
    They are the kernels' only per-call integers (a recorded launch takes them afresh each call)."""
    seed = int(seed) if problem.dropout_p > 0 else 0
    return seed & (2**31 - 1), seed >> 31


def dense_like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialized tensor shaped like ``x`` (of ``dtype``, x's when None): the layout every backend
    gives its outputs (and the custom operators' fake tensors promise). ``x``'s own where its last dim
    is dense (e.g. (B, N, H, D) for a transposed view, so outputs match their inputs' layout),
    contiguous otherwise."""
    out = torch.empty_like(x, dtype=dtype)
    return out if out.stride(-1) == 1 else torch.empty(x.shape, dtype=out.dtype, device=x.device)


def output_like(q: torch.Tensor, head_dim_v: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialized output for queries ``q`` (of ``dtype``, q's when None): :func:`dense_like` of q,
    or, when the values' head dim differs from q's, a tensor of q's shape but ``head_dim_v`` columns in
    the same dim order."""
    if head_dim_v == q.shape[-1]:
        return dense_like(q, dtype)
    shape = (*q.shape[:-1], head_dim_v)
    order = sorted(range(q.dim() - 1), key=lambda i: -q.stride(i))  # q's outer dims, outermost first
    out = torch.empty([shape[i] for i in order] + [head_dim_v], dtype=dtype or q.dtype, device=q.device)
    return out.permute(*[order.index(i) for i in range(q.dim() - 1)], q.dim() - 1)


def in_layout(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``x`` in :func:`dense_like`'s layout for ``like`` (the reference computes contiguous tensors):
    itself when it is already, else a copy."""
    if x.shape[-1] != like.shape[-1]:  # split head dims: the output has v's
        out = output_like(like, x.shape[-1])
        return x if out.stride() == x.stride() else out.copy_(x)
    if like.stride(-1) == 1 and x.stride() == like.stride():  # empty_like keeps such a dense layout
        return x
    out = dense_like(like)
    if out.stride() == x.stride():
        return x
    out.copy_(x)
    return out


def dropout_threshold(p: float) -> int:
    """floor(p * 2^16): the 16-bit random integer below which an entry of P is dropped. The drop
    probability is therefore p rounded down to a multiple of 2^-16 (kept entries are still scaled by
    1 / (1 - p)); the kernels read eight such lanes from each Philox draw."""
    return int(p * 2.0**16)
