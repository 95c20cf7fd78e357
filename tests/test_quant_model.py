"""Quantized models: load modes and their errors, GGUF blocks kept through the loader, lossless
speculation on quantized target and draft (each quantized on its own), load-time peak memory and
perplexity bounds."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import pytest
import torch

from specd.config import CacheConfig, EngineConfig, SpecConfig
from specd.engine.engine import Engine
from specd.engine.perplexity import perplexity
from specd.engine.sequence import SpecParams
from specd.model.loader import LoadError, load_model
from specd.model.quant import QuantLinear
from specd.sampling.params import SamplingParams
from tests.conftest import DRAFT, ROOT, TARGET, private_cache
from tests.test_gguf import model_gguf, write_gguf

Q = gguf.GGMLQuantizationType
DEMO = ROOT / "models" / "demo" / "target"


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    private_cache(tmp_path, monkeypatch)


def _projections(model) -> list:
    return [m for b in model.layers for m in (b.attn.qkv, b.attn.o, b.mlp.gate_up, b.mlp.down)]


@pytest.mark.parametrize("q", ["int8", "int4"])
def test_a_folder_quantized_in_place(q):
    lm = load_model(TARGET, "cpu", "float32", quantization=q)
    assert all(isinstance(p, QuantLinear) and p.fmt == q for p in _projections(lm.model))
    assert lm.model.lm_head is lm.model.embed and lm.model.lm_head.fmt == "int8"  # tied: one int8 table
    assert lm.model.quantized()


def test_bad_quantization_requests_are_one_line_errors(tmp_path):
    with pytest.raises(LoadError, match="unsupported quantization 'int3'"):
        load_model(TARGET, "cpu", "float32", quantization="int3")
    with pytest.raises(LoadError, match="needs a .gguf file"):
        load_model(TARGET, "cpu", "float32", quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(target=str(TARGET), quantization="fp8")
    path, _ = model_gguf(tmp_path, "llama", Q.Q5_0, layers=1)
    with pytest.raises(
        LoadError,
        match=r"--quantization gguf keeps Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K blocks, but blk\.0\.\w+\.weight is Q5_0",
    ):
        load_model(path, "cpu", "float32", quantization="gguf")


def test_gguf_blocks_are_kept_and_other_types_converted(tmp_path):
    """auto: Q8_0 / Q4_1 blocks as they are (fused q/k/v un-permuted); Q5_0 -> int8; Q3_K -> int4;
    F16 -> float. Each projection's weights equal gguf's dequantization (quantized ones within a step).
    (K-quants kept: tests/test_kquants.py.)"""
    from specd.model.gguf import hf_state_dict, open_gguf

    model = model_gguf(tmp_path, "llama", Q.F32, layers=1)[1]
    p = "model.layers.0."
    types = {p + "self_attn.q_proj.weight": Q.Q4_1, p + "self_attn.k_proj.weight": Q.Q4_1,
             p + "self_attn.v_proj.weight": Q.Q4_1, p + "self_attn.o_proj.weight": Q.Q8_0,
             p + "mlp.gate_proj.weight": Q.Q5_0, p + "mlp.up_proj.weight": Q.Q5_0,
             p + "mlp.down_proj.weight": Q.Q3_K, "lm_head.weight": Q.F16}  # fmt: skip
    cfg = model.config.to_dict()
    cfg["rope_theta"] = model.config.rope_parameters["rope_theta"]
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    path = write_gguf(tmp_path / "mixed.gguf", "llama", cfg, weights, Q.F32, types=types)
    lm = load_model(path, "cpu", "float32", quantization="auto")
    ref = hf_state_dict(open_gguf(path), _hf_cfg(path), path)  # gguf's dequantization, q/k un-permuted
    blk = lm.model.layers[0]
    qkv = torch.cat([ref[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    assert blk.attn.qkv.fmt == "int4" and torch.equal(blk.attn.qkv.dequantize(), qkv)
    assert blk.attn.o.fmt == "int8" and torch.equal(blk.attn.o.dequantize(), ref[p + "self_attn.o_proj.weight"])
    gu = torch.cat([ref[p + "mlp.gate_proj.weight"], ref[p + "mlp.up_proj.weight"]])
    assert blk.mlp.gate_up.fmt == "int8" and (blk.mlp.gate_up.dequantize() - gu).abs().max() < gu.abs().max() / 200
    assert blk.mlp.down.fmt == "int4"
    assert isinstance(lm.model.lm_head, torch.nn.Linear)  # F16 stays float
    assert torch.equal(lm.model.lm_head.weight, ref["lm_head.weight"])


def _hf_cfg(path):
    from specd.model.gguf import hf_config, open_gguf, read_metadata

    r = open_gguf(path)
    return hf_config(read_metadata(r, path), r, path)[0]


def _engine(target, draft, q):
    cfg = EngineConfig(target=str(TARGET), draft=str(DRAFT), dtype="float32", quantization=q,
                       cache=CacheConfig(num_blocks=256), spec=SpecConfig(adaptive=False))  # fmt: skip
    return Engine(cfg, target=target, draft=draft)


@pytest.mark.parametrize("tq,dq", [("int8", "int8"), ("int4", "int4"), ("int4", "none"), ("none", "int8")])
def test_greedy_speculation_is_lossless_on_quantized_models(tq, dq):
    """fp32 activations; chain and tree; batch 1 and 4: speculative output == plain output of the
    same (quantized) target, with target and draft quantized independently."""
    t = load_model(TARGET, "cpu", "float32", quantization=tq)
    d = load_model(DRAFT, "cpu", "float32", quantization=dq)
    assert isinstance(d.model.layers[0].mlp.down, QuantLinear) == (dq != "none")
    eng = _engine(t, d, tq)
    tok = eng.tokenizer
    prompts = [tok(p)["input_ids"] for p in ("Once upon a time", "The dog ran", "Lily saw a big", "Tom and Sue")]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for batch in (prompts[:1], prompts):
        plain = [s.output_ids for s in eng.generate(batch, params, SpecParams("off"))]
        for mode in ("chain", "tree"):
            seqs = eng.generate(batch, params, SpecParams(mode))
            assert [s.output_ids for s in seqs] == plain, (tq, dq, mode, len(batch))
            assert sum(s.stats.accepted_tokens for s in seqs) > 0


def _sampled_text(lm, n=384) -> list:
    """Text the unquantized model itself writes (seeded): held out from nothing, but a text it
    predicts well, so a quantization's damage shows in the perplexity."""
    eng = Engine(EngineConfig(target=str(DEMO), dtype="float32", cache=CacheConfig(num_blocks=128)), target=lm)
    ids = lm.tokenizer("Once upon a time")["input_ids"]
    s = eng.generate([ids], SamplingParams(temperature=1.0, seed=5, max_tokens=n, ignore_eos=True))[0]
    return ids + list(s.output_ids)


def test_perplexity_bounds():
    """int8 within +2% and int4 within +10% of the unquantized model's perplexity (the demo target)."""
    base = load_model(DEMO, "cpu", "float32")
    ids = _sampled_text(base)
    ppl = {q: perplexity(load_model(DEMO, "cpu", "float32", quantization=q), ids) for q in ("int8", "int4")}
    ref = perplexity(base, ids)
    assert ppl["int8"] <= ref * 1.02 and ppl["int4"] <= ref * 1.10, (ref, ppl)
    assert ppl["int4"] != ref  # the quantization did change the weights


PEAK = r"""
import json, sys, threading, time
import torch
from specd.model.gguf import cached_folder, check_tensors, open_gguf
from specd.model.loader import load_model
import specd.model.llama, specd.model.quant_load, specd.model.qkernel  # every import before the baseline

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

path = sys.argv[1]
cached_folder(path, weights=False)  # config + tokenizer first: not what is measured
torch.empty(1, device="meta").normal_()  # torch's meta kernels load once (~80 MB of code, no weights)
base, peak, stop = anon(), [0], []
def watch():
    while not stop:
        peak[0] = max(peak[0], anon()); time.sleep(0.0005)
th = threading.Thread(target=watch); th.start()
lm = load_model(path, "cpu", "float32", quantization=sys.argv[2], with_tokenizer=False, progress=False)
time.sleep(0.01); stop.append(1); th.join()
q = sum(m.nbytes() for m in lm.model.modules() if hasattr(m, "nbytes"))
fl = sum(p.numel() * p.element_size() for p in lm.model.parameters())
print(json.dumps({"peak": peak[0] - base, "quantized": q, "float": fl}))
"""


def test_gguf_load_peak_memory_is_bounded(tmp_path):
    """Repacking a Q4_1 file holds at most 1.5x the quantized weights plus one layer in fp32 (the
    fp32 model would be ~6x the quantized size)."""
    path, model = model_gguf(tmp_path, "llama", Q.Q4_1, layers=6, hidden_size=512, intermediate_size=1536)
    layer_fp32 = sum(p.numel() * 4 for n, p in model.named_parameters() if ".layers.0." in n)
    out = subprocess.run([sys.executable, "-c", PEAK, str(path), "gguf"], capture_output=True, text=True,
                         cwd=ROOT, env={**__import__("os").environ}, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["peak"] <= 1.5 * (r["quantized"] + r["float"]) + layer_fp32, (r, layer_fp32)
    assert sum(p.numel() * 4 for p in model.parameters()) > 4 * (r["quantized"] + r["float"])


@pytest.fixture(scope="module")
def builtin_q4():
    """The built-in SmolLM2-135M-Instruct GGUF with its own Q4_1 / Q8_0 blocks (the cached file)."""
    from specd.model.builtin import builtin_gguf

    path = builtin_gguf()
    if not path.exists():
        pytest.fail(f"the built-in model is not cached at {path} (make install fetches it)")
    return load_model(path, "cpu", "float32", quantization="gguf")


@pytest.mark.parametrize("dq", ["none", "int8"])
def test_builtin_gguf_quantized_with_its_reduced_vocabulary_draft(builtin_q4, dq):
    """A short run on the real model: the draft shares the target's quantized (Q8_0) embeddings and
    head rows by reference, quantized or not itself; speculative == plain, chain and tree."""
    t = builtin_q4
    assert t.model.lm_head.fmt == "int8" and t.model.layers[0].mlp.down.fmt == "int4"
    d = load_model(ROOT / "models" / "smollm2-draft", "cpu", "float32", target=t, quantization=dq)
    assert d.model.embed is t.model.embed and isinstance(d.model.head_rows, QuantLinear)
    cfg = EngineConfig(target=str(t.path), draft="smollm2-draft", dtype="float32", cache=CacheConfig(num_blocks=128),
                       spec=SpecConfig(adaptive=False))  # fmt: skip
    eng = Engine(cfg, target=t, draft=d)
    tok = eng.tokenizer
    msgs = ["What is 12 + 30?", "Name the capital of France."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True) for m in msgs]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [s.output_ids for s in eng.generate(prompts, params, SpecParams("off"))]
    assert "Paris" in tok.decode(plain[1])
    for mode in ("chain", "tree"):
        assert [s.output_ids for s in eng.generate(prompts, params, SpecParams(mode))] == plain, mode


def test_builtin_with_int8_activations_speculates_losslessly_and_still_answers(builtin_q4):
    """``--act-quant int8`` on the real model: speculative == plain (chain and tree, a batch of two),
    the factual answer survives, and the output is its own (it differs from fp32 activations
    somewhere in these prompts, else the switch did nothing)."""
    from specd.model.quant import set_act_int8

    t = builtin_q4
    d = load_model(ROOT / "models" / "smollm2-draft", "cpu", "float32", target=t)
    tok = t.tokenizer
    msgs = ["What is 12 + 30?", "Name the capital of France.", "Write one sentence about the sea."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True) for m in msgs]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    def engine(act):
        cfg = EngineConfig(target=str(t.path), draft="smollm2-draft", dtype="float32", act_quant=act,
                           cache=CacheConfig(num_blocks=128), spec=SpecConfig(adaptive=False))  # fmt: skip
        return Engine(cfg, target=t, draft=d)

    fp32 = [s.output_ids for s in engine("none").generate(prompts, params, SpecParams("off"))]
    try:
        eng = engine("int8")
        assert t.model.layers[0].mlp.down.act_int8 and t.model.lm_head.act_int8
        plain = [s.output_ids for s in eng.generate(prompts, params, SpecParams("off"))]
        assert "Paris" in tok.decode(plain[1]) and plain != fp32
        for mode in ("chain", "tree"):
            assert [s.output_ids for s in eng.generate(prompts, params, SpecParams(mode))] == plain, mode
    finally:
        set_act_int8(t.model, False)


def test_int8_activations_need_quantized_weights():
    t = load_model(TARGET, "cpu", "float32")
    with pytest.raises(LoadError, match="act-quant int8 needs quantized weights"):
        Engine(EngineConfig(target=str(TARGET), dtype="float32", act_quant="int8"), target=t)
    with pytest.raises(ValueError, match="act_quant"):
        EngineConfig(target=str(TARGET), act_quant="int4")


def test_act_quant_auto_is_the_command_lines_default_and_picks_int8_for_quantized_weights():
    """``auto`` (the flag's default): int8 activations on a quantized target (draft included), fp32
    on an unquantized one; the Python API's default stays ``none``."""
    from specd.options import engine_config, serve_parser

    assert engine_config(serve_parser().parse_args(["--target", str(TARGET)])).act_quant == "auto"
    assert EngineConfig(target=str(TARGET)).act_quant == "none"
    q = load_model(TARGET, "cpu", "float32", quantization="int4")
    d = load_model(DRAFT, "cpu", "float32", quantization="int8")
    Engine(EngineConfig(target=str(TARGET), draft=str(DRAFT), dtype="float32", act_quant="auto"), target=q, draft=d)
    assert q.model.layers[0].mlp.down.act_int8 and d.model.layers[0].mlp.down.act_int8
    plain = load_model(TARGET, "cpu", "float32")
    Engine(EngineConfig(target=str(TARGET), dtype="float32", act_quant="auto"), target=plain)  # no error, fp32


def test_kv_dtype_auto_is_fp16_for_a_quantized_model_on_the_cpu_kernel_and_explicit_choices_are_checked():
    """``--kv-dtype auto``: fp16 under a quantized fp32 model on the CPU kernel, the model's dtype
    otherwise; fp16 may be asked for under an fp32 model there; anything else is a one-line error."""
    from specd.options import engine_config, serve_parser

    assert engine_config(serve_parser().parse_args(["--kv-dtype", "float16"])).cache.dtype == "float16"
    with pytest.raises(ValueError, match="KV cache dtype"):
        CacheConfig(dtype="int8")
    q = load_model(TARGET, "cpu", "float32", quantization="int4")
    plain = load_model(TARGET, "cpu", "float32")
    for lm, kv, want in ((q, "auto", torch.float16), (plain, "auto", torch.float32), (q, "float32", torch.float32),
                         (plain, "float16", torch.float16)):  # fmt: skip
        cfg = EngineConfig(target=str(TARGET), dtype="float32", cache=CacheConfig(num_blocks=32, dtype=kv))
        assert Engine(cfg, target=lm).cache.kv.dtype == want, (kv, want)
    cfg = EngineConfig(target=str(TARGET), dtype="float32", cache=CacheConfig(num_blocks=32, dtype="bfloat16"))
    with pytest.raises(LoadError, match="--kv-dtype bfloat16: a float32 model on cpu keeps its KV cache"):
        Engine(cfg, target=plain)
