"""``python -m eval bench`` (eval/bench_real.py) smoke test on the tiny stories260K pair (~30 s): the
report has every system with positive tokens/s, the specd systems' greedy outputs agree token for
token, and the llama.cpp and CTranslate2 systems are skipped with a note when their libraries are
not importable (made so here, whether or not they are installed)."""

import json
import sys

from conftest import DRAFT, SHARED, TARGET

from eval.__main__ import main as eval_main

SYSTEMS = ["specd:off", "specd:chain", "hf:generate", "hf:pld"]
# one specd system per quantization (--quantization none,int8)
NAMES = ["specd[none]:off", "specd[int8]:off", "specd[none]:chain", "specd[int8]:chain", "hf:generate", "hf:pld"]


def test_bench_real_smoke(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    monkeypatch.setitem(sys.modules, "ctranslate2", None)
    out = tmp_path / "out"
    rc = eval_main(
        [
            "bench",
            "--target",
            str(TARGET),
            "--draft",
            str(DRAFT),
            "--prompts",
            str(SHARED / "data" / "mt_bench" / "question.jsonl"),
            "--raw",
            "--limit",
            "2",
            "--max-tokens",
            "8",
            "--batch",
            "1",
            "--threads",
            "1",
            "--systems",
            ",".join(SYSTEMS + ["llamacpp:plain", "llamacpp:pld:4", "ct2:generate"]),
            "--quantization",
            "none,int8",
            "--profile-tokens",
            "12",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["kind"] == "bench_real" and rep["systems"] == NAMES and rep["reference"] == "specd[none]:off"
    assert rep["meta"]["cpu_info"]["model"] and rep["meta"]["threads"] == 1
    for name in ("llamacpp:plain", "llamacpp:pld:4", "ct2:generate"):
        assert "not installed" in rep["notes"][name]
    assert rep["meta"]["command"].split()[1:4] == ["-m", "eval", "bench"]
    b1 = rep["batches"]["1"]
    assert set(b1["systems"]) == set(NAMES)
    for name, res in b1["systems"].items():
        assert res["per_category"]["overall"]["tokens_per_s"] > 0, name
        assert res["groups"] == 2
    # greedy speculation is lossless: the specd systems agree with specd:off token for token
    assert b1["systems"]["specd[none]:chain"]["greedy_equal_to_ref"] == 2
    assert b1["systems"]["specd[int8]:chain"]["mean_accepted_length"] >= 1.0
    assert set(rep["profile"]) == set(NAMES[:4])
    assert rep["profile"]["specd[int8]:chain"]["steps"] > 0 and rep["profile"]["specd[int8]:chain"]["draft_ms"] > 0
    floors = rep["bandwidth_floor"]["formats"]
    assert floors["int8"]["weight_bytes_read"] < floors["none"]["weight_bytes_read"] / 3  # int8 vs folded fp32
    assert all(f["floor_ms_per_step"] > 0 and f["specd_off_step_ms"] > 0 for f in floors.values())
    assert (out / "bench_real.png").stat().st_size > 0 and (out / "bench_floor.png").stat().st_size > 0
    assert "llama-cpp-python is not installed" in (out / "summary.md").read_text()


def test_bench_real_runs_specd_with_a_feature_head(tmp_path, monkeypatch, shared_pair):
    """``specd+head:MODE``: the feature head as the model proposer (an untrained head of the tiny
    target: the system must run, draft with the head and stay lossless, whatever it accepts)."""
    import torch

    from specd.model.head_files import save_head
    from specd.training.head import new_head

    target, _ = shared_pair
    save_head(new_head(target, torch.arange(64), init=False), tmp_path / "head", dtype=torch.float32)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    out = tmp_path / "out"
    args = ["--target", str(TARGET), "--draft", str(DRAFT), "--prompts", str(SHARED / "data/mt_bench/question.jsonl")]
    args += ["--raw", "--limit", "2", "--max-tokens", "8", "--batch", "1", "--threads", "1", "--no-progress"]
    args += ["--systems", "specd:off,specd+head:chain:2", "--head", str(tmp_path / "head"), "--out", str(out)]
    assert eval_main(["bench", "real", *args, "--profile-tokens", "8"]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["systems"] == ["specd:off", "specd+head:chain:2"]
    res = rep["batches"]["1"]["systems"]["specd+head:chain:2"]
    assert res["greedy_equal_to_ref"] == 2
    assert rep["profile"]["specd+head:chain:2"]["draft_ms"] > 0  # it drafted (with the head)
