"""Streamed pieces joined == full decode, for byte-level BPE (gpt2) and sentencepiece (mistral)."""

import pytest
from transformers import AutoTokenizer

from specd.engine.detokenizer import IncrementalDetokenizer
from tests.conftest import SHARED

TEXTS = [
    "Hello world! 🎉🚀 emoji 👩‍👩‍👧 family",
    "中文字符测试，日本語のテキスト、한국어",
    "runs   of    spaces\tand\n\nnewlines   end  ",
    "mixed: café naïve — “quotes” 1+1=2 😀x",
]


@pytest.mark.parametrize("name", ["gpt2", "mistral7b"])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_equals_full_decode(name, text, chunk):
    tok = AutoTokenizer.from_pretrained(str(SHARED / "tokenizers" / name))
    prompt = tok("Say:", add_special_tokens=False)["input_ids"]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok, prompt)
    pieces = []
    for i in range(0, len(ids), chunk):
        piece = d.add(ids[i : i + chunk])
        assert "\ufffd" not in piece, "emitted a broken character"
        pieces.append(piece)
    pieces.append(d.flush())
    full = tok.decode(prompt + ids, skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)) :]
    assert "".join(pieces) == full
    if name == "mistral7b":  # sentencepiece: the leading space of the first word survives streaming
        assert full.startswith(" ") or text[0] in "中"
