"""Split-KV decoding tiles crossed with split rules, GPU time of each (CUDA-graph replays), cuDNN's and
SDPA flash's in the same process. The sweep behind ``decode_kernels.PROGRAMS_PER_SM`` = 1
(docs/kernels/tuning-log.md, "Decoding: one wave of splits").

    PYTHONPATH=. python -m benchmarks.decode_tiles OUT_DIR

Each setting patches :func:`flashattn.decode_kernels.decode_config` (block_n, warps, stages; block_m as
the launcher picks it) and :func:`~flashattn.decode_kernels.choose_num_splits` (programs per SM, at
least ``min_keys`` keys per split), makes :func:`~flashattn.decode_kernels.fit_tile` keep that tile,
clears the memo tables, checks ``flashattn.attention``'s output
against cuDNN's (max abs difference below 0.02) and times it. Writes ``OUT_DIR/decode_sweep.json``
after every shape; prints the five best settings per shape.
"""
import json
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn
from benchmarks.decode import _bench, _graph_bench
from flashattn import _config, _memo, decode_kernels
from flashattn.tensors import ceil_div

TILES = [(32, 4, 2), (32, 4, 4), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 4, 3),
         (128, 8, 2), (128, 8, 3), (32, 2, 3), (64, 2, 3)]  # (block_n, warps, stages)
RULES = [(1, 256), (2, 256), (4, 512), (4, 256), (8, 256), (8, 512), (16, 128)]  # (programs per SM, min keys per split)
SHAPES = [(1, 4096, 1, 32, 8), (1, 16384, 1, 32, 8), (1, 65536, 1, 32, 8), (1, 131072, 1, 32, 8),
          (16, 4096, 1, 32, 8), (16, 16384, 1, 32, 8), (16, 131072, 1, 32, 8), (64, 16384, 1, 32, 8),
          (1, 16384, 4, 32, 8), (1, 131072, 4, 32, 8), (16, 16384, 4, 32, 8),
          (1, 16384, 1, 8, 8), (16, 16384, 1, 8, 8), (1, 131072, 1, 8, 8)]  # (B, M, Nq, Hq, Hkv), D 128, bf16


def bench(fn, rep=25):
    """µs of ``fn()`` (median of do_bench), shorter repetitions than the decoding table's."""
    return 1e3 * _bench(fn, rep)


def graph_us(fn, rep=25):
    """µs of ``fn()`` replayed from a CUDA graph: its GPU time alone."""
    return 1e3 * _graph_bench(fn, rep)


def use(tile, rule, sm_count):
    """Patch the launcher's tile and split rule (``restore`` undoes it)."""
    block_n, warps, stages = tile
    per_sm, min_keys = rule

    def config(rows, block_d, device):
        return _config.KernelConfig(min(64, max(16, 1 << (rows - 1).bit_length())), block_n, warps, stages)

    def splits(programs, max_keys, block_n_, device, whole_sm=False):
        return max(1, min(ceil_div(per_sm * sm_count, programs), max(1, max_keys // min_keys), decode_kernels.MAX_SPLITS))

    def fit(cfg, *args):  # the setting's tile as it is
        return cfg

    decode_kernels.decode_config, decode_kernels.choose_num_splits, decode_kernels.fit_tile = config, splits, fit
    _memo.clear()


ORIGINAL = (decode_kernels.decode_config, decode_kernels.choose_num_splits, decode_kernels.fit_tile)


def restore():
    decode_kernels.decode_config, decode_kernels.choose_num_splits, decode_kernels.fit_tile = ORIGINAL
    _memo.clear()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m benchmarks.decode_tiles OUT_DIR")
    out = argv[0]
    warnings.filterwarnings("ignore")
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    rows, t0 = [], time.time()
    for (b, m, nq, hq, hkv) in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(b * 7 + m + nq)
        q = torch.randn(b, hq, nq, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
        k, v = (torch.randn(b, hkv, m, 128, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        def sdpa_flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        ref = cudnn().float()
        row = {"B": b, "M": m, "Nq": nq, "heads": f"{hq}:{hkv}", "cudnn_graph": graph_us(cudnn),
               "cudnn_eager": bench(cudnn, 50)}
        try:
            row["flash_graph"], row["flash_eager"] = graph_us(sdpa_flash), bench(sdpa_flash, 50)
        except Exception as e:  # noqa: BLE001 - recorded
            row["flash_err"] = repr(e)[:100]
        fa = lambda: flashattn.attention(q, k, v)  # noqa: E731
        restore()
        row["current_graph"], row["current_eager"] = graph_us(fa), bench(fa, 50)
        res = {}
        for tile in TILES:
            for rule in RULES:
                try:
                    use(tile, rule, sm_count)
                    err = float((fa().float() - ref).abs().max())
                    res[f"{tile}/{rule}"] = (round(graph_us(fa), 2), round(err, 5))
                except Exception as e:  # noqa: BLE001 - a tile that does not fit shared memory
                    res[f"{tile}/{rule}"] = (None, repr(e)[:80])
                finally:
                    restore()
        row["sweep"] = res
        ok = {key: val[0] for key, val in res.items() if val[0] is not None and val[1] < 0.02}
        row["best"] = sorted(ok.items(), key=lambda kv: kv[1])[:5]
        print(f"[{time.time() - t0:.0f}s] B{b} M{m} Nq{nq} {hq}:{hkv} cudnn {row['cudnn_graph']:.1f} "
              f"current {row['current_graph']:.1f} best {row['best'][:3]}", flush=True)
        rows.append(row)
        with open(f"{out}/decode_sweep.json", "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
        q = k = v = None  # the next shape allocates its own
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
