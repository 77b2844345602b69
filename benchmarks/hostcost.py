"""flashattn's own host work per eager call, measured on a CPU with every kernel launch made a no-op.

    PYTHONPATH=. python -m benchmarks.hostcost [--profile] [--b 1 --h 16 --n 512 --d 64 --causal]

A short eager call is bound by the host (docs/benchmarks.md, the latency section), and much of that
host time is this package's Python: argument checks, the problem description, the config lookup,
output allocation, descriptors, the compiled-kernel cache key, or for a repeated call the replay of
its recipe (flashattn.launch.Recipe). That part runs the same on any machine, so it can be measured
and cut without a GPU. This tool runs the real eager path (``flashattn.attention`` and its autograd
backward) on float16 CPU tensors, routed to the Triton launchers as CUDA tensors are; every kernel
counts as compiled and launches through the package's direct launch, whose two C calls (the
generated launcher and the TMA descriptor fill) do nothing. What it reports is therefore everything
the package does per call except those C calls and the GPU, once with every launcher call on the full
path (no recipe kept) and once replayed (a repeated call goes from the autograd layer straight to its
recipe, as an eager call on the GPU's current device does):

* ``fwd`` and ``fwd+bwd``: ``flashattn.attention(q, k, v)`` with q, k, v requiring grad, and
  ``torch.autograd.grad`` of it (the latency section's two passes), on the calling thread;
* ``launcher fwd`` / ``launcher bwd``: :func:`flashattn.forward.attention_forward` and
  :func:`flashattn.backward.attention_backward` alone.

Numbers are medians of 5 loops on this machine's CPU, in µs. They are not GPU timings and are never
compared with a peer: on the GPU host, the C launches (the driver's launch took about 11 µs per
kernel on an H200 host) and the autograd engine's worker thread come on top. CPU tensors take the
package's CPU tile sizes (the interpreter's), so the backward's two kernels share fewer descriptors
than on a GPU; nothing else in the host work depends on the tiles.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch


class _NoLaunch:
    """Stands in for the C launcher Triton generates for a compiled kernel: a call does nothing but
    count (and, with ``capture``, keep its arguments); so does a TMA descriptor fill, which returns its
    own arguments."""

    def __init__(self, capture: bool = False):
        self.calls, self.captured = 0, [] if capture else None

    def __call__(self, *args):  # the generated launcher's signature: grid, stream, function, ..., the arguments
        self.calls += 1
        if self.captured is not None:
            self.captured.append(args)

    @staticmethod
    def fill(*args):
        return ("tma", *args)

    def direct(self, kernel):
        """A direct launch of ``kernel`` (flashattn.launch._DirectLaunch) whose C calls are this
        stand-in's: descriptors at the kernel's ``*_desc`` parameters, each filled by :meth:`fill`."""
        import triton

        from flashattn import launch as launch_mod

        d = object.__new__(launch_mod._DirectLaunch)
        d.c_launch, d.fill, d.function, d.metadata, d.flags = self, self.fill, None, None, (False, False)
        d.plan = tuple((i, 0, 2, 0, [1]) for i, name in enumerate(kernel.arg_names) if name.endswith("_desc"))
        d.hooks = triton.knobs.runtime
        return d


def normalized(captured: list, inputs: tuple, pointers=None) -> list:
    """The launches :class:`_NoLaunch` captured, comparable across two runs on the same inputs: each
    pointer argument (a tensor, or an int at a position in ``pointers``, a set of (launch, argument)
    indices: a replayed launch passes data pointers) named by the role in ``inputs`` of the tensor
    it points to or, if none (an output, a scratch buffer, o and lse between the passes), by the
    order in which its address first appears; a filled descriptor by its base's role (a copy made
    for alignment is only named so: the allocator may reuse its address); everything else by type
    and value."""
    addresses = {x.data_ptr(): i for i, x in reversed(list(enumerate(inputs))) if x is not None}
    seen, out = {}, []
    for launch, args in enumerate(captured):
        row = []
        for position, a in enumerate(args):
            if isinstance(a, torch.Tensor) or (pointers is not None and (launch, position) in pointers):
                address = a.data_ptr() if isinstance(a, torch.Tensor) else a
                role = addresses.get(address)
                row.append(("input", role) if role is not None else ("pointer", seen.setdefault(address, len(seen))))
            elif isinstance(a, tuple) and a[:1] == ("tma",):
                role = addresses.get(a[1])
                row.append(("tma", ("input", role) if role is not None else "an aligned copy", *a[2:]))
            else:
                row.append((type(a), a))
        out.append(row)
    return out


def pointer_positions(captured: list) -> set:
    """The (launch, argument) indices where the captured launches passed a tensor."""
    return {(launch, position) for launch, args in enumerate(captured)
            for position, a in enumerate(args) if isinstance(a, torch.Tensor)}


def replayed_and_full(run, first: tuple, later: tuple, inputs: tuple, before_later=None,
                      second_stream: bool = False) -> dict:
    """``run(*first)`` then ``run(*later)`` under :func:`launches_disabled`, once with recipes kept and
    once with none. Returns, per path (``True``: replayed), the later call's launches (and stream
    waits) as :func:`normalized` gives them against ``inputs``, and for the replayed path how many
    compiled-kernel cache keys the later call made (``"keys"``: none when it replayed) and the
    recipes kept (``"kept"``). ``before_later`` runs between the two calls (with the capture on);
    ``second_stream`` is :func:`launches_disabled`'s."""
    from flashattn import launch as launch_mod

    keys, signature = [], launch_mod._signature
    out, raw = {}, {}
    launch_mod._signature = lambda *a: keys.append(1) or signature(*a)
    try:
        for replay in (True, False):
            with launches_disabled(capture=True, replay=replay, second_stream=second_stream) as fake:
                run(*first)
                if before_later is not None:
                    before_later()
                fake.captured.clear()
                keys.clear()
                run(*later)
                raw[replay] = list(fake.captured)
                if replay:
                    out["keys"] = len(keys)
                    out["kept"] = [r for r in launch_mod._RECIPES.values() if r is not None]
    finally:
        launch_mod._signature = signature
    # A replayed launch passes ints where the full path passes tensors: the full path says where.
    # (Addresses are compared within one call, whose tensors all live until it returns.)
    out[False] = normalized(raw[False], inputs)
    out[True] = normalized(raw[True], inputs, pointer_positions(raw[False]))
    return out


class _Stream:
    """Stands in for a CUDA stream: its raw handle, and a wait for another stream, which the capture
    of :class:`_NoLaunch` (when on) keeps as ``("wait", this handle, the other's)``."""

    def __init__(self, handle: int, fake: _NoLaunch):
        self.cuda_stream, self.fake = handle, fake

    def wait_stream(self, other: "_Stream") -> None:
        if self.fake.captured is not None:
            self.fake.captured.append(("wait", self.cuda_stream, other.cuda_stream))


@contextlib.contextmanager
def launches_disabled(capture: bool = False, replay: bool = True, second_stream: bool = False):
    """Route float16/bfloat16 CPU tensors to the Triton launchers and make every launch a no-op,
    restoring the package afterwards: each kernel counts as compiled and launches through the
    package's direct launch, whose C calls do nothing (:class:`_NoLaunch`); the autograd layer's early
    replay takes these tensors as it takes CUDA tensors on the current device. ``replay`` off
    forgets every recipe before each launcher call, so each one takes the full path. Streams are
    stand-ins (:class:`_Stream`: the current one has handle 0); with ``second_stream`` every
    backward runs dQ on a second one (handle 1), as large problems on a GPU do. Refuses to run
    under TRITON_INTERPRET (the interpreter never takes the compiled-kernel path this replaces)."""
    from flashattn import _config, api, autograd, decode, tensors, varlen
    from flashattn import launch as launch_mod
    from flashattn import backward as bwd_mod, forward as fwd_mod
    from flashattn.autograd import KERNEL_DTYPES

    if _config.is_interpreter():
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter does not use the compiled-kernel path")
    fake = _NoLaunch(capture)
    from flashattn import decode_kernels as dec_mod

    kernels = {id(k): (k, fake, fake.direct(k)) for k in (fwd_mod._attn_fwd_kernel, bwd_mod._bwd_preprocess_kernel,
                                                         bwd_mod._bwd_dkdv_kernel, bwd_mod._bwd_dq_kernel,
                                                         dec_mod._decode_split_kernel, dec_mod._decode_merge_kernel,
                                                         dec_mod._decode_append_kernel)}

    class Compiled(dict):
        def get(self, key, default=None):  # every signature is "already compiled"
            return kernels[key[0]]

    class Forgetful(dict):
        def get(self, key, default=None):
            return default

    current, side = [_Stream(0, fake)], _Stream(1, fake)

    @contextlib.contextmanager
    def stream_context(stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    users = (api, decode, varlen)  # the entry points that ask whether the kernels run
    saved = dict(compiled=launch_mod._COMPILED, device=launch_mod._current_device, use=[m.use_kernels for m in users],
                 stream=launch_mod._stream, recipes=launch_mod._RECIPES, interpreted=launch_mod._interpreted,
                 current_stream=launch_mod._current_stream, stream_context=launch_mod._stream_context,
                 second_stream=bwd_mod._second_stream, fast_path=launch_mod._FAST_PATH, early=autograd._early)
    launch_mod._COMPILED, launch_mod._RECIPES = Compiled(), ({} if replay else Forgetful())
    launch_mod._FAST_PATH = [True]  # the no-op launches stand in for the fast path on any Triton
    launch_mod._interpreted = lambda kernel: False  # kernels jitted under the interpreter (the tests') count as compiled
    launch_mod._current_device = tensors._current_device = lambda: 0
    # the autograd layer's early replay asks for a CUDA tensor on the current device: these stand in for one
    autograd._early = lambda q, use_kernels: use_kernels and autograd._EARLY_REPLAY[0]
    launch_mod._stream = lambda device: current[-1].cuda_stream
    launch_mod._current_stream = lambda device: current[-1]
    launch_mod._stream_context = stream_context
    if second_stream:
        bwd_mod._second_stream = lambda q, problem: side
    for m in users:
        m.use_kernels = lambda q: q.dtype in KERNEL_DTYPES
    try:
        yield fake
    finally:
        launch_mod._COMPILED, launch_mod._RECIPES = saved["compiled"], saved["recipes"]
        launch_mod._current_device, launch_mod._stream = saved["device"], saved["stream"]
        tensors._current_device = saved["device"]
        launch_mod._current_stream, launch_mod._stream_context = saved["current_stream"], saved["stream_context"]
        bwd_mod._second_stream = saved["second_stream"]
        launch_mod._interpreted = saved["interpreted"]
        launch_mod._FAST_PATH = saved["fast_path"]
        autograd._early = saved["early"]
        for m, use in zip(users, saved["use"]):
            m.use_kernels = use


def _median_us(fn, calls: int, repeats: int = 5) -> float:
    for _ in range(min(calls, 100)):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def measure(b=1, h=16, n=512, d=64, causal=True, calls=2000, replay=True) -> dict:
    """µs per call of the four paths in the module doc, and the no-op launches each made; with
    ``replay`` off every launcher call takes the full path (no recipe is kept)."""
    import flashattn
    from flashattn.backward import launch_backward as attention_backward
    from flashattn.forward import launch_forward as attention_forward
    from flashattn.problem import Problem

    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out = {}
    with launches_disabled(replay=replay) as fake, torch.autograd.set_multithreading_enabled(False):
        problem = Problem.of(q, k, causal, None)
        o, lse = attention_forward(qd, kd, vd, problem)
        paths = {
            "fwd": lambda: flashattn.attention(q, k, v, causal=causal),
            "fwd+bwd": lambda: torch.autograd.grad(flashattn.attention(q, k, v, causal=causal), (q, k, v), do),
            "launcher fwd": lambda: attention_forward(qd, kd, vd, problem),
            "launcher bwd": lambda: attention_backward(do, qd, kd, vd, o, lse, problem),
        }
        for name, fn in paths.items():
            before = fake.calls
            fn()
            launches = fake.calls - before
            out[name] = {"us": _median_us(fn, calls if "bwd" not in name else calls // 2), "launches": launches}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hostcost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", action="store_true", help="also print cProfile's top functions of fwd+bwd")
    args = ap.parse_args(argv)
    print(f"B={args.b} H={args.h} N={args.n} D={args.d} causal={args.causal}, float16, launches made no-ops:")
    runs = {replay: measure(args.b, args.h, args.n, args.d, args.causal, args.calls, replay)
            for replay in (False, True)}
    print(f"  {'':13s} {'full path':>10s} {'replayed':>10s}")
    for name in runs[True]:
        print(f"  {name:13s} {runs[False][name]['us']:7.1f} µs {runs[True][name]['us']:7.1f} µs"
              f"   ({runs[True][name]['launches']} launches)")
    if args.profile:
        import cProfile
        import pstats

        import flashattn

        q, k, v = (torch.randn(args.b, args.h, args.n, args.d, dtype=torch.float16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn_like(q)
        with launches_disabled(), torch.autograd.set_multithreading_enabled(False):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(1000):
                torch.autograd.grad(flashattn.attention(q, k, v, causal=args.causal), (q, k, v), do)
            prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
