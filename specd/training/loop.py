"""The training loop and its measures: the distillation loss, the learning-rate schedule,
:func:`train_draft` (full-vocabulary drafts: KL to the target's distribution + CE on the data),
:func:`train_reduced` (reduced-vocabulary drafts: CE against the target's replies), and held-out
greedy agreement and loss.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specd.training.data import reply_batches
from specd.training.draft import DraftNet

__all__ = [
    "kd_loss",
    "lr_at",
    "model_logits",
    "train_draft",
    "greedy_agreement",
    "heldout_loss",
    "train_reduced",
    "reduced_agreement",
]


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


def model_logits(model, ids: torch.Tensor, autocast_dtype=None) -> torch.Tensor:
    if autocast_dtype is not None and ids.device.type == "cuda":
        with torch.autocast("cuda", dtype=autocast_dtype):
            return model(input_ids=ids, use_cache=False).logits
    return model(input_ids=ids, use_cache=False).logits


def lr_at(step: int, total: int, lr: float, warmup: int, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return lr * (step + 1) / max(1, warmup)
    p = (step - warmup) / max(1, total - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def _optimizer(draft, lr: float, weight_decay: float, device: torch.device):
    """AdamW over the trainable parameters (no decay on vectors); returns (optimizer, parameters)."""
    params = [p for p in draft.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    return opt, params


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
    ``kd_loss`` on positions ``0..T-1`` (predicting tokens ``1..T``); the learning rate follows
    :func:`lr_at` (``warmup`` default: 5% of the steps). Returns per-step history.
    """
    device = torch.device(device)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    opt, params = _optimizer(draft, lr, weight_decay, device)
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
        out = _train_step(
            target, draft, next_batch(step).to(device), opt, params, grad_clip, autocast, kl_weight, ce_weight
        )
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


def _train_step(target, draft, batch, opt, params, grad_clip, autocast, kl_weight, ce_weight) -> dict:
    """One optimizer step on ``batch`` (``[B, T+1]``); the step's ``kd_loss``."""
    x, y = batch[:, :-1], batch[:, 1:]
    with torch.no_grad():
        t_logits = model_logits(target, x, autocast)
    d_logits = model_logits(draft, x, autocast)
    out = kd_loss(d_logits, t_logits, y, kl_weight=kl_weight, ce_weight=ce_weight)
    opt.zero_grad(set_to_none=True)
    out["loss"].backward()
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()
    return out


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
        a = model_logits(draft, x, autocast)[..., :V].argmax(-1)
        b = model_logits(target, x, autocast)[..., :V].argmax(-1)
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
        logits = model_logits(model, x[:, :-1], autocast).float()
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


# reduced-vocabulary drafts ----------------------------------------------------------------------
def train_reduced(net: DraftNet, data: list, t2d: torch.Tensor, steps: int, batch: int, lr: float, seed: int) -> dict:
    """Cross-entropy against the target's next token on reply positions (AdamW, one-cycle
    schedule, clipping 1.0); ``{"final_loss", "train_seconds"}``."""
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    it = reply_batches(data, t2d, batch, random.Random(seed))
    t0, hist = time.perf_counter(), []
    for step in range(steps):
        x, y = next(it)
        loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        hist.append(loss.item())
        if step % 20 == 0 or step == steps - 1:
            print(
                f"step {step + 1}/{steps} loss {sum(hist[-20:]) / len(hist[-20:]):.3f} "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    return {"final_loss": round(sum(hist[-20:]) / len(hist[-20:]), 4), "train_seconds": round(time.perf_counter() - t0)}


@torch.no_grad()
def reduced_agreement(net: DraftNet, data: list, t2d: torch.Tensor) -> float:
    """Share of held-out reply positions where the draft's top token is the target's next token."""
    hit = tot = 0
    batches = reply_batches(data, t2d, 1, random.Random(0))
    for _ in range(len(data)):  # one pass
        x, y = next(batches)
        m = y != -100
        hit += int((net(x).argmax(-1)[m] == y[m]).sum())
        tot += int(m.sum())
    return hit / max(tot, 1)
