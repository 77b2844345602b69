"""Ring attention over torch.distributed, against single-process attention on the full sequence.

CPU: real process groups (gloo on the loopback interface) of 2 and 4 processes, float64, compared with
``naive_attention`` of the whole sequence: output, LSE and the gradients of q, k, v, for both layouts,
causal and not, GQA, head dims that are not powers of two, strided inputs, large logits, a subgroup of
3 ranks, and the errors for shards that cannot be split evenly. Each world size is launched once and
runs every case (starting processes is the slow part); each case is then its own test.

GPU (2 and 4 GPUs, each skipped where the machine has fewer): NCCL, float16 and bfloat16, the ring,
Ulysses and the hybrid against the single-GPU kernels on the full sequence, judged as a ratio of their
errors against float64.
"""

from __future__ import annotations

import datetime
import math
import os
import queue as queue_mod
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashattn.distributed as fd
from flashattn import schedule
from flashattn.reference import causal_mask, naive_attention, varlen_attention
from flashattn.testing import assert_close_ratio, random_qkv, rel_err

LAUNCH_TIMEOUT_S = 120  # per world; a hang (a rank stuck in a send) fails the test instead of blocking CI
GLOO_TIMEOUT_S = 30

# name -> problem; n is the full sequence length as a multiple of 2P ("chunks" per zig-zag chunk).
CASES = {
    "plain": dict(h_q=2, h_kv=2, d=16, chunk=4, causal=False, layout="contiguous"),
    "plain-zigzag": dict(h_q=2, h_kv=2, d=16, chunk=4, causal=False, layout="zigzag"),
    "causal-contiguous": dict(h_q=2, h_kv=2, d=16, chunk=4, causal=True, layout="contiguous"),
    "causal-zigzag": dict(h_q=2, h_kv=2, d=16, chunk=4, causal=True, layout="zigzag"),
    "gqa-causal-zigzag": dict(h_q=4, h_kv=2, d=16, chunk=3, causal=True, layout="zigzag"),
    "mqa-d40": dict(h_q=3, h_kv=1, d=40, chunk=5, causal=False, layout="contiguous"),
    "d24-causal-zigzag": dict(h_q=2, h_kv=1, d=24, chunk=3, causal=True, layout="zigzag"),
    "large-logits": dict(h_q=2, h_kv=2, d=16, chunk=4, causal=True, layout="zigzag", std=6.0, scale=0.9),
    # Shards longer than the reference's 64-row tiles, handed over as (B, N, H, D) storage viewed (B, H, N, D).
    "strided-long": dict(h_q=2, h_kv=1, d=16, chunk=40, causal=True, layout="zigzag", strided=True),
    # Sliding windows over the full sequence: wider than a chunk, so they reach across shards, and
    # narrower than the sequence, so some shard pairs are skipped
    "window-causal-zigzag": dict(h_q=2, h_kv=1, d=16, chunk=4, causal=True, layout="zigzag", window=(5, None)),
    "window-both-sides-contiguous": dict(h_q=2, h_kv=2, d=24, chunk=4, causal=False, layout="contiguous",
                                         window=(6, 3)),
    # Packed documents over the full sequence (B = 1): one inside a chunk, some across chunks and shards,
    # an empty one
    "documents-causal-zigzag": dict(h_q=2, h_kv=1, d=16, chunk=4, causal=True, layout="zigzag",
                                    documents=lambda n: (0, 3, 5, 5, n // 2 + 1, n - 2, n)),
    "documents-contiguous": dict(h_q=2, h_kv=2, d=24, chunk=4, causal=False, layout="contiguous",
                                 documents=lambda n: (0, 6, n - 5, n)),
}
# Ulysses splits the heads over the ranks: every case has a multiple of 4 query heads.
ULYSSES_CASES = {
    "ulysses-plain": dict(h_q=4, h_kv=4, d=16, chunk=4, causal=False, layout="contiguous"),
    "ulysses-causal-zigzag": dict(h_q=4, h_kv=4, d=16, chunk=4, causal=True, layout="zigzag"),
    # fewer K/V heads than ranks (4 ranks): each K/V head is repeated before the exchange
    "ulysses-gqa-causal": dict(h_q=8, h_kv=2, d=24, chunk=3, causal=True, layout="contiguous"),
    "ulysses-mqa-d40": dict(h_q=4, h_kv=1, d=40, chunk=5, causal=False, layout="zigzag"),
    "ulysses-large-logits": dict(h_q=4, h_kv=2, d=16, chunk=4, causal=True, layout="zigzag", std=6.0, scale=0.9),
    "ulysses-strided-long": dict(h_q=4, h_kv=4, d=16, chunk=40, causal=True, layout="contiguous", strided=True),
    "ulysses-window-causal-zigzag": dict(h_q=4, h_kv=2, d=16, chunk=4, causal=True, layout="zigzag", window=(5, 0)),
    "ulysses-documents-causal-zigzag": dict(h_q=4, h_kv=2, d=16, chunk=4, causal=True, layout="zigzag",
                                            documents=lambda n: (0, 3, n // 2 + 1, n)),
}
# Hybrid: Ulysses over groups of `width` ranks, the ring across the groups (width 1: the ring alone).
HYBRID_CASES = {
    "hybrid-width2-causal-zigzag": dict(h_q=4, h_kv=2, d=16, chunk=4, causal=True, layout="zigzag", width=2),
    "hybrid-width2-plain": dict(h_q=4, h_kv=4, d=24, chunk=3, causal=False, layout="contiguous", width=2),
    "hybrid-width1-causal-zigzag": dict(h_q=2, h_kv=1, d=16, chunk=4, causal=True, layout="zigzag", width=1),
    "hybrid-width2-window-causal-zigzag": dict(h_q=4, h_kv=2, d=16, chunk=4, causal=True, layout="zigzag", width=2,
                                               window=(9, None)),
    "hybrid-width2-documents-causal-zigzag": dict(h_q=4, h_kv=2, d=16, chunk=4, causal=True, layout="zigzag",
                                                  width=2, documents=lambda n: (0, 7, n - 3, n)),
}
# The forward fetches key/value shards straight from their owners in small groups
# (fd.DIRECT_FETCH_MAX_WORLD); these cases pass them along the ring instead, as larger groups do.
RELAY_CASES = ["relay-causal-zigzag", "relay-window-causal-zigzag", "relay-documents-causal-zigzag", "relay-plain"]
# The direct fetch is one all-gather (fd.DIRECT_FETCH_BY); these cases fetch by send/receive pairs.
SEND_RECV_CASES = ["send-recv-causal-zigzag", "send-recv-plain"]
CHECKS = [*CASES, *RELAY_CASES, *SEND_RECV_CASES, *ULYSSES_CASES, *HYBRID_CASES, "no-grad", "gather", "odd-zigzag-shard", "shard-length-mismatch",
          "subgroup-of-3", "twice", "ulysses-heads-indivisible"]


# --------------------------------------------------------------------------------------------------
# what every rank runs
# --------------------------------------------------------------------------------------------------
def _problem(case: dict, world: int, device, dtype, seed: int):
    """The full-sequence inputs (identical on every rank: same seed) and an upstream gradient."""
    n = 2 * world * case["chunk"]
    g = torch.Generator(device=device).manual_seed(seed)
    layout = "bnhd" if case.get("strided") else "bhnd"
    q, k, v = random_qkv(1 if "documents" in case else 2, case["h_q"], case["h_kv"], n, n, case["d"], dtype=dtype, device=device,
                         generator=g, layout=layout, std=case.get("std", 1.0))
    do = torch.randn(q.shape, dtype=dtype, device=device, generator=g)
    return q, k, v, do


def _documents(case: dict, n: int):
    return case["documents"](n) if "documents" in case else None


def _reference(full, case: dict, scale):
    """float64 attention on the full sequence, by the definition: dense, or over the case's documents."""
    documents = _documents(case, full[0].shape[2])
    if documents is None:
        return naive_attention(*full, case["causal"], scale, window=case.get("window"))
    cu = torch.tensor(documents, dtype=torch.int32)
    o, lse = varlen_attention(*(x[0].transpose(0, 1) for x in full), cu, cu, case["causal"], scale)
    return o.transpose(0, 1)[None], lse[None]


def _run_attention(case: dict, rank: int, world: int, group=None) -> dict:
    """Ring attention on this rank's shards vs float64 naive attention on the full sequence: max errors."""
    q, k, v, do = _problem(case, world, "cpu", torch.float64, seed=1234)
    scale = case.get("scale")
    full = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o_ref, lse_ref = _reference(full, case, scale)
    o_ref.backward(do)
    # --8<-- [start:usage]
    shard = lambda x, dim=-2: fd.shard_sequence(x, rank, world, layout=case["layout"], dim=dim)  # noqa: E731
    local = [shard(x) for x in (q, k, v)]
    if case.get("strided"):  # keep the (B, N, H, D) storage of the inputs
        local = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in local]
    local = [x.detach().requires_grad_() for x in local]
    o, lse = fd.ring_attention(*local, group=group, causal=case["causal"], scale=scale, layout=case["layout"],
                               return_lse=True, window=case.get("window"), cu_seqlens=_documents(case, q.shape[2]))
    o.backward(shard(do))
    # --8<-- [end:usage]
    errors = {"o": (o, shard(o_ref)), "lse": (lse, shard(lse_ref, dim=-1))}
    errors.update({name: (x.grad, shard(ref.grad)) for name, x, ref in zip(("dq", "dk", "dv"), local, full)})
    return {name: _max_err(got, want) for name, (got, want) in errors.items()}


def _against_full(case: dict, world: int, seed: int, shard, attend) -> dict:
    """``attend(q, k, v) -> (o, lse)`` on this rank's shards (cut by ``shard``) against float64 naive
    attention on the full sequence: max errors of o, lse, dq, dk, dv (the steps of
    :func:`_run_attention`, the ring's documented example, for the other context-parallel paths)."""
    q, k, v, do = _problem(case, world, "cpu", torch.float64, seed=seed)
    full = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o_ref, lse_ref = _reference(full, case, case.get("scale"))
    o_ref.backward(do)
    local = [shard(x) for x in (q, k, v)]
    if case.get("strided"):  # (B, N, H, D) storage viewed as (B, H, N, D)
        local = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in local]
    local = [x.detach().requires_grad_() for x in local]
    o, lse = attend(*local)
    o.backward(shard(do))
    errors = {"o": (o, shard(o_ref)), "lse": (lse, shard(lse_ref, dim=-1))}
    errors.update({name: (x.grad, shard(ref.grad)) for name, x, ref in zip(("dq", "dk", "dv"), local, full)})
    return {name: _max_err(got, want) for name, (got, want) in errors.items()}


def _run_ulysses(case: dict, rank: int, world: int) -> dict:
    """ulysses_attention on this rank's shards vs float64 naive attention on the full sequence."""
    shard = lambda x, dim=-2: fd.shard_sequence(x, rank, world, layout=case["layout"], dim=dim)  # noqa: E731
    return _against_full(case, world, 4321, shard, lambda q, k, v: fd.ulysses_attention(
        q, k, v, causal=case["causal"], scale=case.get("scale"), layout=case["layout"], return_lse=True,
        window=case.get("window"), cu_seqlens=_documents(case, 2 * world * case["chunk"])))


def _run_hybrid(case: dict, rank: int, world: int) -> dict:
    """hybrid_attention on a grid of world / width ring positions x width Ulysses ranks vs float64 naive
    attention on the full sequence. Rank r sits at ring position r // width, Ulysses rank r % width."""
    width = case["width"]
    ring_size = world // width
    # every rank of the world takes part in creating every group
    ulysses_groups = [dist.new_group([g * width + u for u in range(width)]) for g in range(ring_size)]
    ring_groups = [dist.new_group([g * width + u for g in range(ring_size)]) for u in range(width)]
    position, piece = divmod(rank, width)
    shard = lambda x, dim=-2: fd.shard_sequence_2d(x, position, ring_size, piece, width,  # noqa: E731
                                                   layout=case["layout"], dim=dim)
    return _against_full(case, world, 2468, shard, lambda q, k, v: fd.hybrid_attention(
        q, k, v, ulysses_group=ulysses_groups[position], ring_group=ring_groups[piece], causal=case["causal"],
        layout=case["layout"], return_lse=True, window=case.get("window"),
        cu_seqlens=_documents(case, 2 * world * case["chunk"])))


def _max_err(got, want) -> float:
    """Largest difference relative to the largest entry of ``want`` (absolute when that is below 1)."""
    if got is None or got.shape != want.shape or not torch.isfinite(got).all():
        return math.inf
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def _check(name: str, rank: int, world: int):
    if name in CASES:
        return _run_attention(CASES[name], rank, world)
    if name in RELAY_CASES:
        before, fd.DIRECT_FETCH_MAX_WORLD = fd.DIRECT_FETCH_MAX_WORLD, 0
        try:
            return _run_attention(CASES[name.removeprefix("relay-")], rank, world)
        finally:
            fd.DIRECT_FETCH_MAX_WORLD = before
    if name in SEND_RECV_CASES:
        before, fd.DIRECT_FETCH_BY = fd.DIRECT_FETCH_BY, "send_recv"
        try:
            return _run_attention(CASES[name.removeprefix("send-recv-")], rank, world)
        finally:
            fd.DIRECT_FETCH_BY = before
    if name in ULYSSES_CASES:
        return _run_ulysses(ULYSSES_CASES[name], rank, world)
    if name in HYBRID_CASES:
        return _run_hybrid(HYBRID_CASES[name], rank, world)
    if name == "ulysses-heads-indivisible":  # query heads that do not split over the ranks (6 over 4, 3 over 2)
        q, k, v = random_qkv(1, 6 if world == 4 else 3, 3 if world == 4 else 1, 4, 4, 16)
        try:
            fd.ulysses_attention(q, k, v)
        except ValueError as exc:
            return {"message": str(exc)}
        return {"message": None}
    if name == "no-grad":  # inference: no autograd graph, same output
        case = CASES["causal-zigzag"]
        q, k, v, _ = _problem(case, world, "cpu", torch.float64, seed=7)
        with torch.no_grad():
            o = fd.ring_attention(*(fd.shard_sequence(x, rank, world) for x in (q, k, v)), causal=True, layout="zigzag")
        return {"o": _max_err(o, fd.shard_sequence(naive_attention(q, k, v, True)[0], rank, world))}
    if name == "twice":  # create_graph=True: first-order gradients as usual; a second backward raises
        case = CASES["causal-zigzag"]
        q, k, v, _ = _problem(case, world, "cpu", torch.float64, seed=9)
        local = [fd.shard_sequence(x, rank, world, layout="zigzag").requires_grad_() for x in (q, k, v)]
        o = fd.ring_attention(*local, causal=True, layout="zigzag")
        plain = torch.autograd.grad((o ** 2).sum(), local, retain_graph=True)
        graphed = torch.autograd.grad((o ** 2).sum(), local, create_graph=True)
        penalty = sum((g ** 2).sum() for g in graphed) + (local[0] ** 2).sum()
        messages = []
        for second in (lambda: penalty.backward(retain_graph=True),
                       lambda: torch.autograd.grad(penalty, local[:1], retain_graph=True)):
            try:
                second()
            except RuntimeError as exc:
                messages.append(str(exc))
            else:
                messages.append(None)
        return {"same": all(torch.equal(a, b) for a, b in zip(plain, graphed)), "messages": messages}
    if name == "gather":  # all-gather of the shards gives back the full sequence, in order
        x = torch.arange(2 * 3 * 4 * world * 5, dtype=torch.float64).reshape(2, 3, 4 * world, 5)
        out = {}
        for layout in fd.LAYOUTS:
            out[layout] = _max_err(fd.gather_sequence(fd.shard_sequence(x, rank, world, layout=layout), layout=layout), x)
        return out
    if name == "odd-zigzag-shard":  # every rank raises the same error before any message is sent
        q, k, v = random_qkv(1, 2, 2, 5, 5, 16)
        try:
            fd.ring_attention(q, k, v, causal=True, layout="zigzag")
        except ValueError as exc:
            return {"message": str(exc)}
        return {"message": None}
    if name == "shard-length-mismatch":
        q, k, v = random_qkv(1, 2, 2, 4, 6, 16)
        try:
            fd.ring_attention(q, k, v)
        except ValueError as exc:
            return {"message": str(exc)}
        return {"message": None}
    if name == "subgroup-of-3":  # a ring over global ranks 1, 2, 3: peers are global ranks, P = 3
        members = [1, 2, 3]
        if world < 4:
            return {"skipped": True}
        group = dist.new_group(members)  # every rank of the world takes part in creating it
        if rank not in members:
            return {"skipped": True}
        case = CASES["gqa-causal-zigzag"]
        return _run_attention(case, dist.get_rank(group), len(members), group=group)
    raise KeyError(name)


def _worker(rank: int, world: int, port: int, names: list, results) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only: nothing listens on a real interface
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    except Exception:  # noqa: BLE001 - handed to the parent test
        results.put(("<init>", rank, traceback.format_exc(), None))
        return
    try:
        for name in names:
            try:
                results.put((name, rank, None, _check(name, rank, world)))
            except Exception:  # noqa: BLE001 - handed to the parent test
                results.put((name, rank, traceback.format_exc(), None))
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# the parent: start the world, collect, bound the time
# --------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker, world: int, args: tuple, expected: int, timeout_s: float = LAUNCH_TIMEOUT_S):
    """Run ``worker(rank, world, port, *args, queue)`` in ``world`` spawned processes; return what they put
    on the queue. Fails (after killing every process) on a time overrun or a process that dies early."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(rank, world, port, *args, results), daemon=True) for rank in range(world)]
    for p in procs:
        p.start()
    got, deadline = [], time.monotonic() + timeout_s
    try:
        while len(got) < expected:
            if time.monotonic() > deadline:
                pytest.fail(f"{world} processes did not finish in {timeout_s} s ({len(got)}/{expected} results)")
            try:
                got.append(results.get(timeout=0.5))
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    codes = [p.exitcode for p in procs]
                    pytest.fail(f"processes exited with codes {codes} after {len(got)}/{expected} results")
                continue
            if got[-1][0] == "<init>":
                pytest.fail(f"rank {got[-1][1]} could not join the process group:\n{got[-1][2]}")
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return got


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def world(request):
    size = request.param
    start = time.perf_counter()
    got = launch(_worker, size, (CHECKS,), expected=len(CHECKS) * size)
    by_name: dict = {}
    for name, rank, error, result in got:
        by_name.setdefault(name, {})[rank] = (error, result)
    print(f"\n{size} gloo processes ran {len(CHECKS)} checks in {time.perf_counter() - start:.1f} s")
    return size, by_name


def _results(world, name: str) -> list:
    """Every rank's result for one check; a rank's exception fails the test with its traceback."""
    size, by_name = world
    ranks = by_name.get(name, {})
    assert sorted(ranks) == list(range(size)), f"{name}: results from ranks {sorted(ranks)} of {size}"
    for rank, (error, _) in sorted(ranks.items()):
        assert error is None, f"{name} raised on rank {rank}:\n{error}"
    return [result for _, (_, result) in sorted(ranks.items())]


# --------------------------------------------------------------------------------------------------
# the multi-process tests
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [*CASES, *RELAY_CASES, *SEND_RECV_CASES])
def test_ring_attention_matches_full_attention(world, name):
    """Output, LSE and all three gradients of every rank's shard, float64: equal to rounding (1e-12 of
    the largest entry)."""
    for rank, errors in enumerate(_results(world, name)):
        assert set(errors) == {"o", "lse", "dq", "dk", "dv"}
        for what, err in errors.items():
            assert err <= 1e-12, f"{name}, rank {rank}: {what} differs by {err:.3e}"


@pytest.mark.parametrize("name", list(ULYSSES_CASES))
def test_ulysses_attention_matches_full_attention(world, name):
    """Ulysses: output, LSE and all three gradients of every rank's shard equal float64 full attention
    to rounding, with K/V heads fewer than the ranks (repeated) and both layouts."""
    for rank, errors in enumerate(_results(world, name)):
        assert set(errors) == {"o", "lse", "dq", "dk", "dv"}
        for what, err in errors.items():
            assert err <= 1e-12, f"{name}, rank {rank}: {what} differs by {err:.3e}"


@pytest.mark.parametrize("name", list(HYBRID_CASES))
def test_hybrid_attention_matches_full_attention(world, name):
    """Ulysses inside groups x the ring across them (2 x 2 on four processes; on two, one group of two
    or a ring of two): every rank's output, LSE and gradients equal float64 full attention to rounding."""
    for rank, errors in enumerate(_results(world, name)):
        assert set(errors) == {"o", "lse", "dq", "dk", "dv"}
        for what, err in errors.items():
            assert err <= 1e-12, f"{name}, rank {rank}: {what} differs by {err:.3e}"


def test_shard_sequence_2d_cuts_each_ring_shard_into_contiguous_pieces():
    x = torch.arange(48.0).reshape(1, 1, 48, 1)
    pieces = [fd.shard_sequence_2d(x, g, 2, u, 3, layout="zigzag") for g in range(2) for u in range(3)]
    for g in range(2):  # the ring position's zig-zag shard, back from its pieces in order
        ring_shard = torch.cat(pieces[3 * g: 3 * g + 3], dim=-2)
        assert torch.equal(ring_shard, fd.shard_sequence(x, g, 2, layout="zigzag"))
    assert torch.equal(fd.unshard_sequence([torch.cat(pieces[:3], -2), torch.cat(pieces[3:], -2)], layout="zigzag"), x)


def test_ulysses_refuses_heads_that_do_not_split(world):
    for result in _results(world, "ulysses-heads-indivisible"):
        assert result["message"] is not None and "Hq" in result["message"] and "divisible" in result["message"]


@pytest.mark.parametrize("heads_q, heads_kv, world_size, repeats", [
    (8, 8, 4, 1), (8, 2, 4, 2), (8, 1, 4, 4), (12, 3, 4, 4), (6, 2, 3, 3), (16, 4, 8, 2), (32, 8, 4, 1)])
def test_kv_head_repeats_is_the_least_that_splits(heads_q, heads_kv, world_size, repeats):
    assert fd.kv_head_repeats(heads_q, heads_kv, world_size) == repeats
    f = repeats
    assert (heads_kv * f) % world_size == 0 and heads_q % (heads_kv * f) == 0
    assert all((heads_kv * g) % world_size or heads_q % (heads_kv * g) for g in range(1, f))  # nothing smaller


def test_no_grad_inference(world):
    for rank, errors in enumerate(_results(world, "no-grad")):
        assert errors["o"] <= 1e-12, f"rank {rank}: {errors}"


def test_a_second_backward_raises(world):
    """The ring's backward (exchanges that autograd does not see) gives its first-order gradients under
    create_graph=True too, bitwise those of a plain backward, and a second backward through them
    raises instead of dropping their terms."""
    for result in _results(world, "twice"):
        assert result["same"] and all(m and "not differentiable" in m for m in result["messages"]), result


def test_gather_sequence_round_trip(world):
    for errors in _results(world, "gather"):
        assert errors == {layout: 0.0 for layout in fd.LAYOUTS}


def test_odd_zigzag_shard_is_rejected(world):
    for result in _results(world, "odd-zigzag-shard"):
        assert result["message"] is not None, "an odd shard length was accepted for layout='zigzag'"
        assert "zigzag" in result["message"] and "even" in result["message"] and "5" in result["message"]


def test_shards_of_different_length_are_rejected(world):
    for result in _results(world, "shard-length-mismatch"):
        assert result["message"] is not None and "q" in result["message"] and "k" in result["message"]


def test_subgroup_ring_of_three_ranks(world):
    size, _ = world
    results = _results(world, "subgroup-of-3")
    if size < 4:
        pytest.skip("needs 4 ranks")
    assert results[0] == {"skipped": True}
    for rank, errors in enumerate(results[1:], 1):
        for what, err in errors.items():
            assert err <= 1e-12, f"rank {rank}: {what} differs by {err:.3e}"


# --------------------------------------------------------------------------------------------------
# single-process tests: layouts, schedule, merge, errors
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", fd.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_shard_unshard_round_trip(layout, world_size):
    x = torch.randn(2, 3, 4 * world_size * 3, 5)
    shards = [fd.shard_sequence(x, r, world_size, layout=layout) for r in range(world_size)]
    assert all(s.shape[2] == x.shape[2] // world_size for s in shards)
    assert torch.equal(fd.unshard_sequence(shards, layout=layout), x)
    # Along another dim too: (B, N, H, D) tensors shard along dim 1.
    xt = x.transpose(1, 2)
    assert torch.equal(fd.unshard_sequence([fd.shard_sequence(xt, r, world_size, layout=layout, dim=1)
                                            for r in range(world_size)], layout=layout, dim=1), xt)


def test_zigzag_chunks():
    assert [fd.chunk_ids(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [fd.chunk_ids(r, 3, "contiguous") for r in range(3)] == [(0,), (1,), (2,)]


@pytest.mark.parametrize("layout,n,world_size", [("zigzag", 12, 4), ("zigzag", 10, 2), ("contiguous", 10, 4)])
def test_uneven_sequence_is_rejected(layout, n, world_size):
    with pytest.raises(ValueError, match=r"sequence length N of x \(%d\) must be divisible" % n):
        fd.shard_sequence(torch.zeros(1, 1, n, 16), 0, world_size, layout=layout)


def _schedule_mask(world_size: int, chunk: int, causal: bool, layout: str, window=None, documents=None
                   ) -> torch.Tensor:
    """The full (N, N) count of the query/key pairs the ring's steps compute, from the pieces of
    :func:`ring_pieces` (:func:`ring_step`'s one step without a window or documents), each piece through
    its own causal flag, local window and documents; a pair computed twice counts twice."""
    n_local = chunk * len(fd.chunk_ids(0, world_size, layout))
    positions = [fd.shard_sequence(torch.arange(n_local * world_size)[:, None], r, world_size, layout=layout)[:, 0]
                 for r in range(world_size)]
    mask = torch.zeros(n_local * world_size, n_local * world_size, dtype=torch.long)
    for rank in range(world_size):
        for source in range(world_size):
            for piece in fd.ring_pieces(rank, source, world_size, n_local, causal, layout, window, documents):
                rows, cols = positions[rank][piece.rows], positions[source][piece.cols]
                mask[rows[:, None], cols[None, :]] += _visible(len(rows), len(cols), piece.causal, piece.window,
                                                               piece.documents).long()
    return mask


def _visible(n: int, m: int, causal: bool, window=None, documents=None) -> torch.Tensor:
    """(n, m) boolean: which keys each query sees, by the schedule's functions (as the reference masks),
    and, with ``documents`` (cumulative lengths over n = m rows), only inside its own document."""
    rows, cols = torch.arange(n)[:, None], torch.arange(m)[None, :]
    visible = schedule.visible(rows, cols, n, m, causal)
    if window is not None:
        visible = visible & schedule.in_window(rows, cols, n, m, *schedule.window_bounds(n, m, causal, tuple(window)))
    if documents is not None:
        doc = torch.zeros(n, dtype=torch.long)
        for d, (start, end) in enumerate(zip(documents[:-1], documents[1:])):
            doc[start:end] = d
        visible = visible & (doc[:, None] == doc[None, :])
    return visible


@pytest.mark.parametrize("layout", fd.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_schedule_covers_each_visible_pair_once(world_size, causal, layout):
    """Brute force: the steps of all ranks compute every visible (query, key) pair exactly once and no
    masked pair; so every skipped step was fully masked and every unmasked step fully visible."""
    mask = _schedule_mask(world_size, 3, causal, layout)
    n = mask.shape[0]
    want = causal_mask(n, n).long() if causal else torch.ones(n, n, dtype=torch.long)
    assert torch.equal(mask, want)


@pytest.mark.parametrize("layout", fd.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("causal,window", [(True, (0, None)), (True, (2, None)), (True, (5, 0)), (True, (11, None)),
                                           (True, (100, None)), (False, (3, 3)), (False, (0, 7)), (False, (None, 2)),
                                           (False, (6, None)), (False, (1, 0))])
def test_window_pieces_cover_each_pair_in_the_window_once(world_size, causal, window, layout):
    """Brute force: under a global window the pieces of all ranks' steps compute every pair inside it
    exactly once and none outside it, with windows narrower than a chunk, reaching over several
    shards, and wider than the sequence."""
    for chunk in (1, 3, 4):
        mask = _schedule_mask(world_size, chunk, causal, layout, window)
        n = mask.shape[0]
        assert torch.equal(mask, _visible(n, n, causal, window).long())


@pytest.mark.parametrize("layout", fd.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_document_pieces_cover_each_pair_of_a_document_once(world_size, causal, layout):
    """Brute force: with packed documents the pieces of all ranks' steps compute every pair inside one
    document (causal: j <= i) exactly once and no other, for random boundaries: documents inside a
    chunk, across chunks and shards, one over everything, empty ones."""
    gen = torch.Generator().manual_seed(world_size * 2 + causal)
    for chunk in (1, 3, 4, 7):
        n = chunk * world_size * (2 if layout == "zigzag" else 1)
        for _ in range(6):
            cuts = torch.randint(0, n + 1, (int(torch.randint(0, 6, (1,), generator=gen)),), generator=gen)
            documents = tuple(sorted({0, n, *cuts.tolist()}))
            mask = _schedule_mask(world_size, chunk, causal, layout, documents=documents)
            assert torch.equal(mask, _visible(n, n, causal, documents=documents).long()), documents


def test_packed_pieces_run_the_kernels_under_the_interpreter():
    """A piece with documents runs the packed kernels on (1, H, L, D) slices seen as (L, H, D): forward
    and backward against the float64 packed reference (CPU, float16; kernels under TRITON_INTERPRET=1,
    else the reference)."""
    documents = (0, 5, 6, 19, 24)
    q, k, v = random_qkv(1, 4, 2, 24, 24, 16, dtype=torch.float16, generator=torch.Generator().manual_seed(3))
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).half()
    o, lse = fd._local_forward(q, k, v, True, 0.25, documents=documents)
    grads = fd._local_backward(do, q, k, v, o.to(q.dtype), lse, True, 0.25, documents=documents)
    cu = torch.tensor(documents, dtype=torch.int32)
    refs = []
    for dtype in (torch.float64, torch.float16):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        o_r, lse_r = varlen_attention(*(x[0].transpose(0, 1) for x in leaves), cu, cu, True, 0.25)
        o_r = o_r.transpose(0, 1)[None]
        refs.append((o_r, lse_r[None], *torch.autograd.grad(o_r, leaves, do.to(dtype))))
    for name, got, ref, low in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *grads), *refs):
        assert got.shape == ref.shape, name
        assert_close_ratio(name, got.detach().to(ref.dtype), ref.detach(), low.detach().to(ref.dtype))


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(cu_seqlens=[0, 3, 16], window=(2, 0)), ValueError, "cannot be combined"),
    (dict(cu_seqlens=[0, 3, 15]), ValueError, "from 0 to the full sequence length"),
    (dict(cu_seqlens=[0, 9, 3, 16]), ValueError, "non-decreasing"),
    (dict(cu_seqlens=torch.tensor([0.0, 16.0])), TypeError, "integer tensor"),
    (dict(cu_seqlens=[0, 2.5, 16]), TypeError, "must hold ints"),
])
def test_bad_documents_are_refused(kwargs, error, words):
    q = torch.zeros(1, 2, 16, 16)
    with pytest.raises(error, match=words):
        fd._check_documents(kwargs["cu_seqlens"], q, 1, kwargs.get("window"))
    with pytest.raises(ValueError, match="batch of 1"):
        fd._check_documents([0, 16], torch.zeros(2, 2, 16, 16), 1, None)
    assert fd._check_documents(torch.tensor([0, 4, 4, 16]), q, 1, None) == (0, 4, 16)


def test_zigzag_balances_causal_work():
    """Pairs computed per rank: equal across ranks with zig-zag, skewed P-fold-ish with contiguous shards."""
    world_size, chunk = 4, 8
    for layout, balanced in (("zigzag", True), ("contiguous", False)):
        n_local = chunk * len(fd.chunk_ids(0, world_size, layout))
        work = []
        for rank in range(world_size):
            pairs = 0
            for source in range(world_size):
                plan = fd.ring_step(rank, source, n_local, True, layout)
                if plan is not None:
                    r, c = plan.rows.stop - plan.rows.start, plan.cols.stop - plan.cols.start
                    pairs += int(causal_mask(r, c).sum()) if plan.causal else r * c
            work.append(pairs)
        assert (len(set(work)) == 1) == balanced, (layout, work)
    # Every zig-zag step (except the own shard, which is causal) is one full half-by-whole block.
    for source in range(1, world_size):
        plan = fd.ring_step(0, source, 2 * chunk, True, "zigzag")
        assert (plan.rows.stop - plan.rows.start) * (plan.cols.stop - plan.cols.start) == 2 * chunk * chunk


def test_merge_pair_is_exact_and_handles_empty_partials():
    from derivations.merge import merge_pair

    g = torch.Generator().manual_seed(3)
    scores = torch.randn(4, 10, generator=g, dtype=torch.float64) * 5
    values = torch.randn(10, 3, generator=g, dtype=torch.float64)
    scores[1, :6] = -math.inf  # row 1: the first partial is empty
    scores[2] = -math.inf  # row 2: both partials are empty

    def partial(cols):
        s = scores[:, cols]
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0, lse)[:, None])
        return p @ values[cols], lse

    (o_a, lse_a), (o_b, lse_b), (o, lse) = partial(slice(0, 6)), partial(slice(6, 10)), partial(slice(0, 10))
    o_m, lse_m = fd.merge_pair(o_a, lse_a, o_b, lse_b)
    assert not torch.isnan(o_m).any() and not torch.isnan(lse_m).any()
    assert torch.allclose(o_m, o, rtol=0, atol=1e-14) and torch.equal(torch.isinf(lse_m), torch.isinf(lse))
    assert torch.allclose(lse_m[~torch.isinf(lse)], lse[~torch.isinf(lse)], rtol=0, atol=1e-14)
    assert torch.equal(o_m[2], torch.zeros(3, dtype=torch.float64))
    # The same formula as the derivation proves, entry by entry.
    for i in range(4):
        for c in range(3):
            o_ref, lse_ref = merge_pair((float(o_a[i, c]), float(lse_a[i])), (float(o_b[i, c]), float(lse_b[i])),
                                        math.exp, lambda x, y: float(torch.logaddexp(torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64))))
            assert math.isclose(float(o_m[i, c]), o_ref, rel_tol=1e-14, abs_tol=1e-14)
            assert lse_ref == float(lse_m[i]) or math.isclose(lse_ref, float(lse_m[i]), rel_tol=1e-14)


def test_merge_into_writes_merge_pair_in_place():
    """The ring forward's in-place merge gives merge_pair's result to float32 rounding, into views of a
    larger running result (rows of it, as the ring's zig-zag pieces are), empty rows and large LSEs
    included, and leaves the other rows alone."""
    g = torch.Generator().manual_seed(3)
    o = torch.randn(2, 3, 40, 8, generator=g)
    lse = 50.0 * torch.randn(2, 3, 40, generator=g)
    lse[0, 0, 10:13] = float("-inf")  # rows empty in the running result
    o_part = torch.randn(2, 3, 20, 8, generator=g).to(torch.bfloat16)
    lse_part = 50.0 * torch.randn(2, 3, 20, generator=g)
    lse_part[0, 0, 0:2] = float("-inf")  # rows 10, 11 empty in both, 12 only in the running result
    want_o, want_lse = fd.merge_pair(o[:, :, 10:30], lse[:, :, 10:30], o_part.float(), lse_part)
    before_o, before_lse = o.clone(), lse.clone()
    fd.merge_into(o[:, :, 10:30], lse[:, :, 10:30], o_part, lse_part)
    torch.testing.assert_close(o[:, :, 10:30], want_o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse[:, :, 10:30], want_lse)
    assert torch.equal(o[:, :, :10], before_o[:, :, :10]) and torch.equal(o[:, :, 30:], before_o[:, :, 30:])
    assert torch.equal(lse[:, :, :10], before_lse[:, :, :10]) and torch.equal(lse[:, :, 30:], before_lse[:, :, 30:])
    assert torch.all(o[0, 0, 10:12] == 0) and torch.all(lse[0, 0, 10:12] == float("-inf"))
    assert torch.isfinite(o).all()


def test_merge_pair_in_float32_does_not_lose_digits_to_a_large_lse():
    """In float32, with row LSEs near 1000 (scores of that size) and one partial dominating, the merge
    stays within a few ulps of the float64 merge of the same float32 partials: weights taken against
    a rounded logaddexp would be off by e^(ulp(1000)) = 1 + 6e-5."""
    g = torch.Generator().manual_seed(5)
    rows = 64
    o_a, o_b = (torch.randn(rows, 16, generator=g) for _ in range(2))
    lse_a = 1000 + torch.rand(rows, generator=g)
    lse_b = lse_a - torch.rand(rows, generator=g) * 40  # from even to e^-40 of the first
    o_m, lse_m = fd.merge_pair(o_a, lse_a, o_b, lse_b)
    o_64, lse_64 = fd.merge_pair(*(x.double() for x in (o_a, lse_a, o_b, lse_b)))
    assert o_m.dtype == torch.float32
    assert (o_m.double() - o_64).abs().max() < 1e-6  # |o| ~ 1: a few float32 ulps
    assert (lse_m.double() - lse_64).abs().max() <= 2 * 1000 * torch.finfo(torch.float32).eps


def test_errors_without_a_process_group():
    q, k, v = random_qkv(1, 2, 2, 4, 4, 16)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.ring_attention(q, k, v)
    with pytest.raises(ValueError, match="layout"):
        fd.ring_attention(q, k, v, layout="striped")
    with pytest.raises(ValueError, match="head dim"):  # the single-device contract is checked first
        fd.ring_attention(*random_qkv(1, 2, 2, 4, 4, 8))
    for shape in ((0, 2, 4, 16), (1, 2, 0, 16)):  # an empty shard is refused, unlike single-device empties
        x = torch.randn(shape)
        with pytest.raises(ValueError, match="at least one batch"):
            fd.ring_attention(x, x, x)


def test_an_nccl_group_refuses_cpu_tensors(monkeypatch):
    """Under a process group whose backend is NCCL (faked: no GPU needed), CPU shards are refused
    with the contract's ValueError before any exchange."""
    monkeypatch.setattr(fd.dist, "is_available", lambda: True)
    monkeypatch.setattr(fd.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(fd.dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match="uses NCCL"):
        fd.ring_attention(*random_qkv(1, 2, 2, 4, 4, 16))


def test_import_does_not_start_anything():
    import flashattn.distributed

    assert callable(flashattn.distributed.ring_attention)
    assert not dist.is_initialized()


# --------------------------------------------------------------------------------------------------
# GPU: NCCL, one process per GPU, low precision against the single-GPU kernels
# --------------------------------------------------------------------------------------------------
GPU_CASES = {
    "causal-zigzag": dict(h_q=4, h_kv=4, d=128, chunk=256, causal=True, layout="zigzag"),
    "plain-contiguous": dict(h_q=4, h_kv=4, d=64, chunk=200, causal=False, layout="contiguous"),
    "gqa-d96-causal-zigzag": dict(h_q=8, h_kv=2, d=96, chunk=192, causal=True, layout="zigzag"),
    "window-causal-zigzag": dict(h_q=4, h_kv=2, d=128, chunk=256, causal=True, layout="zigzag", window=(300, None)),
    "documents-causal-zigzag": dict(h_q=4, h_kv=2, d=128, chunk=256, causal=True, layout="zigzag",
                                    documents=lambda n: (0, 100, n // 2 + 37, n - 300, n)),
}
GPU_DTYPES = ["float16", "bfloat16"]
GPU_HYBRID_WIDTH = 2  # Ulysses groups of 2: on two GPUs one group (a ring of one), on four a 2 x 2 grid
GPU_LAUNCH_TIMEOUT_S = 290  # per world, both dtypes; the first world compiles the kernels


def _gpu_grid(rank: int, world: int, width: int):
    """(Ulysses group, ring group, ring position, piece) of this rank on a grid of world / width ring
    positions x width Ulysses ranks; every rank takes part in creating every group."""
    ring_size = world // width
    ulysses_groups = [dist.new_group([g * width + u for u in range(width)]) for g in range(ring_size)]
    ring_groups = [dist.new_group([g * width + u for g in range(ring_size)]) for u in range(width)]
    position, piece = divmod(rank, width)
    return ulysses_groups[position], ring_groups[piece], position, piece


def _gpu_worker(rank: int, world: int, port: int, names: list, dtypes: list, results) -> None:
    torch.cuda.set_device(rank)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S), device_id=torch.device("cuda", rank))
    except Exception:  # noqa: BLE001
        results.put(("<init>", rank, traceback.format_exc(), None))
        return
    try:
        grid = _gpu_grid(rank, world, GPU_HYBRID_WIDTH) if world % GPU_HYBRID_WIDTH == 0 else None
        for name in names:
            for dtype_name in dtypes:
                try:
                    results.put((f"{name}/{dtype_name}", rank, None,
                                 _gpu_check(GPU_CASES[name], getattr(torch, dtype_name), rank, world, grid)))
                except Exception:  # noqa: BLE001
                    results.put((f"{name}/{dtype_name}", rank, traceback.format_exc(), None))
    finally:
        dist.destroy_process_group()


def _gpu_check(case: dict, dtype, rank: int, world: int, grid) -> dict:
    """Relative errors against float64 of each context-parallel path (this rank's shard) and of the
    single-GPU kernel (the same rows of the full sequence), for o, dq, dk, dv: ``{"ring/o": (ring's,
    single GPU's), ..., "ulysses/o": ..., "hybrid/o": ...}``; Ulysses where the query heads split over
    the ranks, the hybrid (on ``grid``, :func:`_gpu_grid`) where they split over its groups."""
    import flashattn

    device = torch.device("cuda", rank)
    q, k, v, do = _problem(case, world, device, torch.float64, seed=99)
    causal, layout, window = case["causal"], case["layout"], case.get("window")
    documents = _documents(case, q.shape[2])

    def grads(fn, inputs, grad_out):
        inputs = [x.detach().clone().requires_grad_() for x in inputs]
        o = fn(*inputs)
        o.backward(grad_out)
        return [o.detach()] + [x.grad for x in inputs]

    ref = grads(lambda *x: _reference(x, case, None)[0], (q, k, v), do)
    if documents is None:
        single_fn = lambda *x: flashattn.attention(*x, causal=causal, window=window)  # noqa: E731
    else:
        single_fn = lambda *x: fd._packed_attention(*x, documents, causal, None)[0]  # noqa: E731
    single = grads(single_fn, [x.to(dtype) for x in (q, k, v)], do.to(dtype))
    shard = lambda x: fd.shard_sequence(x, rank, world, layout=layout)  # noqa: E731
    options = dict(causal=causal, layout=layout, window=window, cu_seqlens=documents)
    def ring_fetching(max_world, by):  # the forward's other ways of fetching shards (the backward's is one)
        def fn(*x):
            before = fd.DIRECT_FETCH_MAX_WORLD, fd.DIRECT_FETCH_BY
            fd.DIRECT_FETCH_MAX_WORLD, fd.DIRECT_FETCH_BY = max_world, by
            try:
                return fd.ring_attention(*x, **options)
            finally:
                fd.DIRECT_FETCH_MAX_WORLD, fd.DIRECT_FETCH_BY = before
        return fn

    paths = {"ring": (shard, lambda *x: fd.ring_attention(*x, **options)),
             "ring-send-recv": (shard, ring_fetching(world, "send_recv")),
             "ring-relay": (shard, ring_fetching(0, fd.DIRECT_FETCH_BY))}
    if case["h_q"] % world == 0:
        paths["ulysses"] = (shard, lambda *x: fd.ulysses_attention(*x, **options))
    if grid is not None and case["h_q"] % GPU_HYBRID_WIDTH == 0:
        ulysses_group, ring_group, position, piece = grid
        ring_size = world // GPU_HYBRID_WIDTH
        paths["hybrid"] = (
            lambda x: fd.shard_sequence_2d(x, position, ring_size, piece, GPU_HYBRID_WIDTH, layout=layout),
            lambda *x: fd.hybrid_attention(*x, ulysses_group=ulysses_group, ring_group=ring_group, **options))
    out = {}
    for path, (cut, fn) in paths.items():
        got = grads(fn, [cut(x).to(dtype) for x in (q, k, v)], cut(do).to(dtype))
        for name, r, s, g in zip(("o", "dq", "dk", "dv"), got, single, ref):
            out[f"{path}/{name}"] = (rel_err(r, cut(g)), rel_err(cut(s), cut(g)))
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}gpus")
def nccl_world(request):
    """One NCCL world of 2 or 4 processes (one per GPU) running every GPU case in both dtypes."""
    size = request.param
    if not torch.cuda.is_available() or torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs")
    got = launch(_gpu_worker, size, (list(GPU_CASES), GPU_DTYPES), expected=len(GPU_CASES) * len(GPU_DTYPES) * size,
                 timeout_s=GPU_LAUNCH_TIMEOUT_S)
    return size, got


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_ring_attention_nccl_matches_single_gpu_kernels(nccl_world, dtype):
    """The ring, Ulysses and the hybrid on 2 and 4 GPUs: each rank's output and gradients are as close to
    float64 as the single-GPU kernel's on the same rows, within the rule below."""
    size, got = nccl_world
    problems, seen = [], set()
    for name, rank, error, result in got:
        if not name.endswith(f"/{dtype}"):
            continue
        if error is not None:
            problems.append(f"{name} rank {rank}:\n{error}")
            continue
        for what, (err_cp, err_single) in result.items():
            seen.add(what.split("/")[0])
            # The ring merges partials in float32 and sums per-shard dK/dV partials that were each rounded
            # to the input dtype, so its error may exceed the single-GPU kernel's by a small factor
            # (Ulysses runs the single-GPU kernel on whole sequences: its error is that kernel's).
            if not err_cp <= 3.0 * err_single + 1e-4:
                problems.append(f"{name} rank {rank} {what}: {err_cp:.3e} vs single GPU {err_single:.3e}")
    assert not problems, "\n".join(problems)
    assert seen == {"ring", "ring-send-recv", "ring-relay", "ulysses", "hybrid"}, f"{size} GPUs checked only {sorted(seen)}"


# --------------------------------------------------------------------------------------------------
# the scaling benchmark's harness (the GPU run itself is not a test)
# --------------------------------------------------------------------------------------------------
def test_benchmark_arguments():
    from benchmarks import ring as bench

    args = bench.parse_args(["--out", "x.json", "--heads", "8", "--kv-heads", "2"])
    assert args.lengths == bench.DEFAULT_LENGTHS and (args.heads, args.kv_heads, args.dtype) == (8, 2, "bfloat16")
    assert args.strategy == ["ring"] and args.ulysses_size is None
    args = bench.parse_args(["--out", "x.json", "--strategy", "hybrid", "ring", "hybrid", "--ulysses-size", "2"])
    assert args.strategy == ["hybrid", "ring"] and args.ulysses_size == 2
    for bad in (["--heads", "6", "--kv-heads", "4"], ["--head-dim", "0"], ["--lengths", "1"], [],
                ["--strategy", "striped"], ["--ulysses-size", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad if not bad or bad[0] == "--out" else ["--out", "x.json", *bad])
    # The causal baseline does the ring's visible pairs per GPU (to within the rounding to 128).
    for n, world in ((65536, 2), (1 << 20, 4)):
        rows, cols = bench.baseline_shape(n, world, True)
        assert abs(rows * cols / 2 - n * n / 2 / world) / (n * n / 2 / world) < 0.01
        assert bench.baseline_shape(n, world, False) == (n // world, n)


def test_benchmark_refuses_strategies_the_heads_do_not_allow():
    """Checked on every rank before any collective: Ulysses needs the query heads to split over the
    ranks (K/V heads fewer than the ranks are repeated), the hybrid over its Ulysses groups."""
    from benchmarks import ring as bench

    def problem(world, *argv):
        return bench.check_strategies(bench.parse_args(["--out", "x.json", *argv]), world)

    assert problem(4, "--strategy", "ring", "ulysses", "hybrid", "--heads", "8", "--kv-heads", "2") is None
    assert problem(4, "--strategy", "ulysses", "--heads", "8", "--kv-heads", "1") is None  # K/V repeated 4 times
    assert "Hq (6)" in problem(4, "--strategy", "ulysses", "--heads", "6")
    assert problem(4, "--strategy", "hybrid", "--heads", "6") is None  # 6 heads over Ulysses groups of 2
    assert "must be divisible" in problem(4, "--strategy", "hybrid", "--heads", "6", "--ulysses-size", "4")
    assert "must divide" in problem(4, "--strategy", "hybrid", "--heads", "6", "--ulysses-size", "3")
    assert problem(3, "--strategy", "ring", "hybrid", "--heads", "1") is None  # odd P: U = 1, a ring of 3
    assert bench.default_ulysses_size(4) == 2 and bench.default_ulysses_size(8) == 4


def test_benchmark_exchange_intervals():
    """What the exchange profile reports, on made-up kernel timelines (µs): overlapped and exposed
    exchange, idle gaps, and overlapping kernels of one kind counted once."""
    from benchmarks import ring as bench

    def stats(kernels):
        return dict(zip(bench.EXCHANGE_KEYS, (round(x * 1e3, 6) for x in bench.interval_stats(kernels))))

    # compute 0-100 and 150-250; the exchange 50-180 is hidden for 50-100 and 150-180: 50 us exposed
    timeline = [("attn_fwd", 0, 100), ("ncclDevKernel_SendRecv", 50, 180), ("attn_fwd", 150, 250)]
    assert stats(timeline) == dict(span_ms=250, compute_ms=200, exchange_ms=130, exposed_exchange_ms=50, idle_ms=0)
    # two overlapping compute kernels count once; a gap of 20 us with nothing running
    timeline = [("a", 0, 60), ("b", 40, 100), ("ncclKernel", 120, 130)]
    assert stats(timeline) == dict(span_ms=130, compute_ms=100, exchange_ms=10, exposed_exchange_ms=10, idle_ms=20)
    # fully hidden exchange, and the empty timeline
    assert stats([("k", 0, 100), ("nccl", 10, 90)])["exposed_exchange_ms"] == 0
    assert stats([]) == dict.fromkeys(bench.EXCHANGE_KEYS, 0)


def _dry_run(tmp_path, world: int, *argv) -> dict:
    """``torchrun --nproc-per-node <world> -m benchmarks.ring --dry-run <argv>``: gloo, CPU; its JSON."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "ring.json"
    env = {**os.environ, "PYTHONPATH": str(root), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                           "-m", "benchmarks.ring", "--dry-run", "--out", str(out), *argv],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["environment"]["world_size"] == world and payload["environment"]["backend"] == "gloo"
    return payload


def _check_measured(row: dict, world: int) -> dict:
    rec = row[row["strategy"]]
    assert rec["fwd_ms"] > 0 and rec["fwd_bwd_ms"] > 0 and len(rec["compute_ms_per_rank"]) == world
    assert rec["fwd_tflops_per_gpu"] > 0 and rec["balance"] >= 0
    return rec


def test_benchmark_dry_run_with_two_processes(tmp_path):
    """The default run (the ring alone) on two gloo processes: every row measured, in the format the
    ring page reads."""
    from benchmarks import ring as bench

    payload = _dry_run(tmp_path, 2)
    assert [(r["n"], r["causal"], r["strategy"]) for r in payload["rows"]] == [
        (64, False, "ring"), (64, True, "ring"), (128, False, "ring"), (128, True, "ring")]
    for row in payload["rows"]:
        assert _check_measured(row, 2)["layout"] == ("zigzag" if row["causal"] else "contiguous")
    table = bench.markdown(payload)
    assert "| N | N per GPU | mask | ring fwd / fwd+bwd (ms) |" in table and "| strategy |" not in table
    assert table.count("\n| 128 | 64 | causal | ") == 1


def test_benchmark_dry_run_of_every_strategy(tmp_path):
    """Ring, Ulysses (one K/V head repeated over the two ranks) and the hybrid (Ulysses groups of 2, a
    ring of one) in one run of two gloo processes: a row per length, mask and strategy, each measured."""
    from benchmarks import ring as bench

    payload = _dry_run(tmp_path, 2, "--strategy", "ring", "ulysses", "hybrid", "--ulysses-size", "2",
                       "--heads", "4", "--kv-heads", "1", "--lengths", "64")
    assert [(r["causal"], r["strategy"]) for r in payload["rows"]] == [
        (c, s) for c in (False, True) for s in ("ring", "ulysses", "hybrid")]
    assert payload["config"]["ulysses_size"] == 2 and set(payload["methods"]["strategies"]) == set(bench.STRATEGIES)
    for row in payload["rows"]:
        rec = _check_measured(row, 2)
        assert set(row) & set(bench.STRATEGIES) == {row["strategy"]}  # only its own record
        if row["strategy"] == "hybrid":
            assert rec["grid"] == {"ulysses": 2, "ring": 1}
    table = bench.markdown(payload)
    assert "| mask | strategy | fwd / fwd+bwd (ms) |" in table
    for strategy in bench.STRATEGIES:
        assert table.count(f"| 64 | 32 | causal | {strategy} | ") == 1


def test_shard_and_unshard_refuse_what_they_cannot_cut():
    """A rank outside the world, and zig-zag shards of odd length, raise instead of cutting wrong rows."""
    x = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="rank must be in"):
        fd.shard_sequence(x, 2, 2, layout="zigzag")
    with pytest.raises(ValueError, match="2 equal chunks"):
        fd.unshard_sequence([torch.randn(1, 2, 3, 16)] * 2, layout="zigzag")
