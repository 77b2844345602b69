"""What the Triton kernels share: base-2 constants, the schedule compiled for the device, tile
descriptors, the program-to-tile map, and a launcher that remembers compiled kernels.

:mod:`flashattn.forward` and :mod:`flashattn.backward` import from here and never from each other.
Importing this module imports Triton, but touches no GPU and no driver.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
import triton
import triton.language as tl

from flashattn import _config, constants, schedule
from flashattn._memo import remember

# Kernels may read module globals only when they are constexpr; host code uses ``.value``.
LOG2E = tl.constexpr(constants.LOG2E)
LN2 = tl.constexpr(constants.LN2)


# --8<-- [start:device-schedule]
@triton.jit
def _minimum(a, b):
    return tl.minimum(a, b)


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _clamp(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def _select(condition, if_true, if_false):
    return tl.where(condition, if_true, if_false)


@triton.jit
def _load(table, i):
    return tl.load(table + i)


# The kernels' view of flashattn.schedule: the same functions, compiled, with the five primitives
# swapped for their Triton twins. Triton's interpreter insists on seeing triton.language among a
# jitted function's globals, so the clones get a copy of the module's globals with it added.
_SCOPE = dict(vars(schedule), tl=tl, minimum=_minimum, maximum=_maximum, clamp=_clamp, select=_select, load=_load)


def device_fn(fn):
    """``fn`` of :mod:`flashattn.schedule`, compiled with ``triton.jit`` over the device primitives."""
    clone = types.FunctionType(fn.__code__, _SCOPE, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__doc__, clone.__module__, clone.__qualname__ = fn.__doc__, fn.__module__, fn.__qualname__
    jitted = triton.jit(clone)
    _SCOPE[fn.__name__] = jitted  # composed functions call the compiled versions of their parts
    return jitted


fwd_first_masked_key = device_fn(schedule.fwd_first_masked_key)
fwd_end_visible_key = device_fn(schedule.fwd_end_visible_key)
bwd_first_seeing_query = device_fn(schedule.bwd_first_seeing_query)
bwd_first_full_query = device_fn(schedule.bwd_first_full_query)
clamp = _clamp
visible = device_fn(schedule.visible)
forward_key_range = device_fn(schedule.forward_key_range)
dq_key_range = device_fn(schedule.dq_key_range)
backward_query_range = device_fn(schedule.backward_query_range)
launch_order = device_fn(schedule.launch_order)
sequence_of_tile = device_fn(schedule.sequence_of_tile)
packed_tile = device_fn(schedule.packed_tile)
in_window = device_fn(schedule.in_window)
window_key_range = device_fn(schedule.window_key_range)
window_dq_key_range = device_fn(schedule.window_dq_key_range)
window_query_range = device_fn(schedule.window_query_range)
# --8<-- [end:device-schedule]


@triton.jit
def tile_mask(rows, cols, N_CTX_Q, N_CTX_K, win_left, win_right, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The schedule's visibility test, with the window's when there is one."""
    mask = visible(rows, cols, N_CTX_Q, N_CTX_K, CAUSAL)
    if HAS_WINDOW:
        mask = mask & in_window(rows, cols, N_CTX_Q, N_CTX_K, win_left, win_right)
    return mask


@triton.jit
def tanh(x):
    """tanh from one exp2: (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1], so nothing overflows
    for any finite x, and the sign comes back last. Absolute error a few float32 ulps of 1."""
    e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


# --8<-- [start:score-mods]
@triton.jit
def score_mods(qk, rows, cols, N_CTX_Q, N_CTX_K, qk_scale, cap_in, cap_out, slope2,
               SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Base-2 scores of a tile of raw products q . k, and the tanh the softcap backward needs.

    Plain: s = c q.k with c = scale * log2(e). Softcap: the natural score scale * q.k becomes
    cap * tanh(scale * q.k / cap), so t = tanh(q.k * cap_in) with ``cap_in = scale / cap`` and
    s = t * cap_out with ``cap_out = cap * log2(e)``. ALiBi then adds -slope * |i + M - N - j|
    (``slope2`` is the head's slope times log2(e)): after the cap, as in the definition. ``rows``
    and ``cols`` broadcast to the tile ([R, 1] and [1, C], or transposed in the dK/dV loop). The
    returned ``t`` is meaningful only with SOFTCAP.
    """
    if SOFTCAP:
        t = tanh(qk * cap_in)
        s = t * cap_out
    else:
        t = qk
        s = qk * qk_scale
    if ALIBI:
        distance = tl.abs(rows + (N_CTX_K - N_CTX_Q) - cols).to(tl.float32)
        s = s - slope2 * distance
    return s, t
# --8<-- [end:score-mods]


# --8<-- [start:dropout-mask]
@triton.jit
def dropout_keep(seed_lo, seed_hi, i_bh, rows, first_col, threshold, BLOCK_N: tl.constexpr):
    """Which entries of the tile (rows, first_col .. first_col + BLOCK_N) of P survive dropout: a
    [len(rows), BLOCK_N] mask, a pure function of (seed, b * Hq + h, i, j).

    One Philox-4x32-10 draw (Triton's ``tl.philox``) serves eight neighbouring keys of one row: it is
    keyed by the 62-bit seed (passed as two 31-bit halves, so every launch has the same argument
    types) and counted by three separate 32-bit words, the key group ``j // 8``, the query index ``i``
    and ``b * Hq + h``, so no word ever wraps, whatever B * H * N * M is. Its four 32-bit output words
    give eight 16-bit lanes; key ``j`` reads lane ``j % 8`` = 2 w + h, the low (h = 0) or high
    (h = 1) half of word w. An entry is dropped when its lane falls below
    ``threshold = floor(p * 2^16)``. ``first_col`` must be a multiple of 8 (key tiles start at
    multiples of BLOCK_N); a kernel with transposed tiles transposes the result, so the same (i, j)
    gives the same bit in every kernel.
    """
    seed = (seed_hi.to(tl.int64) << 31) | seed_lo.to(tl.int64)
    groups = first_col // 8 + tl.arange(0, BLOCK_N // 8)  # [BLOCK_N // 8]
    c0 = (groups[None, :] + rows[:, None] * 0).to(tl.uint32)  # every counter word spans the draws' tile
    c1 = (rows[:, None] + groups[None, :] * 0).to(tl.uint32)
    c2 = (c0 * 0 + i_bh).to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c2 * 0)  # [rows, BLOCK_N // 8] each
    # join appends an axis: words[..., a, b] = r_(2a + b), then lanes[..., a, b, h] = half h of it,
    # so the row-major flattening of the last three axes is the lane 2 w + h.
    words = tl.join(tl.join(r0, r2), tl.join(r1, r3))
    lanes = tl.join(words & 0xFFFF, words >> 16)
    lanes = tl.reshape(lanes, [rows.shape[0], BLOCK_N])
    return lanes.to(tl.int32) >= threshold
# --8<-- [end:dropout-mask]


# --8<-- [start:program-tile]
@triton.jit
def program_tile(n_blocks, heads_per_group, LONGEST_FIRST: tl.constexpr):
    """(block, batch * head) of this program.

    The grid is one-dimensional, ``n_blocks * B * H`` programs long, so B * H is not bound by the
    65 535 programs that grid axes 1 and 2 allow. Programs launch in the order of their index, and the
    schedule's :func:`flashattn.schedule.launch_order` maps that index to a tile: without a causal mask
    (one head per group) that is plain row-major order; with one, rank 0, the block with the most
    work, launches first across a group of heads. ``LONGEST_FIRST`` turns rank into a query block
    (the last query block walks the most keys); key blocks of dK/dV are already longest first.
    """
    rank, i_bh = launch_order(tl.program_id(0), n_blocks, heads_per_group)
    block = rank
    if LONGEST_FIRST:
        block = n_blocks - 1 - rank
    return block, i_bh
# --8<-- [end:program-tile]


def variant_args(problem, alibi_slopes, seed: int, dummy: torch.Tensor) -> tuple:
    """The kernels' arguments for the variants, in their order: the window's (left, right), the
    softcap's two factors, the ALiBi slopes (pointer and batch stride), the dropout seed as two
    31-bit halves, its threshold and 1 / (1 - p). A variant that is off passes harmless values that
    its compiled-out code never reads (``dummy`` stands in for the slopes)."""
    p = problem
    left, right = p.window if p.window is not None else (0, 0)
    if p.alibi:
        slopes, stride_b = alibi_slopes, (alibi_slopes.shape[-1] if alibi_slopes.dim() == 2 else 0)
    else:
        slopes, stride_b = dummy, 0
    inv_keep = 1.0 / (1.0 - p.dropout_p)
    return (left, right, p.softcap_in, p.softcap_out, slopes, stride_b,
            *seed_halves(p, seed), p.dropout_threshold, inv_keep)


def seed_halves(problem, seed: int) -> tuple[int, int]:
    """The dropout seed as the kernels take it, two 31-bit halves (low, high); (0, 0) without dropout.
    They are the kernels' only per-call integers (:func:`replay` passes them to a recipe)."""
    seed = int(seed) if problem.dropout_p > 0 else 0
    return seed & (2**31 - 1), seed >> 31


_NO_SWITCH = contextlib.nullcontext()


def on_device(x: torch.Tensor):
    """A context that makes ``x``'s CUDA device the current one, where Triton launches: a device
    switch only when another device is current (none for CPU tensors), since a short call feels
    the few microseconds of switching there and back."""
    if x.is_cuda and x.get_device() != _current_device():
        return torch.cuda.device(x.device)
    return _NO_SWITCH


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` on the host. (``triton.cdiv`` is a constexpr function in Triton 3.6, whose host
    calls cost microseconds each, and a short call makes several.)"""
    return -(-a // b)


def interpreter_needs_float32(x: torch.Tensor) -> bool:
    # Triton's CPU interpreter (3.9) multiplies bfloat16 tiles in tl.dot as raw 16-bit integers, so on
    # the CPU a bfloat16 problem runs in float32 and its results are rounded back. GPUs never take this.
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and _config.is_interpreter()


def describable(x: torch.Tensor) -> bool:
    """Whether a tensor descriptor (a TMA copy on Hopper) may read ``x`` in place: the head dim
    contiguous, and the start and every other stride a multiple of 16 bytes."""
    size = x.element_size()
    return (x.stride(-1) == 1 and x.data_ptr() % 16 == 0
            and all(st * size % 16 == 0 for st in x.stride()[:-1]))


def addressable(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when the kernels can read it through tensor descriptors, else an aligned copy.

    Any layout whose strides are multiples of 16 bytes is read in place: (B, H, N, D), the
    (B, N, H, D) view of ``flash_attn_func``, slices of a larger buffer. Anything else (a strided
    head dim, an odd start, or rows of D elements that are not a multiple of 16 bytes, like
    D = 20 in fp16) is copied into a (B, H, N, D') buffer whose rows are padded to 16 bytes; the
    returned view still has D columns, so the padding is never read.
    """
    if describable(x):
        return x
    per_16_bytes = 16 // x.element_size()
    padded_d = -(-x.shape[-1] // per_16_bytes) * per_16_bytes
    buffer = torch.empty((*x.shape[:-1], padded_d), dtype=x.dtype, device=x.device)
    view = buffer[..., : x.shape[-1]]
    view.copy_(x)
    return view


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """A packed (total, H, D) tensor viewed as the (1, H, total, D) tensor the kernels address: a
    transpose, no copy. Its row stride is the packed tensor's, so slices of a packed qkv work too."""
    return x.transpose(0, 1).unsqueeze(0)


def tile_offsets(cu_seqlens: torch.Tensor, block: int) -> torch.Tensor:
    """``tile_offsets`` of :func:`flashattn.schedule.packed_tile` on the device, with torch ops and no
    host sync: 0, then the running sum of ``cdiv(length, block)`` over the sequences (int32)."""
    tiles = (cu_seqlens[1:] - cu_seqlens[:-1] + (block - 1)) // block
    return torch.nn.functional.pad(torch.cumsum(tiles, 0, dtype=torch.int32), (1, 0))


def tile_desc(x: torch.Tensor, rows: int, block_d: int, checked: bool | None = None):
    """A tensor descriptor of the (B, H, L, D) tensor ``x`` that reads [rows, block_d] tiles of one head.

    Made on the host per launch, so no program spends time building one; ``x`` must pass
    :func:`describable` (the launchers call :func:`addressable` first). Rows past L and columns past
    D load as zeros: the bounds are per dimension, so a tile never runs into the next head.

    On a GPU the descriptor is filled in directly, without the checks Triton's constructor repeats on
    every call (alignment, strides, block shape): :func:`describable` has made them, and they cost a
    short call microseconds per tensor. Under the interpreter, where the tests run, every descriptor
    goes through the checking constructor (``checked``: whether to; by default, under the interpreter).
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    if checked is None:
        checked = _config.is_interpreter()

    shape, strides, block = list(x.shape), list(x.stride()), [1, 1, rows, block_d]
    defaults = _descriptor_defaults()
    if defaults is None or checked:
        desc = TensorDescriptor(x, shape, strides, block)
    else:
        desc = object.__new__(TensorDescriptor)
        vars(desc).update(defaults, base=x, shape=shape, strides=strides, block_shape=block)
    if hasattr(desc, "__dict__"):  # the launch cache's key of this descriptor (_signature), made once
        desc.flashattn_key = _descriptor_key(desc)
    return desc


@functools.lru_cache(maxsize=None)
def _descriptor_defaults() -> dict | None:
    """The optional fields of Triton's ``TensorDescriptor`` with their defaults, or None when it is not
    the plain dataclass of base, shape, strides and block shape this module fills in (then every
    descriptor takes the constructor)."""
    import dataclasses

    from triton.tools.tensor_descriptor import TensorDescriptor

    if not dataclasses.is_dataclass(TensorDescriptor) or hasattr(TensorDescriptor, "__slots__"):
        return None
    fields = dataclasses.fields(TensorDescriptor)
    if [f.name for f in fields[:4]] != ["base", "shape", "strides", "block_shape"]:
        return None
    if any(f.default is dataclasses.MISSING for f in fields[4:]):
        return None
    return {f.name: f.default for f in fields[4:]}


class Descriptors:
    """The tile descriptors of one launcher call, each made once: the backward's two kernels read q, k,
    v and dO through the same descriptors when their block shapes agree."""

    def __init__(self, block_d: int):
        self.block_d, self.made = block_d, {}
        self.checked = _config.is_interpreter()  # read once per launcher call, not per descriptor

    def __call__(self, x: torch.Tensor, rows: int):
        key = (id(x), rows)  # x stays alive for the whole call, so its id is not reused meanwhile
        desc = self.made.get(key)
        if desc is None:
            desc = self.made[key] = tile_desc(x, rows, self.block_d, self.checked)
        return desc


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
    """Make the stream switch now, and keep it in ``record`` for the recipe's replays."""
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


_RECIPES: dict = {}  # a launcher call's key -> its Recipe, or None where its calls cannot be replayed


def tile_counter(device: torch.device) -> torch.Tensor:
    """A zeroed int32 for a kernel whose CTAs draw their tiles by adding to it (the Gluon causal
    forward's dynamic walk), made for each call: allocated, and zeroed by a memset on the current
    stream. The kernel's last draw sets it back to zero, so one counter per stream would do, but a
    tensor kept past the call lives wherever the calling thread allocated it, and while
    torch.compile's CUDA-graph trees warm a graph up that is the graph's memory pool, where a tensor
    the graph does not own makes its recording fail (tuning log, "A tile counter per stream,
    withdrawn")."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def recording(key) -> Recording | None:
    """A :class:`Recording` for a launcher call with ``key`` (None: a call that is never replayed),
    made when no recipe is kept for the key yet and the default tuning is in force."""
    if key is None or key in _RECIPES or not _config.tuning_is_default():
        return None
    return Recording(key)


def replay(key, inputs: tuple, free: tuple = ()):
    """The outputs of a launcher call repeated from its recipe (:meth:`Recording.keep`) with these
    ``inputs`` and per-call integers, or None when there is no recipe for ``key`` or it does not
    apply now (a launch hook set, a misaligned input, a pinned tuning)."""
    if key is None:
        return None
    recipe = _RECIPES.get(key)
    if recipe is None or not _config.tuning_is_default():
        return None
    try:
        return recipe(inputs, free)
    except TypeError:  # the generated launcher parses its arguments otherwise
        _stop_direct_launches()
        return None


def _stop_direct_launches() -> None:
    """Triton's own launch path from now on: no direct launch, no recipe."""
    _DIRECT[0] = False
    _RECIPES.clear()


def _stream(device: int) -> int:
    """The raw handle of ``device``'s current CUDA stream."""
    return torch._C._cuda_getCurrentRawStream(device)


def _no_hook(hook) -> bool:
    """Whether a launch hook of Triton's knobs is unset: None, or an empty ``HookChain``."""
    return hook is None or getattr(hook, "calls", True) == []


# --8<-- [start:launch]
_COMPILED: dict = {}  # launch signature -> the kernel Triton compiled for it
_FAST_LAUNCH = [True]  # cleared for good if this Triton cannot launch a compiled kernel directly
_DIRECT = [True]  # cleared for good if a direct launch (_DirectLaunch) is refused by its launcher


_UNSPECIALIZED: dict = {}  # id(kernel) -> positions of its unspecialized arguments


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
        _UNSPECIALIZED[id(kernel)] = found
    return found


def _interpreted(kernel) -> bool:
    """Whether ``kernel`` was jitted while TRITON_INTERPRET was set: it runs on the CPU, through Triton."""
    return type(kernel).__name__ == "InterpretedFunction"


def _current_device() -> int:
    get = getattr(torch._C, "_cuda_getDevice", None)  # torch.cuda.current_device without its lazy-init check
    return get() if get is not None else torch.cuda.current_device()


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


def _descriptor_key(desc) -> tuple:
    """What a compiled kernel is specialized on in a tensor descriptor: dtype, shape, strides, block."""
    return desc.base.dtype, tuple(desc.shape), tuple(desc.strides), tuple(desc.block_shape)


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
    if _interpreted(kernel):
        kernel[grid](*args, **constexprs, **options)
        if record is not None:
            record.complete = False
        return
    signature = _signature(kernel, args, constexprs, options)
    entry = _COMPILED.get(signature) if _FAST_LAUNCH[0] else None
    known = entry is not None and entry[0] is kernel  # the signature holds id(kernel): check it is this one
    direct = entry[2] if known and _DIRECT[0] else None
    if direct is not None:
        full = (*args, *constexprs.values())
        try:
            if direct(grid, signature[1], full):
                if record is not None:
                    record.add(kernel, direct, grid, full)
                return
        except TypeError:  # the generated launcher parses its arguments otherwise
            _stop_direct_launches()
    if record is not None:
        record.complete = False  # a launch through Triton's path: nothing to replay
    if known:
        try:
            entry[1][grid](*args, *constexprs.values())
            return
        except (AttributeError, TypeError):  # an older or newer Triton: keep its own launch path
            _FAST_LAUNCH[0] = False
    compiled = kernel[grid](*args, **constexprs, **options)
    if compiled is not None:
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        remember(_COMPILED, signature, (kernel, compiled, _DirectLaunch.of(compiled, len(args) + len(constexprs))))
# --8<-- [end:launch]
