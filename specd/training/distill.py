"""Draft-model distillation: train a small Llama draft for a Llama/Qwen2/Mistral target.

``specd distill --target DIR --out DIR [--corpus PATH] [--layers N] [--hidden-size D] ...``

The draft is a ``LlamaForCausalLM`` sharing the target's tokenizer. By default it has one decoder
layer at the target's hidden size; the target's token embeddings, final norm and LM head are copied
(and the embeddings/LM head frozen) when the shapes allow, and the draft's decoder layers are
initialised from the target's first layers. The loss is

    kl_weight * KL(p_target || p_draft) + ce_weight * CE(data, p_draft)

per token, computed on the target's full soft distribution (teacher forcing on the corpus).

Training data is either a corpus (``.txt``: the text is tokenised and cut into windows; ``.jsonl``:
records with ``text``, ``question``+``answer``, ``messages`` or ``turns`` fields, rendered with the
target's chat template when it has one) or, when no corpus is given, text sampled from the target
itself (self-distillation data).

This module is the recipe: it uses ``transformers`` to load the target, then ``data`` (the
training windows), ``draft`` (the initial draft), ``loop`` (training and held-out agreement) and
``export`` (the checkpoint and ``distill_report.json``). The same loss and training loop are used by
``eval/train_demo_pair.py`` to build the built-in demo pair; ``specd distill``'s flags are in
``specd.training.cli``.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from specd.training.data import TokenStream, load_corpus_texts, self_generate
from specd.training.draft import build_draft
from specd.training.export import save_draft, target_generation_config
from specd.training.loop import greedy_agreement, kd_loss, model_logits, train_draft

__all__ = ["distill", "DistillResult"]


@dataclass
class DistillResult:
    out_dir: str
    steps: int
    train_tokens: int
    heldout_agreement_before: float
    heldout_agreement_after: float
    heldout_kl_final: float
    wall_s: float
    copied: dict = field(default_factory=dict)
    history: list = field(default_factory=list)

    def summary(self) -> dict:
        d = dict(self.__dict__)
        d.pop("history")
        return d


def _pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def distill(
    target_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    corpus: str | os.PathLike | None = None,
    layers: int = 1,
    hidden_size: int | None = None,
    steps: int = 2000,
    seq_len: int = 256,
    batch_size: int = 16,
    lr: float = 1e-3,
    seed: int = 0,
    device: str = "auto",
    kl_weight: float = 1.0,
    ce_weight: float = 0.1,
    self_generate_samples: int = 512,
    self_generate_temperature: float = 1.0,
    freeze_embeddings: bool = True,
    copy_layers: bool = True,
    heldout_frac: float = 0.05,
    save_dtype: str | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> DistillResult:
    """Distil a draft for the HF checkpoint in ``target_dir`` and save it to ``out_dir``.

    ``corpus``: a ``.txt`` / ``.jsonl`` file (see :func:`load_corpus_texts`), or ``None`` to train
    on ``self_generate_samples`` sequences of ``seq_len + 1`` tokens sampled from the target at
    ``self_generate_temperature`` (plus a held-out set of ~``heldout_frac`` as many).
    ``save_dtype``: ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``None`` (the target's dtype).
    Returns a :class:`DistillResult` with greedy agreement before/after on held-out data.
    """
    s = SimpleNamespace(**locals())  # the call's settings (every parameter above), for the phases
    log = log or (lambda m: print(m, flush=True))
    t0 = time.time()
    random.seed(seed)
    torch.manual_seed(seed)
    dev = _pick_device(device)
    tok, target = _load_target(target_dir, dev)
    s.seq_len = min(seq_len, int(getattr(target.config, "max_position_embeddings", 2048) or 2048) - 1)
    next_batch, held_windows, train_tokens = _training_data(s, target, tok, dev, log)
    draft, info = _initial_draft(s, target, dev, log)
    hist, before, after, kl_final = _train(s, target, draft, next_batch, held_windows, dev, log)
    _save(draft, target, tok, target_dir, out_dir, save_dtype)
    res = DistillResult(
        out_dir=str(out_dir),
        steps=steps,
        train_tokens=train_tokens,
        heldout_agreement_before=before,
        heldout_agreement_after=after,
        heldout_kl_final=kl_final,
        wall_s=time.time() - t0,
        copied=info,
        history=hist,
    )
    _write_report(res, s, draft)
    log(f"[distill] saved draft to {out_dir} ({res.wall_s:.1f}s)")
    return res


def _training_data(s: SimpleNamespace, target, tok, dev, log) -> tuple:
    """(next_batch(step), held-out windows, training tokens): from the corpus, else sampled."""
    gen = torch.Generator().manual_seed(s.seed)
    if s.corpus is not None:
        return _corpus_data(s.corpus, tok, s.seq_len, s.batch_size, s.heldout_frac, gen, log)
    data = _sampled_data(target, tok, s, dev, log)
    return _sampled_batches(data, s.self_generate_samples, s.batch_size, gen)


def _initial_draft(s: SimpleNamespace, target, dev, log) -> tuple:
    """The draft before training (``draft.build_draft``), on ``dev``; (draft, what was copied)."""
    draft, info = build_draft(
        target,
        layers=s.layers,
        hidden_size=s.hidden_size,
        freeze_embeddings=s.freeze_embeddings,
        copy_layers=s.copy_layers,
        seed=s.seed,
    )
    draft.to(dev)
    n_params = sum(p.numel() for p in draft.parameters())
    n_train = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    log(
        f"[distill] draft: {s.layers} layer(s), d={draft.config.hidden_size}, {n_params / 1e6:.3f}M params "
        f"({n_train / 1e6:.3f}M trainable); copied {info}"
    )
    return draft, info


def _train(s: SimpleNamespace, target, draft, next_batch, held_windows, dev, log) -> tuple:
    """``loop.train_draft``, with held-out greedy agreement before and after (and the final KL)."""
    before = greedy_agreement(draft, target, held_windows, device=dev)
    log(f"[distill] held-out greedy agreement before training: {before:.4f}")
    hist = train_draft(
        target,
        draft,
        next_batch,
        steps=s.steps,
        lr=s.lr,
        kl_weight=s.kl_weight,
        ce_weight=s.ce_weight,
        device=dev,
        progress=s.progress,
        log_every=0 if s.progress else max(1, s.steps // 10),
        log=log,
    )
    after, kl_final = _heldout_after(draft, target, held_windows, dev)
    log(f"[distill] held-out greedy agreement after training: {after:.4f} (KL {kl_final:.4f})")
    return hist, before, after, kl_final


def _write_report(res: DistillResult, s: SimpleNamespace, draft) -> None:
    """``distill_report.json`` beside the draft: the result and the settings it was made with."""
    settings = {
        "target": str(s.target_dir),
        "corpus": str(s.corpus) if s.corpus else None,
        "seq_len": s.seq_len,
        "batch_size": s.batch_size,
        "lr": s.lr,
        "seed": s.seed,
        "kl_weight": s.kl_weight,
        "ce_weight": s.ce_weight,
        "layers": s.layers,
        "hidden_size": draft.config.hidden_size,
    }
    (Path(s.out_dir) / "distill_report.json").write_text(json.dumps({**res.summary(), **settings}, indent=2) + "\n")


def _load_target(target_dir, dev: torch.device) -> tuple:
    """(tokenizer, target) with transformers: frozen, eval mode, bf16 on a GPU, fp32 on a CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    load_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=load_dtype).to(dev)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return tok, target


def _corpus_data(corpus, tok, seq_len: int, batch_size: int, heldout_frac: float, gen, log) -> tuple:
    """(next_batch, held-out windows, training tokens) from a corpus: random windows of its
    training part; the held-out part's first 64 windows."""
    texts = load_corpus_texts(corpus, tok)
    stream = TokenStream.from_texts(texts, tok)
    train_s, held_s = stream.split(heldout_frac, min_heldout=(seq_len + 1) * 4)
    log(
        f"[distill] corpus {corpus}: {len(texts)} docs, {len(stream)} tokens (train {len(train_s)}, held-out "
        f"{len(held_s)})"
    )

    def next_batch(step: int) -> torch.Tensor:
        return train_s.batch(batch_size, seq_len, gen)

    return next_batch, held_s.windows(seq_len, max_windows=64), len(train_s)


def _sampled_data(target, tok, s: SimpleNamespace, dev, log) -> torch.Tensor:
    """``[samples + held-out, seq_len + 1]`` sequences sampled from the target (no corpus)."""
    samples = s.self_generate_samples
    n_held = max(8, int(round(samples * s.heldout_frac)))
    log(f"[distill] no corpus: sampling {samples}+{n_held} sequences of {s.seq_len + 1} tokens from the target")
    seqs = self_generate(
        target,
        tok,
        n_samples=samples + n_held,
        length=s.seq_len + 1,
        batch_size=64 if dev.type == "cpu" else 128,
        temperature=s.self_generate_temperature,
        seed=s.seed,
        device=dev,
        progress=s.progress,
    )
    return torch.tensor(seqs, dtype=torch.long)


def _sampled_batches(data: torch.Tensor, samples: int, batch_size: int, gen) -> tuple:
    """(next_batch: random rows of the first ``samples`` sequences, the rest held out, training tokens)."""
    train_data, held_windows = data[:samples], data[samples:]

    def next_batch(step: int) -> torch.Tensor:
        idx = torch.randint(0, train_data.shape[0], (batch_size,), generator=gen)
        return train_data[idx]

    return next_batch, held_windows, int(train_data.numel())


def _heldout_after(draft, target, held_windows: torch.Tensor, dev) -> tuple:
    """Held-out greedy agreement after training and the KL on the first 16 held-out windows."""
    after = greedy_agreement(draft, target, held_windows, device=dev)
    with torch.no_grad():
        x = held_windows[:16].to(dev)
        kl_final = float(kd_loss(model_logits(draft, x), model_logits(target, x), kl_weight=1.0, ce_weight=0.0)["kl"])
    return after, kl_final


def _save(draft, target, tok, target_dir, out_dir, save_dtype: str | None) -> None:
    """The draft as an HF checkpoint in ``save_dtype`` (None: the target's dtype)."""
    if save_dtype is None:
        tcfg = target.config
        sd = getattr(tcfg, "dtype", None) or getattr(tcfg, "torch_dtype", None) or torch.float32
        sd = getattr(torch, sd) if isinstance(sd, str) else sd
    else:
        sd = getattr(torch, save_dtype)
    draft.cpu()
    gcfg = target_generation_config(target_dir, draft.config)
    save_draft(draft, out_dir, target_dir=target_dir, tokenizer=tok, dtype=sd, generation_config=gcfg)
