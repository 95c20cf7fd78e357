"""What a weight format costs in quality (issue 19): perplexity of one model per ``--quantization`` on
held-out text, relative to the unquantized weights.

    python -m eval.quant_quality --target ~/.cache/specd/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --quantization none,int8,int4,gguf --tokens 4096 --threads 2
    # and a KV cache's element type per format: --quantization gguf+a8 --kv-dtypes float32,float16

Texts: the tail of ``../shared/data/tinyshakespeare/input.txt`` and the answers of the last GSM8K
training problems (``../shared/data/gsm8k/train.jsonl``; the built-in draft's distillation prompts
come from the head of that file, and the target never trained on it), each cut to ``--tokens``
tokens and scored in independent windows of ``--window`` tokens. ``none`` is the reference (for a
GGUF file: its blocks dequantized to fp32, what specd ran before issue 19).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from eval import common as C
from eval import harness as H

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def texts(tokens_chars: int) -> dict:
    """name -> text (about ``tokens_chars`` characters of each)."""
    shakespeare = (SHARED / "tinyshakespeare" / "input.txt").read_text()[-tokens_chars:]
    lines = (SHARED / "gsm8k" / "train.jsonl").read_text().splitlines()
    answers, size = [], 0
    for line in reversed(lines):
        a = json.loads(line)["answer"]
        answers.append(a)
        size += len(a)
        if size >= tokens_chars:
            break
    return {"tinyshakespeare tail": shakespeare, "GSM8K answers (last)": "\n\n".join(answers)}


def run(a) -> dict:
    import torch

    from specd.engine.perplexity import perplexity

    out: dict = {}
    data = None
    kvs = [x.strip() for x in a.kv_dtypes.split(",") if x.strip()]
    for q in [x.strip() for x in a.quantization.split(",") if x.strip()]:
        t0 = time.perf_counter()
        lm = C.load_variant(a.target, q, "cpu", "float32", progress=False)
        if data is None:
            data = {k: lm.tokenizer(v)["input_ids"][: a.tokens] for k, v in texts(a.tokens * 6).items()}
        for kv in kvs:
            name = q if kv == "model" else f"{q}, KV {kv}"
            kv_dt = None if kv == "model" else getattr(torch, kv)
            out[name] = {k: round(perplexity(lm, ids, a.window, kv_dt), 4) for k, ids in data.items()}
            out[name]["seconds"] = round(time.perf_counter() - t0, 1)
            print(name, out[name], flush=True)
    return {"tokens": {k: len(v) for k, v in data.items()}, "perplexity": out}


def render(rep: dict, ref: str) -> str:
    ppl = rep["perplexity"]
    names = list(rep["tokens"])
    rows = []
    for q, d in ppl.items():
        cells = [f"{d[n]:.3f} ({100 * (d[n] / ppl[ref][n] - 1):+.2f}%)" if ref in ppl else f"{d[n]:.3f}" for n in names]
        rows.append([q, *cells])
    head = ["quantization"] + [f"{n} ({rep['tokens'][n]} tokens)" for n in names]
    return C.md_table(head, rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--quantization", default="none,int8,int4,gguf")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument(
        "--kv-dtypes", default="model", help="comma list of KV cache dtypes per quantization: model, float32, float16"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write report.json and summary.md here")
    a = ap.parse_args(argv)
    H.set_threads(a.threads)
    H.quiet_transformers()
    rep = run(a)
    md = render(rep, next(iter(rep["perplexity"])))
    print(md)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        C.write_json(out / "report.json", rep)
        (out / "summary.md").write_text(md + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
