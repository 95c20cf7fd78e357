"""Perplexity of a GGUF file on a text, scored as llama.cpp's ``llama-perplexity`` scores it, and the
same file and text through ``llama-perplexity`` itself (the goal: within 0.5%).

    OMP_NUM_THREADS=2 python -m eval perplexity --target FILE.gguf --ctx 512 --chunks 8 --threads 2

specd loads the file as ``specd serve --target FILE`` does (its Q4_0 / Q4_1 / Q8_0 blocks exact; other
quantized types converted to the nearest supported format, see ``specd.model.quant_load``; the CPU
kernel's int8 activations where it takes them) and scores with ``specd.engine.perplexity.llamacpp_nll``:
the text tokenized once (BOS in front when the file's vocabulary adds one), cut into chunks of
``--ctx`` tokens, the second half of each scored. The token ids are llama.cpp's own when
``llama-tokenize`` is there (``--llama-tools``; whether specd's tokenizer gives the same ids is
reported), so both sides score the same tokens. Writes ``results.json`` and ``summary.md``.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import time
from pathlib import Path

from eval import harness as H
from eval.bench_scale import LLAMA_TOOLS, tool

COMMAND = "perplexity"
TEXT = H.SHARED / "data" / "tinyshakespeare" / "input.txt"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="a .gguf file (default: the built-in model's)")
    ap.add_argument("--text", type=Path, default=TEXT, help="a UTF-8 text file (default: tinyshakespeare)")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity -c)")
    ap.add_argument("--chunks", type=int, default=8, help="chunks scored, from the start (llama-perplexity --chunks)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-tools", type=Path, default=LLAMA_TOOLS, help="llama.cpp's build (make bench-deps)")
    ap.add_argument("--no-llama", action="store_true", help="specd only")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.ctx < 4 or a.ctx % 2 or a.chunks < 1:
        ap.error("--ctx must be an even number >= 4 and --chunks >= 1")
    if not a.text.is_file():
        ap.error(f"--text {a.text}: no such file")
    return a


def specd_ids(lm, text: str, add_bos: bool) -> list:
    """The text's ids by specd's tokenizer (the file's), BOS in front when the vocabulary adds one."""
    ids = list(lm.tokenizer(text, add_special_tokens=False)["input_ids"])
    return [lm.config.bos_token_id, *ids] if add_bos else ids


def llama_ids(path: Path, text: Path, tools: Path) -> list | None:
    """llama.cpp's ids of ``text`` (``llama-tokenize --ids``, special tokens added as llama-perplexity
    adds them), None without the tool."""
    t = tool("llama-tokenize", tools)
    if t is None:
        return None
    cmd = [str(t), "-m", str(path), "-f", str(text), "--ids", "--log-disable"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [int(x) for x in re.findall(r"-?\d+", out.strip().splitlines()[-1])]


def llama_perplexity(path: Path, a) -> dict | None:
    """``llama-perplexity -f TEXT -c CTX -b CTX --chunks N -t T``: its final estimate and the seconds
    it took, None without the tool."""
    t = tool("llama-perplexity", a.llama_tools)
    if t is None:
        return None
    cmd = [str(t), "-m", str(path), "-f", str(a.text), "-c", str(a.ctx), "-b", str(a.ctx), "--chunks", str(a.chunks)]
    cmd += ["-t", str(a.threads)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", r.stdout + r.stderr)
    if r.returncode != 0 or m is None:
        raise SystemExit(f"llama-perplexity failed (exit {r.returncode}): {(r.stdout + r.stderr)[-2000:]}")
    return {"ppl": float(m.group(1)), "pm": float(m.group(2)), "seconds": round(time.perf_counter() - t0, 1),
            "command": " ".join(cmd)}  # fmt: skip


def score(path: Path, a) -> dict:
    """specd's perplexity of ``path`` on the text, llama.cpp's, and whether they tokenized alike."""
    from specd.config import EngineConfig
    from specd.engine.builder import kv_dtype, load_models
    from specd.engine.perplexity import llamacpp_nll
    from specd.model.attention import get_backend
    from specd.model.gguf import quick_metadata

    H.set_threads(a.threads)
    H.quiet_transformers()
    cfg = EngineConfig(target=str(path))
    lm = load_models(cfg, None, None)[0]
    backend = get_backend("auto", lm.device)
    add_bos = bool(quick_metadata(path).get("tokenizer.ggml.add_bos_token", False))
    ids = specd_ids(lm, a.text.read_text(encoding="utf-8"), add_bos)
    theirs = None if a.no_llama else llama_ids(path, a.text, a.llama_tools)
    n = a.ctx * a.chunks
    same = None if theirs is None else theirs[:n] == ids[:n]
    t0 = time.perf_counter()
    bos = lm.config.bos_token_id if add_bos else None
    kvd = kv_dtype(cfg, lm, backend)  # as the engine's cache (fp16 under the CPU kernel, as llama.cpp's)
    total, count, per_chunk = llamacpp_nll(lm, theirs or ids, a.ctx, bos, a.chunks, kv_dtype=kvd, backend=backend)
    res = {"file": str(path), "ctx": a.ctx, "chunks": a.chunks, "tokens_scored": count, "add_bos": add_bos,
           "specd_ppl": round(math.exp(total / count), 4), "specd_seconds": round(time.perf_counter() - t0, 1),
           "same_ids_as_llama_tokenize": same,
           "ids_from": "llama-tokenize" if theirs else "specd's tokenizer",
           "chunk_nll": [round(x, 4) for x in per_chunk],
           "nonfinite_chunks": [i for i, x in enumerate(per_chunk) if not math.isfinite(x)]}  # fmt: skip
    ll = None if a.no_llama else llama_perplexity(path, a)
    if ll is not None:
        res.update(llama_ppl=ll["ppl"], llama_pm=ll["pm"], llama_seconds=ll["seconds"], llama_command=ll["command"])
        res["rel_diff_pct"] = round(100 * (res["specd_ppl"] / ll["ppl"] - 1), 3)
    return res


def main(argv=None) -> int:
    from specd.model import builtin

    a = parse_args(argv)
    path = Path(a.target) if a.target else builtin.builtin_gguf()
    res = score(path, a)
    head = ["file", "ctx x chunks", "tokens scored", "specd PPL", "llama-perplexity PPL", "specd / llama - 1", "ids"]
    ids = res["ids_from"] + ("" if res["same_ids_as_llama_tokenize"] is None else
                             f" (specd's tokenizer the same: {res['same_ids_as_llama_tokenize']})")  # fmt: skip
    llama = f"{res['llama_ppl']} +/- {res['llama_pm']}" if "llama_ppl" in res else "-"
    diff = f"{res['rel_diff_pct']}%" if "rel_diff_pct" in res else "-"
    row = [path.name, f"{a.ctx} x {a.chunks}", res["tokens_scored"], res["specd_ppl"], llama, diff, ids]
    md = H.md_table(head, [row]) + "\n"
    if res["nonfinite_chunks"]:
        md += f"\nspecd's NLL was not finite in chunks {res['nonfinite_chunks']} (of {a.chunks})\n"
    out = H.out_dir(a.out, "perplexity")
    H.write_json(out / "results.json", {"meta": H.run_meta(COMMAND), **res})
    (out / "summary.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
