"""The real-model benchmark (issue #16 item 6): specd against transformers and llama.cpp, Spec-Bench form.

    make bench          # the built-in pair: SmolLM2-135M-Instruct Q4_1 GGUF + models/smollm2-draft
    python -m eval bench --target ~/.cache/specd/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --draft models/smollm2-draft --prompts ../shared/data/spec_bench/question.jsonl \\
        --per-category 8 --max-tokens 256 --batch 1,4 --threads 2 --out eval/out/bench_real

Systems (``--systems``, comma list; greedy; the same prompt token ids for all: the first turn through
the target's chat template, or ``--raw``; the same ``--threads`` for all):

- ``specd:MODE`` (``off``, ``chain:K``, ``tree:N``, see eval/README.md): the specd engine in process,
  prefix cache off (every engine prefills every prompt in full, like the peers)
- ``specd+head:MODE``: the same with the feature head (``--head``, default the built-in one) as the
  model proposer instead of the draft model (``specd+head:auto`` is what ``specd serve`` runs)
- ``hf:generate``: transformers ``generate`` on the target
- ``hf:pld[:K]``: transformers prompt-lookup decoding, ``generate(prompt_lookup_num_tokens=K)``
- ``hf:assisted[:kK]``: transformers assisted generation with the draft; only where transformers can
  load the draft (a specd reduced-vocabulary draft, which shares the target's embeddings, it cannot:
  then ``hf:pld`` is the transformers speculative peer and the report says so)
- ``llamacpp:plain``, ``llamacpp:pld[:K]``: llama.cpp (llama-cpp-python, ``make bench-deps``) on the
  target's GGUF file, plain and with its prompt-lookup drafting; skipped with a note when
  ``llama_cpp`` is not importable or the target is not a GGUF file
- ``ct2:generate``: CTranslate2 (``pip install ctranslate2``) on the target converted from its HF
  checkpoint with its own converter (target only: it has no draft-model speculation); skipped with
  a note when ``ctranslate2`` is not importable

Batch 1 runs every system; batch B > 1 (``--batch 1,4``) runs the systems with a batched generate
(specd, ``hf:generate``, ``llamacpp:plain`` with parallel sequences) on groups of B prompts of one category;
the others are n/a there. Per batch
size one run, systems rotated from group to group (``harness.time_rotated``). Reported per system and
Spec-Bench category: tokens/s (output tokens / wall time, prefill included), speedup over specd:off
on the same prompts, mean accepted length (tokens per target forward; pooled) and greedy agreement
with specd:off. Then a profile of one decode step of each specd mode (``profile_step``) and the
memory-bandwidth floor of one target step. Writes ``report.json``, ``summary.md`` and
``bench_real.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from eval import harness as H

COMMAND = "bench"  # python -m eval bench (this module's ``main``)

DEFAULT_SYSTEMS = (
    "specd:off,specd:chain:4,specd:tree:16,hf:generate,hf:assisted:k4,hf:pld:10,llamacpp:plain,llamacpp:pld:10"
)
PLD_K = 10  # both libraries' default number of prompt-lookup tokens (ngram size 2 in both)
CATEGORY_TITLES = {
    "mt_bench": "MT-bench",
    "translation": "Translation",
    "summarization": "Summarization",
    "qa": "QA",
    "math_reasoning": "Math",
    "rag": "RAG",
}
HF_DRAFT_NOTE = (
    "the draft is a specd reduced-vocabulary draft sharing the target's embeddings: only specd "
    "can load it, so transformers assisted generation cannot use it; hf:pld (prompt lookup) is "
    "the transformers speculative peer"
)


class Skip(Exception):
    """A system that cannot run here; the message is the report's note."""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    H.add_model_prompt_args(ap, max_tokens=256)
    ap.add_argument("--systems", default=DEFAULT_SYSTEMS)
    ap.add_argument("--head", default=None, help="feature head for specd+head systems (default: the built-in head)")
    ap.add_argument("--batch", default="1,4", help="batch sizes, one run each (comma list)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads and llama.cpp n_threads alike")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto: specd and transformers alike (llama.cpp: CPU)")
    ap.add_argument("--dtype", default="float32", help="specd and transformers weights (auto: specd's choice)")
    ap.add_argument(
        "--quantization",
        default="none",
        help="specd weights, comma list of none | int8 | int4 | gguf | auto: each specd system runs with "
        "each (named specd[Q]:MODE when more than one); the draft keeps float weights",
    )
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--per-category", type=int, default=None)
    ap.add_argument("--categories", default=None)
    ap.add_argument("--profile-tokens", type=int, default=64, help="decode steps profiled per specd mode (0: none)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


# setup ------------------------------------------------------------------------------------------
def quantizations(a) -> list:
    return [q.strip() for q in a.quantization.split(",") if q.strip()]


def load_pair(a, quantization: str = "none"):
    """(target, draft, hf_draft_ok) with the target's weights in ``quantization`` (the draft float;
    a reduced-vocabulary draft uses the target's embeddings and head rows in the target's format)."""
    from specd.model.loader import checkpoint_folder, draft_spec

    for what, path in (("target", a.target), ("draft", a.draft)):
        if not Path(path).exists():
            raise SystemExit(f"bench: the {what} {path} does not exist (make: BENCH_DRAFT=DIR for another draft)")
    target, draft = H.load_pair(a.target, a.draft, a.device, a.dtype, quantization)
    return target, draft, draft_spec(checkpoint_folder(a.draft)) is None


def encode_prompts(a, target):
    """(prompts, first-turn token ids, chat template used) for the arguments (``harness.first_turns``)."""
    return H.first_turns(
        a.prompts, target, a.max_tokens, a.chat_template, a.limit, H.split_list(a.categories), a.per_category
    )


def make_context(a, target, draft, hf_draft_ok, ids_list, batches, pairs=None):
    longest = max(map(len, ids_list)) + a.max_tokens + 64
    per_tok = H.kv_bytes_per_token(target) + H.kv_bytes_per_token(draft)
    tok = target.tokenizer
    eos = list(target.config.eos_token_ids)
    pad = tok.pad_token_id if getattr(tok, "pad_token_id", None) is not None else eos[0]
    return SimpleNamespace(
        a=a,
        target=target,
        draft=draft,
        hf_draft_ok=hf_draft_ok,
        eos=eos,
        pad=pad,
        hf=None,
        pairs=pairs or {"none": (target, draft)},  # quantization -> (target, draft) for specd systems
        memory=max(256 << 20, int(1.25 * per_tok * longest * max(batches))),
        max_seqs=max(batches),
        n_ctx=max(2048, 256 * math.ceil((longest + PLD_K) / 256)),
    )


def _hf_model(ctx, path):
    from transformers import AutoModelForCausalLM

    from specd.model.loader import checkpoint_folder

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint_folder(path)), dtype=ctx.target.dtype)
    return model.to(ctx.target.device).eval()


def make_system(name: str, ctx):
    """One system by name (see the module doc), or a list of them (one specd system per weight
    format); raises Skip with the reason when it cannot run."""
    kind, _, arg = name.partition(":")
    build = {"specd": _specd_systems, "specd+head": _head_systems, "hf": _hf_system, "llamacpp": _llamacpp_system}
    build["ct2"] = _ct2_system
    made = build[kind](name, arg, ctx) if kind in build else None
    if made is None:
        raise ValueError(f"unknown system {name!r} (see --help)")
    return made


def _head_systems(name: str, arg: str, ctx) -> list:
    from specd.model import builtin

    head = ctx.a.head or builtin.head_path()
    if head is None:
        raise Skip("no feature head (--head DIR; the built-in one is missing): specd+head systems skipped")
    return _specd_systems(name, arg, ctx, head=str(head))


def _hf_system(name: str, arg: str, ctx):
    a = ctx.a
    if ctx.hf is None:
        ctx.hf = _hf_model(ctx, a.target)
    how, _, k = arg.partition(":")
    if how == "generate":
        return H.HF(name, ctx.hf, a.max_tokens, ctx.eos, pad_id=ctx.pad)
    if how == "pld":
        return H.HF(name, ctx.hf, a.max_tokens, ctx.eos, prompt_lookup=int(k or PLD_K), pad_id=ctx.pad)
    if how == "assisted":
        if not ctx.hf_draft_ok:
            raise Skip(HF_DRAFT_NOTE)
        k_ = int(k.lstrip("k")) if k else None
        draft = _hf_model(ctx, a.draft)
        return H.HF(name, ctx.hf, a.max_tokens, ctx.eos, assistant=draft, assist_k=k_, pad_id=ctx.pad)
    return None


def _llamacpp_system(name: str, arg: str, ctx):
    a = ctx.a
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise Skip("llama-cpp-python is not installed (make bench-deps): llama.cpp systems skipped") from None
    if not str(a.target).endswith(".gguf"):
        raise Skip(f"llama.cpp needs a .gguf target, not {a.target}: skipped")
    how, _, k = arg.partition(":")
    if how not in ("plain", "pld"):
        return None
    pld = int(k or PLD_K) if how == "pld" else None
    return H.LlamaCpp(name, a.target, a.threads, ctx.n_ctx, a.max_tokens, ctx.eos, pld=pld)


def _ct2_system(name: str, arg: str, ctx):
    """CTranslate2 on the target's HF folder (a GGUF file's converted folder), converted into a
    temporary folder removed at exit."""
    import atexit
    import shutil
    import tempfile

    from specd.model.loader import checkpoint_folder

    if arg != "generate":
        return None
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        raise Skip("ctranslate2 is not installed (pip install ctranslate2): skipped") from None
    tmp = tempfile.mkdtemp(prefix="specd-ct2-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    a = ctx.a
    return H.CT2(checkpoint_folder(a.target), tmp, ctx.target.tokenizer, a.max_tokens, ctx.eos, a.threads)


def _specd_systems(name: str, arg: str, ctx, head: str | None = None) -> list:
    """One specd system per quantization of ``ctx.pairs`` (named ``specd[Q]:MODE`` when several);
    ``head``: the feature head as the model proposer (named ``specd+head...``)."""
    out = []
    for q, (target, draft) in ctx.pairs.items():
        s = H.Specd(H.Mode.parse(arg or "off"), target, draft, str(target.device), ctx.a.max_tokens, prefix_cache=False,
                    memory_bytes=ctx.memory, max_num_seqs=ctx.max_seqs, head=head)  # fmt: skip
        if head is not None:
            s.name = s.name.replace("specd:", "specd+head:", 1)
        if len(ctx.pairs) > 1:
            s.name = s.name.replace(":", f"[{q}]:", 1)
        out.append(s)
    return out


def build_systems(names: list, ctx) -> tuple:
    systems, notes = [], {}
    for n in names:
        try:
            made = make_system(n, ctx)
            systems.extend(made if isinstance(made, list) else [made])
        except Skip as e:
            notes[n] = str(e)
            print(f"note: {n}: {e}", flush=True)
    return systems, notes


def batched(s) -> bool:
    """Systems with a batched generate: specd, transformers plain, llama.cpp plain (parallel sequences)."""
    if isinstance(s, H.LlamaCpp):
        return s.draft is None
    return isinstance(s, H.Specd) or (isinstance(s, H.HF) and not s.speculative)


def warm_up(systems: list, ids: list, batch: int, max_tokens: int) -> None:
    """One short generation each (first calls allocate and pick kernels), then back to ``max_tokens``."""
    for s in systems:
        s.set_max_tokens(8)
        if batch == 1:
            s(ids)
        else:
            s.batch([ids] * batch)
        s.set_max_tokens(max_tokens)


# figures ----------------------------------------------------------------------------------------
def summarize(rows: list, names: list, cats: list, ref: str) -> dict:
    """Per system: per category and overall tokens/s (sum of tokens / sum of wall time), speedup over
    ``ref`` on the same prompts, pooled mean accepted length, greedy agreement with ``ref``."""
    out = {}
    ref_out = {r["prompt_id"]: r["output_ids"] for r in rows if r["system"] == ref}
    for n in names:
        rs = [r for r in rows if r["system"] == n]
        per = {}
        for c in cats + ["overall"]:
            rc = rs if c == "overall" else [r for r in rs if r["category"] == c]
            toks, wall = sum(r["output_tokens"] for r in rc), sum(r["wall_s"] for r in rc)
            per[c] = {
                "output_tokens": toks,
                "wall_s": round(wall, 4),
                "tokens_per_s": round(toks / wall, 3) if wall > 0 else 0.0,
            }
        spec = [r for r in rs if r.get("mean_accepted_length")]
        steps = sum(r["output_tokens"] / r["mean_accepted_length"] for r in spec)
        out[n] = {
            "per_category": per,
            "groups": len(rs),
            "mean_accepted_length": round(sum(r["output_tokens"] for r in spec) / steps, 3) if steps else None,
            "greedy_equal_to_ref": sum(1 for r in rs if ref_out.get(r["prompt_id"]) == r["output_ids"]),
        }
    base = out.get(ref, {}).get("per_category", {})
    for n in names:
        for c, d in out[n]["per_category"].items():
            b = base.get(c, {}).get("tokens_per_s")
            d["speedup"] = round(d["tokens_per_s"] / b, 4) if b else None
    return out


# one step, profiled -----------------------------------------------------------------------------
def profile_step(system, ids: list, tokens: int) -> dict:
    """Mean wall time of one steady decode step of a specd system (batch 1, ``tokens`` new tokens,
    EOS ignored), driven through ``Engine.add_request`` / ``Engine.step`` and split by the engine's
    own stage timings (``harness.StepTimer``): draft = the draft model's forwards; target forward =
    the target pass (inputs, forward and head); verify + sampling = verification and the commit
    (acceptance, KV compaction, emitting and detokenizing); other = the rest of the step
    (scheduling, the drafter's tree bookkeeping and draft logits). The prompt's step(s) and the next
    two (the draft catching up on the prompt) are left out."""
    from specd.sampling.params import SamplingParams

    eng = system.engine
    seq = eng.add_request(
        list(ids), SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), system.mode.spec_params()
    )
    while not seq.finished and seq.num_output == 0:  # the prompt
        eng.step()
    for _ in range(2):
        if not seq.finished:
            eng.step()
    timer = H.StepTimer(eng)
    before = seq.num_output
    while not seq.finished:
        eng.step()
    t = timer.as_dict()
    n, toks = t["steps"], seq.num_output - before
    parts = {
        "step": t["step_s"],
        "draft": t["draft_forward_s"],
        "target_forward": t["target_forward_s"],
        "verify_sampling": t["verify_s"] + t["commit_s"],
    }
    parts["other"] = parts["step"] - parts["draft"] - parts["target_forward"] - parts["verify_sampling"]
    out = {"steps": n, "tokens_per_step": round(toks / n, 3) if n else None}
    out.update({f"{k}_ms": round(1e3 * v / n, 3) if n else None for k, v in parts.items()})
    out["ms_per_token"] = round(1e3 * parts["step"] / toks, 3) if toks else None
    return out


def weight_bytes(module) -> int:
    """Bytes of a module's parameters and quantized weight buffers (codes, scales, mins), each tensor
    once (tied embeddings and head: one read per step, the head's full matrix; the embedding lookup
    itself reads one row). KV caches and rotary tables are not weights. A quantized layer that the
    int8-activation kernel ran counts its packed copy (the one a step reads: fp16 scales where exact)."""
    seen, replaced = {}, set()
    for m in module.modules():
        pack = getattr(m, "_x8", None)
        if pack is not None:
            seen.update({t.data_ptr(): t.numel() * t.element_size() for t in pack if t is not None})
            replaced.update(t.data_ptr() for t in (m.qweight, m.scale, m.minv) if t is not None)
    tensors = list(module.parameters()) + [b for n, b in module.named_buffers() if "rotary" not in n]
    for p in tensors:
        if p.data_ptr() not in replaced:
            seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def bandwidth(mib: int = 256, reps: int = 5, device: str = "cpu") -> dict:
    """Streaming bandwidth with torch's threads (or of the GPU): read (``x.sum()``) and copy
    (``y.copy_(x)``, read + write) of a ``mib`` MiB buffer, far beyond the caches; best of ``reps``."""
    import torch

    n = (mib << 20) // 4
    x, y = torch.ones(n, device=device), torch.empty(n, device=device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    best_r = best_c = float("inf")
    for _ in range(reps + 1):  # the first round warms up (allocator, kernels)
        sync()
        t0 = time.perf_counter()
        x.sum()
        sync()
        t1 = time.perf_counter()
        y.copy_(x)
        sync()
        t2 = time.perf_counter()
        best_r, best_c = min(best_r, t1 - t0), min(best_c, t2 - t1)
    return {
        "buffer_mib": mib,
        "threads": torch.get_num_threads(),
        "read_GBps": round(n * 4 / best_r / 1e9, 2),
        "copy_GBps": round(2 * n * 4 / best_c / 1e9, 2),
    }


def step_weight_bytes(target) -> int:
    """Weight bytes one target step reads (folded fp32 copies of small unquantized models included)."""
    import torch

    wb = weight_bytes(target.model)
    c = target.config
    folded = target.dtype == torch.float32 and c.hidden_size <= type(target.model).FOLD_MAX_HIDDEN
    if folded and not target.model.quantized():
        # small fp32 models run on folded copies: q/k projections with their RoPE-rotated rows
        wb += c.num_layers * (c.num_heads + c.num_kv_heads) * c.head_dim * c.hidden_size * 4
    return wb


def _weights_label(target, q: str) -> str:
    w, _, act = q.partition("+")
    a = "int8" if act == "a8" else str(target.dtype).removeprefix("torch.")
    return f"{a} activations, {w} weights"


def bandwidth_floor(pairs: dict, target_path, profile: dict) -> dict:
    """The memory-bandwidth floor of one target step per weight format: weight bytes read / measured
    read GB/s, for specd's weights (``pairs``: quantization -> (target, draft)) and, for llama.cpp,
    the GGUF file's; with each specd plain step measured against it."""
    first = next(iter(pairs.values()))[0]
    bw = bandwidth(mib=256 if first.device.type == "cpu" else 4096, device=str(first.device))
    out = {"bandwidth": bw, "formats": {}}
    for q, (target, _) in pairs.items():
        wb = step_weight_bytes(target)
        floor_ms = 1e3 * wb / (bw["read_GBps"] * 1e9)
        f = {
            "weights": _weights_label(target, q),
            "weight_bytes_read": wb,
            "floor_ms_per_step": round(floor_ms, 3),
            "max_plain_tokens_per_s": round(1e3 / floor_ms, 1),
        }
        name = "specd:off" if len(pairs) == 1 else f"specd[{q}]:off"
        plain = profile.get(name, {}).get("step_ms")
        if plain:
            f.update(specd_off_step_ms=plain, specd_off_step_over_floor=round(plain / floor_ms, 2))
        out["formats"][q] = f
    if str(target_path).endswith(".gguf"):
        gb = Path(target_path).stat().st_size
        out["gguf_bytes"] = gb
        out["gguf_floor_ms_per_step"] = round(1e3 * gb / (bw["read_GBps"] * 1e9), 3)
    return out


# report -----------------------------------------------------------------------------------------
def library_info(names: list) -> dict:
    import numpy

    v = dict(H.versions(), numpy=numpy.__version__)
    info = {"versions": v}
    if any(n.startswith("llamacpp") for n in names):
        try:
            import llama_cpp

            v["llama_cpp_python"] = llama_cpp.__version__
            info["llama_cpp_system_info"] = llama_cpp.llama_print_system_info().decode().strip()
        except ImportError:
            pass
    return info


def _cell(d, key="speedup"):
    x = d.get(key)
    return "-" if x is None else (f"{x:.2f}x" if key == "speedup" else f"{x:.1f}")


def batch_tables(b: int, res: dict, cats: list, na: list, ref: str, sizes: dict) -> list:
    """Spec-Bench leaderboard form (speedup per category, mean accepted length, overall speedup,
    tokens/s), then tokens/s per category, for one batch size."""
    titles = [CATEGORY_TITLES.get(c, c) for c in cats]
    lead, tps = [], []
    for n, d in res.items():
        per = d["per_category"]
        mal = d["mean_accepted_length"]
        lead.append(
            [n]
            + [_cell(per[c]) for c in cats]
            + [
                "-" if mal is None else f"{mal:.2f}",
                _cell(per["overall"]),
                _cell(per["overall"], "tokens_per_s"),
                f"{d['greedy_equal_to_ref']}/{d['groups']}",
            ]
        )
        tps.append([n] + [_cell(per[c], "tokens_per_s") for c in cats + ["overall"]])
    for n, _why in na:
        lead.append([n] + ["n/a"] * (len(cats) + 4))
        tps.append([n] + ["n/a"] * (len(cats) + 1))
    groups = ", ".join(f"{n} of {k}" for k, n in sizes.items())
    how = (
        f"One prompt at a time ({sum(sizes.values())} prompts)."
        if b == 1
        else f"Batches of up to {b} prompts of one category: {groups} prompt(s)."
    )
    return (
        [
            f"## batch {b}",
            "",
            how,
            "",
            f"Speedup over {ref} (tokens/s ratio on the same prompts), Spec-Bench form:",
            "",
            H.md_table(
                ["system"] + titles + ["mean accepted length", "overall speedup", "tokens/s", f"greedy == {ref}"], lead
            ),
            "",
            "Tokens/s per category (output tokens / wall time, prefill included):",
            "",
            H.md_table(["system"] + titles + ["overall"], tps),
            "",
        ]
        + [f"- {n}: n/a ({why})" for n, why in na]
        + [""]
    )


def render(rep: dict) -> str:
    """``summary.md``: how the run was made, the tables of each batch size, the step profile and
    the bandwidth floor."""
    md = render_header(rep["meta"], rep["notes"])
    for b, t in rep["batches"].items():
        md += batch_tables(int(b), t["systems"], rep["categories"], t["n/a"], rep["reference"], t["group_sizes"])
    if rep["profile"]:
        md += render_profile(rep["profile"])
    if rep["bandwidth_floor"]:
        md += floor_lines(rep["bandwidth_floor"])
    return "\n".join(md) + "\n"


def render_header(m: dict, notes: dict) -> list:
    cpu = m["cpu_info"]
    md = [
        "# specd vs transformers vs llama.cpp (Spec-Bench form)",
        "",
        f"- command: `{m['command']}`",
        f"- date {m['date']}, commit {m['git_commit']}; CPU: {cpu['model']}, {cpu['cpu_count']} cores "
        f"({cpu['usable_cpus']} usable); SIMD: {' '.join(cpu['simd_flags'])}; torch CPU capability "
        f"{cpu.get('torch_cpu_capability')}",
        f"- threads: {m['threads']} for every engine (torch.set_num_threads = {m['torch_threads']}, llama.cpp "
        f"n_threads = n_threads_batch = {m['threads']}; OMP_NUM_THREADS={cpu['omp_num_threads_env']})",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()),
        f"- target {m['target']} ({m['dtype']} in specd and transformers), draft {m['draft']}; {m['prompts']} "
        f"prompts (first turn, {'chat template' if m['chat_template'] else 'raw'}), greedy, max_tokens "
        f"{m['max_tokens']}, specd prefix cache off",
    ]
    if m.get("llama_cpp_system_info"):
        md.append(f"- llama.cpp: {m['llama_cpp_system_info']}")
    return md + [f"- note: {k}: {v}" for k, v in notes.items()] + [""]


PROFILE_COLUMNS = (
    ("steps", "steps"),
    ("tokens/step", "tokens_per_step"),
    ("step", "step_ms"),
    ("draft", "draft_ms"),
    ("target forward", "target_forward_ms"),
    ("verify + sampling", "verify_sampling_ms"),
    ("other", "other_ms"),
    ("ms/token", "ms_per_token"),
)


def render_profile(profile: dict) -> list:
    rows = [[n] + [p[key] for _, key in PROFILE_COLUMNS] for n, p in profile.items()]
    return [
        "## One decode step (batch 1, mean over steady steps, ms)",
        "",
        H.md_table(["system"] + [h for h, _ in PROFILE_COLUMNS], rows),
        "",
    ]


def floor_lines(f: dict) -> list:
    """The bandwidth-floor table: per specd weight format (and the GGUF file llama.cpp reads)."""
    if not f:
        return []
    bw = f["bandwidth"]
    rows = [
        [q, d["weights"], f"{d['weight_bytes_read'] / 1e6:.1f}", d["floor_ms_per_step"], d["max_plain_tokens_per_s"],
         d.get("specd_off_step_ms", "-"), d.get("specd_off_step_over_floor", "-")]
        for q, d in f["formats"].items()
    ]  # fmt: skip
    if "gguf_bytes" in f:
        ms = f["gguf_floor_ms_per_step"]
        rows.append(["llama.cpp (GGUF file)", "the file's blocks", f"{f['gguf_bytes'] / 1e6:.1f}", ms,
                     round(1e3 / ms, 1), "-", "-"])  # fmt: skip
    head = ["format", "weights", "MB read per step", "floor ms", "max tokens/s", "specd plain step ms", "x floor"]
    return [
        f"## Memory-bandwidth floor of one target step ({bw['read_GBps']} GB/s read; copy {bw['copy_GBps']} GB/s, "
        f"{bw['buffer_mib']} MiB, {bw['threads']} threads)",
        "",
        H.md_table(head, rows),
        "",
    ]


def plot(rep: dict, path) -> Path:
    """Left: overall tokens/s per system and batch size. Right: batch-1 speedup over the reference per category."""
    plt = H.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    batches = list(rep["batches"])
    names = list(rep["batches"][batches[0]]["systems"])
    w = 0.8 / len(batches)
    for i, b in enumerate(batches):
        res = rep["batches"][b]["systems"]
        ax1.bar(
            [x + i * w for x in range(len(names))],
            [res[n]["per_category"]["overall"]["tokens_per_s"] if n in res else 0 for n in names],
            w,
            label=f"batch {b}",
        )
    ax1.set_xticks([x + w * (len(batches) - 1) / 2 for x in range(len(names))])
    ax1.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax1.set_ylabel("tokens/s (all prompts)")
    ax1.legend(fontsize=8)
    cats = rep["categories"]
    res = rep["batches"][batches[0]]["systems"]
    w = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        ax2.bar(
            [x + i * w for x in range(len(cats))], [res[n]["per_category"][c]["speedup"] or 0 for c in cats], w, label=n
        )
    ax2.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax2.set_xticks([x + 0.4 - w / 2 for x in range(len(cats))])
    ax2.set_xticklabels([CATEGORY_TITLES.get(c, c) for c in cats], fontsize=8)
    ax2.set_ylabel(f"speedup over {rep['reference']}, batch {batches[0]}")
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    m = rep["meta"]
    fig.suptitle(f"{Path(m['target']).name}, {m['threads']} threads, {m['cpu_info']['model']}", fontsize=9)
    return H.save_fig(fig, path)


def plot_floor(rep: dict, path) -> Path | None:
    """Batch-1 tokens/s of every system against each weight format's bandwidth ceiling (the tokens/s
    one plain step per token would give at the floor): how close each engine and format gets."""
    f = rep.get("bandwidth_floor")
    if not f:
        return None
    plt = H.pyplot()
    res = rep["batches"][next(iter(rep["batches"]))]["systems"]
    names = list(res)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    ax.bar(range(len(names)), [res[n]["per_category"]["overall"]["tokens_per_s"] for n in names], color="tab:blue")
    ceilings = {q: d["max_plain_tokens_per_s"] for q, d in f["formats"].items()}
    if "gguf_floor_ms_per_step" in f:
        ceilings["GGUF file (llama.cpp)"] = round(1e3 / f["gguf_floor_ms_per_step"], 1)
    for i, (q, v) in enumerate(ceilings.items()):
        ax.axhline(v, ls="--", lw=1, color=f"C{i + 1}", label=f"bandwidth ceiling, {q}: {v} tok/s")
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s, batch 1 (log)")
    ax.legend(fontsize=7)
    m = rep["meta"]
    ax.set_title(f"{Path(m['target']).name}, {m['threads']} threads, {m['cpu_info']['model']}", fontsize=9)
    return H.save_fig(fig, path)


# run --------------------------------------------------------------------------------------------
def na_reason(s) -> str:
    if isinstance(s, H.LlamaCpp):
        return "llama-cpp-python has no batched generate"
    if isinstance(s, H.CT2):
        return "the CTranslate2 system runs batch 1 only"
    return "transformers assisted generation and prompt lookup run batch 1 only"


def run_batches(systems: list, prompts: list, ids: list, batches: list, cats: list, ref: str, a) -> dict:
    out = {}
    for b in batches:
        run = systems if b == 1 else [s for s in systems if batched(s)]
        warm_up(run, ids[0][:64], b, a.max_tokens)
        rows = H.time_rotated(run, H.groups_of(prompts, ids, b), not a.no_progress, desc=f"batch {b}")
        res = summarize(rows, [s.name for s in run], cats, ref)
        for r in rows:
            r.pop("output_ids")
        sizes = [len(ps) for ps, _ in H.groups_of(prompts, ids, b)]
        out[str(b)] = {
            "systems": res,
            "n/a": [(s.name, na_reason(s)) for s in systems if s not in run],
            "group_sizes": {str(k): sizes.count(k) for k in sorted(set(sizes), reverse=True)},
            "requests": rows,
        }
        print(
            f"batch {b}: "
            + ", ".join(f"{n} {d['per_category']['overall']['tokens_per_s']:.1f} tok/s" for n, d in res.items()),
            flush=True,
        )
    return out


def header(meta: dict) -> str:
    cpu = meta["cpu_info"]
    return (
        f"CPU: {cpu['model']} ({cpu['cpu_count']} cores, {cpu['usable_cpus']} usable); SIMD flags: "
        f"{' '.join(cpu['simd_flags'])}; threads: {meta['threads']} (torch {meta['torch_threads']}, "
        f"llama.cpp n_threads {meta['threads']}, OMP_NUM_THREADS={cpu['omp_num_threads_env']}); "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    )


def setup(a, names: list, batches: list) -> tuple:
    """The model pair per quantization, the encoded prompts and the systems under test:
    ``(pairs, prompts, ids, chat_template, context, systems, notes)``."""
    pairs = {}
    for q in quantizations(a):
        target, draft, hf_draft_ok = load_pair(a, q)
        pairs[q] = (target, draft)
    target, draft = next(iter(pairs.values()))
    prompts, ids, chat = encode_prompts(a, target)
    ctx = make_context(a, target, draft, hf_draft_ok, ids, batches, pairs)
    systems, notes = build_systems(names, ctx)
    if not hf_draft_ok and not any(n.startswith("hf:assisted") for n in notes):
        notes["hf:assisted"] = HF_DRAFT_NOTE
    return pairs, prompts, ids, chat, ctx, systems, notes


def main(argv=None) -> int:
    a = parse_args(argv)
    H.set_threads(a.threads)
    H.quiet_transformers()
    t_start = time.perf_counter()
    names = [n.strip() for n in a.systems.split(",") if n.strip()]
    batches = [int(x) for x in a.batch.split(",") if x.strip()]
    meta = H.run_meta(COMMAND, argv, a.device)
    meta.update(threads=a.threads, cpu_info=H.cpu_info(), **library_info(names))
    print(header(meta), flush=True)
    pairs, prompts, ids, chat, ctx, systems, notes = setup(a, names, batches)
    target = next(iter(pairs.values()))[0]
    offs = [s.name for s in systems if isinstance(s, H.Specd) and s.name.endswith(":off")]
    ref = offs[0] if offs else systems[0].name
    cats = list(dict.fromkeys(p.category for p in prompts))
    res = run_batches(systems, prompts, ids, batches, cats, ref, a)
    profile = {
        s.name: profile_step(s, ids[0], a.profile_tokens)
        for s in systems
        if isinstance(s, H.Specd) and a.profile_tokens > 0
    }
    floor = bandwidth_floor(pairs, a.target, profile)
    meta.update(
        target=str(a.target),
        draft=str(a.draft),
        prompts_file=str(a.prompts),
        max_tokens=a.max_tokens,
        prompts=len(prompts),
        chat_template=chat,
        dtype=str(target.dtype).removeprefix("torch."),
        quantization=list(pairs),
        llama_n_ctx=ctx.n_ctx,
        elapsed_s=round(time.perf_counter() - t_start, 1),
    )
    rep = {
        "schema": H.SCHEMA,
        "kind": "bench_real",
        "meta": meta,
        "reference": ref,
        "categories": cats,
        "systems": [s.name for s in systems],
        "notes": notes,
        "batches": res,
        "profile": profile,
        "bandwidth_floor": floor,
    }
    out = H.out_dir(a.out, "bench")
    H.write_json(out / "report.json", rep)
    md = render(rep)
    (out / "summary.md").write_text(md, encoding="utf-8")
    plot(rep, out / "bench_real.png")
    plot_floor(rep, out / "bench_floor.png")
    print(md)
    print(f"wrote {out} ({meta['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
