"""How often speculative output equals plain output in bf16 (issue #16 item 5), on the built-in pair.

In fp32 speculative greedy output is identical to plain (a test asserts it). In bf16 a verification
computes the same token's logits inside a wider matmul (tree rows batched with the root), and a
bf16 GEMM of several rows does not round like the one-row GEMV of plain decoding: where the top-2
logits are closer than that rounding, the argmax can flip and the outputs diverge from there (vLLM
and SGLang document the same batch-shape dependence). This script reports, per mode, the share of
prompts whose output equals plain bf16 output exactly, and for each difference the position and the
plain step's top-2 logit gap (fp32 reference logits of the same prefix) at the first divergence.

    python -m eval.bf16_agreement --prompts 16 --max-tokens 48 --out eval/out/bf16_agreement.json
"""

from __future__ import annotations

import argparse
import json

import torch

from eval import harness as H

SHORT = ["What is the capital of France?", "Tom has 3 apples and buys 4 more. How many apples does he have?"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16, help="chat prompts (MT-bench first turns after two short ones)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--modes", default="chain,tree,ngram")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="eval/out/bf16_agreement.json")
    return ap.parse_args(argv)


def prompts(n: int) -> list:
    rows = [json.loads(line) for line in (H.ROOT.parent / "shared/data/mt_bench/question.jsonl").open()]
    return (SHORT + [r["turns"][0] for r in rows])[:n]


def engine(dtype: str):
    from specd.config import CacheConfig, EngineConfig, SpecConfig
    from specd.engine.engine import Engine
    from specd.model import builtin

    draft = builtin.draft_path()
    cfg = EngineConfig(
        target=str(builtin.builtin_gguf()),
        draft=str(draft) if draft else None,
        dtype=dtype,
        cache=CacheConfig(num_blocks=512),
        spec=SpecConfig(adaptive=False, suffix_store=False),
    )
    return Engine(cfg)


def top2_gap(ref, ids: list) -> float:
    """The top-2 gap of the next-token logits after ``ids`` from a one-shot fp32 forward of ``ref``
    (an fp32 engine): how close a tie the bf16 rounding had to flip."""
    from specd.engine.kv_cache import KVCache
    from specd.model.attention import build_metadata

    c, n = ref.target.config, len(ids)
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, -(-n // 16) + 1, 16, torch.float32, ref.device)
    s = cache.new_seq()
    s.reserve(n)
    meta = build_metadata([n], [0], [s.blocks], s.slots(0, n), 16, ref.device)
    with torch.no_grad():
        h = ref.target.model(torch.tensor(ids), torch.arange(n), cache.kv, meta)
        top = ref.target.model.compute_logits(h[-1:])[0].topk(2).values
    return float(top[0] - top[1])


def compare(eng, ref, ids_list: list, params, modes: list) -> dict:
    from specd.engine.sequence import SpecParams

    plain = [s.output_ids for s in eng.generate(ids_list, params, SpecParams("off"))]
    out = {}
    for mode in modes:
        got = [s.output_ids for s in eng.generate(ids_list, params, SpecParams(mode))]
        diffs = []
        for ids, a, b in zip(ids_list, plain, got):
            if a == b:
                continue
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diffs.append({"position": k, "top2_gap": round(top2_gap(ref, ids + a[:k]), 4)})
        out[mode] = {"equal": len(ids_list) - len(diffs), "prompts": len(ids_list), "differences": diffs}
    return out


def chat_ids(tok, texts: list) -> list:
    out = []
    for t in texts:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    H.set_threads(a.threads)
    from eval.common import write_json
    from specd.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    res = {"meta": H.run_meta("bf16_agreement", argv), "dtypes": {}}
    ref = engine("float32")
    ids_list = chat_ids(ref.tokenizer, prompts(a.prompts))
    for dtype in ("float32", "bfloat16"):
        eng = ref if dtype == "float32" else engine(dtype)
        res["dtypes"][dtype] = compare(eng, ref, ids_list, params, a.modes.split(","))
        for mode, d in res["dtypes"][dtype].items():
            gaps = [x["top2_gap"] for x in d["differences"]]
            print(
                f"{dtype} {mode}: {d['equal']}/{d['prompts']} equal to plain; first-divergence top-2 gaps (fp32) {gaps}"
            )
    print(f"wrote {write_json(a.out, res)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
