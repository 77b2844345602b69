"""CPU checks of the flash_attn shim and of run.py's bookkeeping (no GPU, no upstream file needed).

    .venv/bin/python -m pytest -q tools/upstream/test_upstream_tools.py
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shim's flash_attn package, as run.py arranges

from flash_attn.bert_padding import pad_input, unpad_input  # noqa: E402
from flash_attn.layers.rotary import apply_rotary_emb  # noqa: E402


def test_the_shim_is_what_imports():
    import flash_attn
    import flashattn.compat

    assert flash_attn.IS_FLASHATTN_SHIM
    assert flash_attn.flash_attn_func is flashattn.compat.flash_attn_func
    assert flash_attn.flash_attn_with_kvcache is flashattn.compat.flash_attn_with_kvcache


def test_unpad_then_pad_round_trip_with_gradients():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    packed, indices, cu, max_len, used = unpad_input(x, mask)
    assert packed.shape == (8, 2, 4)
    assert cu.tolist() == [0, 3, 8, 8] and cu.dtype == torch.int32
    assert max_len == 5 and isinstance(max_len, int)
    assert used.tolist() == [3, 5, 0]
    assert indices.tolist() == [0, 1, 2, 5, 6, 7, 8, 9]
    torch.testing.assert_close(packed[3], x[1, 0])
    back = pad_input(packed, indices, 3, 5)
    torch.testing.assert_close(back, x * mask[:, :, None, None])  # padding comes back as zeros
    back.sum().backward()
    torch.testing.assert_close(x.grad, mask[:, :, None, None].float().expand_as(x))


def test_unused_mask_rows_are_packed_but_not_used():
    x = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]])
    packed, _, cu, max_len, used = unpad_input(x, mask, unused)
    assert cu.tolist() == [0, 3, 6] and max_len == 3 and used.tolist() == [2, 1]
    assert packed.shape == (6, 3)


def _rotate_by_hand(x, cos, sin, pos, interleaved):
    """One token's head vector rotated at position ``pos`` (identity past the tables), in float64."""
    out = x.double().clone()
    half = cos.shape[1]
    if pos >= cos.shape[0]:
        return out
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        c, s = float(cos[pos, i]), float(sin[pos, i])
        out[..., a] = x[..., a].double() * c - x[..., b].double() * s
        out[..., b] = x[..., a].double() * s + x[..., b].double() * c
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", ["int", "tensor"])
def test_apply_rotary_emb_positions_offsets_and_table_end(interleaved, offsets):
    torch.manual_seed(1)
    batch, seqlen, heads, dim, rot = 2, 3, 2, 8, 4
    angle = torch.rand(6, rot // 2) * 2 * math.pi
    cos, sin = torch.cos(angle), torch.sin(angle)
    x = torch.randn(batch, seqlen, heads, dim)
    off = 2 if offsets == "int" else torch.tensor([1, 4], dtype=torch.int32)  # 4 + 2 runs past the 6 rows
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=off)
    for b in range(batch):
        for t in range(seqlen):
            pos = t + (off if isinstance(off, int) else int(off[b]))
            torch.testing.assert_close(out[b, t].double(), _rotate_by_hand(x[b, t], cos, sin, pos, interleaved))
    wrong = apply_rotary_emb(x, cos, sin, interleaved=not interleaved, seqlen_offsets=off)
    assert not torch.allclose(wrong, out)  # the two pairings differ: the check above can fail


def test_apply_rotary_emb_packed_and_inplace():
    torch.manual_seed(2)
    angle = torch.rand(10, 2) * 2 * math.pi
    cos, sin = torch.cos(angle), torch.sin(angle)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    x = torch.randn(7, 2, 4)
    out = apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([0, 5]), cu_seqlens=cu, max_seqlen=4)
    dense = apply_rotary_emb(x[3:7].unsqueeze(0), cos, sin, seqlen_offsets=5)
    torch.testing.assert_close(out[3:7], dense[0])
    torch.testing.assert_close(out[:3], apply_rotary_emb(x[:3].unsqueeze(0), cos, sin)[0])
    y = x.clone()
    assert apply_rotary_emb(y, cos, sin, inplace=True, cu_seqlens=cu, seqlen_offsets=torch.tensor([0, 5])) is y
    torch.testing.assert_close(y, out)


def test_get_block_size_n_says_there_are_no_probabilities():
    from flash_attn.flash_attn_interface import NoAttentionProbabilities, _get_block_size_n

    with pytest.raises(NoAttentionProbabilities, match="no attention probabilities"):
        _get_block_size_n("cuda", 64, True, False)


SYNTHETIC = '''
import os
import time

import pytest


def convert_flash_attn_S_to_softmax(S, seqlen):
    return S.shape


@pytest.mark.parametrize("kind", ["pass", "fail", "ni", "probs", "skip", "error", "timeout", "crash"])
def test_kinds(kind):
    if kind == "fail":
        assert 1 == 2
    if kind == "ni":
        raise NotImplementedError("not built")
    if kind == "probs":
        convert_flash_attn_S_to_softmax(None, 3)
    if kind == "skip":
        pytest.skip("the test skips itself")
    if kind == "error":
        raise ValueError("bad input")
    if kind == "timeout":
        time.sleep(30)
    if kind == "crash":
        os._exit(3)


@pytest.mark.parametrize("i", range(30))
def test_many(i):
    pass
'''


def test_run_classifies_each_outcome(tmp_path):
    """run.py end to end on a made-up test file: one item of each outcome, sampling and the table."""
    has_timeout = importlib.util.find_spec("pytest_timeout") is not None
    has_xdist = importlib.util.find_spec("xdist") is not None
    kinds = ["pass", "fail", "ni", "probs", "skip", "error"] + ["timeout"] * has_timeout + ["crash"] * has_xdist
    source = SYNTHETIC.replace('["pass", "fail", "ni", "probs", "skip", "error", "timeout", "crash"]', repr(kinds))
    test_file = tmp_path / "test_synthetic.py"
    test_file.write_text(textwrap.dedent(source))
    out = tmp_path / "out"
    cmd = [sys.executable, str(HERE / "run.py"), "--test-file", str(test_file), "--out", str(out),
           "--per-function", "12", "--timeout-s", "3", "--budget-s", "300", "-n", "2" if has_xdist else "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((out / "results.json").read_text())
    by_kind = {item["nodeid"].split("[")[1].rstrip("]"): item for item in results["items"]
               if item["function"] == "test_kinds"}
    expected = {"pass": "passed", "fail": "failed", "ni": "not_implemented", "probs": "no_probs",
                "skip": "skipped", "error": "error", "timeout": "timeout", "crash": "error"}
    assert {k: v["category"] for k, v in by_kind.items()} == {k: expected[k] for k in kinds}
    assert by_kind["error"]["exc_type"] == "ValueError" and by_kind["error"]["origin"] == "upstream test"
    summary = results["summary"]
    assert summary["test_many"]["collected"] == 30 and summary["test_many"]["sampled"] == 12
    assert summary["test_many"]["passed"] == 12
    assert "| test_kinds | " in (out / "summary.md").read_text()


def test_a_spent_budget_runs_nothing(tmp_path):
    test_file = tmp_path / "test_synthetic.py"
    test_file.write_text("import pytest\n\n@pytest.mark.parametrize('i', range(5))\ndef test_x(i):\n    pass\n")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(HERE / "run.py"), "--test-file", str(test_file), "--out", str(out),
                           "--budget-s", "0", "-n", "0"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "results.json").read_text())["summary"]
    assert summary["test_x"]["not_run"] == 5 and summary["test_x"]["passed"] == 0
    (out / "results.json").unlink()
    again = subprocess.run([sys.executable, str(HERE / "run.py"), "--summarize-only", "--out", str(out)],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads((out / "results.json").read_text())["summary"] == summary
