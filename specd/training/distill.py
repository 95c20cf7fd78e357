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

This module is a training tool: it uses ``transformers`` to load the target. The same loss and
training loop are used by ``eval/train_demo_pair.py`` to build the built-in demo pair.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = [
    "distill",
    "add_distill_args",
    "run_distill",
    "kd_loss",
    "make_draft_config",
    "build_draft",
    "train_draft",
    "greedy_agreement",
    "heldout_loss",
    "load_corpus_texts",
    "self_generate",
    "TokenStream",
    "DistillResult",
]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


# --------------------------------------------------------------------------------------------
# loss
# --------------------------------------------------------------------------------------------


def kd_loss(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    *,
    kl_weight: float = 1.0,
    ce_weight: float = 0.1,
    temperature: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Distillation loss, averaged over (masked) positions.

    ``draft_logits``/``target_logits``: ``[B, T, V]`` at the same positions (logits predicting the
    next token). ``labels``: ``[B, T]`` next-token ids for the CE term (``-100`` = ignore).
    ``mask``: ``[B, T]`` bool/float, positions that count (defaults to ``labels != -100`` or all).

    Returns ``{"loss", "kl", "ce"}``; ``kl`` is KL(p_target || p_draft) in nats per token.
    """
    V = min(draft_logits.shape[-1], target_logits.shape[-1])
    d = draft_logits[..., :V].float()
    t = target_logits[..., :V].float().detach()
    if temperature != 1.0:
        d = d / temperature
        t = t / temperature
    if mask is None:
        mask = (labels != -100) if labels is not None else torch.ones(d.shape[:-1], dtype=torch.bool, device=d.device)
    m = mask.to(d.dtype)
    denom = m.sum().clamp_min(1.0)
    logp_d = F.log_softmax(d, dim=-1)
    logp_t = F.log_softmax(t, dim=-1)
    kl_tok = (logp_t.exp() * (logp_t - logp_d)).sum(-1)
    kl = (kl_tok * m).sum() / denom
    if temperature != 1.0:
        kl = kl * (temperature**2)
    if labels is not None and ce_weight:
        lab = labels.clone()
        lab[~mask.bool()] = -100
        lab = torch.where(lab >= V, torch.full_like(lab, -100), lab)
        ce = F.nll_loss(logp_d.reshape(-1, V), lab.reshape(-1), ignore_index=-100, reduction="sum") / denom
    else:
        ce = torch.zeros((), device=d.device)
    loss = kl_weight * kl + ce_weight * ce
    return {"loss": loss, "kl": kl.detach(), "ce": ce.detach()}


# --------------------------------------------------------------------------------------------
# draft construction
# --------------------------------------------------------------------------------------------


def _target_head_dim(cfg) -> int:
    hd = getattr(cfg, "head_dim", None)
    return int(hd) if hd else cfg.hidden_size // cfg.num_attention_heads


def _rope_parameters(cfg) -> dict:
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and rp:
        return dict(rp)
    rs = getattr(cfg, "rope_scaling", None)
    out = dict(rs) if isinstance(rs, dict) else {"rope_type": "default"}
    out.setdefault("rope_type", out.pop("type", "default"))
    out["rope_theta"] = float(getattr(cfg, "rope_theta", 10000.0) or 10000.0)
    return out


def make_draft_config(
    target_config, *, layers: int = 1, hidden_size: int | None = None, max_position_embeddings: int | None = None
):
    """A ``LlamaConfig`` for a draft of ``target_config`` (a Llama, Qwen2 or Mistral config)."""
    from transformers import LlamaConfig

    tc = target_config
    H = int(hidden_size or tc.hidden_size)
    t_hd = _target_head_dim(tc)
    if H == tc.hidden_size:
        n_heads, n_kv, head_dim = tc.num_attention_heads, (tc.num_key_value_heads or tc.num_attention_heads), t_hd
        inter = tc.intermediate_size
    else:
        head_dim = t_hd if H % t_hd == 0 else 64 if H % 64 == 0 else H // max(1, H // 64) if H >= 64 else H
        n_heads = max(1, H // head_dim)
        head_dim = H // n_heads
        ratio = max(1, tc.num_attention_heads // (tc.num_key_value_heads or tc.num_attention_heads))
        n_kv = n_heads // ratio if n_heads % ratio == 0 and n_heads >= ratio else n_heads
        inter = int(round(tc.intermediate_size * H / tc.hidden_size / 8.0)) * 8 or 8
    # Qwen2 has q/k/v biases: give the draft biases too so target layers can be copied.
    attn_bias = bool(getattr(tc, "attention_bias", False)) or getattr(tc, "model_type", "") == "qwen2"
    eos = getattr(tc, "eos_token_id", None)
    cfg = LlamaConfig(
        vocab_size=tc.vocab_size,
        hidden_size=H,
        intermediate_size=inter,
        num_hidden_layers=int(layers),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        hidden_act=getattr(tc, "hidden_act", "silu"),
        max_position_embeddings=int(max_position_embeddings or tc.max_position_embeddings),
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
        rope_parameters=_rope_parameters(tc),
        attention_bias=attn_bias,
        mlp_bias=False,
        tie_word_embeddings=bool(getattr(tc, "tie_word_embeddings", False)),
        bos_token_id=getattr(tc, "bos_token_id", None),
        eos_token_id=eos,
        pad_token_id=getattr(tc, "pad_token_id", None),
    )
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def _inner(model):
    return getattr(model, "model", model)


def build_draft(
    target,
    *,
    layers: int = 1,
    hidden_size: int | None = None,
    copy_embeddings: bool = True,
    freeze_embeddings: bool = True,
    copy_layers: bool = True,
    seed: int | None = None,
):
    """Create a ``LlamaForCausalLM`` draft for ``target``; copy what fits (see module doc).

    Returns ``(draft, info)`` where ``info`` says what was copied/frozen.
    """
    from transformers import LlamaForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    cfg = make_draft_config(target.config, layers=layers, hidden_size=hidden_size)
    draft = LlamaForCausalLM(cfg).float()
    info: dict = {
        "copied_embeddings": False,
        "copied_lm_head": False,
        "copied_norm": False,
        "copied_layers": [],
        "frozen": [],
    }
    tin, din = _inner(target), _inner(draft)
    same_h = cfg.hidden_size == target.config.hidden_size
    with torch.no_grad():
        if copy_embeddings and same_h:
            te = tin.embed_tokens.weight
            if te.shape == din.embed_tokens.weight.shape:
                din.embed_tokens.weight.copy_(te.float())
                info["copied_embeddings"] = True
            th = target.get_output_embeddings().weight
            dh = draft.get_output_embeddings().weight
            if th.shape == dh.shape and dh is not din.embed_tokens.weight:
                dh.copy_(th.float())
                info["copied_lm_head"] = True
            elif dh is din.embed_tokens.weight:
                info["copied_lm_head"] = info["copied_embeddings"]
            if hasattr(tin, "norm") and tin.norm.weight.shape == din.norm.weight.shape:
                din.norm.weight.copy_(tin.norm.weight.float())
                info["copied_norm"] = True
        if copy_layers and same_h:
            for i in range(min(layers, len(tin.layers))):
                src = {k: v.float() for k, v in tin.layers[i].state_dict().items()}
                dst = din.layers[i].state_dict()
                if all(k in dst and dst[k].shape == v.shape for k, v in src.items()):
                    missing = [k for k in dst if k not in src]
                    if all(k.endswith("bias") for k in missing):
                        for k in missing:
                            src[k] = torch.zeros_like(dst[k])
                        din.layers[i].load_state_dict(src)
                        info["copied_layers"].append(i)
    if freeze_embeddings and info["copied_embeddings"]:
        din.embed_tokens.weight.requires_grad_(False)
        info["frozen"].append("embed_tokens")
        if info["copied_lm_head"]:
            draft.get_output_embeddings().weight.requires_grad_(False)
            info["frozen"].append("lm_head")
    return draft, info


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


def _render_messages(tokenizer, messages: list[dict]) -> str:
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception:  # noqa: BLE001 - fall back to plain text for odd templates
            pass
    return "\n\n".join(m["content"] for m in messages)


def load_corpus_texts(path: str | os.PathLike, tokenizer=None, *, max_records: int | None = None) -> list[str]:
    """Read a corpus into a list of documents.

    ``.jsonl``/``.json`` lines: ``text``; ``question`` + ``answer``; ``messages`` (list of
    ``{"role","content"}``); ``turns`` (list of strings alternating user/assistant, or of
    message dicts). Chat-like records are rendered with the tokenizer's chat template when it has
    one. Anything else: the whole file is one plain-text document.
    """
    p = Path(path)
    if p.suffix.lower() not in (".jsonl", ".json"):
        return [p.read_text(encoding="utf-8", errors="replace")]
    docs: list[str] = []
    with p.open(encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if isinstance(rec, str):
                docs.append(rec)
            elif "text" in rec and isinstance(rec["text"], str):
                docs.append(rec["text"])
            elif "question" in rec and "answer" in rec:
                msgs = [
                    {"role": "user", "content": str(rec["question"])},
                    {"role": "assistant", "content": str(rec["answer"])},
                ]
                docs.append(
                    _render_messages(tokenizer, msgs)
                    if tokenizer is not None
                    else msgs[0]["content"] + "\n" + msgs[1]["content"]
                )
            elif "messages" in rec or "turns" in rec:
                turns = rec.get("messages", rec.get("turns"))
                msgs = []
                for i, t in enumerate(turns):
                    if isinstance(t, dict):
                        msgs.append(
                            {
                                "role": t.get("role", "user" if i % 2 == 0 else "assistant"),
                                "content": str(t.get("content", "")),
                            }
                        )
                    else:
                        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": str(t)})
                if msgs:
                    docs.append(
                        _render_messages(tokenizer, msgs)
                        if tokenizer is not None
                        else "\n\n".join(m["content"] for m in msgs)
                    )
            if max_records and len(docs) >= max_records:
                break
    return docs


@dataclass
class TokenStream:
    """A flat stream of token ids; batches are random ``seq_len + 1`` windows from it."""

    ids: torch.Tensor  # 1-D long

    @classmethod
    def from_texts(cls, texts: Sequence[str], tokenizer, *, add_bos: bool = True) -> TokenStream:
        bos = getattr(tokenizer, "bos_token_id", None)
        bos_tok = getattr(tokenizer, "bos_token", None)
        out: list[int] = []
        for t in texts:
            ids = tokenizer(t, add_special_tokens=False)["input_ids"]
            if add_bos and bos is not None and not (bos_tok and t.startswith(bos_tok)):
                out.append(bos)
            out.extend(ids)
        return cls(torch.tensor(out, dtype=torch.long))

    def __len__(self) -> int:
        return int(self.ids.numel())

    def split(self, heldout_frac: float = 0.05, min_heldout: int = 0) -> tuple[TokenStream, TokenStream]:
        n = len(self)
        h = max(int(n * heldout_frac), min_heldout)
        h = min(h, n // 2)
        return TokenStream(self.ids[: n - h]), TokenStream(self.ids[n - h :])

    def batch(self, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
        n = len(self)
        L = min(seq_len + 1, n)
        starts = torch.randint(0, n - L + 1, (batch_size,), generator=gen)
        return torch.stack([self.ids[s : s + L] for s in starts.tolist()])

    def windows(self, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
        L = seq_len + 1
        k = len(self) // L
        if max_windows is not None:
            k = min(k, max_windows)
        if k == 0:
            return self.ids[None, :]
        return self.ids[: k * L].view(k, L)


@torch.no_grad()
def self_generate(
    target,
    tokenizer,
    *,
    n_samples: int,
    length: int,
    batch_size: int = 32,
    temperature: float = 1.0,
    seed: int = 0,
    device: str | torch.device = "cpu",
    prompts: Sequence[str] | None = None,
    progress: bool = False,
) -> list[list[int]]:
    """Sample ``n_samples`` sequences of up to ``length`` tokens from ``target``.

    Each sample starts from BOS (or a prompt from ``prompts``, cycled), is sampled at
    ``temperature`` with no top-k/top-p truncation, and keeps going past EOS (the target's
    distribution after EOS is still what the draft will see when a server batch runs on); the
    returned token lists include the starting tokens.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    bos = (
        tokenizer.bos_token_id
        if tokenizer is not None and tokenizer.bos_token_id is not None
        else target.config.bos_token_id
    )
    if bos is None:
        bos = 0
    out: list[list[int]] = []
    it = range(0, n_samples, batch_size)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n_samples, desc="self-generate", unit="seq")
    import inspect

    # transformers >= 5.2x calls the KV cache `cache`; older releases `past_key_values`.
    cache_kw = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    was_training = target.training
    target.eval()
    for b0 in it:
        bs = min(batch_size, n_samples - b0)
        if prompts:
            starts = [
                tokenizer(prompts[(b0 + i) % len(prompts)], add_special_tokens=True)["input_ids"] for i in range(bs)
            ]
            plen = min(len(s) for s in starts)
            starts = [s[:plen] for s in starts]
            ids = torch.tensor(starts, dtype=torch.long, device=device)
        else:
            ids = torch.full((bs, 1), int(bos), dtype=torch.long, device=device)
        past = None
        cur = ids
        seqs = ids
        for _ in range(max(0, length - ids.shape[1])):
            o = target(input_ids=cur, use_cache=True, **({cache_kw: past} if past is not None else {}))
            past = o.get(cache_kw) if cache_kw in o else o.get("past_key_values", o.get("cache"))
            logits = o.logits[:, -1, :].float()
            if temperature <= 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                probs = torch.softmax(logits / temperature, dim=-1).cpu()
                nxt = torch.multinomial(probs, 1, generator=g).to(device)
            seqs = torch.cat([seqs, nxt], dim=1)
            cur = nxt
        out.extend(seqs.cpu().tolist())
        if bar is not None:
            bar.update(bs)
    if bar is not None:
        bar.close()
    target.train(was_training)
    return out


# --------------------------------------------------------------------------------------------
# training and evaluation
# --------------------------------------------------------------------------------------------


def _logits(model, ids: torch.Tensor, autocast_dtype=None) -> torch.Tensor:
    if autocast_dtype is not None and ids.device.type == "cuda":
        with torch.autocast("cuda", dtype=autocast_dtype):
            return model(input_ids=ids, use_cache=False).logits
    return model(input_ids=ids, use_cache=False).logits


def lr_at(step: int, total: int, lr: float, warmup: int, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return lr * (step + 1) / max(1, warmup)
    p = (step - warmup) / max(1, total - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def train_draft(
    target,
    draft,
    next_batch: Callable[[int], torch.Tensor],
    *,
    steps: int,
    lr: float = 1e-3,
    warmup: int | None = None,
    weight_decay: float = 0.0,
    kl_weight: float = 1.0,
    ce_weight: float = 0.1,
    grad_clip: float = 1.0,
    device: str | torch.device = "cpu",
    progress: bool = True,
    log_every: int = 0,
    log: Callable[[str], None] = print,
    desc: str = "distill",
) -> list[dict]:
    """Distil ``draft`` from ``target`` for ``steps`` steps.

    ``next_batch(step)`` returns ``[B, T+1]`` token ids (CPU or device). Loss per step is
    ``kd_loss`` on positions ``0..T-1`` (predicting tokens ``1..T``). Returns per-step history.
    """
    device = torch.device(device)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    params = [p for p in draft.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    warmup = max(1, steps // 20) if warmup is None else warmup
    target.eval()
    draft.train()
    hist: list[dict] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc=desc, unit="step", dynamic_ncols=True)
    ema = None
    for step in range(steps):
        cur_lr = lr_at(step, steps, lr, warmup)
        for gparam in opt.param_groups:
            gparam["lr"] = cur_lr
        batch = next_batch(step).to(device)
        x, y = batch[:, :-1], batch[:, 1:]
        with torch.no_grad():
            t_logits = _logits(target, x, autocast)
        d_logits = _logits(draft, x, autocast)
        out = kd_loss(d_logits, t_logits, y, kl_weight=kl_weight, ce_weight=ce_weight)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        rec = {"step": step, "loss": out["loss"].item(), "kl": float(out["kl"]), "ce": float(out["ce"]), "lr": cur_lr}
        hist.append(rec)
        ema = rec["loss"] if ema is None else 0.95 * ema + 0.05 * rec["loss"]
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{ema:.3f}", kl=f"{rec['kl']:.3f}", ce=f"{rec['ce']:.3f}")
        if log_every and (step % log_every == 0 or step == steps - 1):
            log(
                f"[{desc}] step {step}/{steps} loss {rec['loss']:.4f} kl {rec['kl']:.4f} ce {rec['ce']:.4f} lr "
                f"{cur_lr:.2e}"
            )
    if bar is not None:
        bar.close()
    draft.eval()
    return hist


@torch.no_grad()
def greedy_agreement(
    draft, target, windows: torch.Tensor, *, batch_size: int = 16, device="cpu", mask: torch.Tensor | None = None
) -> float:
    """Fraction of positions where ``argmax draft == argmax target`` (teacher forcing on ``windows``).

    ``windows``: ``[N, T]`` token ids; ``mask`` optional ``[N, T]`` bool of positions to count.
    """
    device = torch.device(device)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    agree = 0.0
    total = 0.0
    V = min(draft.config.vocab_size, target.config.vocab_size)
    for i in range(0, windows.shape[0], batch_size):
        x = windows[i : i + batch_size].to(device)
        a = _logits(draft, x, autocast)[..., :V].argmax(-1)
        b = _logits(target, x, autocast)[..., :V].argmax(-1)
        eq = (a == b).float()
        if mask is not None:
            m = mask[i : i + batch_size].to(device).float()
            agree += float((eq * m).sum())
            total += float(m.sum())
        else:
            agree += float(eq.sum())
            total += eq.numel()
    return agree / max(total, 1.0)


@torch.no_grad()
def heldout_loss(
    model, windows: torch.Tensor, *, batch_size: int = 16, device="cpu", mask: torch.Tensor | None = None
) -> float:
    """Mean next-token cross-entropy (nats/token) of ``model`` on ``windows`` ``[N, T]``.

    ``mask`` (``[N, T]``, optional) marks valid tokens; a target token counts when it and the
    token before it are valid.
    """
    device = torch.device(device)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    tot = 0.0
    cnt = 0.0
    for i in range(0, windows.shape[0], batch_size):
        x = windows[i : i + batch_size].to(device)
        logits = _logits(model, x[:, :-1], autocast).float()
        y = x[:, 1:].clone()
        if mask is not None:
            m = mask[i : i + batch_size].to(device)
            valid = m[:, 1:] & m[:, :-1]
            y[~valid] = -100
        tot += float(
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100, reduction="sum")
        )
        cnt += float((y != -100).sum())
    return tot / max(cnt, 1.0)


# --------------------------------------------------------------------------------------------
# saving
# --------------------------------------------------------------------------------------------


def save_draft(
    draft,
    out_dir: str | os.PathLike,
    *,
    target_dir: str | os.PathLike | None = None,
    tokenizer=None,
    dtype: torch.dtype | None = None,
    generation_config=None,
) -> None:
    """Save ``draft`` as an HF checkpoint; copy tokenizer files (and generation config) from the target."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for p in draft.parameters():
        p.requires_grad_(True)
    m = draft
    if dtype is not None and dtype != torch.float32:
        import copy

        m = copy.deepcopy(draft).to(dtype)
    m.config.dtype = dtype or torch.float32
    m.save_pretrained(out)
    copied = False
    if target_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(target_dir) / name
            if src.is_file():
                shutil.copyfile(src, out / name)
                copied = True
    if not copied and tokenizer is not None:
        tokenizer.save_pretrained(out)
    if generation_config is not None:
        generation_config.save_pretrained(out)


def _target_generation_config(target_dir, cfg):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(target_dir)
    except Exception:  # noqa: BLE001
        return GenerationConfig(
            bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id
        )


# --------------------------------------------------------------------------------------------
# the tool
# --------------------------------------------------------------------------------------------


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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log = log or (lambda s: print(s, flush=True))
    t0 = time.time()
    random.seed(seed)
    torch.manual_seed(seed)
    dev = _pick_device(device)
    tok = AutoTokenizer.from_pretrained(target_dir)
    load_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=load_dtype).to(dev)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    tcfg = target.config
    max_pos = int(getattr(tcfg, "max_position_embeddings", 2048) or 2048)
    seq_len = min(seq_len, max_pos - 1)

    # ---- data
    gen = torch.Generator().manual_seed(seed)
    if corpus is not None:
        texts = load_corpus_texts(corpus, tok)
        stream = TokenStream.from_texts(texts, tok)
        train_s, held_s = stream.split(heldout_frac, min_heldout=(seq_len + 1) * 4)
        held_windows = held_s.windows(seq_len, max_windows=64)
        train_tokens = len(train_s)
        log(
            f"[distill] corpus {corpus}: {len(texts)} docs, {len(stream)} tokens (train {len(train_s)}, held-out "
            f"{len(held_s)})"
        )

        def next_batch(step: int) -> torch.Tensor:
            return train_s.batch(batch_size, seq_len, gen)

    else:
        n_held = max(8, int(round(self_generate_samples * heldout_frac)))
        log(
            f"[distill] no corpus: sampling {self_generate_samples}+{n_held} sequences of {seq_len + 1} tokens from "
            "the target"
        )
        seqs = self_generate(
            target,
            tok,
            n_samples=self_generate_samples + n_held,
            length=seq_len + 1,
            batch_size=64 if dev.type == "cpu" else 128,
            temperature=self_generate_temperature,
            seed=seed,
            device=dev,
            progress=progress,
        )
        data = torch.tensor(seqs, dtype=torch.long)
        train_data, held_windows = data[:self_generate_samples], data[self_generate_samples:]
        train_tokens = int(train_data.numel())

        def next_batch(step: int) -> torch.Tensor:
            idx = torch.randint(0, train_data.shape[0], (batch_size,), generator=gen)
            return train_data[idx]

    # ---- draft
    draft, info = build_draft(
        target,
        layers=layers,
        hidden_size=hidden_size,
        freeze_embeddings=freeze_embeddings,
        copy_layers=copy_layers,
        seed=seed,
    )
    draft.to(dev)
    n_params = sum(p.numel() for p in draft.parameters())
    n_train = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    log(
        f"[distill] draft: {layers} layer(s), d={draft.config.hidden_size}, {n_params / 1e6:.3f}M params "
        f"({n_train / 1e6:.3f}M trainable); copied {info}"
    )
    before = greedy_agreement(draft, target, held_windows, device=dev)
    log(f"[distill] held-out greedy agreement before training: {before:.4f}")

    hist = train_draft(
        target,
        draft,
        next_batch,
        steps=steps,
        lr=lr,
        kl_weight=kl_weight,
        ce_weight=ce_weight,
        device=dev,
        progress=progress,
        log_every=0 if progress else max(1, steps // 10),
        log=log,
    )
    after = greedy_agreement(draft, target, held_windows, device=dev)
    with torch.no_grad():
        x = held_windows[:16].to(dev)
        kl_final = float(kd_loss(_logits(draft, x), _logits(target, x), kl_weight=1.0, ce_weight=0.0)["kl"])
    log(f"[distill] held-out greedy agreement after training: {after:.4f} (KL {kl_final:.4f})")

    # ---- save
    if save_dtype is None:
        sd = getattr(tcfg, "dtype", None) or getattr(tcfg, "torch_dtype", None) or torch.float32
        sd = getattr(torch, sd) if isinstance(sd, str) else sd
    else:
        sd = getattr(torch, save_dtype)
    draft.cpu()
    gcfg = _target_generation_config(target_dir, draft.config)
    save_draft(draft, out_dir, target_dir=target_dir, tokenizer=tok, dtype=sd, generation_config=gcfg)
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
    (Path(out_dir) / "distill_report.json").write_text(
        json.dumps(
            {
                **res.summary(),
                "target": str(target_dir),
                "corpus": str(corpus) if corpus else None,
                "seq_len": seq_len,
                "batch_size": batch_size,
                "lr": lr,
                "seed": seed,
                "kl_weight": kl_weight,
                "ce_weight": ce_weight,
                "layers": layers,
                "hidden_size": draft.config.hidden_size,
            },
            indent=2,
        )
        + "\n"
    )
    log(f"[distill] saved draft to {out_dir} ({res.wall_s:.1f}s)")
    return res


def add_distill_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``specd distill`` arguments to a (sub)parser."""
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
    r.add_argument("--max-new-tokens", type=int, default=160)
    r.add_argument("--data-out", default=None, help="also write the generated replies here (JSON)")
    r.add_argument("--data-in", default=None, help="train on replies an earlier run wrote (--data-out)")
    return p


def run_distill(args: argparse.Namespace) -> int:
    """Entry point for ``specd distill`` (``args`` from :func:`add_distill_args`)."""
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    if getattr(args, "draft_vocab", 0):
        from specd.training.distill_reduced import run

        return run(args)
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
    p = argparse.ArgumentParser(prog="specd distill", description=__doc__.split("\n\n")[0])
    add_distill_args(p)
    return run_distill(p.parse_args(list(argv) if argv is not None else None))


if __name__ == "__main__":
    raise SystemExit(main())
