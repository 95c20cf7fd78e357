"""Shared pieces of the evaluation scripts: prompts, speculation modes, timing, reports, plots.

Vocabulary (as in docs/architecture.md): a *step* is one target forward; per step the verifier keeps
``a`` draft tokens (*accepted*) and emits ``a + 1`` tokens (the +1 is the correction or bonus token).

- mean accepted length (tokens per step) = 1 + accepted / steps   (counts the bonus/correction token)
- acceptance rate                       = accepted / drafted       (over every drafted node)
- acceptance per depth d                = P(accepted path reaches depth d | the tree had depth d)
- conditional acceptance at depth d     = P(reaches d | reached d - 1): alpha_d in the product form
- accepted-length histogram             = steps that accepted exactly 0, 1, 2, ... draft tokens

The workload (prompts, speculation modes), the acceptance statistics and the report helpers
(JSON, Markdown tables, plots) of ``eval.acceptance`` (main entry), ``eval.sweep``, ``eval.peers``
and ``eval.bench_real``; running and timing engines is ``eval.harness``'s.
"""

from __future__ import annotations

import datetime as _dt
import heapq
import json
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCHEMA = "specd.eval/1"
SPEC_BENCH_TASKS = ("translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


# prompts ----------------------------------------------------------------------------------------
@dataclass
class Prompt:
    id: str
    category: str  # reporting category (Spec-Bench: the task; MT-bench: its category)
    turns: list  # user turns (str)
    subcategory: str | None = None  # Spec-Bench's mt_bench rows keep their MT-bench category here


def add_model_prompt_args(ap, max_tokens: int = 128) -> None:
    """The arguments every eval script shares: the pair, the prompt file, chat template or raw."""
    ap.add_argument("--target", required=True, help="target checkpoint dir (HF format)")
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
    """Read MT-bench / Spec-Bench ``question.jsonl`` (``turns``, ``category``), GSM8K ``train.jsonl``
    (``question``; category ``gsm8k``) or plain text. ``start`` skips the file's first N prompts (e.g.
    ``--start 7273`` on GSM8K = the demo pair's 200 held-out questions).

    Plain text: one prompt per non-empty line, category ``text``. In a Spec-Bench file (one that has
    the Spec-Bench task categories) the eight MT-bench categories are reported together as
    ``mt_bench``, the way the Spec-Bench leaderboard does. ``categories`` filters on either name.
    ``per_category`` keeps the first N of each category (Spec-Bench's mt_bench: round-robin over
    its eight subcategories); ``limit`` then keeps N in all, taken round-robin over the categories
    (file order inside each), so a small limit still covers them all.
    """
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


def load_variant(path, quantization: str, *args, **kw):
    """``load_model`` for a benchmark's weight variant: ``Q`` (``--quantization Q``) or ``Q+a8``
    (the same weights with the CPU kernel's int8 activations, ``--act-quant int8``)."""
    from specd.model.loader import load_model
    from specd.model.quant import set_act_int8

    q, _, act = quantization.partition("+")
    if act not in ("", "a8"):
        raise SystemExit(f"unknown weight variant {quantization!r}: Q or Q+a8")
    lm = load_model(path, *args, quantization=q, **kw)
    if act == "a8" and set_act_int8(lm.model, True) == 0:
        raise SystemExit(f"{quantization}: int8 activations need quantized weights")
    return lm


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
        if isinstance(ids, dict):
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


# speculation modes ------------------------------------------------------------------------------
# P(the target's token is the draft's rank-r token), used to shape static trees when nothing
# measured is given; close to the shared stories260K pair (top-1 agreement ~0.55).
DEFAULT_RANK_PROBS = (0.55, 0.13, 0.06, 0.035, 0.02, 0.015, 0.01, 0.008)


def static_choices(n: int, rank_probs=DEFAULT_RANK_PROBS, max_depth: int = 12) -> tuple:
    """The ``n``-node static tree that maximises expected accepted length when the draft's rank-r
    token is right with probability ``rank_probs[r]`` independently at every depth (Sequoia's model).

    Best-first over paths: a path's value is the product of its ranks' probabilities, so a child is
    never worth more than its parent or its earlier sibling, and the first ``n`` popped paths form a
    valid (prefix-closed) Medusa choice list.

    >>> static_choices(4, (0.5, 0.2))
    ((0,), (0, 0), (1,), (0, 0, 0))
    """
    probs = [p for p in rank_probs if p > 0]
    heap = [(-probs[0], (0,))]
    out = []
    while heap and len(out) < n:
        negv, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < max_depth:
            heapq.heappush(heap, (negv * probs[0], path + (0,)))  # first child
        r = path[-1] + 1
        if r < len(probs):  # next sibling
            heapq.heappush(heap, (negv / probs[r - 1] * probs[r], path[:-1] + (r,)))
    return tuple(out)


@dataclass(frozen=True)
class Mode:
    """One speculation setting under test, e.g. ``off``, ``chain:4``, ``tree:16``, ``tree:32:4:8``, ``static:16``,
    ``ngram:8`` (prompt lookup, K tokens, no draft model used), ``auto`` (the adaptive policy)."""

    name: str
    kind: str  # off | chain | tree | static | ngram | auto
    size: int = 0  # chain: k; tree/static: node budget (draft tokens, excluding the root)
    topk: int = 4
    depth: int = 6
    choices: tuple | None = None

    @classmethod
    def parse(cls, s: str, tree_topk: int = 4, tree_depth: int = 6, rank_probs=DEFAULT_RANK_PROBS) -> Mode:
        s = s.strip()
        parts = s.split(":")
        kind = parts[0]
        try:
            if kind in ("off", "auto"):
                return cls(kind, kind)
            if kind == "ngram":
                return cls(s, "ngram", int(parts[1]) if len(parts) > 1 else 8)
            if kind == "chain":
                return cls(s, "chain", int(parts[1]) if len(parts) > 1 else 4)
            if kind == "tree":
                n = int(parts[1]) if len(parts) > 1 else 16
                k = int(parts[2]) if len(parts) > 2 else tree_topk
                d = int(parts[3]) if len(parts) > 3 else tree_depth
                return cls(s, "tree", n, k, d)
            if kind == "static":
                n = int(parts[1]) if len(parts) > 1 else 16
                ch = static_choices(n, rank_probs)
                return cls(s, "static", n, depth=max(len(c) for c in ch), choices=ch)
        except (ValueError, IndexError):
            pass
        raise ValueError(f"bad mode {s!r}: use off | chain:K | tree:N[:TOPK[:DEPTH]] | static:N | ngram:K | auto")

    def spec_config(self):
        from specd.config import SpecConfig

        if self.kind == "off":
            return SpecConfig(mode="off", adaptive=False)
        if self.kind == "auto":
            return SpecConfig(adaptive=True, suffix_store=False)
        if self.kind == "ngram":
            return SpecConfig(mode="ngram", ngram_tokens=self.size, adaptive=False, suffix_store=False)
        if self.kind == "chain":
            return SpecConfig(mode="chain", num_draft_tokens=self.size, adaptive=False)
        if self.kind == "tree":
            return SpecConfig(
                mode="tree", tree_budget=self.size, tree_topk=self.topk, tree_depth=self.depth, adaptive=False
            )
        return SpecConfig(mode="static", tree_budget=self.size, static_tree=self.choices, adaptive=False)

    def spec_params(self):
        from specd.engine.sequence import SpecParams

        return SpecParams(mode="off") if self.kind == "off" else SpecParams(mode="auto")

    def describe(self) -> dict:
        d = {"name": self.name, "kind": self.kind}
        if self.kind in ("chain", "ngram"):
            d["k"] = self.size
        elif self.kind == "tree":
            d.update(budget=self.size, topk=self.topk, depth=self.depth)
        elif self.kind == "static":
            d.update(budget=self.size, depth=self.depth, choices=[list(c) for c in self.choices])
        return d


def parse_modes(spec: str, **kw) -> list:
    modes = [Mode.parse(s, **kw) for s in spec.split(",") if s.strip()]
    names = [m.name for m in modes]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate modes in {spec!r}")
    return modes


# stats ------------------------------------------------------------------------------------------
def stats_from_dicts(ds: list):
    """Merge per-request ``SpecStats`` (as objects or ``as_dict()``-style dicts) into one SpecStats."""
    from specd.engine.sequence import SpecStats

    tot = SpecStats()
    for d in ds:
        if isinstance(d, SpecStats):
            tot.merge(d)
            continue
        s = SpecStats(
            steps=d["steps"],
            draft_tokens=d["draft_tokens"],
            accepted_tokens=d["accepted_tokens"],
            emitted_tokens=d.get("emitted_tokens", 0),
            accepted_per_depth=list(d["accepted_per_depth"]),
            drafted_per_depth=list(d["drafted_per_depth"]),
            accept_len_hist=list(d["accept_len_hist"]),
        )
        tot.merge(s)
    return tot


def tried_per_depth(steps: list) -> list:
    """[d-1] = steps that verified a draft at depth d: the tree had depth >= d and the accepted path
    reached d-1 (a step of depth D that accepted a tried depths 1..min(D, a + 1))."""
    out = []
    for depth, a in steps:
        n = min(depth, a + 1)
        while len(out) < n:
            out.append(0)
        for d in range(n):
            out[d] += 1
    return out


def add_lists(a: list, b: list) -> list:
    out = list(a) + [0] * max(0, len(b) - len(a))
    for i, v in enumerate(b):
        out[i] += v
    return out


def stats_dict(st, tried: list | None = None) -> dict:
    """``SpecStats.as_dict()`` plus raw per-depth counts, the normalised accepted-length histogram and,
    given ``tried`` (see :func:`tried_per_depth`), the conditional per-position acceptance alpha_d and
    the i.i.d. alpha (accepted / positions tried; Leviathan et al.'s alpha)."""
    d = st.as_dict()
    d["emitted_tokens"] = st.emitted_tokens
    d["drafted_per_depth"] = list(st.drafted_per_depth)
    h = st.accept_len_hist
    tot = sum(h)
    d["accept_len_dist"] = [round(x / tot, 4) for x in h] if tot else []
    if tried is not None:
        d["tried_per_depth"] = list(tried)
        acc = st.accepted_per_depth
        d["conditional_acceptance_per_depth"] = [
            round((acc[i] if i < len(acc) else 0) / t, 4) if t else 0.0 for i, t in enumerate(tried)
        ]
        d["alpha_iid"] = round(sum(acc) / sum(tried), 4) if sum(tried) else 0.0
    return d


def expected_tokens_iid(alpha: float, k: int) -> float:
    """Leviathan et al. (2023), eq. 1: E[tokens per step] = (1 - alpha^(k+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_tokens_product(alphas: list) -> float:
    """Product form with per-position alphas: 1 + sum_d prod_{j<=d} alpha_j."""
    e, p = 1.0, 1.0
    for a in alphas:
        p *= a
        e += p
    return e


def leviathan_speedup(expected: float, k: int, c: float) -> float:
    """Predicted walltime improvement E / (k c + 1), c = draft forward time / target step time."""
    return expected / (k * c + 1)


# reports ----------------------------------------------------------------------------------------
def write_json(path, obj) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def md_table(headers: list, rows: list) -> str:
    def cell(x):
        if isinstance(x, float):
            return f"{x:.3f}" if abs(x) < 100 else f"{x:.1f}"
        return str(x)

    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


# plots ------------------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_acceptance_per_depth(series: dict, path, title: str = "acceptance per depth") -> Path:
    """series: {label: [P(reach depth d) for d = 1..]} -> line plot."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = {"chain": "-", "tree": "--", "static": ":"}
    for label, ys in series.items():
        if ys:
            ax.plot(range(1, len(ys) + 1), ys, marker="o", ms=4, ls=styles.get(label.split(":")[0], "-"), label=label)
    ax.set_xlabel("depth d")
    ax.set_ylabel("P(accepted path reaches depth d)")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=1 if len(series) <= 6 else 2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def plot_accept_hist(series: dict, path, title: str = "accepted draft tokens per step") -> Path:
    """series: {label: normalised histogram (index = accepted draft tokens)} -> grouped bars."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    series = {k: v for k, v in series.items() if v}
    n = max((len(v) for v in series.values()), default=1)
    if len(series) <= 5:  # grouped bars
        w = 0.8 / max(1, len(series))
        for i, (label, ys) in enumerate(series.items()):
            ax.bar([x + i * w for x in range(len(ys))], ys, width=w, label=label)
        ax.set_xticks([x + 0.4 - w / 2 for x in range(n)])
    else:  # many modes (sweeps): lines, styled by kind
        styles = {"chain": "-", "tree": "--", "static": ":"}
        for label, ys in series.items():
            ax.plot(range(len(ys)), ys, marker="o", ms=3, ls=styles.get(label.split(":")[0], "-"), label=label)
        ax.set_xticks(range(n))
    ax.set_xticklabels([str(x) for x in range(n)])
    ax.set_xlabel("accepted draft tokens in a step (tokens emitted = this + 1)")
    ax.set_ylabel("fraction of steps")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=1 if len(series) <= 6 else 2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def plot_xy(
    series: dict, path, xlabel: str, ylabel: str, title: str, hline: float | None = None, logx: bool = False
) -> Path:
    """series: {label: (xs, ys)} -> line plot (speedup vs k / tree budget, accepted length, ...)."""
    plt = _plt()
    from matplotlib.ticker import ScalarFormatter

    fig, ax = plt.subplots(figsize=(6.5, 4))
    colors, ticks = {}, set()
    for label, (xs, ys) in series.items():
        if not xs:
            continue
        base, _, variant = label.partition(", ")  # "X, CPU time" is drawn dashed in X's colour
        kw = {"color": colors[base], "ls": "--", "marker": "x"} if base in colors and variant else {"marker": "o"}
        (line,) = ax.plot(xs, ys, label=label, **kw)
        colors.setdefault(base, line.get_color())
        ticks.update(xs)
    if hline is not None:
        ax.axhline(hline, color="gray", lw=0.8, ls="--")
    if logx:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def default_out(name: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return ROOT / "eval" / "out" / f"{name}-{stamp}"
