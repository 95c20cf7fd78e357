"""``specd distill --kind head``: train an EAGLE-style feature head (``specd.model.head``) for a target.

    specd distill --kind head --target TARGET --out DIR --draft-vocab 8192 [--prompts gsm8k.jsonl]
        [--ttt-steps 3] [--data-in replies.json[,more.json]] [--data-out replies.json]

Data is self-distillation, as for the reduced-vocabulary draft (``distill_reduced``): the target's
own greedy replies (``data.generate_replies``; never an evaluation set). The target then runs once
over every reply to record its features (the hidden states entering the head's layers, fp16 in
memory). Training is EAGLE-3's *training-time test*: the head is unrolled ``--ttt-steps`` steps,
step j feeding step j-1's own output hidden states (not the target's) exactly as drafting a tree
does, with cross-entropy against the target's next token on reply positions at every step
(weights 0.8^j). The vocabulary: the N tokens the replies use most (``data.pick_vocab``).
Initialisation: ``fc`` passes the high feature through, the layer's hidden-side projections, MLP
and norms are copied from the target's layer at the high feature, the embedding side is small noise.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specd.model.head import EagleHead, default_layers, head_config

__all__ = ["run", "new_head", "target_features", "train_head", "head_agreement", "head_agreements"]

TTT_DECAY = 0.8  # weight of unrolled step j's loss: 0.8^j (EAGLE's)


def new_head(target, d2t: torch.Tensor, layers: tuple | None = None, init: bool = True, seed: int = 0) -> EagleHead:
    """A head of the target's width for ``target`` (a ``LoadedModel``), fp32, bound to it with dense
    head rows; ``init``: from the target's weights (else the random init of an untrained head)."""
    tc = target.config
    layers = tuple(layers or default_layers(tc.num_layers))
    g = torch.Generator().manual_seed(seed)
    head = EagleHead(head_config(tc), layers, tc.hidden_size)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        if init:
            _init_from_target(head, target.model)
    lm = target.model.lm_head
    rows = lm.dequantize()[d2t] if hasattr(lm, "dequantize") else lm.weight.detach().float()[d2t]
    head.attach(target.model, d2t, rows.float())
    return head


def _init_from_target(head: EagleHead, tm) -> None:
    """fc = identity on the high feature; the layer's hidden half from the target layer there."""
    d, high = head.cfg.hidden_size, head.layers[-1]
    head.fc.weight.zero_()
    head.fc.weight[:, (len(head.layers) - 1) * d :] = torch.eye(d)
    blk = tm.layers[high]

    def dense(m) -> torch.Tensor:
        return m.dequantize() if hasattr(m, "dequantize") else m.weight.detach().float()

    head.qkv.weight[:, d:] = dense(blk.attn.qkv)
    head.o.weight.copy_(dense(blk.attn.o))
    if hasattr(blk.mlp, "gate_up"):  # (a mixture of experts has no one MLP to start from: it stays random)
        head.gate_up.weight.copy_(dense(blk.mlp.gate_up))
        head.down.weight.copy_(dense(blk.mlp.down))
    head.hidden_norm.weight.copy_(blk.input_norm.weight.float())
    head.post_norm.weight.copy_(blk.post_norm.weight.float())
    head.norm.weight.copy_(tm.norm.weight.float())


@torch.no_grad()
def target_features(target, data: list, layers: tuple) -> list:
    """The target's features of every position of every reply: ``[(tokens, prompt length, [n, F] fp16)]``."""
    from specd.engine.kv_cache import KVCache
    from specd.model.attention import build_metadata, get_backend

    c, dev = target.config, target.device
    backend = get_backend("auto", dev)  # on a CPU the kernel's (a quantized target: the fused layers)
    longest = max(len(t) for t, _ in data)
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, longest // 16 + 2, 16, target.dtype, dev)
    out, t0 = [], time.perf_counter()
    for k, (toks, p) in enumerate(data):
        s = cache.new_seq()
        s.reserve(len(toks))
        meta = build_metadata([len(toks)], [0], [s.blocks], s.slots(0, len(toks)), 16, dev)
        caps = dict.fromkeys(layers)
        target.model(torch.tensor(toks, device=dev), torch.arange(len(toks), device=dev), cache.kv, meta, backend, caps)
        out.append((toks, p, torch.cat([caps[i] for i in layers], dim=-1).half().cpu()))
        s.free()
        if (k + 1) % 64 == 0 or k + 1 == len(data):
            print(f"features: {k + 1}/{len(data)} replies ({time.perf_counter() - t0:.0f} s)", flush=True)
    return out


def _batch(rows: list, t2d: torch.Tensor, steps: int) -> tuple:
    """(features [B, T, F], tokens [B, T + steps - 1], labels [steps, B, T]) of replies ``rows``.
    Row p: features of p, token p + 1; step j's label: the reduced id of token p + 2 + j on reply
    positions (-100 elsewhere, past the end or outside the draft vocabulary)."""
    B, T = len(rows), max(len(t) for t, _, _ in rows) - 1
    feats = torch.zeros((B, T, rows[0][2].shape[1]))
    toks = torch.zeros((B, T + steps + 1), dtype=torch.long)
    lab = torch.full((steps, B, T), -100, dtype=torch.long)
    for b, (t, p, f) in enumerate(rows):
        n = len(t)
        feats[b, : n - 1] = f[: n - 1].float()
        toks[b, : n - 1] = torch.tensor(t[1:])
        ids = t2d[torch.tensor(t)]
        for j in range(steps):
            lo, hi = max(p - 2 - j, 0), n - 2 - j  # rows whose target p + 2 + j is a reply token
            if hi > lo:
                lab[j, b, lo:hi] = ids[lo + 2 + j : hi + 2 + j]
    return feats, toks[:, : T + steps - 1], lab


def _loss(head: EagleHead, rows: list, t2d: torch.Tensor, steps: int) -> tuple:
    """(weighted training-time-test loss, [per-step loss])."""
    feats, toks, lab = _batch(rows, t2d, steps)
    total, parts = torch.zeros(()), []
    for j, x in enumerate(head.unroll(feats, toks, steps)):
        m = lab[j] != -100
        loss = F.cross_entropy(head.logits(x[m]), lab[j][m]) if m.any() else torch.zeros(())
        total = total + TTT_DECAY**j * loss
        parts.append(float(loss.detach()))
    return total, parts


def train_head(
    head: EagleHead, data: list, t2d: torch.Tensor, steps: int, batch: int, lr: float, ttt: int, seed=0, bf16=False
):
    """AdamW with a one-cycle schedule over the head's own parameters; prints progress every 10
    steps; ``{"final_loss", "final_step_losses", "train_seconds"}``. ``bf16``: the forward under
    bf16 autocast (fp32 weights, optimizer and softmax): ~2.7x faster steps on a CPU with AMX."""
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    rng, order = random.Random(seed), list(range(len(data)))
    t0, hist, parts_hist = time.perf_counter(), [], []
    for step in range(steps):
        if step * batch % len(order) < batch:
            rng.shuffle(order)
        i = step * batch % len(order)
        with torch.autocast(head.fc.weight.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, parts = _loss(head, [data[k] for k in (order + order)[i : i + batch]], t2d, ttt)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        hist.append(float(loss.detach()))
        parts_hist.append(parts)
        if step % 10 == 0 or step == steps - 1:
            recent = [round(sum(col) / len(col), 3) for col in zip(*parts_hist[-10:])]
            print(f"step {step + 1}/{steps} loss {sum(hist[-10:]) / len(hist[-10:]):.3f} by step {recent} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    recent = [round(sum(col) / len(col), 4) for col in zip(*parts_hist[-20:])]
    return {
        "final_loss": round(sum(hist[-20:]) / len(hist[-20:]), 4),
        "final_step_losses": recent,
        "train_seconds": round(time.perf_counter() - t0),
    }


@torch.no_grad()
def head_agreements(head: EagleHead, data: list, t2d: torch.Tensor, steps: int = 1) -> tuple[list, list]:
    """(masked, unmasked), each per unrolled step j: the share of held-out reply positions where the
    head's top token is the target's token p + 2 + j (step 0: the first draft token; later steps
    feed the head's own hidden states, as deeper tree levels do). Masked leaves out positions whose
    token is outside the draft vocabulary (``t2d`` -100); unmasked counts them as misses: what the
    engine sees, since it never drafts such a token. One pass of the head serves both."""
    assert head.d2t is not None
    every, d2t = torch.arange(t2d.numel()), head.d2t.cpu()  # labels and predictions as target ids
    hit, tot = [[0] * steps, [0] * steps], [[0] * steps, [0] * steps]  # [masked, unmasked][step]
    for row in data:
        feats, toks, lab = _batch([row], every, steps)
        for j, x in enumerate(head.unroll(feats, toks, steps)):
            m = lab[j] != -100
            ok = d2t[head.logits(x[m]).argmax(-1).cpu()] == lab[j][m]
            inv = t2d[lab[j][m]] != -100  # the target's token is in the draft vocabulary
            hit[0][j], tot[0][j] = hit[0][j] + int((ok & inv).sum()), tot[0][j] + int(inv.sum())
            hit[1][j], tot[1][j] = hit[1][j] + int(ok.sum()), tot[1][j] + int(m.sum())
    masked, unmasked = ([h / max(t, 1) for h, t in zip(hs, ts)] for hs, ts in zip(hit, tot))
    return masked, unmasked


def head_agreement(head: EagleHead, data: list, t2d: torch.Tensor, steps: int = 1, oov_miss: bool = False) -> list:
    """``head_agreements``' masked figures, or with ``oov_miss`` its unmasked ones."""
    return head_agreements(head, data, t2d, steps)[int(oov_miss)]


def _replies(args) -> tuple:
    """(target LoadedModel, tokenizer, [(tokens, prompt length)]): generated, or read (--data-in).
    ``--served``: the target as ``specd serve`` runs it (its GGUF blocks, int8 activations on a
    CPU), for the replies and the features both."""
    from specd.training.data import generate_replies, parse_counts

    served = bool(getattr(args, "served", False))
    if args.data_in:
        from specd.model.loader import load_model

        if served:  # loaded as the engine loads it
            from specd.config import EngineConfig
            from specd.engine.builder import load_models

            target = load_models(EngineConfig(target=args.target, act_quant="auto"), None, None)[0]
        else:  # dense: faster over whole replies on a CPU than fp32 activations on quantized weights
            target = load_model(args.target, "cpu", "float32")
        data = [tuple(x) for f in args.data_in.split(",") for x in json.loads(Path(f).read_text())]
        return target, target.tokenizer, data
    tok, data, target = generate_replies(
        args.target, args.prompts, args.prompt_count, args.self_prompts, args.max_new_tokens, args.seed,
        tasks=parse_counts(getattr(args, "tasks", None)), passages=getattr(args, "passages", None), served=served,
    )  # fmt: skip
    return target, tok, data


def _features(args, target, data: list, layers: tuple) -> list:
    """``target_features``, read from / written to ``--features PATH`` when given (they take longer
    than the training on a CPU; the file is only valid for the same replies and layers)."""
    path = getattr(args, "features", None)
    if path and Path(path).exists():
        saved = torch.load(path, weights_only=False)
        if saved["layers"] == list(layers) and [r[0] for r in saved["rows"]] == [t for t, _ in data]:
            print(f"features: read from {path}", flush=True)
            return saved["rows"]
        print(f"features: {path} is for other replies or layers; recomputing", flush=True)
    rows = target_features(target, data, layers)
    if path:
        torch.save({"layers": list(layers), "rows": rows}, path)
    return rows


def run(args) -> int:
    """``specd distill --kind head ...``."""
    from specd.model.head_files import save_head
    from specd.training.data import pick_vocab

    torch.manual_seed(args.seed)
    target, tok, data = _replies(args)
    if args.data_out:
        Path(args.data_out).write_text(json.dumps(data))
    random.Random(args.seed).shuffle(data)
    n_held = max(2, len(data) // 20)
    train_data = data[n_held:]
    V = target.config.vocab_size
    always = [t for t in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if isinstance(t, int) and 0 <= t]
    d2t = pick_vocab(train_data, min(args.draft_vocab or 8192, V), always, V)
    t2d = torch.full((V,), -100, dtype=torch.long)
    t2d[d2t] = torch.arange(d2t.numel())
    head = new_head(target, d2t, seed=args.seed)
    if getattr(args, "init_from", None):  # an earlier head's layer (its vocabulary may differ: rows are the target's)
        from specd.model.head_files import load_head

        earlier = load_head(args.init_from, target)
        if earlier.layers != head.layers:
            raise SystemExit(f"specd distill: --init-from {args.init_from}: layers {earlier.layers}, not {head.layers}")
        head.load_state_dict({k: v.float() for k, v in earlier.state_dict().items()})
    feats = _features(args, target, data, head.layers)
    held_f, train_f = feats[:n_held], feats[n_held:]
    before = head_agreement(head, held_f, t2d, args.ttt_steps)
    print(f"held-out top-1 agreement before training, by step: {[round(a, 4) for a in before]}", flush=True)
    bf16 = getattr(args, "train_dtype", "float32") == "bfloat16"
    res = train_head(head, train_f, t2d, args.steps, args.batch_size, args.lr, args.ttt_steps, args.seed, bf16)
    after, after_all = head_agreements(head, held_f, t2d, args.ttt_steps)
    meta = {
        **res,
        "replies": len(train_data),
        "heldout_replies": n_held,
        "reply_tokens": sum(len(t) - p for t, p in train_data),
        "ttt_steps": args.ttt_steps,
        "steps": args.steps,
        "train_dtype": "bfloat16" if bf16 else "float32",
        "heldout_top1_agreement_before": [round(a, 4) for a in before],
        "heldout_top1_agreement": [round(a, 4) for a in after],
        "heldout_top1_agreement_oov_miss": [round(a, 4) for a in after_all],
    }
    save_head(head, Path(args.out), meta)
    print(json.dumps(meta, indent=1))
    return 0
