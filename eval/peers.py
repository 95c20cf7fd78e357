"""specd against other engines, same models, same prompts, same machine, in one run.

    python -m eval.peers --target ../shared/models/stories260K \\
        --draft ../shared/models/stories260K-draft-1L64 \\
        --prompts ../shared/data/mt_bench/question.jsonl --raw --limit 16 --max-tokens 128 \\
        --out eval/out/peers

Systems (greedy, batch 1, first turn of each prompt, stop on the model's EOS ids):

- ``specd:off``, ``specd:chain:4``, ``specd:tree:16`` (``--modes``): the specd engine in process
- ``hf:generate``: transformers ``model.generate`` on the target alone
- ``hf:assisted``: transformers assisted generation, ``generate(assistant_model=draft)``, with its
  default (heuristic, adaptive) number of draft tokens
- ``hf:assisted:kK``: the same with a constant ``num_assistant_tokens=K`` (``--hf-assist-k``), the
  counterpart of specd's chain of K
- ``ct2:generate``: CTranslate2 (``pip install ctranslate2``), the target converted from the HF
  checkpoint with its own converter; skipped when ctranslate2 is not importable. It has no
  draft-model speculative decoding, so it is a target-only peer.

Per prompt every system runs back to back, in an order rotated from prompt to prompt, so load from
other processes hits them alike. Reported: per-system median tokens/s over prompts (wall clock and
CPU time), aggregate tokens/s, the greedy outputs' agreement with ``specd:off`` token for token, and
ratios as medians over prompts of per-prompt ratios (e.g. specd:chain:4 / hf:assisted:k4).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from eval import common as C
from eval import harness as H


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_model_prompt_args(ap, max_tokens=128)
    ap.add_argument("--modes", default="off,chain:4,tree:16", help="specd modes (see eval.acceptance)")
    ap.add_argument("--hf-assist-k", default="4", help="constant-schedule assisted generation runs (comma list)")
    ap.add_argument("--no-ct2", action="store_true", help="skip CTranslate2 even when installed")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--per-category", type=int, default=None)
    ap.add_argument("--categories", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


# systems: callables ids -> output ids; ``batch(list of ids) -> list of outputs`` where batched ------
class Accepted:
    """Tokens per target forward of a peer that is not specd (from its forward calls)."""

    def __init__(self, mean_accepted_length: float):
        self.mean_accepted_length = mean_accepted_length


class Specd:
    def __init__(self, mode, target, draft, device, max_tokens, **engine_kw):
        from specd.sampling.params import SamplingParams

        self.name = f"specd:{mode.name}"
        self.mode = mode
        self.engine = H.make_engine(mode, target, draft, device, **engine_kw)
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.stats = None

    def set_max_tokens(self, n: int) -> None:
        import dataclasses

        self.params = dataclasses.replace(self.params, max_tokens=n)

    def __call__(self, ids):
        return self.batch([ids])[0]

    def batch(self, ids_list):
        seqs = self.engine.generate(list(ids_list), self.params, self.mode.spec_params())
        self.stats = C.stats_from_dicts([s.stats for s in seqs])
        return [list(s.output_ids) for s in seqs]


class ForwardCounter:
    """Counts a module's forward calls (a public forward hook): a generate call's target forwards."""

    def __init__(self, module):
        self.n = 0
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.n += 1


class HF:
    """transformers ``generate``: plain, assisted (``assistant``, ``assist_k``) or prompt lookup
    (``prompt_lookup``: ``prompt_lookup_num_tokens=K``). ``batch`` left-pads; each output is cut
    after its first EOS (finished rows are padded while the others go on)."""

    def __init__(self, name, model, max_tokens, eos, assistant=None, assist_k=None, prompt_lookup=None, pad_id=0):
        self.name, self.model, self.assistant = name, model, assistant
        self.kw = dict(max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id, eos_token_id=eos)
        if assistant is not None:
            self.kw["assistant_model"] = assistant
            if assist_k is not None:
                assistant.generation_config.num_assistant_tokens = assist_k
                assistant.generation_config.num_assistant_tokens_schedule = "constant"
        if prompt_lookup is not None:
            self.kw["prompt_lookup_num_tokens"] = prompt_lookup
        self.speculative = assistant is not None or prompt_lookup is not None
        self.eos, self.pad = set(eos), pad_id
        self.forwards = ForwardCounter(model)
        self.stats = None

    def set_max_tokens(self, n: int) -> None:
        self.kw["max_new_tokens"] = n

    def __call__(self, ids):
        return self.batch([ids])[0]

    def batch(self, ids_list):
        import torch

        L = max(len(p) for p in ids_list)
        dev = self.model.device
        x = torch.tensor([[self.pad] * (L - len(p)) + list(p) for p in ids_list], device=dev)
        att = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in ids_list], device=dev)
        n0 = self.forwards.n
        with torch.no_grad():
            out = self.model.generate(x, attention_mask=att, **self.kw)
        outs = [cut_at_eos(row[L:].tolist(), self.eos) for row in out]
        steps = self.forwards.n - n0
        self.stats = Accepted(sum(map(len, outs)) / steps) if self.speculative and steps else None
        return outs


def cut_at_eos(ids: list, eos: set) -> list:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


class LlamaCpp:
    """llama.cpp through llama-cpp-python on a GGUF file: ``Llama.generate`` on the given prompt ids
    (greedy: temp 0, top_k 1, no repeat penalty), stopping on ``eos`` or ``max_tokens`` like the
    others; ``pld=K``: its prompt-lookup drafting (``LlamaPromptLookupDecoding(num_pred_tokens=K)``).
    Its KV prefix reuse across calls is reset before each prompt (every prompt prefilled in full)."""

    def __init__(self, name, gguf, threads, n_ctx, max_tokens, eos, pld=None):
        from llama_cpp import Llama

        self.name, self.max_tokens, self.eos = name, max_tokens, set(eos)
        self.threads, self.n_ctx, self._batched = threads, n_ctx, None
        self.draft = counting_pld(pld) if pld else None
        # logits_all with a draft model: llama-cpp-python 0.3.x sizes its logits buffer from the
        # argument, not from the draft model (which turns it on), and overflows past n_batch tokens
        self.llm = Llama(
            model_path=str(gguf),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=n_ctx,
            verbose=False,
            draft_model=self.draft,
            logits_all=self.draft is not None,
        )
        self.stats = None

    def set_max_tokens(self, n: int) -> None:
        self.max_tokens = n

    def __call__(self, ids):
        self.llm.reset()
        calls0 = self.draft.calls if self.draft is not None else 0
        out = []
        for t in self.llm.generate(list(ids), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            out.append(int(t))
            if t in self.eos or len(out) >= self.max_tokens:
                break
        if self.draft is not None:  # one target forward for the prompt, then one after each draft call
            self.stats = Accepted(len(out) / (1 + self.draft.calls - calls0))
        return out

    def batch(self, ids_list):
        """Several prompts decoded together (plain decoding only: ``LlamaCppBatch``)."""
        if self.draft is not None:
            raise ValueError("llama.cpp's prompt lookup runs one sequence at a time")
        if getattr(self, "_batched", None) is None or self._batched.max_seqs < len(ids_list):
            self._batched = LlamaCppBatch(self, self.threads, self.n_ctx, max(4, len(ids_list)))
        return self._batched.generate(ids_list, self.max_tokens, self.eos)


class LlamaCppBatch:
    """Greedy decoding of several prompts at once in one llama.cpp context (``n_seq_max`` = the
    batch, one sequence id per prompt, one ``llama_decode`` per step for every unfinished prompt),
    what llama.cpp's server does with parallel slots; through llama-cpp-python's low-level API on the
    model ``llm`` (a ``LlamaCpp``) already loaded."""

    def __init__(self, llm, threads: int, n_ctx: int, max_seqs: int):
        import llama_cpp as L

        self.L, self.model, self.max_seqs = L, llm.llm.model, max_seqs
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx * max_seqs, n_ctx, n_ctx
        cp.n_seq_max, cp.n_threads, cp.n_threads_batch = max_seqs, threads, threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp: could not create a batched context")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(n_ctx, 0, max_seqs)

    def _decode(self, items: list) -> list:
        """``items``: (seq id, position, token, wants logits); returns the argmax of each that wants them."""
        import numpy as np

        b = self.batch
        b.n_tokens = len(items)
        for k, (sid, pos, tok, want) in enumerate(items):
            b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = tok, pos, 1, want
            b.seq_id[k][0] = sid
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        out = []
        for k, (_, _, _, want) in enumerate(items):
            if want:
                row = np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, k), shape=(self.n_vocab,))
                out.append(int(row.argmax()))
        return out

    def generate(self, ids_list: list, max_tokens: int, eos: set) -> list:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        nxt = []
        for sid, ids in enumerate(ids_list):  # prefill one prompt per decode call (as the server's slots do)
            nxt += self._decode([(sid, p, t, p == len(ids) - 1) for p, t in enumerate(ids)])
        outs = [[t] for t in nxt]
        pos = [len(ids) for ids in ids_list]
        live = [k for k in range(len(ids_list)) if not (nxt[k] in eos or max_tokens <= 1)]
        while live:
            toks = self._decode([(k, pos[k], outs[k][-1], True) for k in live])
            for k, t in zip(live, toks):
                outs[k].append(t)
                pos[k] += 1
            live = [k for k in live if outs[k][-1] not in eos and len(outs[k]) < max_tokens]
        return outs


def counting_pld(k: int):
    """llama-cpp-python's prompt-lookup draft model, counting its calls (one per decode step)."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    class CountingPLD(LlamaPromptLookupDecoding):
        calls = 0

        def __call__(self, input_ids, /, **kw):
            self.calls += 1
            return super().__call__(input_ids, **kw)

    return CountingPLD(num_pred_tokens=k)


class CT2:
    name = "ct2:generate"

    def __init__(self, target_dir, out_dir, tokenizer, max_tokens, eos, threads):
        import ctranslate2
        from ctranslate2.converters import TransformersConverter

        self.version = ctranslate2.__version__
        path = Path(out_dir) / "ct2_target"
        TransformersConverter(str(target_dir)).convert(str(path), force=True)
        self.gen = ctranslate2.Generator(str(path), device="cpu", intra_threads=threads, inter_threads=1)
        self.tok = tokenizer
        self.max_tokens = max_tokens
        self.end = [tokenizer.convert_ids_to_tokens(i) for i in eos]
        self.stats = None

    def __call__(self, ids):
        r = self.gen.generate_batch(
            [self.tok.convert_ids_to_tokens(ids)],
            max_length=self.max_tokens,
            sampling_topk=1,
            beam_size=1,
            include_prompt_in_result=False,
            end_token=self.end,
            return_end_token=True,
        )
        return list(r[0].sequences_ids[0])


# run --------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    a = parse_args(argv)
    H.set_threads(a.threads)
    H.quiet_transformers()
    from specd.model.loader import load_model

    t_start = time.perf_counter()
    meta = H.run_meta("peers", argv, a.device)  # at the start: the code that runs
    cats = [c.strip() for c in a.categories.split(",")] if a.categories else None
    prompts = C.load_prompts(a.prompts, a.limit, cats, a.per_category, max_turns=1)
    out = Path(a.out) if a.out else C.default_out("peers")
    out.mkdir(parents=True, exist_ok=True)
    target = load_model(a.target, a.device, "float32", progress=False)
    draft = load_model(a.draft, a.device, "float32", progress=False, target=target)
    chat = a.chat_template if a.chat_template is not None else C.has_chat_template(target.tokenizer)
    max_prompt = target.config.max_position_embeddings - a.max_tokens - 1
    ids_list = [
        C.fit_prompt(
            C.encode_conversation(target.tokenizer, p.turns[:1], [], chat), max_prompt, target.config.bos_token_id
        )[0]
        for p in prompts
    ]
    systems, notes = build_systems(a, target, draft, out)
    warm = list(target.tokenizer("Once upon a time")["input_ids"])
    for s in systems:
        s(warm)
    rows = time_rotated(systems, [([p], [ids]) for p, ids in zip(prompts, ids_list)], not a.no_progress)
    by = {s.name: {r["prompt_id"]: r for r in rows if r["system"] == s.name} for s in systems}
    summary, ratios = summarize_systems(by), system_ratios(by)
    for r in rows:
        r.pop("output_ids")
    meta.update(
        target=a.target,
        draft=a.draft,
        prompts_file=a.prompts,
        max_tokens=a.max_tokens,
        prompts=len(prompts),
        categories=sorted({p.category for p in prompts}),
        chat_template=chat,
        peers=notes,
        elapsed_s=round(time.perf_counter() - t_start, 2),
    )
    report = {"schema": C.SCHEMA, "kind": "peers", "meta": meta, "systems": summary, "ratios": ratios, "requests": rows}
    C.write_json(out / "report.json", report)
    md = markdown(report)
    (out / "summary.md").write_text(md + "\n", encoding="utf-8")
    _bar(summary, out / "peers_tokens_per_s.png")
    print(md)
    print(f"\nwrote {out} ({meta['elapsed_s']} s)")
    return 0


def build_systems(a, target, draft, out: Path) -> tuple:
    """specd per mode, transformers generate / assisted (default schedule and constant k), and
    CTranslate2 when it is installed. Returns (systems, notes about the optional peers)."""
    import torch
    from transformers import AutoModelForCausalLM

    eos = list(target.config.eos_token_ids)
    systems = [Specd(m, target, draft, a.device, a.max_tokens) for m in C.parse_modes(a.modes)]
    hf_t = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32).eval()
    hf_d = AutoModelForCausalLM.from_pretrained(a.draft, dtype=torch.float32).eval()
    systems.append(HF("hf:generate", hf_t, a.max_tokens, eos))
    systems.append(HF("hf:assisted", hf_t, a.max_tokens, eos, assistant=hf_d))
    for k in [int(x) for x in a.hf_assist_k.split(",") if x.strip()]:
        d_k = AutoModelForCausalLM.from_pretrained(a.draft, dtype=torch.float32).eval()  # own generation_config
        systems.append(HF(f"hf:assisted:k{k}", hf_t, a.max_tokens, eos, assistant=d_k, assist_k=k))
    notes = {}
    if not a.no_ct2:
        try:
            systems.append(CT2(a.target, out, target.tokenizer, a.max_tokens, eos, a.threads))
            notes["ctranslate2"] = systems[-1].version
        except ImportError:
            notes["ctranslate2"] = "not installed (pip install ctranslate2)"
        except Exception as e:  # a converter/architecture failure is a result, not a crash
            notes["ctranslate2"] = f"failed: {type(e).__name__}: {e}"
    return systems, notes


def summarize_systems(by: dict) -> dict:
    """Per system: medians over prompts of tokens/s (wall, CPU), aggregate tokens/s, greedy
    agreement with specd:off (else the first system), median tokens per target step."""
    names = list(by)
    ref = by["specd:off"] if "specd:off" in by else by[names[0]]
    summary = {}
    for n in names:
        rs = list(by[n].values())
        wall = sum(r["wall_s"] for r in rs)
        cpu = sum(r["cpu_s"] for r in rs)
        toks = sum(r["output_tokens"] for r in rs)
        summary[n] = {
            "prompts": len(rs),
            "output_tokens": toks,
            "median_tokens_per_s": round(H.median([r["tokens_per_s"] for r in rs], empty=0.0), 2),
            "median_tokens_per_cpu_s": round(H.median([r["tokens_per_cpu_s"] for r in rs], empty=0.0), 2),
            "tokens_per_s": round(toks / wall, 2) if wall else 0.0,
            "tokens_per_cpu_s": round(toks / cpu, 2) if cpu else 0.0,
            "greedy_equal_to_specd_off": sum(
                1 for pid, r in by[n].items() if ref.get(pid, {}).get("output_ids") == r["output_ids"]
            ),
        }
        if any("mean_accepted_length" in r for r in rs):
            mal = H.median([r.get("mean_accepted_length") for r in rs], empty=0.0)
            summary[n]["mean_accepted_length"] = round(mal, 3)
    return summary


def system_ratios(by: dict) -> list:
    """Median over prompts of per-prompt tokens/s ratios: each specd mode vs each assisted run,
    the target-only engines against each other, each speculative system vs its own target-only."""

    def ratio(a_, b_, key="tokens_per_s"):
        xs = [by[a_][pid][key] / by[b_][pid][key] for pid in by[a_] if pid in by[b_] and by[b_][pid][key] > 0]
        return round(H.median(xs), 4) if xs else None

    names = list(by)
    spec_names = [n for n in names if n.startswith("specd:") and n != "specd:off"]
    assisted = [n for n in names if n.startswith("hf:assisted")]
    pairs = [(x, y) for x in spec_names for y in assisted]
    for x, y in (("specd:off", "hf:generate"), ("specd:off", "ct2:generate"), ("hf:generate", "ct2:generate")):
        if x in by and y in by:
            pairs.append((x, y))
    for x in spec_names + assisted:
        base = "specd:off" if x.startswith("specd:") else "hf:generate"
        if base in by:
            pairs.append((x, base))
    return [
        {"a": x, "b": y, "median_ratio": ratio(x, y), "median_ratio_cpu": ratio(x, y, "tokens_per_cpu_s")}
        for x, y in pairs
    ]


def markdown(report: dict) -> str:
    meta, summary, ratios = report["meta"], report["systems"], report["ratios"]
    md = [
        "# specd vs peers",
        "",
        f"- command: `{meta['command']}`",
        f"- date {meta['date']}; {meta['device']} ({meta['cpu']}, {meta['cpu_count']} cores, "
        f"{meta['torch_threads']} torch threads); "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
        + "".join(f", {k} {v}" for k, v in meta["peers"].items()),
        f"- {meta['prompts']} prompts (first turn), greedy, max_tokens {meta['max_tokens']}, batch 1",
        "",
        C.md_table(
            ["system", "median tok/s", "median tok/CPU-s", "aggregate tok/s", "tokens/step", "greedy == specd:off"],
            [
                [
                    n,
                    s["median_tokens_per_s"],
                    s["median_tokens_per_cpu_s"],
                    s["tokens_per_s"],
                    s.get("mean_accepted_length", "-"),
                    f"{s['greedy_equal_to_specd_off']}/{s['prompts']}",
                ]
                for n, s in summary.items()
            ],
        ),
        "",
        "Ratios (median over prompts of per-prompt tokens/s ratios):",
        "",
        C.md_table(
            ["a / b", "wall clock", "CPU time"],
            [[f"{r['a']} / {r['b']}", r["median_ratio"], r["median_ratio_cpu"]] for r in ratios],
        ),
    ]
    return "\n".join(md)


def time_rotated(systems: list, groups: list, progress: bool = True, desc: str = "peers") -> list:
    """Every system on every group of prompts, back to back, in an order rotated from group to group
    (load from other processes hits them alike). ``groups``: [(prompts, ids lists)]; a group of one
    runs ``system(ids)``, a bigger one ``system.batch(ids lists)`` (one batch, timed as a whole).
    One row per group and system (``output_ids``: a list per prompt when batched)."""
    from tqdm import tqdm

    rows = []
    for qi, (ps, ids_list) in enumerate(tqdm(groups, desc=desc, disable=not progress)):
        for s in systems[qi % len(systems) :] + systems[: qi % len(systems)]:
            t0, c0 = time.perf_counter(), time.process_time()
            o = s(ids_list[0]) if len(ids_list) == 1 else s.batch(ids_list)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            n_out = len(o) if len(ids_list) == 1 else sum(map(len, o))
            r = {
                "prompt_id": "+".join(p.id for p in ps),
                "category": ps[0].category,
                "system": s.name,
                "batch": len(ids_list),
                "prompt_tokens": sum(map(len, ids_list)),
                "output_tokens": n_out,
                "wall_s": round(dt, 6),
                "cpu_s": round(cpu, 6),
                "tokens_per_s": round(n_out / dt, 3) if dt > 0 else 0.0,
                "tokens_per_cpu_s": round(n_out / cpu, 3) if cpu > 0 else 0.0,
                "output_ids": o,
            }
            if s.stats is not None:
                r["mean_accepted_length"] = round(s.stats.mean_accepted_length, 4)
            rows.append(r)
    return rows


def _bar(summary: dict, path):
    plt = C._plt()
    names = list(summary)
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.4
    xs = range(len(names))
    ax.bar([x - w / 2 for x in xs], [summary[n]["median_tokens_per_s"] for n in names], w, label="wall clock")
    ax.bar([x + w / 2 for x in xs], [summary[n]["median_tokens_per_cpu_s"] for n in names], w, label="CPU time")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    vals = [summary[n]["median_tokens_per_s"] for n in names if summary[n]["median_tokens_per_s"] > 0]
    if vals and max(vals) / min(vals) > 20:
        ax.set_yscale("log")  # a compiled peer can be an order of magnitude faster
    ax.set_ylabel("median tokens/s over prompts")
    ax.set_title("specd vs peers (same models, prompts, machine)")
    ax.legend(fontsize=8)
    return C._save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
