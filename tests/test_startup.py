"""`specd serve`'s start-up (issue #42: ready to serve a 1.7B file in under 10 s, first load included):
what was cut keeps its behaviour.

- the GGUF header read in bulk (``specd.model.gguf.GGUFFile``) gives what ``gguf.GGUFReader`` gives:
  every metadata value, every tensor's name, type, shape and bytes;
- a CPU KV cache reads as zeros and takes no memory until written (fresh anonymous pages);
- a model skeleton on the meta device (a GGUF load) builds without importing torch._dynamo;
- the warm-up's row timings run after ready, one forward at a time while the engine is idle: a
  request sent meanwhile is served with the tokens an unseeded engine gives, and the cost model is
  seeded once the timings are done; a later start seeds from the per-model, per-CPU cache at once,
  and a changed checkpoint is measured again;
- the engine process started before the server's imports is taken over by ``ProcessLink``, or ends
  when closed without being taken over.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import DRAFT, TARGET, serve_args

from specd.config import EngineConfig, SpecConfig
from specd.engine.warmup import ROW_WIDTHS, CostCache, Seeding, engine_key, warm_up
from specd.model import gguf as sg
from specd.model.builtin import builtin_gguf
from tests.test_gguf import model_gguf

Q = gguf.GGMLQuantizationType
ROOT = Path(__file__).resolve().parents[1]
BUILTIN_GGUF = builtin_gguf()

pytestmark = pytest.mark.timeout(300)


# the GGUF header -----------------------------------------------------------------------------------
def _same_as_reader(path: Path) -> None:
    ours, ref = sg.open_gguf(path), gguf.GGUFReader(path)
    assert isinstance(ours, sg.GGUFFile)
    assert sg.read_metadata(ours, path) == sg.read_metadata(ref, path)
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist(), a.name
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)


@pytest.mark.parametrize("arch,qtype", [("llama", Q.F16), ("qwen2", Q.Q8_0), ("llama", Q.Q4_K), ("mistral", Q.Q4_0)])
def test_gguf_file_reads_what_gguf_reader_reads(tmp_path, arch, qtype):
    _same_as_reader(model_gguf(tmp_path, arch, qtype, layers=1)[0])


def test_gguf_file_reads_the_builtin_model_as_gguf_reader_does():
    """The real 49k-token vocabulary, merges, scores-free token types and chat template; Q4_1 blocks."""
    _same_as_reader(BUILTIN_GGUF)
    meta = sg.open_gguf(BUILTIN_GGUF).meta
    assert len(meta["tokenizer.ggml.tokens"]) == 49152 and len(meta["tokenizer.ggml.merges"]) > 40000


def test_a_header_cut_short_or_lying_is_a_load_error(tmp_path):
    path, _ = model_gguf(tmp_path, "llama", layers=1)
    data = path.read_bytes()
    n_tok = sg.open_gguf(path).meta["tokenizer.ggml.tokens"]
    cut = tmp_path / "cut.gguf"
    for size in (30, 200, len(data) // 2):
        cut.write_bytes(data[:size])
        with pytest.raises(sg.LoadError, match="truncated or corrupt GGUF file"):
            sg.open_gguf(cut)
    bad = tmp_path / "v9.gguf"
    bad.write_bytes(data[:4] + (9).to_bytes(4, "little") + data[8:])
    with pytest.raises(sg.LoadError, match="GGUF version 9"):
        sg.open_gguf(bad)
    assert len(n_tok) > 100


# the KV cache -------------------------------------------------------------------------------------
def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def test_a_cpu_kv_cache_reads_zero_and_takes_memory_only_where_written():
    from specd.engine.kv_cache import KVCache

    before = _rss_anon()
    c = KVCache(8, 4, 64, 2048, 16, torch.float16, torch.device("cpu"))  # [L, 2, NB, BS, KVH, D]: 256 MiB
    assert c.kv.nbytes == 256 << 20 and c.kv.dtype == torch.float16 and c.kv.is_contiguous()
    assert _rss_anon() - before < 32 << 20  # (torch.zeros wrote all 256 MiB at once)
    c.kv[3, 1, 7] = 2.0
    assert c.kv.count_nonzero() == 16 * 4 * 64 and c.kv[3, 1, 7].eq(2).all()
    assert c.kv.data_ptr() % 4096 == 0
    kv = c.kv[0]
    del c
    kv[0, 0, 0, 0, 0] = 1.0  # (a view keeps the memory mapped)
    assert float(kv.sum()) == 1.0
    bf = KVCache(2, 2, 8, 4, 16, torch.bfloat16, torch.device("cpu")).kv
    assert bf.dtype == torch.bfloat16 and bf.shape == (2, 2, 4, 16, 2, 8) and not bf.any()


# the model skeleton --------------------------------------------------------------------------------
def test_a_gguf_load_does_not_import_torch_dynamo():
    """The meta-device skeleton's RoPE tables are shapes only (computing them there imported
    torch._dynamo, ~1.5 s of CPU); the loaded model's tables are the real ones."""
    code = (
        "import sys, torch; from specd.model.loader import load_model; from specd.model.llama import Rotary; "
        f"lm = load_model({str(BUILTIN_GGUF)!r}, 'cpu', 'float32', with_tokenizer=False, quantization='auto'); "
        "r = Rotary(lm.config, lm.config.max_position_embeddings); "
        "assert torch.equal(lm.model.rotary.cos, r.cos) and torch.equal(lm.model.rotary.sin, r.sin); "
        "print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "False"


def test_rotary_on_the_meta_device_has_the_real_tables_shapes():
    from specd.model.llama import Rotary
    from specd.model.loader import read_config

    cfg, _ = read_config(TARGET)
    real = Rotary(cfg, 64)
    with torch.device("meta"):
        skeleton = Rotary(cfg, 64)
    assert {k: (v.shape, v.dtype) for k, v in skeleton.named_buffers()} == {
        k: (v.shape, v.dtype) for k, v in real.named_buffers()
    }
    assert all(v.is_meta for v in skeleton.buffers())


# row costs after ready -------------------------------------------------------------------------------
def _engine(shared_pair, **spec):
    from specd.engine.engine import Engine

    t, d = shared_pair
    cfg = EngineConfig(target=str(TARGET), draft=str(DRAFT), spec=SpecConfig(mode="chain", **spec))
    return Engine(cfg, target=t, draft=d)


def _seeded_widths(eng) -> dict:
    c = eng.policy.costs
    c.at_context(0)
    return {w: c.t_width[(1, w)] for w in ROW_WIDTHS[1:] if (1, w) in c.t_width}


def test_deferred_row_timings_run_between_requests_and_then_seed(shared_pair, tmp_path):
    """``warm_up(defer=True)``: the plain step is measured before ready, the row timings are left to
    the engine loop's idle moments. A request sent while they are pending waits for one piece at
    most, gets the tokens an engine without seeding gives, and no piece runs while the engine has
    work; once the timings are done the cost model is seeded (each width seen twice, never below the
    plain step) and the timings are kept in the cache."""
    from specd.engine.commands import Submit
    from specd.engine.links import ThreadLink
    from specd.engine.sequence import SpecParams
    from specd.sampling.params import SamplingParams
    from specd.serving.async_engine import AsyncEngine

    ref_eng = _engine(shared_pair)
    warm_up(ref_eng, seed=False)
    prompt = list(ref_eng.tokenizer("Once upon a time")["input_ids"])
    params = SamplingParams(temperature=0.0, max_tokens=24)
    want = ref_eng.generate([prompt], params, SpecParams(mode="chain"))[0].output_ids

    eng = _engine(shared_pair)
    cache = CostCache(tmp_path / "costs.json", "key")
    seeding = warm_up(eng, defer=True, cache=cache)
    assert isinstance(seeding, Seeding) and seeding.seeded is None and _seeded_widths(eng) == {}
    eng.policy.costs.at_context(0)
    plain = eng.policy.costs.plain_cost(1)
    assert plain is not None and plain == seeding.plain

    first, submitted, pieces, busy = threading.Event(), threading.Event(), [], []

    def idle() -> bool:
        busy.append(eng.has_work())
        if not pieces:
            first.set()
            submitted.wait(30)  # the request arrives while this piece runs
        pieces.append(time.monotonic())
        return seeding.step()

    async def main():
        ae = AsyncEngine(ThreadLink(eng, 0.0, idle=idle))
        await ae.start()
        await asyncio.get_running_loop().run_in_executor(None, first.wait, 30)
        stream = ae.stream(Submit("r1", prompt, params, SpecParams(mode="chain")))
        submitted.set()
        got = [t async for out in stream for t in out.token_ids]
        done_at = time.monotonic()
        end = time.monotonic() + 60
        while seeding.seeded is None and time.monotonic() < end:
            await asyncio.sleep(0.01)
        await ae.stop()
        return got, done_at

    got, done_at = asyncio.run(main())
    assert got == want
    assert not any(busy)
    assert sum(t < done_at for t in pieces) < len(pieces)  # pieces ran after the request, too
    seeded = seeding.seeded
    assert seeded is not None and set(seeded) == set(ROW_WIDTHS)
    widths = _seeded_widths(eng)
    assert set(widths) == set(ROW_WIDTHS[1:]) and all(n >= 2 and s >= plain for s, n in widths.values())
    assert set(cache.get() or {}) == set(ROW_WIDTHS)


def test_a_later_start_seeds_from_the_cache_at_once(shared_pair, tmp_path, monkeypatch):
    """A second engine of the same model on the same CPU seeds at once with the first's timings (no
    ``Seeding`` left to run, no forward timed); a changed checkpoint, other threads or another
    kernel build are other keys; a damaged cache file is a miss, not a failure."""
    import specd.engine.warmup as W

    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path / "cache"))
    target = tmp_path / "target"
    shutil.copytree(TARGET, target)
    first = _engine(shared_pair)
    cache = CostCache.for_engine(first, target)
    assert cache.path == W.cost_cache_file(target) and cache.path.parent == tmp_path / "cache" / "row-costs"
    seeding = warm_up(first, defer=True, cache=cache)
    assert seeding is not None
    seeded = seeding.run()

    second = _engine(shared_pair)
    monkeypatch.setattr(W, "row_timings", lambda *a, **k: pytest.fail("timed again"))
    assert warm_up(second, defer=True, cache=CostCache.for_engine(second, target)) is None
    w1, w2 = _seeded_widths(first), _seeded_widths(second)
    assert set(w2) == set(ROW_WIDTHS[1:]) and all(w2[w][1] == 2 for w in w2)
    plain2 = second.policy.costs.plain_cost(1)
    assert {w: w2[w][0] - plain2 for w in w2} == pytest.approx({w: seeded[w] - seeding.plain for w in w2}, abs=1e-12)
    assert w1.keys() == w2.keys()

    key = engine_key(second, target)
    assert engine_key(first, target) == key == cache.key
    st = (target / "config.json").stat()
    os.utime(target / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    changed = engine_key(second, target)
    assert changed != key  # (a changed checkpoint is measured again)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert engine_key(second, target) != changed
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(W, "_kernel_build", lambda engine: "cpu_kernel-other.so")
    assert engine_key(second, target) != changed
    assert engine_key(second, target, widths=(1, 2, 4)) != engine_key(second, target)
    cache.path.write_text("{not json")
    assert cache.get() is None
    cache.put({1: 0.5, 2: 0.6, 4: 0.7})
    assert cache.get() == {1: 0.5, 2: 0.6, 4: 0.7}


def test_idle_work_that_fails_is_dropped_and_serving_goes_on(shared_pair, caplog):
    from specd.engine.commands import Submit
    from specd.engine.links import ThreadLink
    from specd.engine.sequence import SpecParams
    from specd.sampling.params import SamplingParams
    from specd.serving.async_engine import AsyncEngine

    eng = _engine(shared_pair)
    calls = []

    def idle() -> bool:
        calls.append(1)
        raise RuntimeError("boom")

    async def main():
        ae = AsyncEngine(ThreadLink(eng, 0.0, idle=idle))
        await ae.start()
        await asyncio.sleep(0.3)
        ids = list(eng.tokenizer("The little dog")["input_ids"])
        req = Submit("r", ids, SamplingParams(max_tokens=8), SpecParams("off"))
        got = [t async for out in ae.generate(req) for t in out.token_ids]
        await asyncio.sleep(0.3)
        await ae.stop()
        return got

    assert len(asyncio.run(main())) == 8
    assert calls == [1] and "idle work failed (RuntimeError: boom)" in caplog.text


# the engine process started early ------------------------------------------------------------------------
def test_an_engine_process_never_taken_over_ends_when_closed():
    from specd.engine.spawn import spawn
    from specd.serving.engine_proc import ENTRY

    s = spawn(ENTRY)
    t0 = time.monotonic()
    s.close(timeout_s=60)
    assert s.proc.returncode == 0 and (s.cmd_fd, s.out_fd) == (-1, -1) and time.monotonic() - t0 < 60
    s.close()  # (idempotent)


def test_process_link_takes_over_a_spawned_engine_process(shared_pair):
    from specd.engine.commands import Submit
    from specd.engine.links import ProcessLink
    from specd.engine.sequence import SpecParams
    from specd.engine.spawn import spawn
    from specd.options import engine_config
    from specd.sampling.params import SamplingParams
    from specd.serving.async_engine import AsyncEngine
    from specd.serving.engine_proc import ENTRY

    s = spawn(ENTRY)
    link = ProcessLink(engine_config(serve_args(num_blocks=64)), spawned=s, entry="unused")
    assert link.pid == s.proc.pid and link.alive and (s.cmd_fd, s.out_fd) == (-1, -1)
    eng = _engine(shared_pair)
    ids = list(eng.tokenizer("Lily and Tom")["input_ids"])
    params = SamplingParams(temperature=0.0, max_tokens=12)
    want = eng.generate([ids], params, SpecParams(mode="off"))[0].output_ids

    async def main():
        ae = AsyncEngine(link)
        await ae.start()
        got = [t async for out in ae.generate(Submit("r", ids, params, SpecParams("off"))) for t in out.token_ids]
        await ae.stop()
        return got

    assert asyncio.run(main()) == want
    s.close()  # (the link closed it: nothing left to do)
    assert s.proc.returncode is not None


# the benchmark's first load ---------------------------------------------------------------------------------
def test_bench_startup_first_load_removes_what_specd_keeps_for_that_file_only(tmp_path, monkeypatch):
    """``python -m eval bench startup``'s first-load mode removes the file's converted folders and its
    row-cost cache (as the checkout it runs names them), nothing of another file's."""
    from eval.bench_startup import clear_file_cache
    from specd.engine.warmup import cost_cache_file

    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = model_gguf(tmp_path, "llama", layers=1)
    other = tmp_path / "other.gguf"
    shutil.copy(path, other)
    kept = [sg.cached_folder(other, weights=False), cost_cache_file(other)]
    mine = [sg.cached_folder(path, weights=False), sg.cached_folder(path), cost_cache_file(path)]
    for f in (kept[1], mine[2]):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("{}")
    removed = clear_file_cache(path, ROOT)
    assert sorted(removed) == sorted(mine) and not any(p.exists() for p in mine)
    assert all(p.exists() for p in kept) and sg.cached_folders(path) == []


def test_the_engine_process_heap_is_settled_so_full_collections_skip_the_model():
    """``settle_heap`` (called by the engine process once its models are loaded) moves every live object
    to the collector's permanent generation: a later full collection walks only what came after (a
    fresh process, so this one's collector is left alone)."""
    code = (
        "import gc, torch\n"
        "from specd.engine.links import settle_heap\n"
        "keep = [torch.zeros(1) for _ in range(20000)] + [{'a': [i]} for i in range(20000)]\n"
        "before = len(gc.get_objects())\n"
        "n = settle_heap()\n"
        "after = len(gc.get_objects())\n"
        "assert n >= before > 40000 and after < before // 20, (n, before, after)\n"
        "print('ok', n, before, after)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-2000:]


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps (Linux)")
def test_the_server_process_never_loads_torch_or_xgrammar():
    """``specd serve``'s server process (the HTTP / gRPC side; the engine steps in its own process)
    reads requests, renders chat templates and tool prompts, checks grammars through the engine's
    compiler and parses tool calls: none of it needs torch, which cost it ~200 MB of resident memory
    and ~0.5 s of its start when a module-level import pulled it in. After serving plain, streamed,
    logprob, JSON-mode and tool-call requests its memory maps hold no libtorch; the engine process's do.
    (A GGUF file, as users bring: its tokenizer loads as ``PreTrainedTokenizerFast`` directly. A folder
    whose tokenizer needs ``AutoTokenizer``, a SentencePiece one, still imports torch through
    transformers' config classes.)"""
    import json
    import urllib.request

    from specd.serving.app import ServerProcess

    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.pop("SPECD_API_KEY", None)
    args = ["--target", str(BUILTIN_GGUF), "--device", "cpu", "--num-blocks", "128", "--port", "0", "--grpc-port", "0"]
    sp = ServerProcess(args, env=env, cwd=ROOT).start(120)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    bodies = [
        {"logprobs": True, "top_logprobs": 2},
        {"stream": True},
        {"response_format": {"type": "json_object"}},
        {"tools": [tool], "tool_choice": "required"},
    ]
    try:
        for extra in bodies:
            chat = [{"role": "user", "content": "hi"}]
            body = {"model": BUILTIN_GGUF.stem, "messages": chat, "max_tokens": 6, **extra}
            req = urllib.request.Request(
                f"http://127.0.0.1:{sp.port}/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"content-type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=60) as r:
                assert r.status == 200 and r.read(), extra
        engine_pids = [int(p) for p in Path(f"/proc/{sp.proc.pid}/task/{sp.proc.pid}/children").read_text().split()]
        assert engine_pids and any(_maps_torch(p) for p in engine_pids)  # (the check can see torch)
        assert not _maps_torch(sp.proc.pid)
    finally:
        sp.proc.kill()
        sp.proc.wait()
