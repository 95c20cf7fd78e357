"""``python -m eval COMMAND [TOOL] ARGS``: the evaluation tools, a few entry points over one harness.

Each command groups tools that answer one question; its first tool is the default (``python -m
eval bench ARGS`` = ``python -m eval bench real ARGS``). Every tool is a thin command line over
:mod:`eval.harness` (engines, daemons, timing, percentiles, prompts, reports) and also runs as its
module (``python -m eval.bench_real ...``), which eval/gpu_check.sh and older notes use.
``python -m eval`` lists them; ``python -m eval COMMAND [TOOL] --help`` explains one.
"""

from __future__ import annotations

import importlib
import sys

# command -> {tool: (module, what it measures)}; a command's first tool is its default
COMMANDS = {
    "bench": {
        "real": ("eval.bench_real", "decode speed on Spec-Bench: specd vs transformers, llama.cpp, CTranslate2"),
        "groups": ("eval.bench_groups", "groups of B requests started together: makespan and each one's completion"),
        "tp": ("eval.bench_tp", "tensor parallelism: TP=2 vs TP=1, decode tokens/s and the collectives' cost"),
        "json": ("eval.bench_constrained", "structured outputs on JSONSchemaBench: validity, mask cost, auto vs plain"),
        "scale": ("eval.bench_scale", "1.7-8B random-weight GGUFs: plain decode vs llama.cpp, row costs, the floor"),
        "startup": ("eval.bench_startup", "specd serve --target FILE: start to /readyz 200, warm and on a first load"),
        "served": ("eval.bench_served", "specd serve vs llama-server on one GGUF: one streaming client's decode tok/s"),
    },
    "perplexity": {"": ("eval.perplexity", "perplexity of a GGUF on a text as llama-perplexity scores it, and vs it")},
    "accept": {
        "rates": ("eval.acceptance", "acceptance per category and mode, speedup over target-only, theory check"),
        "methods": ("eval.bench_head", "head / draft / prompt lookup / hybrid / auto per category (built-in model)"),
        "heads": ("eval.head_agreement", "feature heads' top-1 agreement with their target, offline, per category"),
    },
    "load": {
        "soak": ("eval.soak", "N streaming clients for T minutes: every delta checked, memory flat, KV freed"),
        "latency": ("eval.bench_latency", "interactive latency under batch load, turn-2 TTFT, tokens/s vs concurrency"),
        "http": ("eval.bench_http", "OpenAI HTTP (SSE) and both websockets vs in-process; previous_response_id"),
        "server": ("eval.bench_server", "specd's websocket vs in-process tokens/s and TTFT, A/A control"),
        "hostile": ("eval.hostile", "hostile request mixes and injected faults against the engine's oracle"),
    },
    "costs": {
        "step": ("eval.step_costs", "the target's prefill chunks and W-row decode steps outside the engine"),
        "head": ("eval.head_costs", "a feature-head step piece by piece next to the target's"),
        "grammar": ("eval.grammar_libs", "xgrammar vs llguidance on JSONSchemaBench: compile and mask times"),
        "masks": ("eval.structured_costs", "specd.structured's per-step work: tree masks, applying, forced tokens"),
    },
    "serve-check": {"": ("eval.serve_check", "start specd serve, ask /readyz and /healthz, stop it")},
    "train-demo": {"": ("eval.train_demo_pair", "train the demo pair (models/demo) on GSM8K")},
    "gpu": {"": ("eval.gpu_check", "paged tree-attention timings on a GPU (--dry-run: Triton interpreter, CPU)")},
}
MAKE = {"bench": "make bench, make bench-scale", "accept": "make eval", "load": "make soak: load soak"}
MAKE["serve-check"] = "make run SMOKE=1"


def usage() -> str:
    lines = [__doc__.split("\n\n")[0], "", "commands (a command's first tool is its default):"]
    for cmd, tools in COMMANDS.items():
        head = f"  {cmd}" + (f"    [{MAKE[cmd]}]" if cmd in MAKE else "")
        lines.append(head)
        for tool, (module, what) in tools.items():
            lines.append(f"    {(tool or '-'):8} {what}  ({module})")
    return "\n".join(lines)


def resolve(args: list) -> tuple:
    """``(command words, module, the tool's own arguments)`` for ``args`` = COMMAND [TOOL] ARGS;
    ValueError for an unknown command."""
    if not args or args[0] not in COMMANDS:
        raise ValueError(f"unknown command {args[0]!r}" if args else "no command")
    tools = COMMANDS[args[0]]
    if len(args) > 1 and args[1] in tools and args[1]:
        words, rest = args[:2], args[2:]
        return " ".join(words), tools[args[1]][0], rest
    return args[0], next(iter(tools.values()))[0], args[1:]


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"], ["help"]):
        print(usage())
        return 0
    try:
        words, module, rest = resolve(args)
    except ValueError as e:
        print(f"python -m eval: {e}\n\n{usage()}", file=sys.stderr)
        return 2
    sys.argv = [f"python -m eval {words}", *rest]  # the tool sees only its own arguments (argparse, --dry-run)
    rc = importlib.import_module(module).main(rest)
    return rc if isinstance(rc, int) else 0  # (a tool may return its results instead of a status)


if __name__ == "__main__":
    sys.exit(main())
