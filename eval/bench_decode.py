"""Decode benchmark, one run: specd (target-only / chain / tree) vs transformers generate and assisted generation.

Same machine, same models, same prompts, greedy. Every configuration makes ``--repeats`` passes
over the prompts, interleaved with the others (so drift on a shared machine hits all alike); the
figures are medians over all groups of all passes (batch 1: prompt x pass; batch 8: pass). Prints a
Markdown table and the exact command; ``--json`` writes the figures.

    OMP_NUM_THREADS=1 python -m eval.bench_decode --target ../shared/models/stories260K \
        --draft ../shared/models/stories260K-draft-1L64 --prompts 8 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from eval.harness import ROOT, command_line, median
from specd.config import EngineConfig, SpecConfig
from specd.engine.engine import Engine
from specd.engine.sequence import SpecParams
from specd.sampling.params import SamplingParams

STORY_PROMPTS = [
    "Once upon a time, there was a little",
    "Tom had a big red ball. One day",
    "The cat and the dog",
    "Lily went to the park with her mom. She saw",
    "Sam was sad because",
    "It was a sunny day and",
    "The little bird wanted to fly",
    "Anna found a shiny key under the",
]


def load_prompts(tok, n, path=None):
    texts = []
    if path:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                texts.append(json.loads(line)["turns"][0] if line.lstrip().startswith("{") else line)
    texts = (texts or STORY_PROMPTS) * (1 + n // max(1, len(texts or STORY_PROMPTS)))
    return [tok(t)["input_ids"][:48] for t in texts[:n]]


def time_specd(eng, prompts, max_tokens, mode, batch):
    """One pass over the prompts in groups of ``batch``: (tokens/s of each group, outputs, mean accepted lengths)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rates, outs, mals = [], [], []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        t0 = time.perf_counter()
        seqs = eng.generate(chunk, params, SpecParams(mode=mode))
        dt = time.perf_counter() - t0
        rates.append(sum(s.num_output for s in seqs) / dt)
        outs += [s.output_ids for s in seqs]
        mals += [s.stats.mean_accepted_length for s in seqs]
    return rates, outs, mals


def time_hf(model, prompts, max_tokens, batch, assistant=None):
    """One pass of transformers ``generate`` (left-padded groups of ``batch``): (tokens/s per group, outputs)."""
    rates, outs = [], []
    kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    if assistant is not None:
        kw["assistant_model"] = assistant
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            L = max(len(p) for p in chunk)
            ids = torch.tensor([[0] * (L - len(p)) + p for p in chunk])
            att = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk])
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=att, **kw)
            dt = time.perf_counter() - t0
            rates.append(len(chunk) * max_tokens / dt)
            outs += out[:, L:].tolist()
    return rates, outs


# speculative configurations timed (greedy); every one is reported, the best is compared with assisted generation
SPEC_CONFIGS = {
    "off": ("off", {}),
    "chain k=1": ("chain", dict(num_draft_tokens=1)),
    "chain k=2": ("chain", dict(num_draft_tokens=2)),
    "chain k=4": ("chain", dict(num_draft_tokens=4)),
    "tree N=16 top-4 depth 6": ("tree", dict(tree_budget=16, tree_topk=4, tree_depth=6)),
}


def config_key(name: str) -> str:
    """The result key of a specd configuration: ``chain k=4`` -> ``specd_chain_k4``."""
    return "specd_" + name.replace(" ", "_").replace("=", "")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(ROOT.parent / "shared/models/stories260K"))
    ap.add_argument("--draft", default=str(ROOT.parent / "shared/models/stories260K-draft-1L64"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-file", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="passes per configuration, interleaved across configurations (medians reported)",
    )
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def setup(a) -> tuple:
    """(specd engines by configuration sharing the loaded pair, prompts, transformers target and
    draft), everything warmed up."""
    from transformers import AutoModelForCausalLM

    from specd.model.loader import load_model

    target = load_model(a.target, "cpu", "float32")
    draft = load_model(a.draft, "cpu", "float32", with_tokenizer=True, target=target)
    engines = {
        name: Engine(
            EngineConfig(target=a.target, draft=a.draft, spec=SpecConfig(adaptive=False, **kw)),
            target=target,
            draft=draft,
        )
        for name, (_, kw) in SPEC_CONFIGS.items()
    }
    prompts = load_prompts(target.tokenizer, a.prompts, a.prompt_file)
    hf = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32).eval()
    hf_draft = AutoModelForCausalLM.from_pretrained(a.draft, dtype=torch.float32).eval()
    warm = SamplingParams(temperature=0, max_tokens=8)
    for name, eng in engines.items():
        eng.generate(prompts[:1], warm, SpecParams(mode=SPEC_CONFIGS[name][0]))
    with torch.no_grad():
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    return engines, prompts, hf, hf_draft


def run_batch(batch: int, a, engines: dict, prompts: list, hf, hf_draft, res: dict) -> list:
    """Every configuration at one batch size, ``--repeats`` interleaved passes; the table rows (and
    the medians into ``res``)."""
    rates = {k: [] for k in [*SPEC_CONFIGS, "hf", "assisted"]}
    outs, mals, rows = {}, {}, []
    for _ in range(a.repeats):  # interleaved, so drift on a shared machine hits every configuration alike
        r, outs["hf"] = time_hf(hf, prompts, a.max_tokens, batch)
        rates["hf"] += r
        for name, (mode, _) in SPEC_CONFIGS.items():
            r, outs[name], mals[name] = time_specd(engines[name], prompts, a.max_tokens, mode, batch)
            rates[name] += r
        if batch == 1:  # assisted generation supports batch 1 only
            r, _ = time_hf(hf, prompts, a.max_tokens, 1, assistant=hf_draft)
            rates["assisted"] += r
    med = {k: median(v) for k, v in rates.items() if v}
    r_hf = med["hf"]
    res[f"hf_generate_b{batch}"] = r_hf
    for name in SPEC_CONFIGS:
        key = config_key(name)
        res[f"{key}_b{batch}"] = med[name]
        res[f"{key}_b{batch}_mal"] = median(mals[name])
        same = sum(x == y for x, y in zip(outs[name], outs["hf"]))
        rows.append(
            (
                batch,
                f"specd {name}",
                med[name],
                med[name] / r_hf,
                res[f"{key}_b{batch}_mal"],
                f"{same}/{len(outs[name])}",
            )
        )
    rows.append((batch, "transformers generate", r_hf, 1.0, 1.0, "-"))
    if batch == 1:
        res["hf_assisted_b1"] = med["assisted"]
        rows.append((1, "transformers assisted", med["assisted"], med["assisted"] / r_hf, float("nan"), "-"))
    return rows


def report(rows: list, res: dict, cmd: str) -> None:
    import transformers

    print(
        f"\n{time.strftime('%Y-%m-%d')} {platform.processor() or platform.machine()} {os.cpu_count()} cores, "
        f"torch {torch.__version__}, transformers {transformers.__version__}\n`{cmd}`\n"
    )
    print(
        "| batch | engine | tokens/s (median) | vs transformers generate | mean accepted length | same tokens as HF |"
    )
    print("|---|---|---|---|---|---|")
    for b, name, r, ratio, mal, same in rows:
        print(f"| {b} | {name} | {r:.1f} | {ratio:.2f}x | {mal:.2f} | {same} |")
    print()
    for b in (1, 8):
        print(
            f"batch {b}: specd target-only / transformers generate = "
            f"{res[f'specd_off_b{b}'] / res[f'hf_generate_b{b}']:.2f}x"
        )
    best = max((n for n in SPEC_CONFIGS if n != "off"), key=lambda n: res[config_key(n) + "_b1"])
    best_rate = res[config_key(best) + "_b1"]
    print(
        f"batch 1: specd speculative (best: {best}) / transformers assisted = {best_rate / res['hf_assisted_b1']:.2f}x"
    )


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    engines, prompts, hf, hf_draft = setup(a)
    rows, res = [], {}
    for batch in (1, 8):
        rows += run_batch(batch, a, engines, prompts, hf, hf_draft, res)
    cmd = f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} {command_line('bench_decode', argv)}"
    report(rows, res, cmd)
    if a.json:
        Path(a.json).write_text(json.dumps({"command": cmd, "results": res}, indent=1))


if __name__ == "__main__":
    main()
