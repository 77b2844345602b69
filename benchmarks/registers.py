"""Compile every kernel for sm_90 without a GPU and report registers, stack (spills) and shared memory.

    PYTHONPATH=. python -m benchmarks.registers [fp16|bf16] [--dropout] [BM,BN,WARPS,STAGES ...]   # no GPU needed

Uses the Triton installed where it runs (on a CPU machine that may not be the GPU's version; the
tuning log's numbers came from Triton 3.6, the GPU image's, so treat other versions' as leads).
Catches compile errors before a device call costs time, and shows which block shapes spill.
Strides are marked divisible by 16 (as Triton specializes them for contiguous fp16 tensors); the
inputs are host tensor descriptors, as the launchers pass them.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashattn import _config, backward, forward
from flashattn.problem import Problem

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def signature(fn, dtype, consts):
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_desc"):  # host tensor descriptors of (B, H, L, D), read in [1, 1, rows, BLOCK_D] tiles
            rows = consts["BLOCK_N"] if name in ("k_desc", "v_desc") else consts["BLOCK_M"]
            sig[name] = f"tensordesc<{dtype}[1, 1, {rows}, {consts['BLOCK_D']}]>"
        elif name.startswith("CU_SEQLENS") or name == "TILE_OFFSETS":  # packed sequences' int32 tables
            sig[name] = "*i32"
        elif name in ("LSE", "DELTA", "SLOPES"):
            sig[name] = "*fp32"
        elif name.isupper() and len(name) <= 5 and not name.startswith(("H_", "N_")) and name != "GROUP":
            sig[name] = "*" + dtype
        elif name in ("qk_scale", "scale", "cap_in", "cap_out", "inv_keep"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_one(fn, dtype, consts, warps, stages):
    sig = signature(fn, dtype, consts)
    ptrs_and_strides = [(i,) for i, n in enumerate(fn.arg_names) if sig[n].startswith("*") or n.startswith("stride")]
    attrs = {idx: [["tt.divisibility", 16]] for idx in ptrs_and_strides}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=TARGET, options=dict(num_warps=warps, num_stages=stages))
    # The bundled ptxas may be older than the PTX Triton emits, so read the cubin Triton built.
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    res = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    wgmma = k.asm["ptx"].count("wgmma.mma_async")
    return k.metadata.shared, int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1, wgmma


def jobs(extra=(), dropout: bool = False) -> list[tuple]:
    """(kernel, jit function, D, BLOCK_D, causal, KernelConfig) for every Hopper table entry (at N = 2k and
    16k, where a :class:`_config.ByLength` entry differs, and the small-grid tile where one replaces it;
    the dropout entries with ``dropout``), then each ``extra`` config at D = 128, causal."""
    out = []
    kernels = (("fwd", forward._attn_fwd_kernel), ("bwd_dkdv", backward._bwd_dkdv_kernel),
               ("bwd_dq", backward._bwd_dq_kernel))
    for d, block_d in ((64, 64), (128, 128), (72, 128), (256, 256), (16, 16)):
        for causal in (False, True):
            for kernel, fn in kernels:
                entry = _config.sm90_entry(kernel, block_d, dropout=dropout)
                cfgs = [_config.resolve(entry, causal, n) for n in (2048, 16384)]
                small = None if dropout else _config._SM90_SMALL_GRID.get((kernel, block_d))
                if small is not None:
                    cfgs.append(small[1])
                for cfg in dict.fromkeys(cfgs):
                    out.append((kernel, fn, d, block_d, causal, cfg))
    for bm, bn, w, s, *split in extra:
        for kernel, fn in kernels:
            out.append((kernel, fn, 128, 128, True, _config.KernelConfig(bm, bn, w, s, bool(split and split[0]))))
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.registers", description=__doc__.splitlines()[0])
    ap.add_argument("dtype", nargs="?", default="fp16", help="fp16 or bf16 (default %(default)s)")
    ap.add_argument("configs", nargs="*", type=lambda a: tuple(map(int, a.split(","))),
                    help="BM,BN,WARPS,STAGES[,SPLIT] configs to try at D = 128, causal")
    ap.add_argument("--dropout", action="store_true", help="compile with dropout on, from the table's dropout tiles")
    return ap.parse_intermixed_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    for kernel, fn, d, block_d, causal, cfg in jobs(args.configs, args.dropout):
        # the launchers' own constexprs (one set per launch: a split dK/dV config has two)
        problem = Problem(1, 8, 8, 2048, 2048, d, torch.float16, causal, d ** -0.5,
                          dropout_p=0.1 if args.dropout else 0.0)
        passes = _config.plan_for(kernel, problem, torch.device("cpu"), cfg).passes
        for consts in passes:
            which = {None: "", 0: "", 1: " dV", 2: " dK"}[consts.get("PART")]
            try:
                smem, regs, spill, wg = compile_one(fn, args.dtype, consts, cfg.num_warps, cfg.num_stages)
                print(f"{kernel + which:9s} D={d:3d} causal={causal!s:5s} {cfg}  smem {smem:6d}  regs {regs:3d}  "
                      f"stack {spill:5d}  wgmma {wg}")
            except Exception as exc:  # noqa: BLE001
                print(f"{kernel + which:9s} D={d:3d} causal={causal!s:5s} {cfg}  FAILED {type(exc).__name__}: "
                      f"{str(exc)[:300]}")

if __name__ == "__main__":
    main()
