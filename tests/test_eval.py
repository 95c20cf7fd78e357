"""eval/: the dispatcher (``python -m eval COMMAND [TOOL]``), acceptance numbers at the two extremes,
report totals, plots and the harness (fast: a few seconds each).

- the target as its own draft: every draft token is accepted, so a chain of k yields exactly k + 1
  tokens per step (max_tokens is a multiple of k + 1 and EOS is ignored, so no step is cut short);
- a randomly initialised draft: acceptance near 0, about one token per step;
- the JSON report's totals equal the sum of the per-request stats and the engine-wide stats;
- the plots are written and non-empty;
- every command and tool of ``python -m eval`` resolves to a module whose ``main`` runs it and whose
  reports record that command.
"""

import json
import shutil
import time

import pytest
from conftest import DRAFT, ROOT, TARGET

from eval import acceptance
from eval import harness as H
from eval.__main__ import COMMANDS, resolve, usage
from eval.__main__ import main as eval_main

PROMPTS = ["Once upon a time, there was a little", "Tom and Lily went to the park", "The cat sat"]


@pytest.fixture(scope="module", autouse=True)
def _threads():
    H.set_threads(1)


@pytest.fixture(scope="module")
def target_lm():
    from specd.model.loader import load_model

    return load_model(TARGET, "cpu", "float32", progress=False)


def _prompts():
    return [H.Prompt(str(i), "text", [p]) for i, p in enumerate(PROMPTS)]


def _overall(res, temp, name):
    run = next(r for r in res["runs"] if r["temperature"] == temp)
    return next(e for e in run["modes"] if e["mode"]["name"] == name)


def test_self_draft_accepts_everything(target_lm):
    k = 4
    modes = [H.Mode.parse(f"chain:{k}"), H.Mode.parse("tree:8:2:4")]
    res = acceptance.run_eval(
        target_lm,
        target_lm,
        _prompts(),
        modes,
        temperatures=(0.0,),
        max_tokens=6 * (k + 1),
        ignore_eos=True,
        progress=False,
    )
    chain = _overall(res, 0.0, f"chain:{k}")
    o = chain["overall"]
    assert o["acceptance_rate"] == 1.0
    assert o["mean_accepted_length"] == k + 1
    assert o["steps"] == 6 * len(PROMPTS)
    assert o["accept_len_hist"] == [0] * k + [o["steps"]]
    assert o["acceptance_per_depth"] == [1.0] * k
    assert o["conditional_acceptance_per_depth"] == [1.0] * k
    assert o["alpha_iid"] == 1.0
    th = chain["theory"]
    assert th["expected_tokens_iid"] == k + 1
    assert chain["greedy_match"] == {"equal": len(PROMPTS), "of": len(PROMPTS)}
    # a tree's best path is accepted to its full depth every step (the other branches are not)
    t = _overall(res, 0.0, "tree:8:2:4")["overall"]
    assert t["acceptance_per_depth"][0] == 1.0
    assert t["mean_accepted_length"] > 3.0
    for r in res["requests"]:
        assert r["output_tokens"] == 6 * (k + 1)


def test_random_draft_accepts_almost_nothing(target_lm, tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specd.model.loader import load_model

    torch.manual_seed(0)
    cfg = LlamaConfig.from_pretrained(str(TARGET))
    LlamaForCausalLM(cfg).save_pretrained(str(tmp_path))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (TARGET / f).exists():
            shutil.copy(TARGET / f, tmp_path / f)
    rnd = load_model(tmp_path, "cpu", "float32", progress=False)
    res = acceptance.run_eval(
        target_lm,
        rnd,
        _prompts(),
        [H.Mode.parse("chain:4")],
        temperatures=(0.0, 1.0),
        max_tokens=40,
        ignore_eos=True,
        progress=False,
    )
    for temp in (0.0, 1.0):
        o = _overall(res, temp, "chain:4")["overall"]
        assert o["steps"] > 0 and o["draft_tokens"] > 0
        assert o["acceptance_rate"] < 0.1, o
        assert o["mean_accepted_length"] < 1.25, o
    # greedy speculation is lossless even with a useless draft
    assert _overall(res, 0.0, "chain:4")["greedy_match"]["equal"] == len(PROMPTS)


def _check_mode_totals(rep: dict, run: dict, e: dict) -> None:
    """One mode's overall figures in an acceptance report equal the sums of its requests' and the
    engine's own counters."""
    name = e["mode"]["name"]
    rows = [r for r in rep["requests"] if r["mode"] == name and r["temperature"] == run["temperature"]]
    assert len(rows) == len(PROMPTS)
    o = e["overall"]
    for key in ("steps", "draft_tokens", "accepted_tokens"):
        assert o[key] == sum(r["stats"][key] for r in rows) == e["engine_stats"][key], (name, key)
    assert o["output_tokens"] == sum(r["output_tokens"] for r in rows)
    assert o["accept_len_hist"] == e["engine_stats"]["accept_len_hist"]
    assert sum(o["accept_len_hist"]) == o["steps"]
    if o["steps"]:
        assert o["mean_accepted_length"] == pytest.approx(1 + o["accepted_tokens"] / o["steps"], abs=1e-4)
    assert sum(c["steps"] for c in e["per_category"].values()) == o["steps"]
    assert e["timing"]["steps"] == o["steps"]  # one engine step per verification step at batch 1
    if name == "off":
        assert o["speedup"] == 1.0 and o["draft_tokens"] == 0
    else:
        assert e["theory"]["predicted_speedup"] > 0


def test_report_totals_and_plots(tmp_path):
    pf = tmp_path / "prompts.txt"
    pf.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "out"
    rc = eval_main(
        [
            "accept",
            "--target",
            str(TARGET),
            "--draft",
            str(DRAFT),
            "--prompts",
            str(pf),
            "--raw",
            "--max-tokens",
            "24",
            "--modes",
            "chain:3,tree:8,static:6",
            "--temperature",
            "0,0.8",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["schema"] == H.SCHEMA and rep["kind"] == "acceptance"
    for key in ("command", "date", "versions", "device"):
        assert rep["meta"][key]
    assert set(rep["meta"]["versions"]) >= {"torch", "transformers", "specd"}
    assert rep["prompts"]["count"] == len(PROMPTS)
    for run in rep["runs"]:
        for e in run["modes"]:
            _check_mode_totals(rep, run, e)
    md = (out / "summary.md").read_text()
    assert "chain:3" in md and "tree:8" in md and "static:6" in md
    pngs = sorted(out.glob("*.png"))
    assert {p.name for p in pngs} >= {
        "acceptance_per_depth_T0.png",
        "accept_len_hist_T0.png",
        "speedup_T0.png",
        "acceptance_per_depth_T0.8.png",
    }
    for p in pngs:
        assert p.stat().st_size > 1000 and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prompt_loading(tmp_path):
    mt = ROOT.parent / "shared" / "data" / "mt_bench" / "question.jsonl"
    sb = ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
    if mt.exists():
        ps = H.load_prompts(mt, limit=8)
        assert len({p.category for p in ps}) == 8 and all(len(p.turns) == 2 for p in ps)
    if sb.exists():
        ps = H.load_prompts(sb, per_category=2)
        assert {p.category for p in ps} == {"mt_bench", *H.SPEC_BENCH_TASKS}
        assert all(p.subcategory for p in ps if p.category == "mt_bench")
    pf = tmp_path / "p.txt"
    pf.write_text("a\n\nb\n")
    assert [p.turns for p in H.load_prompts(pf)] == [["a"], ["b"]]
    assert H.fit_prompt([1, 5, 6, 7], 3, 1) == ([1, 6, 7], True)
    ch = H.static_choices(10)
    assert len(ch) == 10 and all(c[:-1] in ch or len(c) == 1 for c in ch)
    assert H.expected_tokens_iid(0.0, 4) == 1.0 and H.expected_tokens_iid(1.0, 4) == 5.0
    assert H.tried_per_depth([(4, 0), (4, 4), (2, 1)]) == [3, 2, 1, 1]


# the harness ------------------------------------------------------------------------------------
def test_percentile_is_linear_interpolation_between_ranks():
    import random

    import numpy as np

    assert H.percentile([], 50) is None and H.percentile([None], 99) is None
    assert H.percentile([7], 0) == 7 and H.percentile([7], 99) == 7
    assert H.percentile([1, 2, 3, 4], 50) == 2.5  # between the two middle ranks
    assert H.percentile([4, 1, 3, 2], 0) == 1 and H.percentile([4, 1, 3, 2], 100) == 4
    assert H.percentile(range(1, 101), 99) == pytest.approx(99.01)  # rank 98.01: 99 + 0.01 * (100 - 99)
    assert H.percentile([10, None, 20], 25) == 12.5  # None entries are not samples
    rng = random.Random(0)
    for n in (2, 3, 10, 101):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (1, 50, 90, 99):
            assert H.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
    assert H.median([3, 1, 2]) == 2 and H.median([1, 2, 3, 4]) == 2.5
    assert H.median([]) is None and H.median([], empty=0.0) == 0.0
    with pytest.raises(ValueError):
        H.percentile([1, 2], 101)


def test_step_timer_stages_are_measured_and_fit_in_the_step(target_lm):
    """A real engine run: every stage took time, on both clocks, and the stages add up to no more
    than the step; the draft model's forwards are part of the draft stage."""
    from specd.model.loader import load_model
    from specd.sampling.params import SamplingParams

    draft = load_model(DRAFT, "cpu", "float32", progress=False, target=target_lm)
    mode = H.Mode.parse("chain:3")
    eng = H.make_engine(mode, target_lm, draft)
    timer = H.StepTimer(eng)
    ids = list(target_lm.tokenizer(PROMPTS[0])["input_ids"])
    seq = eng.generate([ids], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), mode.spec_params())[0]
    t = timer.as_dict()
    assert t["steps"] >= seq.stats.steps > 0  # every verification step, plus the prompt's
    assert t["draft_forwards"] >= seq.stats.steps  # a chain of 3 drafts every decode step
    for clock in ("", "cpu_"):
        stages = [t[f"{clock}{k}_s"] for k in ("schedule", "draft", "target_forward", "verify", "commit")]
        assert all(x > 0 for x in stages), (clock, stages)
        assert sum(stages) <= t[f"{clock}step_s"]
        assert 0 < t[f"{clock}draft_forward_s"] <= t[f"{clock}draft_s"]
        assert t[f"{clock}step_ms_mean"] == pytest.approx(1e3 * t[f"{clock}step_s"] / t["steps"], rel=1e-3)
    timer.reset()
    assert timer.as_dict()["steps"] == 0 and timer.as_dict()["step_s"] == 0.0


def test_step_log_pairs_and_engine_totals(target_lm):
    """StepLog: with the target as its own draft every chain step verifies (k, k); the pairs, the
    request's own stats and the engine totals since the log began agree."""
    from specd.sampling.params import SamplingParams

    k = 4
    mode = H.Mode.parse(f"chain:{k}")
    eng = H.make_engine(mode, target_lm, target_lm)
    params = SamplingParams(temperature=0.0, max_tokens=5 * (k + 1), ignore_eos=True)
    ids = list(target_lm.tokenizer(PROMPTS[1])["input_ids"])
    eng.generate([ids], params, mode.spec_params())  # engine totals before the log: not counted
    log = H.StepLog(eng)
    seq = log.generate(ids, params, mode.spec_params())
    pairs = log.take()
    assert pairs == [(k, k)] * 5 == [v for r in log.rows for v in r.verified]
    assert log.take() == []
    assert sum(a for _, a in pairs) == seq.stats.accepted_tokens and len(pairs) == seq.stats.steps
    assert all(r.outputs == 1 and r.seconds > 0 for r in log.rows)
    assert log.engine_stats().as_dict() == seq.stats.as_dict()


def test_a_followed_step_log_logs_each_step_once_on_the_stepping_thread(target_lm):
    """StepLog.follow: steps taken by another thread (an in-process server's engine thread) are
    logged there, each once, before the step returns (a listener on the event loop read requests'
    stats after later steps had changed them: 3 pairs for 4 steps); ``StepLog.step`` does not log
    twice; the CPU clock is the stepping thread's."""
    import threading

    from specd.sampling.params import SamplingParams

    k = 4
    mode = H.Mode.parse(f"chain:{k}")
    eng = H.make_engine(mode, target_lm, target_lm)
    params = SamplingParams(temperature=0.0, max_tokens=4 * (k + 1), ignore_eos=True)
    ids = list(target_lm.tokenizer(PROMPTS[1])["input_ids"])
    log = H.StepLog(eng)
    assert log.follow() is log and log.follow() is log  # (twice: still one wrapper)
    seq = eng.add_request(ids, params, mode.spec_params())
    seen, clocks = [], []

    def run():
        while not seq.finished:
            before = time.thread_time()
            eng.step()
            seen.append(len(log.rows))  # logged before the step returned
            clocks.append((before, time.thread_time()))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == list(range(1, len(seen) + 1)) and log.take() == [(k, k)] * 4
    assert all(a <= r.cpu_clock <= b for r, (a, b) in zip(log.rows, clocks, strict=True))
    seq2 = log.generate(ids, params, mode.spec_params())
    assert seq2.stats.steps == 4 and log.take() == [(k, k)] * 4 and len(log.rows) == 8


def test_in_process_daemon_serves_and_logs_its_steps(target_lm):
    """harness.start_daemon (in process): a websocket request is served, its StepLog sees every
    verification step of it, and stop() shuts the server down."""
    import asyncio

    from specd.model.loader import load_model

    draft = load_model(DRAFT, "cpu", "float32", progress=False, target=target_lm)
    srv = H.start_daemon(
        ["--target", str(TARGET), "--draft", str(DRAFT), "--num-blocks", "256"], target=target_lm, draft=draft
    )
    try:
        assert srv.pid > 0 and srv.url.endswith(f":{srv.port}/ws") and srv.logs == []
        k0 = srv.steplog.mark()

        async def one():
            async with H.connect(srv.port) as ws:
                body = {"prompt": PROMPTS[2], "max_tokens": 12, "ignore_eos": True, "speculation": {"mode": "chain"}}
                return await H.request(ws, "r1", body)

        r = H.run_async(one())
        assert len(r.token_ids) == 12
        rows = srv.steplog.since(k0)
        pairs = [v for row in rows for v in row.verified]
        assert len(pairs) == r.done["spec"]["steps"] > 0
        assert sum(a for _, a in pairs) == r.done["spec"]["accepted_tokens"]
    finally:
        srv.stop()
    with pytest.raises(OSError):
        asyncio.run(asyncio.open_connection("127.0.0.1", srv.port))


def test_step_costs_times_prefill_chunks_and_decode_widths(tmp_path):
    out = tmp_path / "out"
    args = ["costs", "--target", str(TARGET), "--quantization", "int4", "--prefill", "20:8", "--decode", "10:1,10:3"]
    assert eval_main([*args, "--reps", "1", "--steps", "3", "--threads", "1", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    pre = res["prefill"]["20:8"]
    assert len(pre["chunk_ms"]) == 3 and all(v > 0 for v in pre["chunk_ms"])  # chunks of 8, 8, 4
    assert pre["tokens_per_s"] == pytest.approx(20 / pre["total_ms"] * 1e3, rel=1e-2)
    assert set(res["decode"]) == {"10:1", "10:3"} and all(v > 0 for v in res["decode"].values())
    with pytest.raises(SystemExit, match="positive integers"):
        eval_main([*args[:5], "--prefill", "20:0"])


# the dispatcher ---------------------------------------------------------------------------------
def test_every_command_resolves_to_a_tool_that_records_it(capsys):
    """Each COMMAND [TOOL] imports to a module with ``main``; a command alone is its first tool; a
    tool that writes reports records the command it was reached by (``harness.run_meta``)."""
    import importlib

    assert set(COMMANDS) >= {"bench", "accept", "load", "costs"}
    for cmd, tools in COMMANDS.items():
        default = next(iter(tools.values()))[0]
        assert resolve([cmd, "--x"]) == (cmd, default, ["--x"])
        for tool, (module, what) in tools.items():
            words = f"{cmd} {tool}".strip()
            assert resolve(words.split() + ["-y"])[1:] == (module, ["-y"]) and what
            if module == "eval.gpu_check":  # imports Triton; its dry run is tests/test_kernels.py's
                continue
            mod = importlib.import_module(module)
            assert callable(mod.main), module
            recorded = getattr(mod, "COMMAND", None)
            if module not in ("eval.train_demo_pair", "eval.grammar_libs"):  # (no COMMAND)
                assert recorded in (words, cmd) and resolve(recorded.split())[1] == module, (module, recorded)
    assert H.command_line("load soak", ["--clients", "2"]).endswith("-m eval load soak --clients 2")
    assert H.command_line("eval.x", []).endswith("-m eval.x")
    with pytest.raises(ValueError):
        resolve(["nope"])
    text = usage()
    assert all(m in text for tools in COMMANDS.values() for m, _ in tools.values())
    assert eval_main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err
    assert eval_main(["--help"]) == 0 and "bench" in capsys.readouterr().out


def test_accept_methods_takes_penalties():
    """``accept methods --penalties JSON``: penalty fields only, checked by SamplingParams."""
    from eval import bench_head

    a = bench_head.parse_args(["--penalties", '{"repetition_penalty": 1.1, "presence_penalty": 0.5}'])
    assert a.penalties == {"repetition_penalty": 1.1, "presence_penalty": 0.5}
    assert bench_head.parse_args([]).penalties == {}
    for bad in ('{"top_k": 3}', '{"repetition_penalty": 0}', "[1]", "{"):
        with pytest.raises(SystemExit):
            bench_head.parse_args(["--penalties", bad])
