# --8<-- [start:statement]
"""Attention sinks (gpt-oss): each query head h has one more logit s_h that joins the softmax of every
row of that head as an extra score with no value. With ℓ_i = Σ_j e^(S_ij) over the visible keys,

    P'_ij = e^(S_ij) / (ℓ_i + e^(s_h)),    O' = P' V,    LSE'_i = log(ℓ_i + e^(s_h)),

so the keys' weights sum to less than 1 and the sink takes the rest, π_i = e^(s_h − LSE'_i). The
attention without the sink, O = softmax(S) V and LSE = log ℓ, gives both outputs at once:

    LSE' = log(e^LSE + e^s),    O' = e^(LSE − LSE') · O,

and a row that sees no key (O = 0, LSE = −∞) gets O' = 0, LSE' = s_h, for a finite sink. For a loss
L(O', LSE') the backward of plain attention, run on the final outputs, is unchanged: P' = e^(S − LSE')
is what the kernels recompute from the stored LSE, and the sink column's dP is 0 (it has no value), so
δ' = rowsum(P' ∘ dP) = rowsum(dO ∘ O') and dS = P' ∘ (dP − δ' + dLSE) hold as on the LSE-gradient page;
dQ, dK, dV follow as always. The sink's own gradient is the same softmax backward for its column:

    ∂L/∂s_h = Σ_i π_i (dLSE_i − δ'_i),    summed over every row i of head h (all batch entries).
"""
# --8<-- [end:statement]

from __future__ import annotations

import functools

import sympy as sp

from ._common import holds, is_zero_with_exps
from ._result import CheckResult, Ledger

IDENTITY = ("attention sinks: LSE' = log(e^LSE + e^s), O' = e^(LSE − LSE')·O; the plain backward on (O', LSE'); "
            "∂L/∂s_h = Σ_i e^(s_h − LSE'_i)(dLSE_i − δ'_i)")
METHOD = ("SymPy on explicit symbols (scores, sink, values, dO, dLSE; exp and log eliminated exactly); "
          "float64 torch central differences of a hand-written softmax over [S, s_h] against "
          "flashattn.autograd.with_sinks / sinks_grad, the sink-free reference backward fed the final outputs, "
          "and flashattn.attention / attention_varlen(sinks=)")
NEGATIVE = ("O' = O (the sink in the LSE only); O weighted by the sink's share e^(s − LSE'); LSE left without "
            "the sink; δ from the sink-free output; P from the sink-free LSE; the sink gradient's sign flipped; "
            "dLSE left out of the sink gradient")


# --8<-- [start:formula]
def with_sink(o, lse, sink, exp, logaddexp):
    """(O', LSE') of a row from its attention without the sink (O, LSE): e^s joins the denominator e^LSE,
    so the keys' weights, and with them O, shrink by e^LSE / e^LSE' = e^(LSE − LSE')."""
    lse_sink = logaddexp(lse, sink)
    return o * exp(lse - lse_sink), lse_sink


def sink_grad_row(sink, lse, delta, dlse, exp):
    """One row's share of ∂L/∂s: the sink's probability e^(s − LSE') times (dLSE − δ), with LSE' and
    δ = rowsum(dO ∘ O') of the final output (the sink's dP is 0: it has no value)."""
    return exp(sink - lse) * (dlse - delta)


def backward_inputs(plain, final):
    """The (O, LSE) that the unchanged backward takes (δ from O, P recomputed from the LSE): the final ones."""
    return final
# --8<-- [end:formula]


# --8<-- [start:proof]
def _sp_logaddexp(a, b):
    return sp.log(sp.exp(a) + sp.exp(b))


def _row_without_sink(scores, values):
    """(o, LSE) of one row over its keys, by the definition; o is a list over the d features."""
    total = sum(sp.exp(x) for x in scores)
    return [sum(sp.exp(x) * v[c] for x, v in zip(scores, values)) / total for c in range(len(values[0]))], sp.log(total)


def symbolic_forward_route(forward, n_keys=3, d=2) -> bool:
    """Symbolic scores s_j, sink σ, values v_j: the formula applied to the sink-free row equals the softmax
    over [s, σ] with σ's column dropped, and e^LSE' = Σ e^(s_j) + e^σ."""
    s = sp.symbols(f"s0:{n_keys}", real=True)
    sink = sp.Symbol("sigma", real=True)
    values = [[sp.Symbol(f"v_{j}_{c}", real=True) for c in range(d)] for j in range(n_keys)]
    o, lse = _row_without_sink(s, values)
    o_sink, lse_sink = zip(*[forward(x, lse, sink, sp.exp, _sp_logaddexp) for x in o])
    denominator = sum(sp.exp(x) for x in s) + sp.exp(sink)
    want = [sum(sp.exp(x) * v[c] for x, v in zip(s, values)) / denominator for c in range(d)]
    return (all(holds(lambda c=c: is_zero_with_exps(o_sink[c] - want[c])) for c in range(d))
            and all(holds(lambda c=c: is_zero_with_exps(sp.exp(lse_sink[c]) - denominator)) for c in range(d)))


def symbolic_empty_row_route(forward) -> bool:
    """A row with no key (o = 0, LSE = −∞) gets o' = 0 and LSE' = σ."""
    sink = sp.Symbol("sigma", real=True)
    o, lse = forward(sp.Integer(0), -sp.oo, sink, sp.exp, _sp_logaddexp)
    return sp.simplify(o) == 0 and sp.simplify(lse - sink) == 0


def symbolic_backward_route(forward, grad_row, feed, N=2, M=2, d=1) -> bool:
    """L = ⟨dO, O'⟩ + ⟨dLSE, LSE'⟩ with O', LSE' by the definition (every score, value, dO, dLSE and the
    sink a symbol). The plain backward given feed(plain, final) — P = e^(S − LSE), δ = rowsum(dO ∘ O),
    dS = P ∘ (dP − δ + dLSE), dV = Pᵀ dO — must give ∂L/∂S and ∂L/∂V, and Σ_i grad_row must give ∂L/∂σ."""
    S = [[sp.Symbol(f"s_{i}_{j}", real=True) for j in range(M)] for i in range(N)]
    V = [[sp.Symbol(f"v_{j}_{c}", real=True) for c in range(d)] for j in range(M)]
    dO = [[sp.Symbol(f"g_{i}_{c}", real=True) for c in range(d)] for i in range(N)]
    dlse = [sp.Symbol(f"h_{i}", real=True) for i in range(N)]
    sink = sp.Symbol("sigma", real=True)
    # the definition: one more term e^σ in each row's denominator, no value
    denominators = [sum(sp.exp(x) for x in row) + sp.exp(sink) for row in S]
    O_def = [[sum(sp.exp(S[i][j]) * V[j][c] for j in range(M)) / denominators[i] for c in range(d)] for i in range(N)]
    loss = (sum(dO[i][c] * O_def[i][c] for i in range(N) for c in range(d))
            + sum(dlse[i] * sp.log(denominators[i]) for i in range(N)))
    # the sink-free outputs, the formula's final ones, and what the backward is given
    plain = [_row_without_sink(S[i], V) for i in range(N)]
    final = []
    for o, lse in plain:
        pairs = [forward(x, lse, sink, sp.exp, _sp_logaddexp) for x in o]
        final.append(([x for x, _ in pairs], pairs[0][1]))
    fed = [feed(p, f) for p, f in zip(plain, final)]
    delta = [sum(dO[i][c] * fed[i][0][c] for c in range(d)) for i in range(N)]
    P = [[sp.exp(S[i][j] - fed[i][1]) for j in range(M)] for i in range(N)]
    dP = [[sum(dO[i][c] * V[j][c] for c in range(d)) for j in range(M)] for i in range(N)]
    tests = [lambda i=i, j=j: is_zero_with_exps(P[i][j] * (dP[i][j] - delta[i] + dlse[i]) - sp.diff(loss, S[i][j]))
             for i in range(N) for j in range(M)]
    tests += [lambda j=j, c=c: is_zero_with_exps(sum(P[i][j] * dO[i][c] for i in range(N)) - sp.diff(loss, V[j][c]))
              for j in range(M) for c in range(d)]
    d_sink = sum(grad_row(sink, fed[i][1], delta[i], dlse[i], sp.exp) for i in range(N))
    tests.append(lambda: is_zero_with_exps(d_sink - sp.diff(loss, sink)))
    return all(holds(t) for t in tests)
# --8<-- [end:proof]


# --8<-- [start:numeric]
def definition(q, k, v, sinks, causal=False, window=None, softcap=0.0, slopes=None, keep=None, dropout_p=0.0):
    """O', LSE' of dense (B, Hq, N, D) inputs by the definition, float64 torch, no flashattn code: the
    scores (capped, biased, masked), a column of the head's sink appended, the softmax over both, the
    sink's column dropped, dropout's keep mask (B, Hq, N, M) applied, times V."""
    import torch

    b, h_q, n, d = q.shape
    h_kv, m = k.shape[1], k.shape[2]
    kk, vv = k.repeat_interleave(h_q // h_kv, 1), v.repeat_interleave(h_q // h_kv, 1)
    s = q @ kk.transpose(-1, -2) / d ** 0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(n)[:, None], torch.arange(m)[None, :]
    diagonal = i + m - n  # bottom-right aligned, as the package defines causal and the window
    if slopes is not None:
        s = s - slopes.view(1, h_q, 1, 1) * (diagonal - j).abs()
    visible = torch.ones(n, m, dtype=torch.bool)
    if causal:
        visible &= j <= diagonal
    if window is not None:
        visible &= (j >= diagonal - window[0]) & (j <= diagonal + window[1])
    s = s.masked_fill(~visible, float("-inf"))
    full = torch.cat([s, sinks.view(1, h_q, 1, 1).expand(b, h_q, n, 1)], dim=-1)
    p = torch.softmax(full, dim=-1)[..., :m]
    if keep is not None:
        p = p * keep / (1.0 - dropout_p)
    return p @ vv, torch.logsumexp(full, dim=-1)


def _packed_definition(q, k, v, sinks, lengths_q, lengths_k, causal):
    """The definition sequence by sequence on packed (total, H, D) tensors; lse (Hq, total_q)."""
    import torch

    outs, lses, a, c = [], [], 0, 0
    for n, m in zip(lengths_q, lengths_k):
        o, lse = definition(*(x[lo:lo + size].transpose(0, 1)[None] for x, lo, size in ((q, a, n), (k, c, m), (v, c, m))),
                            sinks, causal)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
        a, c = a + n, c + m
    return torch.cat(outs), torch.cat(lses, dim=-1)


def _central_differences(loss, tensors, h=1e-6):
    """∂loss/∂x for every entry of every tensor, by central differences (float64)."""
    import torch

    grads = []
    for x in tensors:
        g = torch.zeros_like(x)
        for idx in range(x.numel()):
            old = x.view(-1)[idx].item()
            x.view(-1)[idx] = old + h
            up = loss().item()
            x.view(-1)[idx] = old - h
            down = loss().item()
            x.view(-1)[idx] = old
            g.view(-1)[idx] = (up - down) / (2 * h)
        grads.append(g)
    return grads


# (B, Hq, Hkv, N, M, causal, window, softcap, ALiBi, dropout): causal N > M leaves rows 0 and 1 with no
# key; the second case stacks a window, softcap, ALiBi and dropout.
DENSE_CASES = [(2, 4, 2, 7, 5, True, None, 0.0, False, 0.0),
               (1, 2, 1, 6, 9, False, (2, 1), 3.0, True, 0.25)]
PACKED_LENGTHS = ([3, 0, 4, 2], [5, 2, 0, 3])  # empty sequences on either side; causal
SEED = 1234  # the dropout seed


@functools.lru_cache(maxsize=None)
def dense_case(index: int):
    """Inputs of one dense case and the central differences of L = ⟨dO, O'⟩ + ⟨dLSE, LSE'⟩ of the definition
    in q, k, v and the sinks (computed once, shared by every route that uses the case)."""
    import torch

    from flashattn.reference import dropout_keep_mask

    b, h_q, h_kv, n, m, causal, window, softcap, alibi, dropout_p = DENSE_CASES[index]
    gen = torch.Generator().manual_seed(100 + index)
    q, k, v = (torch.randn(b, h, r, 16, generator=gen, dtype=torch.float64) for h, r in ((h_q, n), (h_kv, m), (h_kv, m)))
    sinks = 2 * torch.randn(h_q, generator=gen, dtype=torch.float64)
    do = torch.randn(b, h_q, n, 16, generator=gen, dtype=torch.float64)
    dlse = torch.randn(b, h_q, n, generator=gen, dtype=torch.float64)
    slopes = torch.tensor([0.5, 0.25][:h_q], dtype=torch.float32) if alibi else None  # float32, as the API takes
    keep = dropout_keep_mask(SEED, b, h_q, n, m, dropout_p).to(torch.float64) if dropout_p else None
    kwargs = dict(causal=causal, window=window, softcap=softcap, dropout_p=dropout_p,
                  slopes=None if slopes is None else slopes.double(), keep=keep)

    def loss():
        o, lse = definition(q, k, v, sinks, **kwargs)
        return (do * o).sum() + (dlse * lse).sum()

    fd = _central_differences(loss, (q, k, v, sinks))
    return dict(q=q, k=k, v=v, sinks=sinks, do=do, dlse=dlse, slopes=slopes, kwargs=kwargs,
                want=definition(q, k, v, sinks, **kwargs), fd=fd)


@functools.lru_cache(maxsize=None)
def packed_case():
    import torch

    lengths_q, lengths_k = PACKED_LENGTHS
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(sum(lengths_q), 2, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(sum(lengths_k), 1, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    sinks = 2 * torch.randn(2, generator=gen, dtype=torch.float64)
    do = torch.randn_like(q)
    dlse = torch.randn(2, sum(lengths_q), generator=gen, dtype=torch.float64)

    def loss():
        o, lse = _packed_definition(q, k, v, sinks, lengths_q, lengths_k, causal=True)
        return (do * o).sum() + (dlse * lse).sum()

    cu = lambda lengths: torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    return dict(q=q, k=k, v=v, sinks=sinks, do=do, dlse=dlse, cu_q=cu(lengths_q), cu_k=cu(lengths_k),
                want=_packed_definition(q, k, v, sinks, lengths_q, lengths_k, causal=True),
                fd=_central_differences(loss, (q, k, v, sinks)))


def _close(got, want, atol=1e-7, rtol=1e-6) -> bool:
    import torch

    return got.shape == want.shape and bool(torch.isfinite(got).all()) and torch.allclose(got, want, atol=atol, rtol=rtol)


def torch_route(forward, sink_grad, feed) -> bool:
    """``forward(o, lse, sinks, packed)`` and ``sink_grad(do, o, lse, dlse, sinks, packed)`` in the signature of
    flashattn.autograd.with_sinks / sinks_grad. Dense cases: the package's sink-free reference (naive_attention)
    through ``forward`` equals the definition; flashattn.reference.online_backward, which knows nothing of
    sinks, given ``feed(plain, final)`` gives dQ, dK, dV equal to the central differences, and ``sink_grad``
    given the same gives ∂L/∂s. Packed case: the sink-free varlen reference through ``forward`` and
    ``sink_grad`` (the packed layouts)."""
    import torch

    from flashattn import reference

    for index in range(len(DENSE_CASES)):
        c = dense_case(index)
        kw = c["kwargs"]
        variants = dict(window=kw["window"], softcap=kw["softcap"], alibi_slopes=c["slopes"],
                        dropout_p=kw["dropout_p"], seed=SEED if kw["dropout_p"] else None)
        plain = reference.naive_attention(c["q"], c["k"], c["v"], kw["causal"], **variants)
        final = forward(*plain, c["sinks"], False)
        if not all(_close(g, w, atol=1e-12, rtol=1e-12) for g, w in zip(final, c["want"])):
            return False
        o, lse = feed(plain, final)
        grads = reference.online_backward(c["do"], c["q"], c["k"], c["v"], o, lse, kw["causal"], dlse=c["dlse"],
                                          **variants)
        grads = (*grads, sink_grad(c["do"], o, lse, c["dlse"], c["sinks"], False))
        if not all(_close(g, w) for g, w in zip(grads, c["fd"])):
            return False
    c = packed_case()
    plain = reference.varlen_attention(c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"], causal=True)
    final = forward(*plain, c["sinks"], True)
    if not all(_close(g, w, atol=1e-12, rtol=1e-12) for g, w in zip(final, c["want"])):
        return False
    o, lse = feed(plain, final)
    return _close(sink_grad(c["do"], o, lse, c["dlse"], c["sinks"], True), c["fd"][3])


def package_route() -> bool:
    """End to end: flashattn.attention(..., sinks=) and flashattn.attention_varlen(..., sinks=) on float64
    CPU tensors (the reference backend, with_sinks after it, the custom backward): O', LSE' against the
    definition, and the gradients of q, k, v and the sinks against the central differences."""
    import torch

    import flashattn

    runs = []
    for index in range(len(DENSE_CASES)):
        c = dense_case(index)
        kw = c["kwargs"]
        inputs = [c[name].clone().requires_grad_() for name in ("q", "k", "v", "sinks")]
        o, lse = flashattn.attention(*inputs[:3], causal=kw["causal"], window=kw["window"], softcap=kw["softcap"] or None,
                                     alibi_slopes=c["slopes"], dropout_p=kw["dropout_p"],
                                     seed=SEED if kw["dropout_p"] else None, sinks=inputs[3], return_lse=True)
        runs.append((c, o, lse, inputs))
    c = packed_case()
    inputs = [c[name].clone().requires_grad_() for name in ("q", "k", "v", "sinks")]
    lengths_q, lengths_k = PACKED_LENGTHS
    o, lse = flashattn.attention_varlen(*inputs[:3], c["cu_q"], c["cu_k"], max(lengths_q), max(lengths_k),
                                        causal=True, sinks=inputs[3], return_lse=True)
    runs.append((c, o, lse, inputs))
    for c, o, lse, inputs in runs:
        if not (_close(o, c["want"][0], atol=1e-12, rtol=1e-12) and _close(lse, c["want"][1], atol=1e-12, rtol=1e-12)):
            return False
        grads = torch.autograd.grad((c["do"] * o).sum() + (c["dlse"] * lse).sum(), inputs)
        if not all(_close(g, w) for g, w in zip(grads, c["fd"])):
            return False
    return True


def torch_forms(forward, grad_row):
    """The module's row formulas (generic in exp and logaddexp) in the package's signatures: dense o (B, Hq, N, D),
    lse (B, Hq, N); packed o (total, Hq, D), lse (Hq, total)."""
    import torch

    def forward_t(o, lse, sinks, packed):
        rows = lse.transpose(0, 1)[..., None] if packed else lse[..., None]  # one row's LSE beside its o
        sink = sinks.view(1, -1, 1) if packed else sinks.view(1, -1, 1, 1)
        o_sink, lse_sink = forward(o, rows, sink, torch.exp, torch.logaddexp)
        lse_sink = lse_sink.expand_as(rows)[..., 0]
        return o_sink, lse_sink.transpose(0, 1) if packed else lse_sink

    def sink_grad_t(do, o, lse, dlse, sinks, packed):
        delta = (do * o).sum(-1)
        delta = delta.transpose(0, 1) if packed else delta  # lse's layout
        sink = sinks.view(-1, 1) if packed else sinks.view(1, -1, 1)
        return grad_row(sink, lse, delta, dlse, torch.exp).sum((1,) if packed else (0, 2))

    return forward_t, sink_grad_t
# --8<-- [end:numeric]


def check() -> CheckResult:
    from flashattn.autograd import sinks_grad, with_sinks

    ledger = Ledger()
    ledger.claim("symbolic scores s_0..s_2, sink σ, values (d = 2): O' = e^(LSE − LSE')·O is the softmax over "
                 "[s, σ] with σ's column dropped, and e^LSE' = Σ e^s + e^σ", lambda: symbolic_forward_route(with_sink))
    ledger.claim("symbolic: a row with no key (O = 0, LSE = −∞) gets O' = 0, LSE' = σ",
                 lambda: symbolic_empty_row_route(with_sink))
    ledger.claim("symbolic 2×2×1 and 1×3×2: the plain backward on (O', LSE') gives ∂L/∂S, ∂L/∂V; "
                 "Σ_i e^(σ − LSE'_i)(dLSE_i − δ'_i) = ∂L/∂σ (L = ⟨dO, O'⟩ + ⟨dLSE, LSE'⟩)",
                 lambda: symbolic_backward_route(with_sink, sink_grad_row, backward_inputs)
                 and symbolic_backward_route(with_sink, sink_grad_row, backward_inputs, N=1, M=3, d=2))
    ledger.claim("float64 central differences, the formulas above in torch: causal 7×5 GQA 4:2 with empty rows; "
                 "window + softcap + ALiBi + dropout 6×9; packed causal (empty sequences on either side)",
                 lambda: torch_route(*torch_forms(with_sink, sink_grad_row), backward_inputs))
    ledger.claim("float64 central differences, flashattn.autograd.with_sinks / sinks_grad and the sink-free "
                 "online_backward fed (O', LSE'): the same cases", lambda: torch_route(with_sinks, sinks_grad, backward_inputs))
    ledger.claim("flashattn.attention / attention_varlen(sinks=), float64 CPU: O', LSE' = the definition, "
                 "dQ, dK, dV, ds = central differences, the same cases", package_route)
    # --8<-- [start:negative]
    def sink_in_lse_only(o, lse, sink, exp, logaddexp):
        return o, logaddexp(lse, sink)  # the keys' weights still sum to 1

    def sinks_share(o, lse, sink, exp, logaddexp):
        lse_sink = logaddexp(lse, sink)
        return o * exp(sink - lse_sink), lse_sink  # O weighted by the sink's probability, not the keys'

    def lse_without_sink(o, lse, sink, exp, logaddexp):
        return with_sink(o, lse, sink, exp, logaddexp)[0], lse  # the backward then recomputes P without it

    def sign_flipped(sink, lse, delta, dlse, exp):
        return -sink_grad_row(sink, lse, delta, dlse, exp)

    def dlse_left_out(sink, lse, delta, dlse, exp):
        return -exp(sink - lse) * delta  # the gradient through LSE' forgotten

    def delta_sink_free(plain, final):
        return plain[0], final[1]  # δ from the output before the sink rescaled it

    def p_sink_free(plain, final):
        return final[0], plain[1]  # P recomputed from the LSE without the sink

    for name, fwd in (("O' = O, the sink in the LSE only", sink_in_lse_only), ("O' = e^(s − LSE')·O", sinks_share),
                      ("LSE' = LSE, the sink left out", lse_without_sink)):
        ledger.control(f"{name}: symbolic", lambda: not symbolic_forward_route(fwd))
        ledger.control(f"{name}: torch", lambda: not torch_route(*torch_forms(fwd, sink_grad_row), backward_inputs))
    for name, row, feed in (("δ from the sink-free O", sink_grad_row, delta_sink_free),
                            ("P from the sink-free LSE", sink_grad_row, p_sink_free),
                            ("∂L/∂s with its sign flipped", sign_flipped, backward_inputs),
                            ("∂L/∂s without dLSE", dlse_left_out, backward_inputs)):
        ledger.control(f"{name}: symbolic", lambda: not symbolic_backward_route(with_sink, row, feed))
        ledger.control(f"{name}: torch", lambda: not torch_route(*torch_forms(with_sink, row), feed))
    # --8<-- [end:negative]
    sizes = ("symbolic rows of 3 keys, backward 2×2×1 and 1×3×2; torch 2×(4:2)×7×5 causal, 1×(2:1)×6×9 with "
             "window, softcap, ALiBi, dropout, packed (3,5) (0,2) (4,0) (2,3) at d = 16")
    return ledger.result(identity=IDENTITY, method=METHOD, sizes=sizes, negative_control=NEGATIVE, module=__name__)
