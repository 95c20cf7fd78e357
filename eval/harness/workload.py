"""The workload: prompt files (MT-bench, Spec-Bench, GSM8K, plain text), how a prompt becomes token
ids (chat template or raw, left-truncated to fit), and how prompts are grouped into batches.

``--prompts`` takes MT-bench / Spec-Bench ``question.jsonl`` (``{"question_id", "category", "turns"}``),
GSM8K ``train.jsonl`` (``question``; category ``gsm8k``) or a plain text file (one prompt a line,
category ``text``). In a Spec-Bench file the eight MT-bench categories are reported together as
``mt_bench``, as on the Spec-Bench leaderboard (the original category kept as ``subcategory``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eval.harness.machine import SHARED

SPEC_BENCH_TASKS = ("translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SPEC_BENCH = SHARED / "data" / "spec_bench" / "question.jsonl"
MT_BENCH = SHARED / "data" / "mt_bench" / "question.jsonl"
GSM8K = SHARED / "data" / "gsm8k" / "train.jsonl"
PASSAGES = SHARED / "data" / "tinyshakespeare" / "input.txt"
# short raw prompts for the tiny story models and the load tools (the first 8 are the soak's)
STORY_PROMPTS = (
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park",
    "One day, a big bird",
    "There was a girl named Sue",
    "The sun was hot and",
    "Tim had a red ball",
    "Mom said to Ben",
    "The cat sat on the mat",
    "Ben wanted to play",
    "It was a rainy day",
    "Sam found a box",
    "The old tree was",
    "Anna liked to draw",
    "A small fish swam",
    "The boy saw a big truck",
)


@dataclass
class Prompt:
    id: str
    category: str  # reporting category (Spec-Bench: the task; MT-bench: its category)
    turns: list  # user turns (str)
    subcategory: str | None = None  # Spec-Bench's mt_bench rows keep their MT-bench category here


def split_list(s: str | None) -> list | None:
    """``"a, b,"`` -> ``["a", "b"]``; None (or empty) -> None."""
    out = [x.strip() for x in (s or "").split(",") if x.strip()]
    return out or None


def add_model_prompt_args(ap, max_tokens: int = 128) -> None:
    """The arguments the model-pair tools share: the pair, the prompt file, chat template or raw."""
    ap.add_argument("--target", required=True, help="target checkpoint dir (HF format) or GGUF file")
    ap.add_argument("--draft", required=True, help="draft checkpoint dir (same tokenizer)")
    ap.add_argument(
        "--prompts",
        required=True,
        help="question.jsonl (turns, category), GSM8K jsonl (question) or text, one prompt a line",
    )
    g = ap.add_mutually_exclusive_group()
    g.add_argument(
        "--chat-template",
        dest="chat_template",
        action="store_true",
        default=None,
        help="apply the tokenizer's chat template (default when it has one)",
    )
    g.add_argument("--raw", dest="chat_template", action="store_false", help="raw text prompts (BOS + text)")
    ap.add_argument("--max-tokens", type=int, default=max_tokens)


def load_prompts(
    path,
    limit: int | None = None,
    categories: list | None = None,
    per_category: int | None = None,
    max_turns: int | None = None,
    start: int = 0,
) -> list:
    """The prompts of a file (see the module doc for the formats). ``start`` skips the file's first N
    prompts (e.g. ``--start 7273`` on GSM8K = the demo pair's 200 held-out questions).
    ``categories`` filters on the category or the subcategory. ``per_category`` keeps the first N of
    each category (Spec-Bench's mt_bench: round-robin over its eight subcategories); ``limit`` then
    keeps N in all, taken round-robin over the categories (file order inside each), so a small
    limit still covers them all."""
    rows = read_prompt_file(Path(path))[start:]
    if max_turns is not None:
        for p in rows:
            p.turns = p.turns[:max_turns]
    if categories:
        want = set(categories)
        rows = [p for p in rows if p.category in want or p.subcategory in want]
    by_cat = _by_category(rows)
    if per_category is not None:
        by_cat = {c: ps[:per_category] for c, ps in by_cat.items()}
    if limit is None:
        out = [p for ps in by_cat.values() for p in ps]
        return sorted(out, key=rows.index) if per_category is None else out
    out = []
    queues = [list(ps) for ps in by_cat.values()]
    while len(out) < limit and any(queues):
        for q in queues:
            if q and len(out) < limit:
                out.append(q.pop(0))
    return out


def read_prompt_file(path: Path) -> list:
    """Every prompt of a file, in file order (see :func:`load_prompts` for the formats)."""
    text = path.read_text(encoding="utf-8")
    if not (path.suffix in (".jsonl", ".json") or text.lstrip().startswith("{")):
        return [Prompt(str(i + 1), "text", [ln]) for i, ln in enumerate(x for x in text.splitlines() if x.strip())]
    rows = []
    for n, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        r = json.loads(line)
        turns = r.get("turns") or ([r["prompt"]] if "prompt" in r else None)
        category = r.get("category", "default")
        if not turns and "question" in r:  # GSM8K
            turns, category = [r["question"]], "gsm8k"
        if not turns:
            raise ValueError(f"{path}:{n + 1}: no 'turns' (or 'prompt' / 'question') field")
        rows.append(Prompt(str(r.get("question_id", n + 1)), str(category), list(turns)))
    if {p.category for p in rows} & set(SPEC_BENCH_TASKS):
        for p in rows:
            if p.category in MT_BENCH_CATEGORIES:
                p.subcategory, p.category = p.category, "mt_bench"
    return rows


def _by_category(rows: list) -> dict:
    """Prompts by category, in file order; Spec-Bench's mt_bench interleaves its subcategories."""
    by_cat: dict[str, list] = {}
    for p in rows:
        by_cat.setdefault(p.category, []).append(p)
    for c, ps in by_cat.items():
        if any(p.subcategory for p in ps):
            subs: dict = {}
            for p in ps:
                subs.setdefault(p.subcategory, []).append(p)
            by_cat[c] = [p for grp in _zip_longest(list(subs.values())) for p in grp]
    return by_cat


def _zip_longest(lists: list) -> list:
    """[[a1, a2], [b1]] -> [[a1, b1], [a2]] (round-robin rows)."""
    return [[lst[i] for lst in lists if i < len(lst)] for i in range(max((len(x) for x in lists), default=0))]


def first_turns_by_category(path, categories: list, per_category: int) -> dict:
    """{category: [first turn]}: the first ``per_category`` prompts of each wanted category, in file
    order; an MT-bench subcategory of a Spec-Bench file (e.g. ``writing``) counts as a category here."""
    by: dict = {}
    for p in read_prompt_file(Path(path)):
        cat = p.subcategory or p.category
        if cat in categories and len(by.setdefault(cat, [])) < per_category:
            by[cat].append(p.turns[0])
    return by


def gsm8k_questions(n: int, offset: int = 0) -> list:
    """Held-out GSM8K questions (the last 200 of train.jsonl, which the demo pair never trained on)."""
    lines = [ln for ln in GSM8K.read_text(encoding="utf-8").splitlines() if ln.strip()][-200:]
    qs = [json.loads(ln)["question"] for ln in lines]
    return [qs[(offset + i) % len(qs)] for i in range(n)]


# token ids --------------------------------------------------------------------------------------
def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_conversation(tokenizer, turns: list, answers: list, chat_template: bool) -> list:
    """Token ids for the next turn: user turns[i] answered by answers[i] (the model's own), then turns[-1].

    With a chat template: the messages go through the tokenizer's template (generation prompt on).
    Raw: the text is the turns and answers joined by blank lines, prefixed by the tokenizer's BOS.
    """
    assert len(answers) == len(turns) - 1
    if chat_template:
        msgs = []
        for i, t in enumerate(turns):
            msgs.append({"role": "user", "content": t})
            if i < len(answers):
                msgs.append({"role": "assistant", "content": answers[i]})
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    parts = []
    for i, t in enumerate(turns):
        parts.append(t)
        if i < len(answers):
            parts.append(answers[i])
    return list(tokenizer("\n\n".join(parts))["input_ids"])


def fit_prompt(ids: list, max_prompt: int, bos_id: int | None) -> tuple:
    """Left-truncate to ``max_prompt`` tokens (keeping a leading BOS). Returns (ids, truncated?)."""
    if len(ids) <= max_prompt:
        return ids, False
    if bos_id is not None and ids and ids[0] == bos_id:
        return [ids[0]] + ids[len(ids) - (max_prompt - 1) :], True
    return ids[len(ids) - max_prompt :], True


def first_turns(
    path, model, max_tokens: int, chat: bool | None = None, limit=None, categories=None, per_category=None
) -> tuple:
    """``(prompts, token ids, chat template used)``: the first turn of each selected prompt of
    ``path`` (:func:`load_prompts`), encoded for the loaded ``model`` (its chat template unless
    ``chat`` is False or it has none) and left-truncated to leave ``max_tokens`` in its context."""
    prompts = load_prompts(path, limit, categories, per_category, max_turns=1)
    tok, cfg = model.tokenizer, model.config
    chat = has_chat_template(tok) if chat is None else chat
    max_prompt = cfg.max_position_embeddings - max_tokens - 1
    ids = [
        fit_prompt(encode_conversation(tok, p.turns[:1], [], chat), max_prompt, cfg.bos_token_id)[0] for p in prompts
    ]
    return prompts, ids, chat


def groups_of(prompts: list, ids_list: list, b: int) -> list:
    """``[(prompts, ids lists)]``: consecutive groups of ``b`` prompts of one category (a category's
    last group may be smaller)."""
    by: dict = {}
    for p, ids in zip(prompts, ids_list):
        by.setdefault(p.category, []).append((p, ids))
    out = []
    for items in by.values():
        for i in range(0, len(items), b):
            chunk = items[i : i + b]
            out.append(([p for p, _ in chunk], [x for _, x in chunk]))
    return out
