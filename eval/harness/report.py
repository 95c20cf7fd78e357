"""Reports: every tool writes ``report.json`` / ``results.json`` (:func:`write_json`), Markdown tables
(:func:`md_table`) and PNG plots under ``--out`` (default :func:`default_out`: ``eval/out/NAME-DATE``,
git-ignored); results worth keeping are copied by hand into docs/benchmarks.md.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

from eval.harness.machine import ROOT

SCHEMA = "specd.eval/1"  # report.json's "schema" (acceptance and bench)


# files and tables ------------------------------------------------------------------------------
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
def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_acceptance_per_depth(series: dict, path, title: str = "acceptance per depth") -> Path:
    """series: {label: [P(reach depth d) for d = 1..]} -> line plot."""
    plt = pyplot()
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
    return save_fig(fig, path)


def plot_accept_hist(series: dict, path, title: str = "accepted draft tokens per step") -> Path:
    """series: {label: normalised histogram (index = accepted draft tokens)} -> grouped bars."""
    plt = pyplot()
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
    return save_fig(fig, path)


def plot_xy(
    series: dict, path, xlabel: str, ylabel: str, title: str, hline: float | None = None, logx: bool = False
) -> Path:
    """series: {label: (xs, ys)} -> line plot (speedup vs k / tree budget, accepted length, ...)."""
    plt = pyplot()
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
    return save_fig(fig, path)


def save_fig(fig, path) -> Path:
    """Write ``fig`` as a PNG at ``path`` (folders created) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def default_out(name: str) -> Path:
    """``eval/out/NAME-DATE-TIME/`` (git-ignored)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return ROOT / "eval" / "out" / f"{name}-{stamp}"


def out_dir(out: str | None, name: str) -> Path:
    """The folder a tool writes to: ``out`` (``--out``), else :func:`default_out`; created."""
    path = Path(out) if out else default_out(name)
    path.mkdir(parents=True, exist_ok=True)
    return path
