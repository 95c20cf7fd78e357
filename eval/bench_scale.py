"""Speed at the sizes users run (issue #42 item 5): shape-true random-weight GGUF files of SmolLM2-1.7B,
Llama-3.2-3B and Llama-3.1-8B, specd's plain decode vs llama.cpp's on the same file, the cost of 1..32
verification rows, and each step against the memory-bandwidth floor.

    OMP_NUM_THREADS=2 python -m eval bench scale --sizes 1.7b --formats q4_0 --threads 1,2

Per size: an f16 GGUF written with the ``gguf`` package (normal weights, std ``--std``: each matrix a
random window of one pool of 2^26 normals, so an 8B file takes as long as its writes; RMSNorm weights
1; the built-in model's byte-level BPE tokenizer, padded with reserved control tokens up to the shape's
vocabulary, so specd and llama.cpp both load it; RoPE without Llama 3's frequency scaling, which costs
nothing per step) into ``--cache`` (default ``~/.cache/specd/bench-scale``, outside the repository),
quantized by llama.cpp's ``llama-quantize`` (``--llama-tools``: ``make bench-deps`` builds it). Per
file and thread count:

- specd plain decode at batch 1 and 4: the engine as ``specd serve --target FILE --spec-mode off``
  runs, driven step by step; tokens/s = batch / the median wall time of its steady steps (every
  request emitting one token; prefill and the first steps not counted);
- llama.cpp: ``llama-bench -p 0 -n N -t T`` (tg, batch 1) and ``llama-batched-bench`` (``-npl 1,4``,
  its S_TG: parallel sequences, batch 4);
- specd's rows: one target forward with logits over W = 1..32 rows after 32 tokens (medians, wall
  time; ``specd.engine.warmup.row_costs``, what ``specd serve``'s warm-up seeds the cost model with),
  as multiples of one row, and the draft depth ``auto`` picks from them for a free drafter (prompt
  lookup) at per-token acceptance 0.6 and 0.8;
- the floor: the bytes one step reads (every tensor of the file but an untied token-embedding table,
  of which a step reads a row) / the machine's read bandwidth measured in the same run with the same
  threads (``x.sum()`` over 256 MiB); "floor" columns = floor time / step time (1.0: at the floor).

Writes ``results.json`` and ``summary.md`` to ``--out`` (default ``eval/out/bench_scale-DATE``).

``--ab NAME=TREE ...`` compares specd trees instead (a kernel change against the commit before it: ``git
worktree add``): per file, thread count and ``--batch``, one process per tree in turn, ``--passes`` rounds,
each process loading the file with its tree's code (``PYTHONPATH=TREE``) and timing its steady plain steps
as above; the medians per tree, and each tree's time as a multiple of the first's. Alternating processes
spread a busy machine's noise over every tree alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from eval import harness as H

COMMAND = "bench scale"
CACHE = Path(os.environ.get("SPECD_BENCH_SCALE_CACHE", Path.home() / ".cache" / "specd" / "bench-scale"))
LLAMA_TOOLS = Path(os.environ.get("LLAMA_TOOLS", Path.home() / ".cache" / "specd" / "llama.cpp"))
FORMATS = ("f16", "q4_0", "q4_k_m", "q8_0")
ROWS = (1, 2, 4, 8, 16, 32)
ACCEPT = (0.6, 0.8)  # per-token acceptances at which the table shows the depth auto picks


@dataclass(frozen=True)
class Shape:
    """A Llama-architecture model's shape (what decides a step's cost)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    rope_theta: float

    @property
    def params(self) -> int:
        d, hd = self.hidden, self.hidden // self.heads
        attn = d * (self.heads * hd) * 2 + d * (self.kv_heads * hd) * 2
        per_layer = attn + 3 * d * self.intermediate + 2 * d
        return self.layers * per_layer + self.vocab * d * (1 if self.tied else 2) + d


SHAPES = {
    "tiny": Shape("tiny (tests, smoke)", 256, 512, 2, 4, 2, 49152, True, 10000.0),
    "1.7b": Shape("SmolLM2-1.7B", 2048, 8192, 24, 32, 32, 49152, True, 130000.0),
    "3b": Shape("Llama-3.2-3B", 3072, 8192, 28, 24, 8, 128256, True, 500000.0),
    "8b": Shape("Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128256, False, 500000.0),
}
CONTEXT = 8192  # the files' context length (the step's cost does not depend on it)
POOL = 1 << 26  # random normals drawn per file; each weight matrix is a random window of them


# the files --------------------------------------------------------------------------------------
def tokenizer_fields(vocab: int, src=None) -> dict:
    """The ``tokenizer.*`` metadata of ``src`` (default: the built-in model's GGUF, SmolLM2's 49152
    tokens), padded with ``<|reserved_special_token_N|>`` control tokens up to ``vocab``."""
    import gguf

    from specd.model import builtin

    r = gguf.GGUFReader(str(src or builtin.builtin_gguf()))
    out = {k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")}
    have = len(out["tokenizer.ggml.tokens"])
    if vocab < have:
        raise SystemExit(f"vocabulary {vocab} is smaller than the tokenizer's {have} tokens")
    out["tokenizer.ggml.tokens"] += [f"<|reserved_special_token_{i}|>" for i in range(vocab - have)]
    out["tokenizer.ggml.token_type"] += [3] * (vocab - have)
    return out


def _add_field(w, key: str, val) -> None:
    if isinstance(val, list):
        w.add_array(key, val)
    elif isinstance(val, str):
        w.add_string(key, val)
    elif isinstance(val, bool):
        w.add_bool(key, val)
    elif isinstance(val, float):
        w.add_float32(key, val)
    else:
        w.add_uint32(key, val)


def tensor_plan(s: Shape) -> list:
    """[(GGUF name, numpy shape (rows = outputs), float16?)] in llama.cpp's order."""
    d, hd = s.hidden, s.hidden // s.heads
    plan = [("token_embd.weight", (s.vocab, d), True)]
    for i in range(s.layers):
        b = f"blk.{i}."
        plan += [
            (b + "attn_norm.weight", (d,), False),
            (b + "attn_q.weight", (s.heads * hd, d), True),
            (b + "attn_k.weight", (s.kv_heads * hd, d), True),
            (b + "attn_v.weight", (s.kv_heads * hd, d), True),
            (b + "attn_output.weight", (d, s.heads * hd), True),
            (b + "ffn_norm.weight", (d,), False),
            (b + "ffn_gate.weight", (s.intermediate, d), True),
            (b + "ffn_up.weight", (s.intermediate, d), True),
            (b + "ffn_down.weight", (d, s.intermediate), True),
        ]
    plan.append(("output_norm.weight", (d,), False))
    if not s.tied:
        plan.append(("output.weight", (s.vocab, d), True))
    return plan


def write_f16(path: Path, s: Shape, std: float = 0.02, seed: int = 0) -> Path:
    """An f16 GGUF of shape ``s`` at ``path`` (written to ``path.tmp`` and renamed: a killed run never
    leaves a partial file under the final name), one tensor in memory at a time."""
    import gguf

    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_string("general.name", f"{s.name} (random weights, std {std})")
    w.add_uint32("general.file_type", 1)  # MOSTLY_F16
    for key, val in {
        "block_count": s.layers,
        "context_length": CONTEXT,
        "embedding_length": s.hidden,
        "feed_forward_length": s.intermediate,
        "attention.head_count": s.heads,
        "attention.head_count_kv": s.kv_heads,
        "vocab_size": s.vocab,
        "rope.dimension_count": s.hidden // s.heads,
    }.items():
        w.add_uint32(f"llama.{key}", val)
    w.add_float32("llama.rope.freq_base", s.rope_theta)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, val in tokenizer_fields(s.vocab).items():
        _add_field(w, key, val)
    plan = tensor_plan(s)
    for name, shape, half in plan:
        dt = np.dtype(np.float16 if half else np.float32)
        w.add_tensor_info(name, shape, dt, int(np.prod(shape)) * dt.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal(min(POOL, max(int(np.prod(x)) for _, x, _ in plan)), dtype=np.float32) * std
    pool = pool.astype(np.float16)
    for _, shape, half in plan:
        if half:  # a random window (rotation) of one pool of normals (drawing 8B normals takes minutes)
            w.write_tensor_data(_window(pool, shape, rng))
        else:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
    w.close()
    tmp.rename(path)
    return path


def _window(pool: np.ndarray, shape: tuple, rng) -> np.ndarray:
    """``shape`` values from ``pool`` starting at a random offset: a view when they fit, else the pool
    rotated and repeated."""
    n = int(np.prod(shape))
    if n <= len(pool):
        start = int(rng.integers(len(pool) - n + 1))
        return pool[start : start + n].reshape(shape)
    return np.resize(np.roll(pool, -int(rng.integers(len(pool)))), shape)


def tool(name: str, tools: Path = LLAMA_TOOLS) -> Path | None:
    """llama.cpp's ``name`` binary under ``tools`` (its ``build/bin``), else on PATH, else None."""
    for p in (tools / "build" / "bin" / name, tools / name):
        if p.is_file() and os.access(p, os.X_OK):
            return p
    from shutil import which

    found = which(name)
    return Path(found) if found else None


def model_file(size: str, fmt: str, cache: Path = CACHE, tools: Path = LLAMA_TOOLS, std: float = 0.02) -> Path:
    """The GGUF of ``size`` in ``fmt`` under ``cache``, written / quantized when missing."""
    cache.mkdir(parents=True, exist_ok=True)
    f16 = cache / f"{size}-f16.gguf"
    if not f16.exists():
        H.log(f"writing {f16} ({SHAPES[size].params / 1e9:.2f}B parameters)")
        write_f16(f16, SHAPES[size], std)
    if fmt == "f16":
        return f16
    out = cache / f"{size}-{fmt}.gguf"
    if not out.exists():
        q = tool("llama-quantize", tools)
        if q is None:
            raise FileNotFoundError(f"no llama-quantize under {tools} (make bench-deps builds it)")
        tmp = out.with_suffix(".tmp")
        H.log(f"quantizing {f16.name} to {fmt}")
        subprocess.run([str(q), str(f16), str(tmp), fmt.upper()], check=True, capture_output=True)
        tmp.rename(out)
    return out


def step_bytes(path: Path) -> int:
    """Bytes one decode step reads from the file: every tensor but an untied token-embedding table."""
    import gguf

    ts = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    untied = "output.weight" in ts
    return sum(n for name, n in ts.items() if not (untied and name == "token_embd.weight"))


# specd ------------------------------------------------------------------------------------------
def load_target(path: Path):
    """The model as ``specd serve --target PATH`` loads it (GGUF blocks, the CPU kernel's int8
    activations where it takes them)."""
    from specd.config import EngineConfig
    from specd.engine.builder import load_models

    return load_models(EngineConfig(target=str(path)), None, None)[0]


def plain_engine(path: Path, lm):
    return H.engine_from_flags(
        ["--target", str(path), "--spec-mode", "off", "--max-num-seqs", "4", "--kv-memory-gb", "0.5"], target=lm
    )


def steady_steps(engine, batch: int, tokens: int, prompt_len: int = 16) -> list:
    """Wall seconds of each steady decode step of ``batch`` greedy requests decoding ``tokens`` tokens
    each without speculation: steps where every request emitted one token, after the first two."""
    from specd.sampling.params import SamplingParams
    from specd.speculation.request import SpecParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens + 3, ignore_eos=True)
    seqs = [
        engine.add_request([100 + 7 * b + i for i in range(prompt_len)], params, SpecParams(mode="off"))
        for b in range(batch)
    ]
    times: list = []
    while any(not s.finished for s in seqs):
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        if len(outs) == batch and all(len(o.token_ids) == 1 and len(o.seq.output_ids) > 1 for o in outs):
            times.append(dt)
    return times[2:]


def decode_rate(engine, batch: int, tokens: int) -> float:
    """specd's steady plain decode tokens/s at ``batch`` (batch / median step)."""
    ts = steady_steps(engine, batch, tokens)
    if not ts:
        raise SystemExit(f"no steady decode step at batch {batch}: decode more --tokens")
    return batch / statistics.median(ts)


def auto_depth(costs: dict, accept: float, dmax: int = 16) -> int:
    """The chain depth ``auto`` picks at batch 1 for a drafter that costs nothing (prompt lookup) at
    per-token acceptance ``accept``, from row costs ``costs`` ({rows: seconds}) as the warm-up seeds them."""
    from specd.config import SpecConfig
    from specd.speculation.policy import SpecPolicy

    p = SpecPolicy(SpecConfig(mode="chain", num_draft_tokens=dmax, tree_depth=dmax), has_draft=True)
    p.costs.seed(1, costs)
    p.costs.t_draft = 0.0
    p.step = 1  # (step 0 would be a probe step where nothing pays)
    return p.choose_depth([accept])


# llama.cpp --------------------------------------------------------------------------------------
def llama_bench(path: Path, threads: int, tokens: int, reps: int, tools: Path = LLAMA_TOOLS) -> float | None:
    """``llama-bench -p 0 -n TOKENS -t THREADS`` tg tokens/s (the mean of its ``reps``), None without it."""
    b = tool("llama-bench", tools)
    if b is None:
        return None
    cmd = [str(b), "-m", str(path), "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", str(reps), "-o", "json"]
    r = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return round(float(json.loads(r.stdout)[0]["avg_ts"]), 2)


def llama_batched(path: Path, threads: int, tokens: int, tools: Path = LLAMA_TOOLS) -> dict:
    """``llama-batched-bench`` text generation tokens/s (its S_TG) at 1 and 4 parallel sequences after a
    16-token prompt each, {} without it."""
    b = tool("llama-batched-bench", tools)
    if b is None:
        return {}
    cmd = [str(b), "-m", str(path), "-c", "1024", "-b", "512", "-ub", "512", "-npp", "16", "-ntg", str(tokens)]
    cmd += ["-npl", "1,4", "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"]
    r = subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    return {int(x["pl"]): round(float(x["speed_tg"]), 2) for x in rows}


# one file ---------------------------------------------------------------------------------------
def floor_fraction(nbytes: int, read_gbps: float, batch: int, tok_s: float | None) -> float | None:
    """Floor time / step time of a step of ``batch`` tokens decoded at ``tok_s`` (1.0: at the floor)."""
    if not tok_s:
        return None
    return round(nbytes / (read_gbps * 1e9) / (batch / tok_s), 3)


def one_pass(engine, path: Path, t: int, a) -> dict:
    """specd's plain decode at batch 1 and 4, then llama.cpp's, on ``t`` threads."""
    return {
        "specd": {b: decode_rate(engine, b, a.tokens) for b in (1, 4)},
        "llama_bench_b1": llama_bench(path, t, a.tokens, a.reps, a.llama_tools),
        "llama_batched": llama_batched(path, t, a.tokens, a.llama_tools),
    }


def _median(xs: list):
    xs = [x for x in xs if x]
    return round(statistics.median(xs), 2) if xs else None


def merge_passes(passes: list) -> dict:
    """Medians over alternating passes, and the median of each pass's specd / llama.cpp ratio at
    batch 1 and 4 (on a shared machine the ratio within a pass is steadier than either rate)."""
    b4 = [(p["specd"][4], p["llama_batched"].get(4)) for p in passes]
    b1 = [(p["specd"][1], p["llama_bench_b1"]) for p in passes]
    return {
        "specd": {b: _median([p["specd"][b] for p in passes]) for b in (1, 4)},
        "llama_bench_b1": _median([p["llama_bench_b1"] for p in passes]),
        "llama_batched": {n: _median([p["llama_batched"].get(n) for p in passes]) for n in (1, 4)},
        "ratio_b1": _median([x / y for x, y in b1 if y]),
        "ratio_b4": _median([x / y for x, y in b4 if y]),
        "passes": passes,
    }


def measure_file(path: Path, threads: list, a) -> list:
    """One row per thread count: specd b1/b4 and llama.cpp b1/b4 in ``a.passes`` alternating passes,
    the rows' costs, the read bandwidth (the best of the passes') and the floor."""
    from eval.bench_real import bandwidth
    from specd.engine.warmup import row_costs

    lm = load_target(path)
    engine = plain_engine(path, lm)
    nbytes, out = step_bytes(path), []
    for t in threads:
        H.set_threads(t)
        steady_steps(engine, 1, 4)  # first-call costs at this thread count
        bws, passes = [], []
        for _ in range(a.passes):
            bws.append(bandwidth(mib=256, reps=3 if a.tokens >= 16 else 1)["read_GBps"])
            passes.append(one_pass(engine, path, t, a))
        rows = row_costs(lm.model, engine.cache.kv.dtype, engine.backend, ROWS, reps=a.reps, clock=time.perf_counter)
        bw = max(bws)
        r = {"threads": t, "read_GBps": bw, "read_GBps_passes": bws, "step_bytes": nbytes,
             "floor_ms": round(nbytes / (bw * 1e9) * 1e3, 2), **merge_passes(passes),
             "rows_ms": {w: round(s * 1e3, 3) for w, s in rows.items()},
             "auto_depth": {str(x): auto_depth(rows, x) for x in ACCEPT}}  # fmt: skip
        H.log(f"{path.name} t{t}: {r['specd']} tok/s specd, llama-bench {r['llama_bench_b1']}, {r['llama_batched']}")
        out.append(r)
    return out


# report -----------------------------------------------------------------------------------------
def _times(x) -> str:
    return f"{x:.2f}x" if x else "-"


def table(results: list) -> str:
    """The Markdown table: per file and thread count, decode tokens/s (specd vs llama.cpp) with each
    one's fraction of the bandwidth floor, and the cost of 2..32 rows as multiples of one row."""
    head = ["model", "format", "GB/step", "thr", "read GB/s", "floor ms", "specd b1 tok/s (floor)",
            "llama-bench b1 (floor)", "specd/llama b1 (median of passes)", "specd b4 tok/s (floor)", "llama b4 (floor)",
            "specd/llama b4 (median of passes)", "rows 2/4/8/16/32 vs 1", "auto depth a=0.6/0.8"]  # fmt: skip
    rows = []
    for f in results:
        for r in f["runs"]:
            sp, lb, lb4, nb, bw = (
                r["specd"],
                r["llama_bench_b1"],
                r["llama_batched"].get(4),
                f["step_bytes"],
                r["read_GBps"],
            )
            one = r["rows_ms"][1]
            rows.append([f["model"], f["format"], round(nb / 1e9, 2), r["threads"], bw, r["floor_ms"],
                         f"{sp[1]} ({floor_fraction(nb, bw, 1, sp[1])})",
                         f"{lb} ({floor_fraction(nb, bw, 1, lb)})" if lb else "-", _times(r.get("ratio_b1")),
                         f"{sp[4]} ({floor_fraction(nb, bw, 4, sp[4])})",
                         f"{lb4} ({floor_fraction(nb, bw, 4, lb4)})" if lb4 else "-", _times(r.get("ratio_b4")),
                         "/".join(f"{r['rows_ms'][w] / one:.2f}" for w in ROWS[1:] if w in r["rows_ms"]),
                         "/".join(str(r["auto_depth"][str(x)]) for x in ACCEPT)])  # fmt: skip
    return H.md_table(head, rows)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1.7b,3b,8b", help=f"of {','.join(SHAPES)}")
    ap.add_argument("--formats", default="q4_0,q4_k_m,q8_0", help=f"of {','.join(FORMATS)}")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=64, help="decoded tokens per timing (specd and llama.cpp)")
    ap.add_argument("--reps", type=int, default=3, help="llama-bench repetitions; row-cost medians")
    ap.add_argument("--passes", type=int, default=3, help="alternating specd / llama.cpp passes (medians)")
    ap.add_argument("--std", type=float, default=0.02, help="the random weights' standard deviation")
    ap.add_argument("--cache", type=Path, default=CACHE, help="where the GGUF files are written")
    ap.add_argument("--llama-tools", type=Path, default=LLAMA_TOOLS, help="llama.cpp's build (make bench-deps)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--ab", nargs="+", metavar="NAME=TREE", help="compare specd trees' plain steps instead")
    ap.add_argument("--batch", type=int, default=1, help="--ab: requests decoded together")
    a = ap.parse_args(argv)
    a.sizes, a.formats = _choices(a.sizes, SHAPES, "size"), _choices(a.formats, FORMATS, "format")
    try:
        a.threads = [int(t) for t in a.threads.split(",")]
    except ValueError:
        ap.error(f"--threads: expected integers like 1,2, got {a.threads!r}")
    return a


# one tree's process for --ab: the steady plain step of --batch requests, printed as "STEP <seconds>"
AB_CHILD = """
import statistics, sys, torch
from pathlib import Path
import eval.bench_scale as B
torch.set_num_threads(int(sys.argv[2]))
path, batch, tokens = Path(sys.argv[1]), int(sys.argv[3]), int(sys.argv[4])
lm = B.load_target(path)
engine = B.plain_engine(path, lm)
B.steady_steps(engine, batch, 8)
print("STEP", statistics.median(B.steady_steps(engine, batch, tokens)))
"""


def ab_step(tree: Path, path: Path, threads: int, batch: int, tokens: int) -> float:
    """The median steady plain step (seconds) of ``tree``'s specd on ``path``, in a process of its own."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads)}
    argv = [sys.executable, "-c", AB_CHILD, str(path), str(threads), str(batch), str(tokens)]
    out = subprocess.run(argv, env=env, cwd=tree, capture_output=True, text=True)
    line = next((x for x in out.stdout.splitlines() if x.startswith("STEP ")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(f"--ab {tree}: the step timing failed (exit {out.returncode}): {out.stderr.strip()[-400:]}")
    return float(line.split()[1])


def ab_rows(trees: list, path: Path, a) -> list:
    """Per thread count: each tree's median step (ms, over --passes alternating processes) and its
    ratio to the first tree's."""
    rows = []
    for t in a.threads:
        ms: dict = {name: [] for name, _ in trees}
        for _ in range(a.passes):
            for name, tree in trees:
                ms[name].append(1e3 * ab_step(tree, path, t, a.batch, a.tokens))
                H.log(f"{path.name} t{t} b{a.batch} {name}: {ms[name][-1]:.2f} ms")
        first = statistics.median(ms[trees[0][0]])
        for name, _ in trees:
            med = statistics.median(ms[name])
            rows.append({"file": path.name, "threads": t, "batch": a.batch, "tree": name, "step_ms": ms[name],
                         "median_ms": round(med, 2), "vs_first": round(med / first, 3)})  # fmt: skip
    return rows


def ab_table(rows: list) -> str:
    head = ["file", "thr", "batch", "tree", "step ms (per pass)", "median ms", "tok/s", "time vs first"]
    body = [[r["file"], r["threads"], r["batch"], r["tree"], "/".join(f"{x:.1f}" for x in r["step_ms"]), r["median_ms"],
             round(1e3 * r["batch"] / r["median_ms"], 2), f"{r['vs_first']:.3f}x"] for r in rows]  # fmt: skip
    return H.md_table(head, body)


def parse_trees(specs: list) -> list:
    """``NAME=TREE`` pairs (TREE a specd checkout) in order."""
    trees = []
    for spec in specs:
        name, sep, tree = spec.partition("=")
        if not sep or not name or not (Path(tree) / "specd" / "__init__.py").is_file():
            raise SystemExit(f"--ab {spec!r}: expected NAME=TREE with TREE a specd checkout")
        trees.append((name, Path(tree).resolve()))
    return trees


def _choices(spec: str, allowed, what: str) -> list:
    got = [x.strip().lower() for x in spec.split(",") if x.strip()]
    bad = [x for x in got if x not in allowed]
    if bad or not got:
        raise SystemExit(f"unknown {what} {bad or spec!r}; choose from {', '.join(allowed)}")
    return got


def main_ab(a) -> int:
    trees = parse_trees(a.ab)
    rows = []
    for size in a.sizes:
        for fmt in a.formats:
            rows += ab_rows(trees, model_file(size, fmt, a.cache, a.llama_tools, a.std), a)
    md = ab_table(rows) + "\n"
    out = H.out_dir(a.out, "bench_scale_ab")
    args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}
    H.write_json(out / "results.json", {"meta": H.run_meta(COMMAND), "args": args, "rows": rows})
    (out / "summary.md").write_text(md)
    print(md)
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.ab:
        return main_ab(a)
    results, notes = [], []
    for size in a.sizes:
        for fmt in a.formats:
            try:
                path = model_file(size, fmt, a.cache, a.llama_tools, a.std)
            except FileNotFoundError as e:
                notes.append(f"{size} {fmt}: skipped: {e}")
                H.log(notes[-1])
                continue
            runs = measure_file(path, a.threads, a)
            results.append({"model": SHAPES[size].name, "size": size, "format": fmt, "file": str(path),
                            "file_bytes": path.stat().st_size, "step_bytes": step_bytes(path),
                            "runs": runs})  # fmt: skip
    if not (tool("llama-bench", a.llama_tools) and tool("llama-batched-bench", a.llama_tools)):
        notes.append(f"llama.cpp's llama-bench / llama-batched-bench not under {a.llama_tools}: make bench-deps")
    md = table(results) + "".join(f"\n\n{n}" for n in notes) + "\n"
    out = H.out_dir(a.out, "bench_scale")
    args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}
    shapes = {s: asdict(SHAPES[s]) for s in a.sizes}
    H.write_json(out / "results.json", {"meta": H.run_meta(COMMAND), "args": args, "shapes": shapes, "results": results,
                                         "notes": notes})  # fmt: skip
    (out / "summary.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
