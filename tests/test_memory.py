"""Resident memory of a loaded GGUF model, like a memory-mapped file's: a random-weight Llama file
(Q4_0, or llama.cpp's Q4_K_M mix of K-quants) loaded in a fresh process grows its resident set by
at most 1.2x the file plus the KV cache plus a measured constant, after a forward (the kernel's
layouts built) and at its peak. ``write_random_llama`` also writes the benchmark's 1.7B-shaped
files (docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from specd.model.qkernel import kernel
from tests.conftest import private_cache

Q = gguf.GGMLQuantizationType
ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_1_7B = dict(hidden=2048, layers=24, heads=32, kv_heads=32, inter=8192, vocab=49152)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose v and down projections Q4_K_M keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _types(mix: str, layers: int) -> dict:
    """GGUF name -> type of every 2-D tensor for ``mix``: ``q4_0`` (Q4_0, the embeddings Q8_0) or
    ``q4_k_m`` (Q4_K; v and down Q6_K on ``use_more_bits`` layers; the tied embeddings Q6_K)."""
    if mix not in ("q4_0", "q4_k_m"):
        raise ValueError(f"unknown mix {mix!r}; known: q4_0, q4_k_m")
    base, more = (Q.Q4_0, Q.Q4_0) if mix == "q4_0" else (Q.Q4_K, Q.Q6_K)
    t = {"token_embd.weight": Q.Q8_0 if mix == "q4_0" else Q.Q6_K}
    for i in range(layers):
        for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            t[f"blk.{i}.{n}.weight"] = base
        for n in ("attn_v", "ffn_down"):
            t[f"blk.{i}.{n}.weight"] = more if use_more_bits(i, layers) else base
    return t


def random_blocks(qtype, N: int, K: int, rng) -> np.ndarray:
    """Blocks [N, bytes per row] of random weights centred on zero, spread ~1 / sqrt(K)."""
    from tests.test_kquants import centered_blocks

    if qtype in (Q.Q4_0, Q.Q8_0):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (N * K // block, size), dtype=np.uint8)
        d = 1.0 / ((4.6 if qtype == Q.Q4_0 else 74.0) * K**0.5)  # (the codes' spread: 4.6, 74)
        raw[:, 0:2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
        return raw.reshape(N, -1)
    return centered_blocks(np.zeros((N, K), np.float32), qtype, rng)


def write_random_llama(path, mix: str, hidden: int, layers: int, heads: int, kv_heads: int, inter: int,
                       vocab: int, tokenizer_from=None, context: int = 8192) -> Path:  # fmt: skip
    """A tied-embedding Llama GGUF of random blocks (``mix``: see ``_types``); ``tokenizer_from``: a
    GGUF whose tokenizer fields to copy (its vocabulary must be ``vocab`` tokens), else the tests'
    tiny vocabulary (``tests.test_gguf.TOKENS``)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", f"random-{mix}")
    for key, val in {"block_count": layers, "context_length": context, "embedding_length": hidden,
                     "feed_forward_length": inter, "attention.head_count": heads,
                     "attention.head_count_kv": kv_heads, "vocab_size": vocab}.items():  # fmt: skip
        w.add_uint32(f"llama.{key}", val)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    if tokenizer_from is not None:
        _copy_tokenizer(w, tokenizer_from)
    else:
        _tiny_tokenizer(w)
    rng = np.random.default_rng(0)
    D = hidden // heads
    shapes = {"token_embd": (vocab, hidden), "attn_q": (hidden, hidden), "attn_k": (kv_heads * D, hidden),
              "attn_v": (kv_heads * D, hidden), "attn_output": (hidden, hidden), "ffn_gate": (inter, hidden),
              "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}  # fmt: skip
    for name, qtype in _types(mix, layers).items():
        N, K = shapes[name.split(".")[-2]]
        w.add_tensor(name, random_blocks(qtype, N, K, rng), raw_dtype=qtype)
    norm = np.ones(hidden, np.float32)
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm)
    w.add_tensor("output_norm.weight", norm)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _copy_tokenizer(w, src) -> None:
    from gguf import GGUFValueType as V

    r = gguf.GGUFReader(str(src))
    for name, f in r.fields.items():
        if not name.startswith("tokenizer."):
            continue
        if f.types[0] == V.ARRAY:
            w.add_array(name, [f.contents(i) for i in range(len(f.data))])
        else:
            w.add_key_value(name, f.contents(), f.types[0])


def _tiny_tokenizer(w) -> None:
    """``tests.test_gguf``'s byte-level vocabulary (``TOKENS``: the file's vocab must be its size)."""
    from tests.test_gguf import MERGES, TOKEN_TYPES, TOKENS

    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", TOKENS)
    w.add_array("tokenizer.ggml.token_type", TOKEN_TYPES)
    w.add_array("tokenizer.ggml.merges", MERGES)
    w.add_uint32("tokenizer.ggml.eos_token_id", TOKENS.index("<|im_end|>"))


# the test ----------------------------------------------------------------------------------------------
SHAPE = dict(hidden=1024, layers=4, heads=16, kv_heads=4, inter=4096, context=2048)
# bytes: what a load adds whatever the file's size (measured on this test's 33-37 MB files): the RoPE
# tables (1 MiB at 2048 positions; their construction peaks at twice that), one chunk's repacking
# temporaries (CHUNK_BYTES of the file: a few MiB) and the allocator's pages not yet handed back
SLACK = 16 << 20


@pytest.mark.skipif(kernel() is None, reason="no CPU kernel here: the dequantizing fallback keeps other layouts")
@pytest.mark.parametrize("mix", ["q4_0", "q4_k_m"])
def test_a_gguf_load_is_resident_like_its_file(tmp_path, mix, monkeypatch):
    """A ~40 MB random Llama file (Q4_0, or Q4_K / Q6_K as llama.cpp's Q4_K_M) in a fresh process,
    the baseline taken after a first tiny load (imports, the kernel, first-call costs): the load
    grows the resident set by at most 1.2x the file, its peak too, and after the KV cache and a
    forward (the kernel's layouts in use) by at most 1.2x the file plus the cache (each plus
    SLACK). Before this change a 1.7B file grew it by 2.5x (Q4_0) to 3.3x (Q4_K_M, requantized) plus
    the cache: the row layout with fp32 scales beside the kernel's packed copy, the mapped file and
    the GGUF reader's vocabulary objects resident at once (docs/benchmarks.md, session 23)."""
    from tests.test_gguf import TOKENS

    warm = write_random_llama(tmp_path / "warm.gguf", mix, hidden=256, layers=1, heads=4, kv_heads=2, inter=512,
                              vocab=len(TOKENS))  # fmt: skip
    path = write_random_llama(tmp_path / "m.gguf", mix, vocab=len(TOKENS), **SHAPE)
    cache = private_cache(tmp_path, monkeypatch)  # (the built kernel, not a rebuild)
    env = {"SPECD_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "eval.bench_kquants", "rss", str(path), "gguf", "--warm", str(warm), "--kv-mib", "8",
           "--threads", "1"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps({k: round(v / m["file"], 3) if isinstance(v, int) else v for k, v in m.items()}))
    assert m["file"] > 30 << 20 and m["kinds"] == (["KQuantLinear"] if mix == "q4_k_m" else ["QuantLinear"])
    assert m["loaded"] - m["base"] <= 1.2 * m["file"] + SLACK, m
    assert m["peak"] - m["base"] <= 1.2 * m["file"] + SLACK, m
    assert m["after"] - m["base"] <= 1.2 * m["file"] + m["kv"] + SLACK, m
