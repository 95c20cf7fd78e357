"""How often feature heads agree with their target, per prompt category, offline.

The target (as ``specd serve`` runs it: ``--act-quant auto`` = GGUF blocks and int8 activations on
a CPU) writes greedy replies to the prompts; its features are recorded once over every reply; each
head then predicts every reply position through EAGLE-3's training-time test
(``specd.training.head.head_agreement``), by unrolled step. Two figures per head and category:
*masked* (positions whose token is in the head's draft vocabulary; what training optimizes) and
*unmasked* (every position, a token outside the vocabulary being a miss: what the engine sees;
step 0 unmasked is the first draft token's acceptance rate). Evaluation prompts are measured here,
never trained on.

    OMP_NUM_THREADS=2 python -m eval accept heads --per-category 8 --max-tokens 256 \\
        --heads models/smollm2-head,/path/to/other/head --out eval/out/head_agreement
"""

from __future__ import annotations

import argparse
import time

import torch

from eval import harness as H

COMMAND = "accept heads"  # python -m eval accept heads (this module's ``main``)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="target (default: the built-in model)")
    ap.add_argument("--heads", default=None, help="comma list of head folders (default: the built-in head)")
    ap.add_argument("--prompts", default=str(H.SPEC_BENCH))
    ap.add_argument("--per-category", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="unrolled draft steps (tree depths) measured")
    ap.add_argument("--act-quant", default="auto", choices=("auto", "none", "int8"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="folder for results.json and summary.md")
    return ap.parse_args(argv)


def target_replies(args) -> tuple:
    """(engine, [category], [(tokens, prompt length)]): the target's greedy replies, first turns."""
    from specd.config import CacheConfig, EngineConfig
    from specd.engine.engine import Engine
    from specd.engine.sequence import SpecParams
    from specd.model import builtin
    from specd.sampling.params import SamplingParams

    target = args.target or str(builtin.builtin_gguf())
    cfg = EngineConfig(target=target, act_quant=args.act_quant, dtype=args.dtype, cache=CacheConfig(num_blocks=4096))
    eng = Engine(cfg)
    rows = H.load_prompts(args.prompts, per_category=args.per_category)
    chat = H.has_chat_template(eng.tokenizer)
    ids = [H.encode_conversation(eng.tokenizer, p.turns[:1], [], chat) for p in rows]
    seqs = eng.generate(ids, SamplingParams(temperature=0.0, max_tokens=args.max_tokens), SpecParams("off"))
    return eng, [p.category for p in rows], [(s.tokens[:], s.num_prompt) for s in seqs]


def agreement_table(target, heads: dict, cats: list, data: list, steps: int) -> dict:
    """{head: {category: {"masked": [by step], "unmasked": [by step], "positions": n}}}."""
    from specd.training.head import head_agreements, target_features

    layers = {h.layers for h in heads.values()}
    feats = {ls: target_features(target, data, ls) for ls in layers}
    V = target.config.vocab_size
    out: dict = {}
    for name, head in heads.items():
        head = head.float()
        t2d = torch.full((V,), -100, dtype=torch.long)
        t2d[head.d2t.cpu()] = torch.arange(head.d2t.numel())
        out[name] = {}
        for cat in dict.fromkeys(cats):
            rows = [f for f, c in zip(feats[head.layers], cats) if c == cat]
            masked, unmasked = head_agreements(head, rows, t2d, steps)
            out[name][cat] = {
                "masked": [round(a, 4) for a in masked],
                "unmasked": [round(a, 4) for a in unmasked],
                "positions": sum(len(t) - max(p, 2) for t, p, _ in rows),
            }
    return out


def summary(table: dict) -> str:
    cats = list(next(iter(table.values())))
    lines = ["Top-1 agreement by unrolled step (unmasked, OOV = miss; masked in brackets):", ""]
    rows = []
    for name, by_cat in table.items():
        cells = [
            " / ".join(f"{u:.1%} ({m:.1%})" for u, m in zip(by_cat[c]["unmasked"], by_cat[c]["masked"])) for c in cats
        ]
        rows.append([name, *cells])
    lines.append(H.md_table(["head", *cats], rows))
    return "\n".join(lines)


def main(argv=None) -> int:
    from specd.model import builtin
    from specd.model.head_files import load_head

    args = parse_args(argv)
    H.set_threads(args.threads)
    t0 = time.perf_counter()
    eng, cats, data = target_replies(args)
    H.log(f"{len(data)} replies in {time.perf_counter() - t0:.0f} s")
    paths = (args.heads or str(builtin.head_path())).split(",")
    heads = {p: load_head(p, eng.target) for p in paths}
    table = agreement_table(eng.target, heads, cats, data, args.steps)
    text = summary(table)
    print(text)
    out = H.out_dir(args.out, "head_agreement")
    cmd = H.command_line(COMMAND, argv)
    H.write_json(out / "results.json", {"command": cmd, "replies": len(data), "agreement": table})
    (out / "summary.md").write_text(f"# Head agreement\n\n- command: `{cmd}`\n\n{text}\n")
    H.log(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
