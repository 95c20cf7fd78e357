"""``specd distill``: its flags (:func:`add_distill_args`) and entry point (:func:`run_distill`):
the full-vocabulary recipe (``specd.training.distill``), with ``--draft-vocab N`` the
reduced-vocabulary one (``specd.training.distill_reduced``), or with ``--kind head`` an EAGLE-style
feature head (``specd.training.head``). Nothing heavy is imported until a run
starts."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable

__all__ = ["add_distill_args", "run_distill", "main"]


def add_distill_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``specd distill`` arguments to a (sub)parser."""
    p.add_argument(
        "--kind",
        default="draft",
        choices=["draft", "head"],
        help="draft: a small draft model; head: an EAGLE-style feature head (specd.training.head; uses the "
        "reply flags below, --draft-vocab defaults to 8192)",
    )
    p.add_argument("--target", required=True, help="target checkpoint folder or .gguf (Llama/Qwen2/Mistral)")
    p.add_argument("--out", required=True, help="output folder for the draft checkpoint")
    p.add_argument("--corpus", default=None, help=".txt or .jsonl training text; default: text sampled from the target")
    p.add_argument("--layers", type=int, default=1, help="draft decoder layers (default 1)")
    p.add_argument("--hidden-size", type=int, default=None, help="draft hidden size (default: the target's)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--kl-weight", type=float, default=1.0)
    p.add_argument("--ce-weight", type=float, default=0.1)
    p.add_argument(
        "--self-generate-samples", type=int, default=512, help="sequences sampled from the target when no --corpus"
    )
    p.add_argument("--self-generate-temperature", type=float, default=1.0)
    p.add_argument("--train-embeddings", action="store_true", help="do not freeze the copied embeddings / LM head")
    p.add_argument(
        "--no-copy-layers",
        action="store_true",
        help="random-init the draft layers instead of copying the target's first layers",
    )
    p.add_argument("--save-dtype", default=None, choices=[None, "float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true")
    _add_reply_args(p)
    return p


def _add_reply_args(p: argparse.ArgumentParser) -> None:
    """The reply-data flags of the reduced-vocabulary draft and the feature head."""
    r = p.add_argument_group("reduced-vocabulary draft (specd.training.distill_reduced: a large-vocabulary target)")
    r.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="N > 0: a draft over the N tokens the target's replies use most, sharing the target's "
        "embeddings by reference (self-distillation on the target's greedy replies)",
    )
    r.add_argument("--prompts", default=None, help="JSONL with a 'question' field (e.g. GSM8K train)")
    r.add_argument("--prompt-count", type=int, default=256)
    r.add_argument("--self-prompts", type=int, default=64, help="questions the target writes itself")
    r.add_argument(
        "--tasks",
        default=None,
        help="more kinds of requests, KIND=N,...: write (a story, email, tips, ... about a subject), code, translate "
        "(a --prompts question), summarize / passage_qa (a --passages passage), rewrite (explain a --prompts "
        "worked answer), article (a news article on a --prompts story); then, quoting those replies: "
        "summarize_own ('Summarize: ' an article), rag_own (an article and a question), translate_back",
    )
    r.add_argument("--passages", default=None, help="plain text the summarize / passage_qa requests quote")
    r.add_argument(
        "--served",
        action="store_true",
        help="--kind head: replies and features from the target as `specd serve` runs it (a GGUF file's blocks, "
        "int8 activations on a CPU) instead of fp32 floats",
    )
    r.add_argument("--max-new-tokens", type=int, default=160)
    r.add_argument("--data-out", default=None, help="also write the generated replies here (JSON)")
    r.add_argument(
        "--data-in", default=None, help="train on replies earlier runs wrote (--data-out; comma-separated files)"
    )
    r.add_argument("--ttt-steps", type=int, default=3, help="--kind head: training-time-test unroll steps")
    r.add_argument("--features", default=None, help="--kind head: cache the target's features in this file")
    r.add_argument(
        "--train-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="--kind head: bfloat16 runs the training forward under bf16 autocast (fp32 weights and optimizer): "
        "several times faster on a CPU with AMX / AVX512-BF16 or on a GPU, slower on an AVX2-only CPU",
    )
    r.add_argument(
        "--init-from", default=None, help="--kind head: start from an earlier head's weights (same target and layers)"
    )


def run_distill(args: argparse.Namespace) -> int:
    """Entry point for ``specd distill`` (``args`` from :func:`add_distill_args`)."""
    import torch

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    if getattr(args, "kind", "draft") == "head":
        from specd.training.head import run as run_head

        return run_head(args)
    if getattr(args, "draft_vocab", 0):
        from specd.training.distill_reduced import run

        return run(args)
    from specd.training.distill import distill

    res = distill(
        args.target,
        args.out,
        corpus=args.corpus,
        layers=args.layers,
        hidden_size=args.hidden_size,
        steps=args.steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        device=args.device,
        kl_weight=args.kl_weight,
        ce_weight=args.ce_weight,
        self_generate_samples=args.self_generate_samples,
        self_generate_temperature=args.self_generate_temperature,
        freeze_embeddings=not args.train_embeddings,
        copy_layers=not args.no_copy_layers,
        save_dtype=args.save_dtype,
        progress=not args.no_progress,
    )
    print(json.dumps(res.summary(), indent=2))
    return 0


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="specd distill",
        description="Draft-model distillation: train a small Llama draft for a Llama/Qwen2/Mistral target.",
    )
    add_distill_args(p)
    return run_distill(p.parse_args(list(argv) if argv is not None else None))


if __name__ == "__main__":
    raise SystemExit(main())
