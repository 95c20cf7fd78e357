"""Every `make` target the README or the Makefile names, run in its smoke mode (``make TARGET SMOKE=1``:
the same commands on one prompt, a few tokens, a few seconds, nothing installed, built or deleted),
and what it printed or wrote checked, so that no target can break silently. The whole file takes
about 2-4 minutes on 2 cores (the built-in model is loaded by run, bench, eval; the suite is
collected by test and test-slow).

The normal mode's commands are checked too, without running them (``make -n``): `make test` is the
set-up, the linters over the whole tree and the suite; bench, eval and soak keep their sizes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

TARGETS = ("install", "run", "test", "lint", "test-slow", "bench", "bench-deps", "eval", "soak", "proto", "sysdeps")
TARGETS += ("clean", "bench-scale")
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def make(*args: str, timeout: float = 420) -> str:
    """``make ARGS`` in the repository: its stdout and stderr together (asserting exit status 0)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECD_", "MAKE", "MFLAGS"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = ["make", "--no-print-directory", *args]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"make {' '.join(args)}: exit status {r.returncode}\n{out[-4000:]}"
    return out


def smoke(target: str, tmp_path: Path) -> str:
    return make(target, "SMOKE=1", f"SMOKE_OUT={tmp_path}")


def test_every_target_named_is_smoke_tested():
    """The README's `make X` and the Makefile's targets are exactly the ones this file runs."""
    phony = re.search(r"^\.PHONY:(.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert phony is not None
    readme = set(re.findall(r"(?:^|`)make ([a-z][a-z-]*)", (ROOT / "README.md").read_text(), re.M))
    assert set(phony.group(1).split()) == set(TARGETS)
    assert readme and readme <= set(TARGETS), readme - set(TARGETS)


def test_make_test_is_the_setup_the_linters_and_the_suite():
    """`make test` (not run: ``make -n``) lints the whole tree and runs the whole suite, after the
    system packages; bench, eval and soak keep their full sizes outside smoke mode."""
    out = make("-n", "test")
    for line in ("ruff check .", "ruff format --check .", "bin/mypy", "python -m pytest -q", "apt-get install"):
        assert line in out, line
    assert "--collect-only" not in out and "SMOKE" not in out
    out = make("-n", "bench", "eval", "soak", "BENCH_LLAMA=0")
    assert "-m eval bench --target" in out and "--per-category 8 --max-tokens 256 --batch 1,4" in out
    assert "--quantization none,int8,int4,gguf" in out and "--threads 2" in out
    assert "-m eval accept --target" in out and "-m eval accept methods --per-category 2 --max-tokens 128" in out
    assert "-m eval load soak --clients 8 --minutes 3" in out


def test_install(tmp_path):
    stamp = ROOT / ".venv" / ".installed"
    before = stamp.stat().st_mtime_ns
    out = smoke("install", tmp_path)
    assert "built-in model ready" in out and "install (smoke): " in out
    assert stamp.stat().st_mtime_ns == before  # nothing reinstalled


def test_run(tmp_path):
    out = smoke("run", tmp_path)
    assert "-m eval serve-check --host 127.0.0.1 --threads 0" in out
    summary = json.loads(next(ln for ln in reversed(out.splitlines()) if ln.startswith("{")))
    assert summary["readyz"] == 200 and summary["healthz"] == 200 and summary["exit_status"] == 0 and summary["ok"]


def test_test(tmp_path):
    """Set-up, system packages and linters in their smoke modes, then the suite collected."""
    out = smoke("test", tmp_path)
    assert "sysdeps (smoke): " in out and "All checks passed!" in out and "Success: no issues found" in out
    counts = dict(re.findall(r"^(tests/test_\w+\.py): (\d+)$", out, re.M))
    assert int(counts["tests/test_make_targets.py"]) >= len(TARGETS) and int(counts["tests/test_eval.py"]) > 5
    assert len(counts) > 40


def test_lint(tmp_path):
    out = smoke("lint", tmp_path)
    assert "All checks passed!" in out and "already formatted" in out
    assert "Success: no issues found in 1 source file" in out


def test_test_slow(tmp_path):
    """Only the slow tests are collected (the long soak among them)."""
    out = smoke("test-slow", tmp_path)
    counts = dict(re.findall(r"^(tests/test_\w+\.py): (\d+)$", out, re.M))
    assert "tests/test_soak.py" in counts and "tests/test_eval.py" not in counts


def test_bench(tmp_path):
    """One QA prompt, 8 tokens: specd plain and chain, transformers, llama.cpp (skipped with a note
    when it is not built: then bench-deps' smoke mode prints the build it would run)."""
    out = smoke("bench", tmp_path)
    rep = json.loads((tmp_path / "bench" / "report.json").read_text())
    assert rep["systems"][:3] == ["specd:off", "specd:chain:4", "hf:generate"] and rep["categories"] == ["qa"]
    res = rep["batches"]["1"]["systems"]
    assert all(r["per_category"]["overall"]["tokens_per_s"] > 0 for r in res.values())
    assert res["specd:chain:4"]["greedy_equal_to_ref"] == 1  # lossless
    assert rep["meta"]["quantization"] == ["gguf"] and rep["meta"]["max_tokens"] == 8
    if "llamacpp:plain" not in rep["systems"]:
        assert "not installed" in rep["notes"]["llamacpp:plain"] and "bench-deps (smoke): would run" in out
    assert (tmp_path / "bench" / "summary.md").stat().st_size > 0


def test_bench_deps(tmp_path):
    """The flags this CPU gets (AMX: AVX512 without ggml's AMX matmul; else -march=native), printed, nothing built."""
    site = sorted((ROOT / ".venv" / "lib").glob("python*/site-packages"))
    had = [bool(list(s.glob("llama_cpp*"))) for s in site]
    out = smoke("bench-deps", tmp_path)
    build = next(ln for ln in out.splitlines() if "would run: CMAKE_ARGS=" in ln)
    assert "-DGGML_OPENMP=ON" in build and "--no-binary llama-cpp-python" in build
    tools = next(ln for ln in out.splitlines() if "would run: cmake -S" in ln)  # llama.cpp's tools, same ISA flags
    assert "--target llama-bench llama-batched-bench llama-quantize llama-perplexity llama-tokenize" in tools
    assert "-DGGML_OPENMP=ON" in tools and ("-DGGML_NATIVE=ON" in build) == ("-DGGML_NATIVE=ON" in tools)
    amx = "amx_int8" in Path("/proc/cpuinfo").read_text().split()
    assert ("-DGGML_NATIVE=OFF" in build and "-DGGML_AVX512=ON" in build) if amx else "-DGGML_NATIVE=ON" in build
    assert [bool(list(s.glob("llama_cpp*"))) for s in site] == had  # nothing installed or removed


def test_bench_scale(tmp_path):
    """A tiny random-weight shape in f16 (written into the smoke folder, nothing under ~/.cache): specd
    plain at batch 1 and 4 and its rows; llama.cpp's columns where its tools are built (else the smoke
    mode says bench-deps would build them); then perplexity on the built-in model, scored as
    llama-perplexity scores it. Outside smoke mode the issue's sizes, formats and threads."""
    out = smoke("bench-scale", tmp_path)
    res = json.loads((tmp_path / "scale" / "results.json").read_text())
    (run,) = res["results"][0]["runs"]
    assert res["results"][0]["model"].startswith("tiny") and run["threads"] == 1
    assert run["specd"]["1"] > 0 and run["specd"]["4"] > 0 and run["read_GBps"] > 0
    assert set(run["rows_ms"]) == {"1", "2", "4", "8", "16", "32"}
    assert (run["llama_bench_b1"] or 0) > 0 or "bench-deps would build them" in out
    assert (tmp_path / "scale-cache" / "tiny-f16.gguf").exists()
    ppl = json.loads(next((tmp_path / "scale").glob("perplexity-*/results.json")).read_text())
    assert ppl["tokens_scored"] == 31 and ppl["specd_ppl"] > 1
    out = make("-n", "bench-scale", "LLAMA_TOOLS=/nonexistent")
    assert "-m eval bench scale --sizes 1.7b,3b,8b --formats q4_0,q4_k_m,q8_0 --threads 1,2" in out
    assert "-m eval perplexity --target" in out and "--ctx 512 --chunks 8" in out


def test_eval(tmp_path):
    """Acceptance on one Spec-Bench and one MT-bench prompt (off, chain:4, tree:16), then the methods
    per category on one QA prompt, every method's output identical to plain's."""
    out = smoke("eval", tmp_path)
    for name in ("spec_bench", "mt_bench"):
        rep = json.loads((tmp_path / "eval" / name / "report.json").read_text())
        assert rep["prompts"]["count"] == 1 and rep["meta"]["max_tokens"] == 8
        modes = {e["mode"]["name"]: e for e in rep["runs"][0]["modes"]}
        assert set(modes) == {"off", "chain:4", "tree:16"}
        assert all(modes[m]["greedy_match"]["equal"] == 1 for m in ("chain:4", "tree:16"))
    res = json.loads((tmp_path / "eval" / "head" / "results.json").read_text())
    assert res["methods"] == ["plain", "head-chain", "head-tree", "ngram", "auto"] and list(res["results"]) == ["qa"]
    assert "every method identical" in out and (tmp_path / "eval" / "head" / "speedup.png").exists()


def test_soak(tmp_path):
    smoke("soak", tmp_path)
    s = json.loads((tmp_path / "soak.json").read_text())
    assert s["ok"] and s["requests"] > 0 and s["violations"] == 0 and s["kv_blocks_used_after"] == [0, 0]


def test_proto(tmp_path):
    """The gRPC code generated again into a scratch folder equals the committed code."""
    committed = ROOT / "specd" / "serving" / "proto" / "specd" / "v1" / "specd_pb2.py"
    before = committed.stat().st_mtime_ns
    out = smoke("proto", tmp_path)
    assert "proto (smoke): the generated code matches specd/serving/proto" in out
    assert committed.stat().st_mtime_ns == before


def test_sysdeps(tmp_path):
    out = smoke("sysdeps", tmp_path)
    have = shutil.which("chromium") and shutil.which("systemd-analyze")
    have = have and (shutil.which("nginx") or Path("/usr/sbin/nginx").exists())
    assert ("are installed" if have else "some are missing: make sysdeps would run: apt-get") in out
    assert "warning" not in out


def test_clean(tmp_path):
    out = smoke("clean", tmp_path)
    assert "clean (smoke): 'rm -rf .venv build *.egg-info' emptied a scratch copy" in out
    assert (ROOT / ".venv" / "bin" / "python").exists()
