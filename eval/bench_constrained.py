"""Structured outputs on the built-in model over the JSONSchemaBench sample (issue 41): how many
schemas compile, compile time, whether every reply validates, what the mask costs per step, and
decode speed constrained with speculation (``auto``) against constrained plain decoding, at batch 1
and B, in one engine configured as ``specd serve`` (the built-in model, its feature head, ``auto``).

Per schema a chat prompt asks for one JSON instance of it (the schema in the system message); every
system decodes the same prompts with the same grammar, greedy, so constrained ``auto`` must give
token for token what constrained plain gives (column "= off": replies identical to the first
constrained system's). "decode tok/s" is steady state: the tokens
after each group's first step over the time after it (prefill excluded), median over groups ("(complete)": over
the groups whose replies all ended under the grammar, i.e. none looped until max_tokens); "mask
ms/step" is the engine's ``mask`` stage (tree masks, pruning, applying them) per step.

    OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 python -m eval bench json --schemas 24 --batch 1,4 --threads 2
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

from eval import harness as H

COMMAND = "bench json"  # python -m eval bench json (this module's ``main``)

DATA = H.ROOT.parent / "shared" / "data" / "jsonschemabench" / "schemas.jsonl"
SYSTEM = "Reply with one JSON value that is valid under this JSON schema, and nothing else.\nSchema: {schema}"
USER = "Give a realistic example."


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--schemas", type=int, default=24, help="schemas decoded (round-robin over categories)")
    ap.add_argument("--compile-all", action="store_true", help="compile every schema of the file (the rate)")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--systems", default="free,off,auto", help="free (unconstrained plain), off, auto, ngram, ...")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--serve-flags", default="", help="extra `specd serve` flags (space separated)")
    ap.add_argument("--llama-server", default=None, help="a llama-server binary: the peer, on the same GGUF (batch 1)")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def load_rows(path: Path, n: int) -> list:
    """``n`` rows of the sample, round-robin over its categories (file order within each)."""
    by_cat = collections.defaultdict(list)
    for line in path.open():
        row = json.loads(line)
        by_cat[row["category"]].append(row)
    out, lists = [], list(by_cat.values())
    for i in range(max(map(len, lists))):
        out += [rows[i] for rows in lists if i < len(rows)]
    return out[:n] if n else out


def compile_rows(engine, rows: list) -> tuple:
    """``(compiled rows, refusals {code: count}, compile seconds of the compiled ones)``."""
    from specd.structured import GrammarError, GrammarSpec

    ok, refused, secs = [], collections.Counter(), []
    for row in rows:
        spec = GrammarSpec("json_schema", row["schema"], "response_format")
        t0 = time.perf_counter()
        try:
            engine.constraints.compiler.compile(spec)
        except GrammarError as e:
            refused[e.code] += 1
            continue
        secs.append(time.perf_counter() - t0)
        ok.append((row, spec))
    return ok, dict(refused), secs


def validator():
    """``valid(schema, value) -> bool``: jsonschema's validator when installed, else JSON parses."""
    try:
        import jsonschema
    except ImportError:
        return None
    return lambda schema, value: jsonschema.Draft202012Validator(schema).is_valid(value)


def run_group(engine, items: list, mode: str | None, max_tokens: int, tenant: str) -> dict:
    """One group decoded together: tokens after the first step, the time after it, the replies.
    ``tenant``: one per system and batch size, so model-free drafting never reads another system's
    replies (the suffix store would replay the identical replies of the system run before it)."""
    from specd.sampling.params import SamplingParams
    from specd.speculation.request import SpecParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    seqs = [
        engine.add_request(
            ids, params, SpecParams(mode=mode or "off"), tenant=tenant, grammar=None if mode is None else spec
        )
        for ids, spec in items
    ]
    engine.step()
    while not all(s.num_output > 0 or s.finished for s in seqs):
        engine.step()
    t0, n0 = time.perf_counter(), sum(s.num_output for s in seqs)
    while not all(s.finished for s in seqs):
        engine.step()
    dt = time.perf_counter() - t0
    return {"tokens": sum(s.num_output for s in seqs) - n0, "seconds": dt, "seqs": seqs}


def run_system(engine, prompts: list, system: str, batch: int, max_tokens: int) -> dict:
    mode = None if system == "free" else system
    engine.timings.reset()
    rates, done_rates, replies, steps, errors = [], [], [], 0, 0
    for i in range(0, len(prompts), batch):
        g = run_group(engine, prompts[i : i + batch], mode, max_tokens, f"{system}-b{batch}")
        if g["seconds"] > 0 and g["tokens"] > 0:
            rates.append(g["tokens"] / g["seconds"])
            if all(s.finish_reason == "stop" for s in g["seqs"]):  # no reply cut by max_tokens (loops)
                done_rates.append(rates[-1])
        for s in g["seqs"]:
            replies.append((s.output_ids, s.finish_reason))
            steps += s.stats.steps
            errors += s.finish_reason == "error"
    t = engine.timings.as_dict()
    return {
        "tok_s": H.median(rates),
        "tok_s_complete": H.median(done_rates),  # groups whose replies all ended under the grammar
        "replies": replies,
        "steps": steps,
        "errors": errors,
        "mask_ms_per_step": t["wall_ms_per_step"].get("mask", 0.0),
        "step_ms": t["wall_ms_per_step"]["step"],
    }


def check_replies(engine, rows: list, replies: list, valid) -> dict:
    """Replies the grammar ended (``complete``: finish "stop", not cut by max_tokens), those of them
    that parse as JSON, and (with jsonschema) that validate; ``invalid_relaxed``: invalid replies whose
    schema uses a keyword the grammar relaxes (``specd.structured.exactness``; strict refuses those)."""
    from specd.structured.exactness import unenforced

    parsed = ok = complete = relaxed = 0
    for (row, _), (ids, reason) in zip(rows, replies):
        if reason != "stop":
            continue
        complete += 1
        text = engine.tokenizer.decode(ids, skip_special_tokens=True)
        try:
            value = json.loads(text)
        except ValueError:
            continue
        parsed += 1
        good = valid(row["schema"], value) if valid is not None else True
        ok += good
        relaxed += not good and bool(unenforced(row["schema"]))
    checked = valid is not None
    return {"replies": len(replies), "complete": complete, "json": parsed, "valid": ok if checked else None,
            "invalid_relaxed": relaxed if checked else None}  # fmt: skip


def prompts_for(engine, compiled: list) -> list:
    out = []
    for row, spec in compiled:
        system = SYSTEM.format(schema=json.dumps(row["schema"], separators=(",", ":"))[:3000])
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": USER}]
        ids = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        out.append((list(ids)[-1500:], spec))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    H.set_threads(args.threads)
    engine = H.engine_from_flags(["--threads", str(args.threads), *args.serve_flags.split()], warm=True)
    rows = load_rows(args.data, 0 if args.compile_all else args.schemas * 2)
    compiled, refused, secs = compile_rows(engine, rows)
    H.log(f"compiled {len(compiled)}/{len(rows)} schemas; refused {refused}")
    use = compiled[: args.schemas]
    prompts = prompts_for(engine, use)
    valid = validator()
    results = {
        "meta": H.run_meta(COMMAND, argv),
        "compile": {"schemas": len(rows), "compiled": len(compiled), "refused": refused, "seconds": H.p50_p99(secs)},
    }
    table = []
    for batch in [int(b) for b in args.batch.split(",")]:
        ref = None
        for system in args.systems.split(","):
            r = run_system(engine, prompts, system, batch, args.max_tokens)
            replies = r.pop("replies")
            checks = check_replies(engine, use, replies, valid) if system != "free" else {}
            if system != "free":
                ids = [x for x, _ in replies]
                ref = ids if ref is None else ref
                checks["same_as_first"] = sum(a == b for a, b in zip(ids, ref))
            results[f"b{batch}:{system}"] = {**r, **checks}
            cells = [checks.get(k) for k in ("complete", "json", "valid", "same_as_first")]
            table.append(
                [
                    batch,
                    system,
                    r["tok_s"],
                    r["tok_s_complete"],
                    r["steps"],
                    r["mask_ms_per_step"],
                    r["step_ms"],
                    *cells,
                    r["errors"],
                ]
            )
            H.log(f"b{batch} {system}: {r['tok_s']:.1f} tok/s, {r['steps']} steps, {checks}")
    if args.llama_server:
        peer = peer_row(args, engine, use, valid)
        results["llama-server"] = peer
        cells = [peer[k] for k in ("tok_s", "tok_s_complete")] + [None] * 3
        table.append([1, "llama-server", *cells, peer["complete"], peer["json"], peer["valid"], None, None])
    out = H.out_dir(args.out, "bench_json")
    H.write_json(out / "results.json", results)
    heads = "batch|system|decode tok/s|(complete)|steps|mask ms/step|step ms|complete|JSON|valid|= off|errors".split(
        "|"
    )
    (out / "summary.md").write_text(H.md_table(heads, table) + "\n")
    print(H.md_table(heads, table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def peer_row(args, engine, use: list, valid) -> dict:
    """llama-server on the GGUF specd serves (the built-in model's file unless --serve-flags names one)."""
    gguf = engine.cfg.target
    if not str(gguf).endswith(".gguf"):
        raise SystemExit(f"--llama-server needs a GGUF target; specd serves {gguf}")
    proc, url = start_llama_server(args.llama_server, str(gguf), args.threads)
    try:
        return run_llama_server(url, use, args.max_tokens, valid)
    finally:
        proc.terminate()
        proc.wait(30)


# llama.cpp's server as the peer --------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def start_llama_server(binary: str, gguf: str, threads: int):
    """``llama-server`` on ``gguf`` (one slot, ``threads`` threads), ready: ``(process, base url)``."""
    import subprocess
    import urllib.request

    port = _free_port()
    cmd = [binary, "-m", gguf, "--port", str(port), "--host", "127.0.0.1", "-t", str(threads), "-tb", str(threads),
           "-c", "4096", "-np", "1", "--no-webui"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited ({proc.returncode}): {' '.join(cmd)}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("llama-server did not become ready in 300 s")


def run_llama_server(url: str, use: list, max_tokens: int, valid) -> dict:
    """Each schema's prompt (the same messages; llama-server applies the file's chat template) with
    ``response_format`` json_schema, greedy: its own steady-state decode rate (``timings``)."""
    rates, done_rates, parsed, ok, complete = [], [], 0, 0, 0
    for row, _spec in use:
        system = SYSTEM.format(schema=json.dumps(row["schema"], separators=(",", ":"))[:3000])
        body = {
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": USER}],
            "max_tokens": max_tokens, "temperature": 0, "seed": 0, "cache_prompt": False,
            "response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": row["schema"]}},
        }  # fmt: skip
        try:
            r = _post(url + "/v1/chat/completions", body)
        except OSError as e:  # a schema llama.cpp cannot convert: a 4xx
            H.log(f"llama-server refused {row['id']}: {e}")
            continue
        rates.append(r.get("timings", {}).get("predicted_per_second") or 0.0)
        if r["choices"][0].get("finish_reason") != "stop":
            continue
        complete += 1
        done_rates.append(rates[-1])
        try:
            value = json.loads(r["choices"][0]["message"]["content"])
        except (ValueError, KeyError, TypeError):
            continue
        parsed += 1
        ok += valid(row["schema"], value) if valid is not None else 1
    return {
        "tok_s": H.median(rates),
        "tok_s_complete": H.median(done_rates),
        "answered": len(rates),
        "complete": complete,
        "json": parsed,
        "valid": ok if valid else None,
    }
