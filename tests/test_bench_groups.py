"""``python -m eval bench groups`` (eval/bench_groups.py) smoke test on the tiny stories260K pair:
groups run under each mode, the makespan and mean-completion table is printed, and the speculative
mode's greedy output equals plain decoding's in every group."""

from conftest import DRAFT, SHARED, TARGET

from eval.__main__ import main as eval_main


def test_bench_groups_smoke(capsys):
    rc = eval_main(
        ["bench", "groups", "--target", str(TARGET), "--draft", str(DRAFT), "--head", "none", "--quantization", "none",
         "--prompts", str(SHARED / "data" / "spec_bench" / "question.jsonl"), "--categories", "qa",
         "--per-category", "4", "--batch", "2", "--max-tokens", "8", "--rounds", "1", "--modes", "off,ngram",
         "--threads", "1"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    rows = {ln.split("|")[1].strip(): ln for ln in out.splitlines() if ln.startswith(("| off ", "| ngram "))}
    assert set(rows) == {"off", "ngram"}
    assert rows["off"].rstrip().endswith("| 2/2 |") and rows["ngram"].rstrip().endswith("| 2/2 |")
    assert "ms/step" in out
