"""The systems a benchmark times side by side, each a callable ``ids -> output ids`` (greedy, stopping on
the model's EOS ids or ``max_tokens``) with ``batch(list of ids) -> outputs`` where it can batch, a
``name`` and, after a call, ``stats`` (``mean_accepted_length`` where it speculates):

- :class:`Specd`: the specd engine in process, one per speculation mode (``harness.Mode``);
- :class:`HF`: transformers ``generate`` (plain, assisted generation with a draft, prompt lookup);
- :class:`LlamaCpp` (and :class:`LlamaCppBatch`): llama.cpp through llama-cpp-python on a GGUF file;
- :class:`CT2`: CTranslate2 on the target converted from its HF checkpoint (target only).

:func:`time_rotated` runs every system on every group of prompts, back to back, in an order rotated
from group to group, so load from other processes on a shared machine hits them alike.
"""

from __future__ import annotations

import time
from pathlib import Path

from eval.harness.engines import make_engine
from eval.harness.stats import stats_from_dicts


class Accepted:
    """Tokens per target forward of a peer that is not specd (from its forward calls)."""

    def __init__(self, mean_accepted_length: float):
        self.mean_accepted_length = mean_accepted_length


class Specd:
    def __init__(self, mode, target, draft, device, max_tokens, **engine_kw):
        from specd.sampling.params import SamplingParams

        self.name = f"specd:{mode.name}"
        self.mode = mode
        self.engine = make_engine(mode, target, draft, device, **engine_kw)
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.stats = None

    def set_max_tokens(self, n: int) -> None:
        import dataclasses

        self.params = dataclasses.replace(self.params, max_tokens=n)

    def __call__(self, ids):
        return self.batch([ids])[0]

    def batch(self, ids_list):
        seqs = self.engine.generate(list(ids_list), self.params, self.mode.spec_params())
        self.stats = stats_from_dicts([s.stats for s in seqs])
        return [list(s.output_ids) for s in seqs]


class ForwardCounter:
    """Counts a module's forward calls (a public forward hook): a generate call's target forwards."""

    def __init__(self, module):
        self.n = 0
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.n += 1


class HF:
    """transformers ``generate``: plain, assisted (``assistant``, ``assist_k``) or prompt lookup
    (``prompt_lookup``: ``prompt_lookup_num_tokens=K``). ``batch`` left-pads; each output is cut
    after its first EOS (finished rows are padded while the others go on)."""

    def __init__(self, name, model, max_tokens, eos, assistant=None, assist_k=None, prompt_lookup=None, pad_id=0):
        self.name, self.model, self.assistant = name, model, assistant
        self.kw = dict(max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id, eos_token_id=eos)
        if assistant is not None:
            self.kw["assistant_model"] = assistant
            if assist_k is not None:
                assistant.generation_config.num_assistant_tokens = assist_k
                assistant.generation_config.num_assistant_tokens_schedule = "constant"
        if prompt_lookup is not None:
            self.kw["prompt_lookup_num_tokens"] = prompt_lookup
        self.speculative = assistant is not None or prompt_lookup is not None
        self.eos, self.pad = set(eos), pad_id
        self.forwards = ForwardCounter(model)
        self.stats = None

    def set_max_tokens(self, n: int) -> None:
        self.kw["max_new_tokens"] = n

    def __call__(self, ids):
        return self.batch([ids])[0]

    def batch(self, ids_list):
        import torch

        L = max(len(p) for p in ids_list)
        dev = self.model.device
        x = torch.tensor([[self.pad] * (L - len(p)) + list(p) for p in ids_list], device=dev)
        att = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in ids_list], device=dev)
        n0 = self.forwards.n
        with torch.no_grad():
            out = self.model.generate(x, attention_mask=att, **self.kw)
        outs = [cut_at_eos(row[L:].tolist(), self.eos) for row in out]
        steps = self.forwards.n - n0
        self.stats = Accepted(sum(map(len, outs)) / steps) if self.speculative and steps else None
        return outs


def cut_at_eos(ids: list, eos: set) -> list:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


class LlamaCpp:
    """llama.cpp through llama-cpp-python on a GGUF file: ``Llama.generate`` on the given prompt ids
    (greedy: temp 0, top_k 1, no repeat penalty), stopping on ``eos`` or ``max_tokens`` like the
    others; ``pld=K``: its prompt-lookup drafting (``LlamaPromptLookupDecoding(num_pred_tokens=K)``).
    Its KV prefix reuse across calls is reset before each prompt (every prompt prefilled in full)."""

    def __init__(self, name, gguf, threads, n_ctx, max_tokens, eos, pld=None):
        from llama_cpp import Llama

        self.name, self.max_tokens, self.eos = name, max_tokens, set(eos)
        self.threads, self.n_ctx, self._batched = threads, n_ctx, None
        self.draft = counting_pld(pld) if pld else None
        # logits_all with a draft model: llama-cpp-python 0.3.x sizes its logits buffer from the
        # argument, not from the draft model (which turns it on), and overflows past n_batch tokens
        self.llm = Llama(
            model_path=str(gguf),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=n_ctx,
            verbose=False,
            draft_model=self.draft,
            logits_all=self.draft is not None,
        )
        self.stats = None

    def set_max_tokens(self, n: int) -> None:
        self.max_tokens = n

    def __call__(self, ids):
        self.llm.reset()
        calls0 = self.draft.calls if self.draft is not None else 0
        out = []
        for t in self.llm.generate(list(ids), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            out.append(int(t))
            if t in self.eos or len(out) >= self.max_tokens:
                break
        if self.draft is not None:  # one target forward for the prompt, then one after each draft call
            self.stats = Accepted(len(out) / (1 + self.draft.calls - calls0))
        return out

    def batch(self, ids_list):
        """Several prompts decoded together (plain decoding only: ``LlamaCppBatch``)."""
        if self.draft is not None:
            raise ValueError("llama.cpp's prompt lookup runs one sequence at a time")
        if getattr(self, "_batched", None) is None or self._batched.max_seqs < len(ids_list):
            self._batched = LlamaCppBatch(self, self.threads, self.n_ctx, max(4, len(ids_list)))
        return self._batched.generate(ids_list, self.max_tokens, self.eos)


class LlamaCppBatch:
    """Greedy decoding of several prompts at once in one llama.cpp context (``n_seq_max`` = the
    batch, one sequence id per prompt, one ``llama_decode`` per step for every unfinished prompt),
    what llama.cpp's server does with parallel slots; through llama-cpp-python's low-level API on the
    model ``llm`` (a ``LlamaCpp``) already loaded."""

    def __init__(self, llm, threads: int, n_ctx: int, max_seqs: int):
        import llama_cpp as L

        self.L, self.model, self.max_seqs = L, llm.llm.model, max_seqs
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx * max_seqs, n_ctx, n_ctx
        cp.n_seq_max, cp.n_threads, cp.n_threads_batch = max_seqs, threads, threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp: could not create a batched context")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(n_ctx, 0, max_seqs)

    def _decode(self, items: list) -> list:
        """``items``: (seq id, position, token, wants logits); returns the argmax of each that wants them."""
        import numpy as np

        b = self.batch
        b.n_tokens = len(items)
        for k, (sid, pos, tok, want) in enumerate(items):
            b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = tok, pos, 1, want
            b.seq_id[k][0] = sid
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        out = []
        for k, (_, _, _, want) in enumerate(items):
            if want:
                row = np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, k), shape=(self.n_vocab,))
                out.append(int(row.argmax()))
        return out

    def generate(self, ids_list: list, max_tokens: int, eos: set) -> list:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        nxt = []
        for sid, ids in enumerate(ids_list):  # prefill one prompt per decode call (as the server's slots do)
            nxt += self._decode([(sid, p, t, p == len(ids) - 1) for p, t in enumerate(ids)])
        outs = [[t] for t in nxt]
        pos = [len(ids) for ids in ids_list]
        live = [k for k in range(len(ids_list)) if not (nxt[k] in eos or max_tokens <= 1)]
        while live:
            toks = self._decode([(k, pos[k], outs[k][-1], True) for k in live])
            for k, t in zip(live, toks):
                outs[k].append(t)
                pos[k] += 1
            live = [k for k in live if outs[k][-1] not in eos and len(outs[k]) < max_tokens]
        return outs


def counting_pld(k: int):
    """llama-cpp-python's prompt-lookup draft model, counting its calls (one per decode step)."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    class CountingPLD(LlamaPromptLookupDecoding):
        calls = 0

        def __call__(self, input_ids, /, **kw):
            self.calls += 1
            return super().__call__(input_ids, **kw)

    return CountingPLD(num_pred_tokens=k)


class CT2:
    name = "ct2:generate"

    def __init__(self, target_dir, out_dir, tokenizer, max_tokens, eos, threads):
        import ctranslate2
        from ctranslate2.converters import TransformersConverter

        self.version = ctranslate2.__version__
        path = Path(out_dir) / "ct2_target"
        TransformersConverter(str(target_dir)).convert(str(path), force=True)
        self.gen = ctranslate2.Generator(str(path), device="cpu", intra_threads=threads, inter_threads=1)
        self.tok = tokenizer
        self.max_tokens = max_tokens
        self.end = [tokenizer.convert_ids_to_tokens(i) for i in eos]
        self.stats = None

    def set_max_tokens(self, n: int) -> None:
        self.max_tokens = n

    def __call__(self, ids):
        r = self.gen.generate_batch(
            [self.tok.convert_ids_to_tokens(ids)],
            max_length=self.max_tokens,
            sampling_topk=1,
            beam_size=1,
            include_prompt_in_result=False,
            end_token=self.end,
            return_end_token=True,
        )
        return list(r[0].sequences_ids[0])


def time_rotated(systems: list, groups: list, progress: bool = True, desc: str = "systems") -> list:
    """Every system on every group of prompts, back to back, in an order rotated from group to group
    (load from other processes hits them alike). ``groups``: [(prompts, ids lists)]; a group of one
    runs ``system(ids)``, a bigger one ``system.batch(ids lists)`` (one batch, timed as a whole).
    One row per group and system (``output_ids``: a list per prompt when batched)."""
    from tqdm import tqdm

    rows = []
    for qi, (ps, ids_list) in enumerate(tqdm(groups, desc=desc, disable=not progress)):
        for s in systems[qi % len(systems) :] + systems[: qi % len(systems)]:
            t0, c0 = time.perf_counter(), time.process_time()
            o = s(ids_list[0]) if len(ids_list) == 1 else s.batch(ids_list)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            n_out = len(o) if len(ids_list) == 1 else sum(map(len, o))
            r = {
                "prompt_id": "+".join(p.id for p in ps),
                "category": ps[0].category,
                "system": s.name,
                "batch": len(ids_list),
                "prompt_tokens": sum(map(len, ids_list)),
                "output_tokens": n_out,
                "wall_s": round(dt, 6),
                "cpu_s": round(cpu, 6),
                "tokens_per_s": round(n_out / dt, 3) if dt > 0 else 0.0,
                "tokens_per_cpu_s": round(n_out / cpu, 3) if cpu > 0 else 0.0,
                "output_ids": o,
            }
            if s.stats is not None:
                r["mean_accepted_length"] = round(s.stats.mean_accepted_length, 4)
            rows.append(r)
    return rows
