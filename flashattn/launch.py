"""The one launch layer: every kernel of the package is launched by :func:`launch` here.

It keeps the kernels Triton compiled per launch signature, and, on the Triton versions the GPU
tests ran on (:data:`FAST_PATH_TRITON`), a fast path that calls the compiled kernel's generated C
launcher directly and replays a whole launcher call from a recorded :class:`Recipe`. Everywhere
else, and for any launch the fast path does not recognise, it calls ``kernel[grid](...)``.

:func:`in_background` runs a launcher call with nothing launched: each kernel it would launch is
compiled on a thread of its own instead (Triton's ``warmup``), so that a later real call of the same
signature finds it in Triton's cache.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import os

import torch
import triton

from flashattn import _config
from flashattn._memo import remember, table
from flashattn.tensors import _current_device, _descriptor_key, tile_counter


class _DirectLaunch:
    """The launch of one compiled kernel without Triton's per-call Python (Triton 3.6's CUDA launcher).

    ``compiled[grid](*args)`` looks up the current device and stream, builds a closure, asks for
    launch metadata, calls the launch hooks, then expands each tensor descriptor into a TMA
    descriptor, its shape and its strides in a Python loop before the generated C launcher runs:
    28 µs a launch on an H200 host, the driver's own launch included. This does the same expansion
    with the work that does not change between launches done once, and calls the generated C
    function itself. It is built only when the compiled kernel has exactly the launcher layout it
    was written against (checked in :meth:`of`; kernels that need scratch memory are left out), and
    it steps aside while a launch hook is set; anything else keeps Triton's own path.
    """

    __slots__ = ("c_launch", "function", "metadata", "flags", "plan", "fill", "hooks")

    @classmethod
    def of(cls, compiled, n_args: int):
        """The direct launch of ``compiled`` (whose kernel takes ``n_args`` arguments, constexprs
        included), or None where its launcher is not the one this class knows."""
        try:
            from triton.backends.nvidia import driver as nv

            hooks = triton.knobs.runtime  # where Triton keeps its launch hooks
            run = getattr(compiled, "_run", None)
            if type(run).__name__ != "CudaLauncher" or getattr(nv, "_BASE_ARGS_FORMAT", None) != "iiiKKppOOOOOO":
                return None
            if run.global_scratch_size or run.profile_scratch_size:
                return None  # scratch memory comes from Triton's allocator at each launch
            inner = run.launch
            if getattr(inner, "__closure__", None) is None:  # no descriptor argument: the generated function
                c_launch, indices, metas = inner, set(), []
            else:
                cells = dict(zip(inner.__code__.co_freevars, (c.cell_contents for c in inner.__closure__)))
                c_launch, indices, metas = cells["launcher"], cells["tensordesc_indices"], cells["tensordesc_meta"]
            if type(c_launch).__name__ != "builtin_function_or_method" or len(metas) != len(indices):
                return None
            plan = []
            for position, meta in zip(sorted(indices), metas):
                if meta is None or meta.get("fp4_padded") or position >= n_args:
                    return None  # a descriptor not lowered to TMA, packed fp4, or not one of the arguments
                plan.append((position, meta["swizzle"], meta["elem_size"],
                             nv.TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], list(meta["block_size"])))
            fill = triton.runtime.driver.active.utils.fill_tma_descriptor if plan else None
        except (ImportError, AttributeError, KeyError, TypeError):
            return None
        self = object.__new__(cls)
        self.c_launch, self.function, self.metadata = c_launch, compiled.function, compiled.packed_metadata
        self.flags = (bool(run.launch_cooperative_grid), bool(run.launch_pdl))
        self.plan, self.fill, self.hooks = tuple(plan), fill, hooks
        return self

    def __call__(self, grid: tuple, device: int, args: tuple) -> bool:
        """Launch on ``grid`` on the current stream of ``device``; ``args`` are all of the kernel's,
        constexprs included, in its parameter order. False, launching nothing, while a launch hook
        is set (a profiler's): then Triton's own path must run, which calls it."""
        if not self.unhooked():
            return False
        self.launch_flat(grid, _stream(device), self.expand(args))
        return True

    def unhooked(self) -> bool:
        """Whether no launch hook is set, so a launch may skip Triton's path."""
        return _no_hook(self.hooks.launch_enter_hook) and _no_hook(self.hooks.launch_exit_hook)

    def expand(self, args: tuple) -> list:
        """The generated launcher's arguments for the kernel's ``args``: each tensor descriptor becomes
        its TMA descriptor (filled here), then its shape and its strides."""
        flat, start = [], 0
        for position, swizzle, elem_size, dtype, block in self.plan:
            flat += args[start:position]
            d = args[position]
            shape, strides = d.shape, d.strides
            flat.append(self.fill(d.base.data_ptr(), swizzle, elem_size, dtype, block, shape, strides,
                                  1 if d.padding == "nan" else 0))
            flat += shape
            flat += strides
            start = position + 1
        flat += args[start:]
        return flat

    def header(self, grid: tuple, stream) -> list:
        """The generated C launcher's arguments before the kernel's own: the grid, the stream, the
        function, the launch flags, the metadata, and no hooks or profiler scratch."""
        return [grid[0], grid[1], grid[2], stream, self.function, *self.flags, None, None, self.metadata,
                None, None, None]

    def launch_flat(self, grid: tuple, stream: int, flat) -> None:
        """Call the generated C launcher with arguments :meth:`expand` made."""
        self.c_launch(*self.header(grid, stream), *flat)


class _Step:
    """One launch of a :class:`Recipe`: the whole argument list of the generated C launcher for a
    recorded launch (grid, stream, function, metadata, then the kernel's expanded arguments), with
    the places that change from call to call marked: the stream, a tensor's pointer, a TMA
    descriptor of a tensor, a seed half. A replay copies the list, fills those places and makes the
    one C call."""

    __slots__ = ("direct", "c_launch", "fill", "template", "tensors", "descriptors", "free", "side")

    STREAM = 3  # where the stream goes in the C launcher's arguments (see _DirectLaunch.launch_flat)

    @classmethod
    def bind(cls, direct: "_DirectLaunch", grid: tuple, args: tuple, roles: tuple, free: tuple, positions,
             side=None):
        """The step that repeats ``direct``'s launch of ``args`` with other tensors in the same
        ``roles`` and other per-call integers ``free``, on the stream ``side`` (None: the current
        stream), or None when an argument tensor (or a descriptor's) is not one of the roles, or the
        kernel's unspecialized arguments (at ``positions``) are not ``free`` in order."""
        def role(x):
            for i, r in enumerate(roles):
                if r is x:
                    return i
            return None

        described = {position: rest for position, *rest in direct.plan}
        template = direct.header(grid, None)
        tensors, descriptors, frees = [], [], []
        for position, a in enumerate(args):
            if position in described:
                i = role(a.base)
                if i is None:
                    return None
                swizzle, elem_size, dtype, block = described[position]
                fill = (swizzle, elem_size, dtype, block, a.shape, a.strides, 1 if a.padding == "nan" else 0)
                descriptors.append((len(template), i, fill))  # numbered by the Recipe
                template.append(None)
                template += a.shape
                template += a.strides
            elif isinstance(a, torch.Tensor):
                i = role(a)
                if i is None:
                    return None
                tensors.append((len(template), i))
                template.append(None)
            elif position in positions:  # the n-th free integer of this call
                n = len(frees)
                if n >= len(free) or a != free[n]:
                    return None
                frees.append((len(template), n))
                template.append(None)
            else:
                template.append(a)
        self = object.__new__(cls)
        self.direct, self.c_launch, self.fill = direct, direct.c_launch, direct.fill
        self.template, self.tensors = template, tuple(tensors)
        self.descriptors, self.free, self.side = tuple(descriptors), tuple(frees), side
        return self

    def __call__(self, stream: int, pointers: list, filled: list, free: tuple) -> None:
        """Launch with the data pointers of the recipe's roles (``pointers``, ints), the TMA
        descriptors the recipe ``filled`` for them (:attr:`descriptors` holds an index into it after
        :class:`Recipe` made the step its own) and the per-call integers. A pointer goes to the C
        launcher as an int: given a tensor, the launcher would call its ``data_ptr`` and ask the
        driver whether the address is device memory, once per pointer argument per launch; the
        recipe's roles are the call's own CUDA tensors, already checked, and outputs it allocated."""
        flat = self.template.copy()
        flat[self.STREAM] = stream
        for index, i in self.tensors:
            flat[index] = pointers[i]
        for index, n in self.descriptors:
            flat[index] = filled[n]
        for index, n in self.free:
            flat[index] = free[n]
        self.c_launch(*flat)


class Recording:
    """The launches of one launcher call, which :func:`launch` fills in as it goes: what
    :meth:`keep` turns into the :class:`Recipe` that repeats the call for the next tensors."""

    __slots__ = ("key", "steps", "complete", "side", "counters")

    def __init__(self, key):
        self.key, self.steps, self.complete = key, [], True
        self.side = None  # the stream the launches being added go to, when not the current one (on_stream)
        self.counters = []  # the tile counters its kernels drew from (add_counter)

    def add(self, kernel, direct, grid: tuple, args: tuple) -> None:
        self.steps.append((kernel, direct, grid, args, self.side))

    def add_counter(self, x: torch.Tensor) -> None:
        """``x`` is the call's :func:`tile_counter`: a replay makes and passes a zeroed one of its own."""
        if not any(c is x for c in self.counters):
            self.counters.append(x)

    def keep(self, inputs: tuple, outputs: tuple, free: tuple = (), shared: tuple = ()) -> None:
        """Remember the call as a recipe: ``inputs`` are the tensors (or None) it was given, in the
        order :func:`replay` will get them, ``outputs`` the tensors it allocated, ``free`` the
        per-call integers, in the kernels' order (the dropout seed's halves). Kept only when every
        launch went through a direct launch and every argument tensor is one of these (or the call's
        tile counter, :meth:`add_counter`).

        A tensor in two roles binds both slots to the first of them, which is right only for calls
        that pass one tensor in the same roles: the inputs at positions ``shared`` may be one tensor
        because the key records which of them are; any other tensor in two roles keeps no recipe."""
        roles = (*inputs, *outputs, *self.counters)
        tensors = [x for x in roles if x is not None]
        others = [id(x) for i, x in enumerate(roles) if x is not None and i not in shared]
        on_side = [args for entry in self.steps if isinstance(entry, tuple) and entry[4] is not None
                   for args in entry[3]]
        if (not self.complete or any(x.data_ptr() & 15 for x in tensors) or len(set(others)) < len(others)
                or not {id(inputs[i]) for i in shared}.isdisjoint(others)
                or any(a is c for a in on_side for c in self.counters)):  # counters: current-stream launches only
            return
        steps = []
        for entry in self.steps:
            if not isinstance(entry, tuple):  # a stream switch (fork, join)
                steps.append(entry)
                continue
            kernel, direct, grid, args, side = entry
            step = _Step.bind(direct, grid, args, roles, free, _unspecialized(kernel), side)
            if step is None:
                remember(_RECIPES, self.key, None)  # this key's calls always take the launchers' own path
                return
            steps.append(step)
        layouts = tuple((tuple(x.shape), x.stride(), x.dtype) for x in outputs)
        remember(_RECIPES, self.key, Recipe(tuple(steps), layouts, len(self.counters), outputs[0].device))


class _Fork:
    """A stream switch of a recipe: ``side`` waits for the work queued so far on the current stream."""

    __slots__ = ("side",)

    def __init__(self, side):
        self.side = side

    def __call__(self, device: torch.device) -> None:
        self.side.wait_stream(_current_stream(device))


class _Join(_Fork):
    """A stream switch of a recipe: the current stream waits for the work queued so far on ``side``."""

    __slots__ = ()

    def __call__(self, device: torch.device) -> None:
        _current_stream(device).wait_stream(self.side)


def _switch(switch: _Fork, record: Recording | None) -> None:
    """Make the stream switch now, and keep it in ``record`` for the recipe's replays (none in a call
    that only compiles, :func:`in_background`)."""
    if compiling():
        return
    switch(_current_device())
    if record is not None:
        record.steps.append(switch)


def fork(side, record: Recording | None = None) -> None:
    """Let the stream ``side`` (of the current device) start after the work queued so far on the
    current stream; a ``record`` replays the same wait."""
    _switch(_Fork(side), record)


def join(side, record: Recording | None = None) -> None:
    """Make the current stream wait for the work queued so far on ``side``: whatever runs after this
    call (and any reuse of its tensors' memory) starts after ``side``'s kernels; recorded likewise."""
    _switch(_Join(side), record)


@contextlib.contextmanager
def on_stream(side, record: Recording | None = None):
    """Launch on the stream ``side`` inside the block; a ``record`` notes which launches went there."""
    with _stream_context(side):
        if record is not None:
            record.side = side
        try:
            yield
        finally:
            if record is not None:
                record.side = None


def _current_stream(device):
    return torch.cuda.current_stream(device)


def _stream_context(stream):
    return torch.cuda.stream(stream)


class Recipe:
    """A launcher call kept for repeating: the outputs to allocate and the launches to make, each with
    its arguments expanded once, and the stream switches between them. Replaying it costs the
    allocations, one TMA descriptor fill per described tensor and tile shape, the C launches and the
    switches; no config lookup, descriptor object, cache key or argument binding. Its roles are the call's
    inputs, its outputs (``layouts``) and ``n_counters`` tile counters (:func:`tile_counter`)."""

    __slots__ = ("steps", "layouts", "n_counters", "device", "fills", "first")

    def __init__(self, steps: tuple, layouts: tuple, n_counters: int, device: torch.device):
        self.steps, self.layouts, self.n_counters, self.device = steps, layouts, n_counters, device
        self.first = next(step for step in steps if isinstance(step, _Step))  # its hooks are every launch's
        # One TMA descriptor per distinct (tensor, tile): the backward's two kernels often read q, k,
        # v and dO in the same tiles. A launch copies its descriptors into the kernel's parameters, so
        # two launches may share one.
        fills, index = [], {}
        for step in steps:
            if not isinstance(step, _Step):
                continue
            numbered = []
            for position, role, args in step.descriptors:
                # (the block, shape and strides are lists, as the fill takes them)
                key = (step.fill, role, *(tuple(x) if isinstance(x, list) else x for x in args))
                if key not in index:
                    index[key] = len(fills)
                    fills.append((step.fill, role, args))
                numbered.append((position, index[key]))
            step.descriptors = tuple(numbered)
        self.fills = tuple(fills)

    def __call__(self, inputs: tuple, free: tuple):
        if not self.first.direct.unhooked():
            return None
        pointers = [0 if x is None else x.data_ptr() for x in inputs]
        for pointer in pointers:
            if pointer & 15:
                return None  # recorded with aligned inputs: a misaligned one takes the launchers' own path
        device = self.device
        allocated = tuple(torch.empty_strided(shape, stride, dtype=dtype, device=device)
                          for shape, stride, dtype in self.layouts)
        pointers += [x.data_ptr() for x in allocated]
        stream = _stream(device.index)
        if self.n_counters:  # held until the launches are queued
            counter = tile_counter(device)
            pointers += [counter.data_ptr()] * self.n_counters
        filled = [fill(pointers[i], *args) for fill, i, args in self.fills]
        for step in self.steps:
            if isinstance(step, _Step):
                step(stream if step.side is None else step.side.cuda_stream, pointers, filled, free)
            else:
                step(device)
        return allocated


_RECIPES = table("launch.recipes")  # a launcher call's key -> its Recipe, or None where its calls cannot be replayed






def recording(key) -> Recording | None:
    """A :class:`Recording` for a launcher call with ``key`` (None: a call that is never replayed),
    made when no recipe is kept for the key yet and the default tuning is in force (and never for a
    call that only compiles, :func:`in_background`)."""
    if key is None or key in _RECIPES or not _FAST_PATH[0] or not _config.tuning_is_default() or compiling():
        return None
    return Recording(key)


def has_recipe(key) -> bool:
    """Whether a recipe is kept for ``key`` (:func:`replay` may still decline it: a hook, a misaligned input)."""
    return _RECIPES.get(key) is not None


def replay(key, inputs: tuple, free: tuple = ()):
    """The outputs of a launcher call repeated from its recipe (:meth:`Recording.keep`) with these
    ``inputs`` and per-call integers, or None when there is no recipe for ``key`` or it does not
    apply now (a launch hook set, a misaligned input, a pinned tuning)."""
    if key is None or compiling():
        return None
    recipe = _RECIPES.get(key)
    if recipe is None or not _FAST_PATH[0] or not _config.tuning_is_default():
        return None
    try:
        return recipe(inputs, free)
    except TypeError:  # the generated launcher parses its arguments otherwise: this key takes the launchers' path
        remember(_RECIPES, key, None)
        return None


def _stream(device: int) -> int:
    """The raw handle of ``device``'s current CUDA stream."""
    return torch._C._cuda_getCurrentRawStream(device)


def _no_hook(hook) -> bool:
    """Whether a launch hook of Triton's knobs is unset: None, or an empty ``HookChain``."""
    return hook is None or getattr(hook, "calls", True) == []


# --8<-- [start:launch]
# The fast path reads the launcher that Triton generates for a compiled kernel (its argument layout,
# the closure of its tensor-descriptor wrapper): private to Triton, so it is on only for the Triton
# versions whose GPU tests ran it, and :func:`fast_path` turns it off (the tests compare the two).
FAST_PATH_TRITON = ("3.6.",)
_FAST_PATH = [triton.__version__.startswith(FAST_PATH_TRITON)]


@contextlib.contextmanager
def _holding(switch: list, value: bool):
    """Set the process-wide ``switch`` (a one-item list) to ``value`` inside the ``with`` block."""
    before = switch[0]
    switch[0] = value
    try:
        yield
    finally:
        switch[0] = before


def fast_path(enabled: bool):
    """Launch through the fast path (where this Triton has it) or through ``kernel[grid](...)`` alone
    inside the ``with`` block."""
    return _holding(_FAST_PATH, bool(enabled) and triton.__version__.startswith(FAST_PATH_TRITON))


_COMPILED = table("launch.compiled")  # launch signature -> (kernel, compiled kernel, its direct launch or None)
_UNSPECIALIZED = table("launch.unspecialized")  # id(kernel) -> positions of its unspecialized arguments


def _unspecialized(kernel) -> frozenset:
    """Positions of the arguments ``kernel`` was told not to specialize on (a dropout seed, which
    changes every call): their values must not key the cache of compiled kernels either. Kept by the
    kernel's id: a jitted function hashes through its source-derived cache key, slowly."""
    found = _UNSPECIALIZED.get(id(kernel))
    if found is None:
        params = getattr(kernel, "params", None)
        if params is not None:
            found = frozenset(p.num for p in params if getattr(p, "do_not_specialize", False))
        else:  # jitted under the interpreter: the decorator's own arguments, by name
            names = list(getattr(kernel, "arg_names", ()))
            found = frozenset(names.index(a) if isinstance(a, str) else a
                              for a in (getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()))
        remember(_UNSPECIALIZED, id(kernel), found)
    return found


def _interpreted(kernel) -> bool:
    """Whether ``kernel`` was jitted while TRITON_INTERPRET was set: it runs on the CPU, through Triton."""
    return type(kernel).__name__ == "InterpretedFunction"




def _signature(kernel, args: tuple, constexprs: dict, options: dict) -> tuple:
    """Everything Triton's specialization of ``kernel`` can depend on, and more: the value of every
    integer, the dtype and 16-byte alignment of every tensor (a pointer argument reaches the compiled
    kernel as nothing else; its strides are integers of their own), the shape, strides and block shape
    of every descriptor (integers the kernel is specialized on), the constexprs, the options and the
    device. A descriptor's base needs no alignment entry: :func:`tile_desc` only describes tensors
    that passed :func:`describable`, 16-byte aligned."""
    # id(kernel): the kernels live as long as the process (launch checks the entry's kernel is this
    # one), and hashing the jitted function itself goes through Triton's source-derived cache key
    key = [id(kernel), _current_device(), *constexprs.values(), *options.values()]
    first = len(key)
    append = key.append
    for a in args:  # one pass with no per-argument lookups: this runs before every launch
        kind = type(a)
        if kind is int:
            append(a)
        elif kind is bool:
            append((bool, a))  # not keyed like the int it equals: Triton types it apart
        elif kind is float:
            append(float)  # floats are never specialized on their value
        elif kind is torch.Tensor or isinstance(a, torch.Tensor):
            append((a.dtype, a.data_ptr() & 15))
        else:  # a tensor descriptor; tile_desc stores its key when it makes one
            found = vars(a).get("flashattn_key")
            append(found if found is not None else _descriptor_key(a))
    for index in _unspecialized(kernel):
        a = args[index]
        if type(a) is int:  # only the width of an unspecialized integer reaches the compiled kernel
            key[first + index] = ("width", -2**31 <= a < 2**31)
    return tuple(key)




def launch(kernel, grid, args: tuple, constexprs: dict, options: dict, record: Recording | None = None) -> None:
    """Launch ``kernel`` on ``grid`` (an int, or a tuple of up to three) on the current device and stream.

    ``kernel[grid](...)`` spends tens of microseconds per call binding and specializing every
    argument before it finds the compiled kernel in Triton's cache, which is most of a short call.
    After the first launch of a signature (:func:`_signature`) the arguments go straight to the
    kernel Triton compiled for it. ``constexprs`` must follow the kernel's parameter order. The
    interpreter always takes Triton's own path. A ``record`` collects each direct launch; any other
    path marks it incomplete, so no recipe is kept from it.
    """
    grid = (grid, 1, 1) if isinstance(grid, int) else tuple(grid) + (1,) * (3 - len(grid))
    dry_run = _COMPILE_ONLY.get()
    if dry_run is not None:  # in_background: compile, launch nothing
        device, compiles = dry_run
        if not _interpreted(kernel):
            compiles.append(_COMPILERS.submit(_compile, device, kernel, grid, args, constexprs, options))
        return
    if _interpreted(kernel) or not _FAST_PATH[0]:
        kernel[grid](*args, **constexprs, **options)
        if record is not None:
            record.complete = False
        return
    signature = _signature(kernel, args, constexprs, options)
    entry = _COMPILED.get(signature)
    known = entry is not None and entry[0] is kernel  # the signature holds id(kernel): check it is this one
    direct = entry[2] if known else None
    if direct is not None:
        full = (*args, *constexprs.values())
        try:
            if direct(grid, signature[1], full):
                if record is not None:
                    record.add(kernel, direct, grid, full)
                return
        except TypeError:  # the generated launcher parses its arguments otherwise: not for this signature
            entry = remember(_COMPILED, signature, (kernel, entry[1], None))
    if record is not None:
        record.complete = False  # a launch through Triton's path: nothing to replay
    if known and entry[1] is not None:
        try:
            entry[1][grid](*args, *constexprs.values())
            return
        except (AttributeError, TypeError):  # a compiled kernel launched otherwise: Triton's own path for it
            remember(_COMPILED, signature, (kernel, None, None))
    compiled = kernel[grid](*args, **constexprs, **options)
    if compiled is not None and not known:
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        remember(_COMPILED, signature, (kernel, compiled, _DirectLaunch.of(compiled, len(args) + len(constexprs))))
# --8<-- [end:launch]


# --8<-- [start:background]
# A launcher call run by in_background: its device and the list of its kernels' compiles, which
# launch() fills in place of launching (a context variable: only the thread running that call sees it)
_COMPILE_ONLY: contextvars.ContextVar = contextvars.ContextVar("flashattn_compile_only", default=None)
_BACKGROUND = [os.environ.get("FLASHATTN_BACKGROUND_COMPILE", "1") != "0"]
# Triton's compiler releases the GIL in its passes and in ptxas, so kernels compile side by side on
# threads: the calls on one, their kernels' compiles on the others
_CALLS = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flashattn-precompile")
_COMPILERS = concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="flashattn-compile")


def compiling() -> bool:
    """Whether this thread runs a launcher call that only compiles (:func:`in_background`): its
    launches write nothing, so its outputs may be any tensors laid out as the real ones would be."""
    return _COMPILE_ONLY.get() is not None


def _on(device: int):
    """Make ``device`` the current CUDA device of this thread inside the ``with`` block."""
    return torch.cuda.device(device)


def _compile(device: int, kernel, grid: tuple, args: tuple, constexprs: dict, options: dict) -> None:
    """Compile ``kernel`` for this launch on ``device`` into Triton's cache, launching nothing: the
    launch's later ``kernel[grid](...)`` finds it there (same arguments, same specialization)."""
    with _on(device):
        kernel.warmup(*args, grid=grid, **constexprs, **options)


def _dry_run(device: int, call) -> None:
    compiles = []
    token = _COMPILE_ONLY.set((device, compiles))
    try:
        with _on(device):
            call()
    finally:
        _COMPILE_ONLY.reset(token)
    for done in compiles:
        done.result()


def _quietly(future: concurrent.futures.Future) -> None:
    # a call that fails to compile in the background compiles (and fails) again when it runs
    future.exception()


def in_background(device: torch.device, call) -> concurrent.futures.Future | None:
    """Run the launcher call ``call()`` on a background thread with nothing launched, compiling each
    kernel it would launch on threads of its own (:func:`launch`), so that the real call later finds
    its kernels compiled. No recipe is recorded and no stream switch made, but ``call`` still
    allocates what the launcher allocates, on ``device``. Returns a future that is done when every
    kernel has compiled (errors stay inside it: the real call meets them again), or None where
    background compiles are off (:func:`background_compile`, or ``FLASHATTN_BACKGROUND_COMPILE=0``)."""
    if not _BACKGROUND[0] or device.type != "cuda":
        return None
    future = _CALLS.submit(_dry_run, _config.index_of(device), call)
    future.add_done_callback(_quietly)
    return future


def background_compile(enabled: bool):
    """Let :func:`in_background` compile (the default) or do nothing inside the ``with`` block."""
    return _holding(_BACKGROUND, bool(enabled))
# --8<-- [end:background]
