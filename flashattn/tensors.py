"""Host-side tensor preparation for the launchers: the current device, layouts the kernels can read
in place, tensor descriptors of tiles, packed-sequence tile offsets and small host arithmetic.
Importing it imports Triton and touches no GPU.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from flashattn import _config


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


def keys_last(v: torch.Tensor) -> torch.Tensor:
    """v (B, H, M, D) seen as (B, H, D, M) with the keys contiguous, so that a tensor descriptor reads
    [D, keys] tiles of it: the layout the float8 P V product takes. A v whose keys are already
    contiguous (the transpose of a (B, H, D, M) tensor, as a caller may quantize it) is read in place;
    any other v is copied (:func:`addressable` of the transposed view)."""
    return addressable(v.transpose(2, 3))


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

    def __call__(self, x: torch.Tensor, rows: int, block_d: int | None = None):
        """The descriptor of [rows, block_d] tiles of x (block_d: the call's head-dim block by default;
        v, dO and o take D_v's when the head dims are split)."""
        block_d = block_d or self.block_d
        key = (id(x), rows, block_d)  # x stays alive for the whole call, so its id is not reused meanwhile
        desc = self.made.get(key)
        if desc is None:
            desc = self.made[key] = tile_desc(x, rows, block_d, self.checked)
        return desc


def tile_counter(device: torch.device) -> torch.Tensor:
    """A zeroed int32 for a kernel whose CTAs draw their tiles by adding to it (the Gluon causal
    forward's dynamic walk), made for each call: allocated, and zeroed by a memset on the current
    stream. The kernel's last draw sets it back to zero, so one counter per stream would do, but a
    tensor kept past the call lives wherever the calling thread allocated it, and while
    torch.compile's CUDA-graph trees warm a graph up that is the graph's memory pool, where a tensor
    the graph does not own makes its recording fail
    (docs/kernels/tuning-log.md#a-tile-counter-per-stream-withdrawn-issue-11)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


_current_device = _config.current_device  # the launch layer's name for it (tests replace it there)


def _descriptor_key(desc) -> tuple:
    """What a compiled kernel is specialized on in a tensor descriptor: dtype, shape, strides, block."""
    return desc.base.dtype, tuple(desc.shape), tuple(desc.strides), tuple(desc.block_shape)

