"""xgrammar vs llguidance on the built-in model's vocabulary, over the JSONSchemaBench sample (issue 41).

For each schema of ``../shared/data/jsonschemabench/schemas.jsonl`` and each library: does it compile
(and why not), how long compiling takes, and how long filling the next-token bitmask takes at every
position of a valid JSON instance tokenized with the built-in tokenizer (SmolLM2-135M-Instruct,
49,152 tokens). The instance is :func:`eval.json_instance.instance` when both libraries accept it,
else a random walk under every library's mask at once (so it is valid for all); mask times are
taken on the schemas all compile, the libraries' fills interleaved token by token.

Settings alike for both: JSON with fixed separators ``", "`` / ``": "`` and no free whitespace
(xgrammar ``any_whitespace=False``; llguidance ``whitespace_flexible=False``), one compile thread,
xgrammar's compile cache off. xgrammar runs three ways: ``strict`` (undeclared properties refused,
as specd compiles), ``strict dynamic`` (``enable_dynamic_compilation``: each state's token-mask
cache built on its first use instead of at compile time) and plain (the schema's own semantics,
llguidance's: its masks are compared bit for bit with llguidance's). "compile" is what a request
waits for before its first mask: xgrammar ``compile_json_schema``; llguidance
``grammar_from_json_schema`` + ``LLMatcher`` (its lexer is built lazily, so first masks are
reported apart too).

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m eval.grammar_libs [--limit N] [--out DIR]

llguidance is not a specd dependency: install it first (``.venv/bin/pip install llguidance==1.9.1``,
no dependencies of its own).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import time
from pathlib import Path

from eval import harness as H
from eval.json_instance import NoInstance, instance

DATA = H.ROOT.parent / "shared" / "data" / "jsonschemabench" / "schemas.jsonl"
SEPARATORS = (", ", ": ")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--limit", type=int, default=0, help="first N schemas only (0: all)")
    ap.add_argument("--walk-tokens", type=int, default=384, help="longest random-walk instance")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args(argv)


def builtin_tokenizer():
    """The built-in model's Hugging Face tokenizer (from the converted GGUF's cache folder)."""
    from specd.model import builtin
    from specd.model.gguf import cached_folder
    from specd.model.loader import load_tokenizer

    return load_tokenizer(cached_folder(builtin.ensure(download=False), weights=False))


class Xgr:
    """xgrammar: a ``CompiledGrammar`` per schema, a ``GrammarMatcher`` per walk."""

    dist = "xgrammar"

    def __init__(self, tok, vocab: int, strict: bool = True, dynamic: bool = False):
        import xgrammar as xgr

        self.xgr, self.strict = xgr, strict
        self.name = "xgrammar" + (" strict" if strict else "") + (" dynamic" if dynamic else "")
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(
            info, max_threads=1, cache_enabled=False, enable_dynamic_compilation=dynamic
        )

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=SEPARATORS, strict_mode=self.strict
        )

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    @staticmethod
    def fill(m, bitmask) -> None:
        m.fill_next_token_bitmask(bitmask)

    @staticmethod
    def accept(m, token: int) -> bool:
        return m.accept_token(token)

    @staticmethod
    def terminated(m) -> bool:
        return m.is_terminated()


class Llg:
    """llguidance: a validated template ``LLMatcher`` per schema, a ``deep_copy`` of it per walk."""

    name = dist = "llguidance"

    def __init__(self, tok, vocab: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)

    def compile(self, schema: dict):
        opts = {"whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]}
        opts.update(lenient=True, coerce_one_of=True)  # as xgrammar does: unknown keywords ignored, oneOf ~ anyOf
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=opts)
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    @staticmethod
    def matcher(compiled):
        return compiled.deep_copy()

    def fill(self, m, bitmask) -> None:
        self.lt.fill_next_token_bitmask(m, bitmask)

    @staticmethod
    def accept(m, token: int) -> bool:
        return m.consume_token(token)

    @staticmethod
    def terminated(m) -> bool:
        return m.is_stopped() and not m.is_error()


def reason(err: Exception) -> str:
    """An error message reduced to its kind (names, numbers and quoted parts dropped) for counting."""
    line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    line = re.sub(r"(\"[^\"]*\"|'[^']*'|`[^`]*`)", "…", line)
    return re.sub(r"\d+", "N", line)[:90]


def compile_all(libs: list, rows: list) -> dict:
    """``{lib name: {"compiled": {id: obj}, "ms": {id: ms}, "failed": {id: reason}}}``."""
    out = {}
    for lib in libs:
        res: dict = {"compiled": {}, "ms": {}, "failed": {}}
        for r in rows:
            t0 = time.perf_counter()
            try:
                obj = lib.compile(r["schema"])
            except Exception as e:  # noqa: BLE001 - a library's refusal is the measurement
                res["failed"][r["id"]] = reason(e)
                continue
            res["ms"][r["id"]] = (time.perf_counter() - t0) * 1e3
            res["compiled"][r["id"]] = obj
        out[lib.name] = res
        H.log(f"{lib.name}: {len(res['compiled'])}/{len(rows)} compiled")
    return out


def accepts(lib, compiled, tokens: list, eos: int) -> bool:
    m = lib.matcher(compiled)
    return all(lib.accept(m, t) for t in tokens) and lib.accept(m, eos) and lib.terminated(m)


def unpack(bitmask, vocab: int):
    """``[1, ceil(V/32)] int32`` bitmask -> ``[V]`` bool (bit j of word i is token 32 i + j)."""
    import torch

    bits = torch.arange(32, dtype=torch.int32)
    return ((bitmask[0].unsqueeze(-1) >> bits) & 1).bool().view(-1)[:vocab]  # [V]


def walk(libs: list, compiled: list, eos: int, closing, rng, max_tokens: int) -> list | None:
    """A random token path every library allows, ending where EOS is allowed (None: no end in
    ``max_tokens``). ``closing`` [V] bool marks tokens with a quote or bracket, drawn 30% of the
    time so that strings and arrays end."""
    import torch

    ms = [lib.matcher(c) for lib, c in zip(libs, compiled)]
    vocab = closing.numel()
    bm = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    out: list = []
    for _ in range(max_tokens):
        allowed = torch.ones(vocab, dtype=torch.bool)
        for lib, m in zip(libs, ms):
            lib.fill(m, bm)
            allowed &= unpack(bm, vocab)
        if allowed[eos]:
            return out
        pool = allowed & closing if rng.random() < 0.3 and (allowed & closing).any() else allowed
        ids = pool.nonzero().view(-1).tolist()
        if not ids:
            return None
        t = ids[rng.randrange(len(ids))]
        if not all(lib.accept(m, t) for lib, m in zip(libs, ms)):
            return None
        out.append(t)
    return None


def instance_tokens(libs, compiled: list, schema: dict, tok, eos: int, closing, rng, max_tokens: int):
    """``(tokens, how)``: the schema's heuristic instance when every library accepts it, else a walk."""
    try:
        text = json.dumps(instance(schema), ensure_ascii=False, separators=SEPARATORS)
        ids = tok.encode(text, add_special_tokens=False)
        if all(accepts(lib, c, ids, eos) for lib, c in zip(libs, compiled)):
            return ids, "instance"
    except NoInstance:
        pass
    ids = walk(libs, compiled, eos, closing, rng, max_tokens)
    return ids, "walk" if ids is not None else "none"


def time_masks(libs: list, compiled: list, tokens: list, vocab: int) -> tuple:
    """Every library's fill time (us) at each position of ``tokens`` and the end, interleaved; and how
    many positions the last two libraries' masks (the same schema semantics) were bit-equal."""
    import torch

    ms = [lib.matcher(c) for lib, c in zip(libs, compiled)]
    bms = [torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32) for _ in libs]
    times: list = [[] for _ in libs]
    equal = 0
    for pos in range(len(tokens) + 1):
        for i, (lib, m) in enumerate(zip(libs, ms)):
            t0 = time.perf_counter_ns()
            lib.fill(m, bms[i])
            times[i].append((time.perf_counter_ns() - t0) / 1e3)
        equal += torch.equal(bms[-2], bms[-1])
        if pos < len(tokens):
            for lib, m in zip(libs, ms):
                lib.accept(m, tokens[pos])
    return times, equal


def closing_tokens(tok, vocab: int):
    import torch

    out = torch.zeros(vocab, dtype=torch.bool)
    for i in range(len(tok)):
        out[i] = any(c in tok.decode([i]) for c in '"]}')
    return out


def measure_masks(libs, comp: dict, rows: list, tok, vocab: int, args) -> dict:
    """Mask times along each instance, on the schemas every library compiled."""
    import random

    rng = random.Random(args.seed)
    eos = tok.eos_token_id
    closing = closing_tokens(tok, vocab)
    res: dict = {"us": [[] for _ in libs], "first_us": [[] for _ in libs], "how": collections.Counter()}
    res.update(positions=0, equal=0, schemas=0)
    for r in rows:
        compiled = [comp[lib.name]["compiled"].get(r["id"]) for lib in libs]
        if any(c is None for c in compiled):
            continue
        tokens, how = instance_tokens(libs, compiled, r["schema"], tok, eos, closing, rng, args.walk_tokens)
        res["how"][how] += 1
        if tokens is None:
            continue
        times, equal = time_masks(libs, compiled, tokens, vocab)
        for i, ts in enumerate(times):
            res["us"][i].extend(ts)
            res["first_us"][i].append(ts[0])
        res["positions"] += len(tokens) + 1
        res["equal"] += equal
        res["schemas"] += 1
    return res


def summarize(libs, rows: list, comp: dict, masks: dict, setup_s: dict) -> dict:
    p = H.percentile
    out: dict = {"schemas": len(rows), "mask_schemas": masks["schemas"], "mask_positions": masks["positions"]}
    out["instances"] = dict(masks["how"])
    out["masks_bit_equal"] = masks["equal"]
    for i, lib in enumerate(libs):
        c = comp[lib.name]
        us, first = masks["us"][i], masks["first_us"][i]
        out[lib.name] = {
            "tokenizer_setup_s": setup_s[lib.name],
            "compiled": len(c["compiled"]),
            "failed": dict(collections.Counter(c["failed"].values()).most_common()),
            "failed_ids": c["failed"],
            "compile_ms": _compile_ms(c["ms"]),
            "mask_us": {"p50": p(us, 50), "p99": p(us, 99), "mean": sum(us) / max(len(us), 1)},
            "first_mask_us": {"p50": p(first, 50), "p99": p(first, 99)},
        }
    return out


def _compile_ms(ms: dict) -> dict:
    """Percentiles of the compile times (ms), how many took over 1 s and 10 s, and the slowest schema."""
    xs = list(ms.values())
    slowest = max(ms, key=ms.__getitem__, default=None)
    return {
        "p50": H.percentile(xs, 50),
        "p99": H.percentile(xs, 99),
        "max": ms.get(slowest),
        "slowest": slowest,
        "over_1s": sum(x > 1e3 for x in xs),
        "over_10s": sum(x > 1e4 for x in xs),
    }


def table(libs, s: dict) -> str:
    lines = [
        f"{s['schemas']} schemas; mask times on {s['mask_schemas']} compiled by both "
        f"({s['mask_positions']} positions; instances: {s['instances']}); {libs[-2].name} and "
        f"{libs[-1].name} masks bit-equal at {s['masks_bit_equal']} positions",
        "",
        "| library | compiled | compile p50 / p99 (ms) | compiles > 1 s / > 10 s | mask p50 / p99 (us) "
        "| first mask p50 / p99 (us) | tokenizer setup (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for lib in libs:
        r = s[lib.name]
        c, m, f = r["compile_ms"], r["mask_us"], r["first_mask_us"]
        lines.append(
            f"| {lib.name} | {r['compiled']}/{s['schemas']} | {c['p50']:.2f} / {c['p99']:.1f} | "
            f"{c['over_1s']} / {c['over_10s']} | {m['p50']:.1f} / {m['p99']:.0f} | {f['p50']:.0f} / {f['p99']:.0f} | "
            f"{r['tokenizer_setup_s']:.2f} |"
        )
    for lib in libs:
        lines += ["", f"{lib.name} failures:"] + [f"- {n} x {why}" for why, n in s[lib.name]["failed"].items()]
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    H.set_threads(1)
    rows = [json.loads(line) for line in args.data.open()]
    rows = rows[: args.limit] if args.limit else rows
    tok = builtin_tokenizer()
    vocab = len(tok)
    libs, setup_s = [], {}
    makers = (
        lambda: Xgr(tok, vocab, strict=True),
        lambda: Xgr(tok, vocab, strict=True, dynamic=True),
        lambda: Xgr(tok, vocab, strict=False),
        lambda: Llg(tok, vocab),
    )
    for make in makers:
        t0 = time.perf_counter()
        libs.append(make())
        setup_s[libs[-1].name] = time.perf_counter() - t0
    comp = compile_all(libs, rows)
    masks = measure_masks(libs, comp, rows, tok, vocab, args)
    summary = summarize(libs, rows, comp, masks, setup_s)
    text = table(libs, summary)
    print(text)
    out = args.out or H.default_out("grammar_libs")
    out.mkdir(parents=True, exist_ok=True)
    meta = H.run_meta("eval.grammar_libs", argv)
    meta["versions"].update({lib.dist: _version(lib.dist) for lib in libs})
    (out / "report.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=1))
    (out / "summary.md").write_text(text + "\n")
    H.log(f"wrote {out}")
    return summary


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    main()
