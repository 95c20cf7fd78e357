#!/usr/bin/env python3
"""Train specd's built-in demo model pair (a Llama target and a 1-layer distilled draft) on GSM8K.

Seeded and reproducible (same seed, same thread count, same torch build -> same weights):

    HF_HUB_OFFLINE=1 .venv/bin/python -m eval train-demo            # ~30 min on 1 CPU thread
    HF_HUB_OFFLINE=1 .venv/bin/python -m eval train-demo --target-steps 5 --draft-steps 5 \
        --out /tmp/demo_smoke                                              # smoke run

Steps:
  1. read GSM8K train.jsonl (``--data``); example i < N-200 is training data, the last 200
     (indices N-200..N-1, file order) are the held-out set;
  2. format each example as a chat (``<|bos|><|user|>Q<|end|><|assistant|>A<|end|>``; ``<<...>>``
     calculator annotations stripped, the final ``#### N`` line becomes ``The answer is N.``);
  3. train a byte-level BPE tokenizer on the training chats (special tokens + chat template);
  4. train the target (LlamaForCausalLM, fp32) on packed sequences of the training chats;
  5. distil a 1-layer draft from it (KL(target||draft) + CE, ``specd.training.loop``), embeddings
     initialised from the target's, decoder layer initialised from the target's first layer;
  6. evaluate held-out loss and greedy draft/target agreement, save both in HF format (bf16) under
     ``--out``/target and ``--out``/draft, reload them with transformers and generate.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from eval.harness import ROOT as REPO
from specd.training.draft import build_draft
from specd.training.loop import greedy_agreement, heldout_loss, lr_at, train_draft

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}<|end|>"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}<|end|>"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}<|end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
HELDOUT = 200


def log(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------


def format_answer(answer: str) -> str:
    """Strip ``<<...>>`` calculator annotations; ``#### N`` -> ``The answer is N.``"""
    text = re.sub(r"<<[^>]*>>", "", answer)
    if "####" in text:
        body, final = text.rsplit("####", 1)
        body = body.rstrip()
        final = final.strip()
        text = (body + "\n" if body else "") + f"The answer is {final}."
    return text.strip()


def load_gsm8k(path: Path) -> list[list[dict]]:
    chats = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                chats.append(
                    [
                        {"role": "user", "content": r["question"].strip()},
                        {"role": "assistant", "content": format_answer(r["answer"])},
                    ]
                )
    return chats


def render(chat: list[dict]) -> str:
    # Same output as the Jinja template above (checked against apply_chat_template at save time).
    out = "<|bos|>"
    for m in chat:
        out += f"<|{m['role']}|>{m['content']}<|end|>"
    return out


# ------------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Train on the text without the special-token markers.
    plain = [re.sub(r"<\|[a-z]+\|>", "\n", t) for t in texts]
    tok.train_from_iterator(plain, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        extra_special_tokens=["<|user|>", "<|assistant|>", "<|system|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def pad_batch(seqs: list[list[int]], pad: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    L = min(max(len(s) for s in seqs), max_len)
    ids = torch.full((len(seqs), L), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.bool)
    for i, s in enumerate(seqs):
        s = s[:L]
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = True
    return ids, mask


def evaluate(target, draft, held_ids, held_mask, asst_mask) -> dict:
    pair_mask = torch.zeros_like(held_mask)
    pair_mask[:, :-1] = held_mask[:, :-1] & held_mask[:, 1:]
    asst_pairs = pair_mask & asst_mask
    res = {
        "target_loss": heldout_loss(target, held_ids, mask=held_mask),
        "draft_loss": heldout_loss(draft, held_ids, mask=held_mask) if draft is not None else float("nan"),
    }
    if draft is not None:
        res["agreement_all"] = greedy_agreement(draft, target, held_ids, mask=pair_mask)
        res["agreement_assistant"] = greedy_agreement(draft, target, held_ids, mask=asst_pairs)
    return res


def save_model(model, tok, out: Path, end_id: int) -> None:
    import copy

    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    m = copy.deepcopy(model).to(torch.bfloat16)
    m.config.dtype = torch.bfloat16
    m.config.use_cache = True
    m.save_pretrained(out)
    tok.save_pretrained(out, save_jinja_files=False)  # chat template goes into tokenizer_config.json
    # "PreTrainedTokenizerFast" (rather than v5's "TokenizersBackend") also loads in transformers 4.x.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=[end_id],
        pad_token_id=tok.pad_token_id,
        do_sample=False,
        max_new_tokens=256,
    ).save_pretrained(out)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"))
    ap.add_argument("--out", default=str(REPO / "models" / "demo"))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--max-pos", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--target-steps", type=int, default=700)
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--draft-steps", type=int, default=400)
    ap.add_argument("--draft-lr", type=float, default=2e-3)
    ap.add_argument("--kl-weight", type=float, default=1.0)
    ap.add_argument("--ce-weight", type=float, default=0.1)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    out = Path(args.out)
    times: dict[str, float] = {}
    T0, C0 = time.time(), time.process_time()
    log(f"args: {vars(args)}")
    log(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    d = prepare_data(args, times)
    target = build_target(args, d.tok, d.end_id)
    chunks = packed_chunks(d.stream, args.seq_len + 1)
    ema = train_target(args, target, chunks, times)
    draft, hist = train_the_draft(args, target, chunks, times)
    t = time.time()
    ev = evaluate(target, draft, d.held_ids, d.held_mask, d.asst_mask)
    times["eval_s"] = time.time() - t
    log(
        f"held-out ({HELDOUT} examples): target loss {ev['target_loss']:.4f} (ppl {math.exp(ev['target_loss']):.2f}), "
        f"draft loss {ev['draft_loss']:.4f} (ppl {math.exp(ev['draft_loss']):.2f}); "
        f"greedy agreement all {ev['agreement_all']:.4f}, assistant {ev['agreement_assistant']:.4f}"
    )
    t = time.time()
    ev_bf16 = save_and_reload(target, draft, d, out)
    times["save_s"] = time.time() - t
    times["total_s"] = time.time() - T0
    times["total_cpu_s"] = time.process_time() - C0
    summary = {
        "args": vars(args),
        "n_examples": d.n,
        "heldout_range": [d.n - HELDOUT, d.n],
        "train_tokens": int(d.stream.numel()),
        "vocab_size": len(d.tok),
        "eval_fp32": ev,
        "eval_bf16_saved": ev_bf16,
        "times_s": {k: round(v, 1) for k, v in times.items()},
        "final_target_train_loss_ema": ema,
        "final_draft_kl": hist[-1]["kl"] if hist else None,
        "size_bytes": sum(f.stat().st_size for f in out.rglob("*") if f.is_file()),
    }
    log("SUMMARY " + json.dumps(summary))
    return 0


def prepare_data(args, times: dict) -> SimpleNamespace:
    """GSM8K split into training chats and the last 200 held out; the tokenizer trained on the
    training chats; the training token stream; the held-out set padded (in length order, less
    padding, same numbers) with its mask and assistant-token mask."""
    t = time.time()
    chats = load_gsm8k(Path(args.data))
    n = len(chats)
    train_chats, held_chats = chats[: n - HELDOUT], chats[n - HELDOUT :]
    log(f"data: {n} examples; train = [0, {n - HELDOUT}), held-out = [{n - HELDOUT}, {n})")
    train_texts = [render(c) for c in train_chats]
    tok = train_tokenizer(train_texts, args.vocab_size)
    end_id = tok.convert_tokens_to_ids("<|end|>")
    asst_id = tok.convert_tokens_to_ids("<|assistant|>")
    assert tok.apply_chat_template(train_chats[0], tokenize=False) == train_texts[0], "chat template mismatch"
    enc = tok(train_texts, add_special_tokens=False)["input_ids"]
    stream = torch.tensor([i for s in enc for i in s], dtype=torch.long)
    held_enc = sorted(tok([render(c) for c in held_chats], add_special_tokens=False)["input_ids"], key=len)
    held_ids, held_mask = pad_batch(held_enc, tok.pad_token_id, args.max_pos)
    asst_mask = (torch.cumsum((held_ids == asst_id).long(), dim=1) > 0) & held_mask
    times["tokenizer_s"] = time.time() - t
    log(
        f"tokenizer: vocab {len(tok)}, train tokens {stream.numel()} ({stream.numel() / len(enc):.1f}/example), "
        f"held-out tokens {int(held_mask.sum())}; {times['tokenizer_s']:.1f}s"
    )
    return SimpleNamespace(
        n=n,
        tok=tok,
        end_id=end_id,
        held_chats=held_chats,
        stream=stream,
        held_ids=held_ids,
        held_mask=held_mask,
        asst_mask=asst_mask,
    )


def build_target(args, tok, end_id: int):
    """A fresh fp32 ``LlamaForCausalLM`` of the requested shape (seeded), tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_pos,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=end_id,
        pad_token_id=tok.pad_token_id,
        attention_bias=False,
        mlp_bias=False,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(args.seed)
    target = LlamaForCausalLM(cfg).float()
    log(
        f"target: {sum(p.numel() for p in target.parameters()) / 1e6:.3f}M params, {args.layers} layers, "
        f"d={args.hidden}"
    )
    return target


def packed_chunks(stream: torch.Tensor, L: int) -> torch.Tensor:
    """The training stream cut into ``[n, L]`` packed chunks (the remainder dropped)."""
    n_chunks = stream.numel() // L
    return stream[: n_chunks * L].view(n_chunks, L)


def train_target(args, target, chunks: torch.Tensor, times: dict) -> float:
    """Next-token cross-entropy on shuffled packed chunks (epoch after epoch, seeded), AdamW with
    warmup and cosine decay (``loop.lr_at``), clipping 1.0; returns the final loss EMA."""
    from tqdm.auto import tqdm

    n_chunks = chunks.shape[0]
    steps_per_epoch = max(1, n_chunks // args.batch_size)
    log(
        f"target training: {n_chunks} packed chunks of {chunks.shape[1]} tokens, {steps_per_epoch} steps/epoch, "
        f"{args.target_steps} steps "
        f"({args.target_steps / steps_per_epoch:.2f} epochs)"
    )
    batches = epoch_batches(chunks, args.batch_size, torch.Generator().manual_seed(args.seed))
    opt = target_optimizer(target, args.target_lr)
    warmup = max(1, min(50, args.target_steps // 10))
    t, c = time.time(), time.process_time()
    target.train()
    bar = tqdm(total=args.target_steps, desc="target", unit="step", disable=args.no_progress, dynamic_ncols=True)
    ema = None
    for step in range(args.target_steps):
        lr = lr_at(step, args.target_steps, args.target_lr, warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        lv = target_step(target, opt, next(batches))
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}")
        if step % args.log_every == 0 or step == args.target_steps - 1:
            el = time.time() - t
            log(
                f"[target] step {step}/{args.target_steps} loss {lv:.4f} (ema {ema:.4f}) lr {lr:.2e} "
                f"elapsed {el:.0f}s ({el / (step + 1):.2f}s/step)"
            )
    bar.close()
    target.eval()
    times["target_train_s"] = time.time() - t
    times["target_train_cpu_s"] = time.process_time() - c
    log(f"target training: {times['target_train_s']:.1f}s wall, {times['target_train_cpu_s']:.1f}s CPU")
    return ema


def epoch_batches(chunks: torch.Tensor, batch_size: int, gen: torch.Generator):
    """Batches of ``batch_size`` chunks in a fresh random order each epoch (an epoch's remainder
    starts the next batch)."""
    order: list[int] = []
    while True:
        if len(order) < batch_size:
            order = order + torch.randperm(chunks.shape[0], generator=gen).tolist()
        idx, order = order[:batch_size], order[batch_size:]
        yield chunks[idx]


def target_optimizer(target, lr: float):
    decay = [p for p in target.parameters() if p.dim() >= 2]
    no_decay = [p for p in target.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )


def target_step(target, opt, b: torch.Tensor) -> float:
    """One optimizer step of next-token cross-entropy on ``b`` (``[B, L]``); its loss."""
    logits = target(input_ids=b[:, :-1], labels=None, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
    opt.step()
    return loss.item()


def train_the_draft(args, target, chunks: torch.Tensor, times: dict) -> tuple:
    """A 1-layer draft initialised from the target, distilled on random packed chunks
    (``loop.train_draft``); (draft, history)."""
    draft, info = build_draft(target, layers=1, freeze_embeddings=False, copy_layers=True, seed=args.seed)
    log(
        f"draft: {sum(p.numel() for p in draft.parameters()) / 1e6:.3f}M params, 1 layer, "
        f"d={draft.config.hidden_size}; init {info}"
    )
    dgen = torch.Generator().manual_seed(args.seed + 1)
    n_chunks = chunks.shape[0]

    def draft_batch(step: int) -> torch.Tensor:
        idx = torch.randint(0, n_chunks, (args.batch_size,), generator=dgen)
        return chunks[idx]

    t, c = time.time(), time.process_time()
    hist = train_draft(
        target,
        draft,
        draft_batch,
        steps=args.draft_steps,
        lr=args.draft_lr,
        weight_decay=0.0,
        kl_weight=args.kl_weight,
        ce_weight=args.ce_weight,
        progress=not args.no_progress,
        log_every=args.log_every,
        log=log,
        desc="draft",
    )
    times["draft_train_s"] = time.time() - t
    times["draft_train_cpu_s"] = time.process_time() - c
    log(f"draft training: {times['draft_train_s']:.1f}s wall, {times['draft_train_cpu_s']:.1f}s CPU")
    return draft, hist


def save_and_reload(target, draft, d: SimpleNamespace, out: Path) -> dict:
    """Save both (bf16, HF format), reload each with transformers and answer a held-out question,
    then evaluate the saved weights (fp32 compute)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    save_model(target, d.tok, out / "target", d.end_id)
    save_model(draft, d.tok, out / "draft", d.end_id)
    for name in ("target", "draft"):
        m = AutoModelForCausalLM.from_pretrained(out / name)
        tk = AutoTokenizer.from_pretrained(out / name)
        q = d.held_chats[0][0]["content"]
        enc_p = tk.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        o = m.generate(**enc_p, max_new_tokens=96, do_sample=False)
        txt = tk.decode(o[0, enc_p["input_ids"].shape[1] :], skip_special_tokens=False)
        log(f"[{name}] reload ok ({m.dtype}); Q: {q[:80]}...\n[{name}] A: {txt!r}")
    ev_bf16 = evaluate(
        AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval(),
        AutoModelForCausalLM.from_pretrained(out / "draft", dtype=torch.float32).eval(),
        d.held_ids,
        d.held_mask,
        d.asst_mask,
    )
    log(
        f"after bf16 save/reload (fp32 compute): target loss {ev_bf16['target_loss']:.4f}, draft loss "
        f"{ev_bf16['draft_loss']:.4f}, "
        f"agreement all {ev_bf16['agreement_all']:.4f}, assistant {ev_bf16['agreement_assistant']:.4f}"
    )
    return ev_bf16


if __name__ == "__main__":
    raise SystemExit(main())
