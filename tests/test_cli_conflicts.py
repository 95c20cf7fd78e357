"""Option conflicts are refused before any model loads: one line on stderr, exit status 2, in under
2 s (``specd.options.check_conflicts``, called by ``specd serve`` and ``specd generate``); and
``generate`` speculates as a served request does by default (``auto``), so it runs without a draft."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_model_families import hf_folder

ROOT = Path(__file__).resolve().parents[1]


def specd(*args: str, env: dict | None = None) -> tuple[int, str, str, float]:
    """(exit status, stdout, stderr, seconds) of ``python -m specd ARGS``."""
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-m", "specd", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        timeout=300,
    )
    return p.returncode, p.stdout, p.stderr, time.perf_counter() - t0


def config_only(folder: Path, **cfg) -> Path:
    """A folder holding only a config.json: enough for a conflict found before loading."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return hf_folder(tmp_path_factory.mktemp("target"), "llama")[0]


def _conflicts(target: Path, tmp: Path) -> list:
    """(argv, the message's telling part) for each conflict."""
    llama = json.loads((target / "config.json").read_text())
    other_vocab = config_only(tmp / "draft-other-vocab", **{**llama, "vocab_size": 999})
    head_other = config_only(tmp / "head-other-vocab", architectures=["LlamaForCausalLMEagle3"], vocab_size=999,
                             hidden_size=64, target_hidden_size=64)  # fmt: skip
    head_same = config_only(tmp / "head", specd_head={"target_hidden_size": 64, "target_layers": [0, 1, 2]})
    head_deep = config_only(tmp / "head-deep", specd_head={"target_hidden_size": 64, "target_layers": [0, 1, 7]})
    gemma = config_only(tmp / "gemma", **{**llama, "architectures": ["Gemma2ForCausalLM"], "sliding_window": 8})
    t = ["--target", str(target), "--prompt", "hi", "--device", "cpu"]
    return [
        (["generate", *t, "--spec", "tree"], "--spec tree needs --draft DIR or --head DIR"),
        (["generate", *t, "--spec", "chain"], "--spec chain needs --draft DIR or --head DIR"),
        (["generate", *t, "--spec", "head"], "--spec head needs --head DIR"),
        (["serve", "--target", str(target), "--spec-mode", "chain"], "--spec-mode chain needs --draft DIR"),
        (["serve", "--target", str(target), "--spec-mode=tree"], "--spec-mode tree needs --draft DIR"),
        (["generate", *t, "--draft", str(target), "--head", str(head_same)], "were both given"),
        (["generate", *t, "--head", str(head_other)], "made for a target with vocabulary 999, not 306"),
        (["generate", *t, "--head", str(head_deep)], "reads target layer 7"),
        (["generate", *t, "--head", str(head_same), "--tensor-parallel-size", "2"], "tensor-parallel ranks do not"),
        (["generate", *t, "--draft", str(other_vocab)], "draft vocabulary (999 tokens"),
        (["generate", "--target", str(gemma), "--tensor-parallel-size", "2"], "Llama layers only"),
        (["generate", *t, "--act-quant", "int8"], "--act-quant int8 needs quantized weights"),
        (["generate", *t, "--quantization", "int4", "--tensor-parallel-size", "2"], "cannot be combined"),
    ]


def test_option_conflicts_exit_2_in_one_line_before_loading(target, tmp_path):
    for argv, message in _conflicts(target, tmp_path):
        rc, out, err, seconds = specd(*argv)
        assert rc == 2, (argv, err)
        assert message in err and err.startswith("specd: "), (argv, err)
        assert len(err.strip().splitlines()) == 1, err
        assert seconds < 2.0, (argv, seconds)


def test_the_default_tree_mode_of_serve_needs_no_draft(target, tmp_path):
    """``serve``'s default mode ``tree`` means "a tree where there is a drafter": not a conflict
    (checked without starting the server: the same check, in process)."""
    from specd.cli import build_parser, subcommand_parser
    from specd.options import apply_env_and_toml, check_conflicts, spec_mode_explicit

    sub = subcommand_parser(build_parser(), "serve")
    argv = ["--target", str(target)]
    a = apply_env_and_toml(sub, argv, "serve")
    assert a.spec_mode == "tree" and not spec_mode_explicit(argv)
    assert check_conflicts(a, a.spec_mode, spec_mode_explicit(argv)) is None
    assert check_conflicts(a, a.spec_mode, True) is not None


def test_generate_defaults_to_auto_and_runs_without_a_draft(target):
    rc, out, err, _ = specd(
        "generate", "--target", str(target), "--prompt", "Hello world", "--raw", "--max-tokens", "5",
        "--device", "cpu", "--dtype", "float32", "--json",
    )  # fmt: skip
    assert rc == 0, err
    res = json.loads(out.splitlines()[-1])
    assert len(res["token_ids"]) == 5 and res["stats"]["steps"] >= 1


def test_a_head_for_another_vocabulary_is_refused_for_a_gguf_target(tmp_path):
    """The target's shape comes from a GGUF file's header (not its whole metadata): fast enough
    before any model loads."""
    import gguf

    from tests.test_gguf import model_gguf

    path, _ = model_gguf(tmp_path, "llama", gguf.GGMLQuantizationType.F32, layers=1)
    head = config_only(tmp_path / "head", vocab_size=999, target_hidden_size=256)
    rc, _, err, seconds = specd("generate", "--target", str(path), "--head", str(head), "--prompt", "hi")
    assert rc == 2 and "made for a target with vocabulary 999, not 306" in err and seconds < 2.0, err
