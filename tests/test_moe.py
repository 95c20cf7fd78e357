"""Mixtures of experts (Qwen3-MoE, Mixtral) == transformers, from HF folders and GGUF files.

Tiny random-weight models built with transformers' own config and model classes (the helpers and
the ~300-token vocabulary of tests/test_model_families.py): specd's logits equal transformers' in
fp32 within 1e-4 on prefill, decode and draft-tree rows; its routing (chosen experts and their
weights) equals transformers' router outputs; only the chosen experts run; greedy speculation equals
plain greedy; a Q8_0 GGUF's experts run on their own blocks; unsupported mixtures are one-line errors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from specd.model import gguf as sg
from specd.model.loader import LoadError, load_model
from specd.model.moe import Expert, SparseMoE
from specd.model.quant import QuantLinear, set_act_int8
from specd.model.tp_shard import check_shardable
from tests import test_model_families as fam
from tests.conftest import private_cache
from tests.test_gguf import gguf_name as base_gguf_name
from tests.test_model_families import (
    TOL,
    V,
    assert_rows_match,
    assert_speculation_lossless,
    engine,
    prompts,
    specd_rows,
    the_tree,
)


def moe_classes(family: str):
    import transformers as tf

    return {
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
    }[family]


QWEN3_MOE = dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
MOE_FAMILIES = {  # (family, config): what real checkpoints use, plus the routing switches
    "qwen3_moe": ("qwen3_moe", dict(QWEN3_MOE, mlp_only_layers=[1])),  # layer 1 keeps a dense MLP
    "qwen3_moe-unnormed-step2": (
        "qwen3_moe",
        dict(QWEN3_MOE, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2),
    ),  # fmt: skip
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)),
    "mixtral-windowed": (
        "mixtral",
        dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=32, sliding_window=7),
    ),  # fmt: skip
}
GGUF_MOE = {  # what llama.cpp runs: experts in every layer, the top k renormalised
    "qwen3_moe": ("qwen3_moe", dict(QWEN3_MOE, num_experts_per_tok=3)),
    "mixtral": MOE_FAMILIES["mixtral"],
}


def moe_folder(tmp_path: Path, name: str, families: dict = MOE_FAMILIES) -> tuple[Path, object]:
    """(an HF folder of ``families[name]`` saved by transformers, the transformers model)."""
    family, over = families[name]
    with mock.patch.object(fam, "hf_classes", moe_classes):
        folder, model = fam.hf_folder(tmp_path, family, **over)
    model.config._attn_implementation = "eager"
    return folder, model


def router_outputs(model, ids: list) -> dict:
    """Layer index -> (router input [T, d], transformers' routing weights [T, k], chosen experts [T, k])."""
    seen: dict = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:

            def hook(mod, args, out, i=i):
                seen[i] = (args[0].reshape(-1, args[0].shape[-1]).clone(), out[1].clone(), out[2].clone())

            hooks.append(gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(torch.tensor([ids], device=model.device))
    finally:
        for h in hooks:
            h.remove()
    return seen


# the families ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MOE_FAMILIES))
def test_moe_family_matches_transformers_and_speculates_losslessly(tmp_path, name):
    """Prefill, decode and tree rows == transformers (torch and CPU attention); greedy speculation
    (prompt lookup, a draft chain and tree) == plain greedy == transformers' greedy."""
    folder, model = moe_folder(tmp_path, name)
    lm = load_model(folder, "cpu", "float32", with_tokenizer=False)
    cfg = lm.config
    assert cfg.architecture == type(model).__name__
    hf_moe = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    assert list(cfg.moe_layers) == hf_moe and hf_moe  # the same layers are mixtures
    assert [isinstance(b.mlp, SparseMoE) for b in lm.model.layers] == [cfg.is_moe(i) for i in range(cfg.num_layers)]
    with pytest.raises(ValueError, match="a mixture of experts: use --tensor-parallel-size 1"):
        check_shardable(cfg, 2)  # (tensor-parallel ranks compute Llama's layers only)
    assert_rows_match(lm, model)
    eng = engine(folder)
    ps = prompts()
    plain = assert_speculation_lossless(eng, ps)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ps[0]]), max_new_tokens=24, do_sample=False)[0, len(ps[0]) :]
    assert plain[0] == ref.tolist()


@pytest.mark.parametrize("name", ["qwen3_moe-unnormed-step2", "mixtral"])
def test_routing_equals_transformers_router(tmp_path, name):
    """On transformers' own router inputs, specd picks the same experts in the same rank order with
    the same weights (renormalised or not), and a tie between two experts breaks as torch.topk breaks
    it in transformers; the block's output equals transformers' MoE block's."""
    folder, model = moe_folder(tmp_path, name)
    lm = load_model(folder, "cpu", "float32", with_tokenizer=False)
    ids = torch.randint(0, V, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    seen = router_outputs(model, ids)
    assert sorted(seen) == list(lm.config.moe_layers)
    for i, (h, w_ref, idx_ref) in seen.items():
        w, idx = lm.model.layers[i].mlp.route(h)
        assert torch.equal(idx, idx_ref), i
        torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)
        sums = w.sum(-1)
        assert torch.allclose(sums, torch.ones_like(sums)) == lm.config.norm_topk_prob
        with torch.no_grad():
            ref = model.model.layers[i].mlp(h.unsqueeze(0))[0]
        assert (lm.model.layers[i].mlp(h) - ref).abs().max().item() < 1e-5
    i = lm.config.moe_layers[0]  # experts 0 and 1 with equal router rows: every token ties them
    with torch.no_grad():
        model.model.layers[i].mlp.gate.weight[1] = model.model.layers[i].mlp.gate.weight[0]
        lm.model.layers[i].mlp.router.weight[1] = lm.model.layers[i].mlp.router.weight[0]
    h, w_ref, idx_ref = router_outputs(model, ids)[i]
    w, idx = lm.model.layers[i].mlp.route(h)
    assert ((idx_ref == 0).any(-1) & (idx_ref == 1).any(-1)).any()  # some token chose both tied experts
    assert torch.equal(idx, idx_ref) and torch.allclose(w, w_ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_bf16_routing_is_transformers_bit_for_bit(tmp_path, name):
    """In bf16 (CUDA's default dtype; the test runs on CUDA where present) the router's logits are bf16
    and its softmax fp32, as in transformers: on transformers' router inputs the chosen experts and
    their weights are equal bit for bit (Qwen3-MoE's weights rounded to bf16, Mixtral's kept in fp32),
    and the block's output is within bf16 rounding of transformers' block."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    folder, model = moe_folder(tmp_path, name)
    model = model.to(device=device, dtype=torch.bfloat16)
    lm = load_model(folder, device, "bfloat16", with_tokenizer=False)
    ids = torch.randint(0, V, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    for i, (h, w_ref, idx_ref) in router_outputs(model, ids).items():
        moe = lm.model.layers[i].mlp
        w, idx = moe.route(h)
        assert w.dtype == (torch.float32 if name == "mixtral" else torch.bfloat16) == w_ref.dtype
        assert torch.equal(idx, idx_ref) and torch.equal(w, w_ref), i
        with torch.no_grad():
            ref = model.model.layers[i].mlp(h.unsqueeze(0))[0].float()
        assert (moe(h).float() - ref).abs().max().item() < 0.02 * ref.abs().max().item()


def test_only_the_chosen_experts_run_on_their_tokens_rows(tmp_path, monkeypatch):
    """In every mixture call (prefill chunks, decode steps, a draft tree) the experts that run are
    exactly the router's choices, each on as many rows as tokens chose it (no other expert is
    touched: T * k rows in all, not T * E); the dense reference (every expert, the unchosen ones
    weighted 0) gives the same logits."""
    folder, _ = moe_folder(tmp_path, "qwen3_moe")
    lm = load_model(folder, "cpu", "float32", with_tokenizer=False)
    events: list = []
    route, run = SparseMoE.route, Expert.forward

    def routed(self, h, ops=None):
        w, idx = route(self, h, ops)
        events.append((self, idx))
        return w, idx

    monkeypatch.setattr(SparseMoE, "route", routed)
    monkeypatch.setattr(Expert, "forward", lambda self, x, ops=None: events.append((self, x.shape[0])) or run(self, x))
    ids = torch.randint(0, V, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    tree, tree_ids = the_tree()
    sparse = specd_rows(lm, ids, 20, tree, tree_ids)
    calls = [i for i, (m, _) in enumerate(events) if isinstance(m, SparseMoE)]
    assert len(calls) == 13 * len(lm.config.moe_layers)  # 2 prefill chunks, 10 decode steps, 1 tree
    for a, b in zip(calls, calls[1:] + [len(events)]):
        moe, idx = events[a]
        ran = {list(moe.experts).index(ex): n for ex, n in events[a + 1 : b]}  # (an expert runs once per call)
        assert len(ran) == b - a - 1
        assert ran == {int(e): int((idx == e).sum()) for e in idx.unique()}
    rows = sum(n for m, n in events if isinstance(m, Expert))
    assert rows == (30 + len(tree_ids)) * lm.config.num_experts_per_tok * len(lm.config.moe_layers)
    events.clear()
    monkeypatch.setattr(SparseMoE, "all_experts", True)
    dense = specd_rows(lm, ids, 20, tree, tree_ids)
    c, dense_rows = lm.config, sum(n for m, n in events if isinstance(m, Expert))
    assert dense_rows == (30 + len(tree_ids)) * c.num_experts * len(c.moe_layers)
    for a, b in zip(sparse, dense):
        assert (a - b).abs().max().item() < TOL


def test_batch_invariant_ops_route_and_run_the_experts(tmp_path, monkeypatch):
    """With the batch-invariant ops (``--batch-invariant``, CUDA's greedy steps; here the Triton kernels
    interpreted on CPU tensors, as tests/test_invariant_forward.py runs them) the router's and the
    experts' GEMMs take the kernels: the mixture's output equals the ordinary path within 1e-4, and a
    token's row has the same bits alone as among the others."""
    from specd_kernels import batch_invariant as bi
    from tests.test_invariant_forward import DEVICE, OPS

    folder, _ = moe_folder(tmp_path, "qwen3_moe")
    lm = load_model(folder, DEVICE.type, "float32", with_tokenizer=False)
    moe = lm.model.layers[0].mlp
    calls = []
    matmul = bi.matmul
    monkeypatch.setattr(bi, "matmul", lambda *a, **kw: calls.append(a[0].shape[0]) or matmul(*a, **kw))
    h = torch.randn(5, lm.config.hidden_size, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    batched = moe(h, OPS)
    assert calls[0] == 5 and len(calls) == 1 + 2 * len(moe.route(h)[1].unique())  # the router, then each expert
    alone = torch.cat([moe(h[i : i + 1], OPS) for i in range(5)])
    assert torch.equal(batched, alone)
    assert (batched - moe(h)).abs().max().item() < TOL


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_fused_expert_checkpoints_load_too(tmp_path, name):
    """A checkpoint saved in transformers 5's own layout (the router as ``mlp.gate``, every layer's
    experts in 3-D ``mlp.experts.gate_up_proj`` [E, 2I, d] / ``down_proj`` [E, d, I]) loads to the
    same model as the per-expert files of the Hub."""
    from safetensors.torch import save_file

    folder, model = moe_folder(tmp_path, name)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    (folder / "model.safetensors").unlink()
    save_file(state, str(folder / "model.safetensors"))
    lm = load_model(folder, "cpu", "float32", with_tokenizer=False)
    assert_rows_match(lm, model, n=20, prompt=12, backends=("torch",))


@pytest.mark.parametrize("act", ["none", "int8"])
def test_int8_experts_of_a_folder(tmp_path, act):
    """``--quantization int8`` on a folder makes every expert's projections ``QuantLinear`` (the router
    stays in floats): fp32 activations equal the dequantized float model within 1e-4; a token's
    mixture output has the same bits decoded alone (one row) as grouped with 12 others (the CPU
    kernel's rows are independent), and greedy speculation with either activations is lossless."""
    folder, _ = moe_folder(tmp_path, "mixtral")
    q = load_model(folder, "cpu", "float32", with_tokenizer=False, quantization="int8")
    moe = q.model.layers[0].mlp
    assert all(isinstance(p, QuantLinear) for ex in moe.experts for p in (ex.gate_up, ex.down))
    assert isinstance(moe.router, torch.nn.Linear)
    set_act_int8(q.model, act == "int8")
    h = torch.randn(13, q.config.hidden_size, generator=torch.Generator().manual_seed(2))
    assert torch.equal(moe(h), torch.cat([moe(h[i : i + 1]) for i in range(13)]))
    set_act_int8(q.model, False)
    ref = load_model(folder, "cpu", "float32", with_tokenizer=False)
    _dequantize_into(ref.model, q.model)
    ids = torch.randint(0, V, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    tree, tree_ids = the_tree()
    for a, b in zip(specd_rows(q, ids, 20, tree, tree_ids, "cpu"), specd_rows(ref, ids, 20, tree, tree_ids, "cpu")):
        assert (a - b).abs().max().item() < TOL
    assert_speculation_lossless(engine(folder, quantization="int8", act_quant=act), prompts())


def _dequantize_into(float_model, quant_model) -> None:
    """Every ``QuantLinear`` of ``quant_model``'s layers' weight, dequantized, into ``float_model``."""
    floats = dict(float_model.named_modules())
    with torch.no_grad():
        for name, m in quant_model.named_modules():
            if isinstance(m, QuantLinear):
                floats[name].weight.copy_(m.dequantize())
    float_model._flat = None


# GGUF files ------------------------------------------------------------------------------------------
def moe_gguf(
    tmp_path: Path, name: str, qtype, *, families: dict = GGUF_MOE, types: dict | None = None, **meta_over
) -> tuple[Path, object]:
    """(a GGUF file laid out as llama.cpp's converter writes families[name]: the router
    ``ffn_gate_inp``, the experts stacked in 3-D ``ffn_{gate,up,down}_exps``, Qwen3-MoE's q/k norms;
    Mixtral as "llama" with ``llama.expert_count``, the transformers model). ``types``: per weight
    (HF names, the experts' as ``...mlp.experts.{gate,up,down}_exps``) a type other than ``qtype``."""
    from tests import test_gguf

    family, _ = families[name]
    _, model = moe_folder(tmp_path / "hf", name, families)
    cfg = model.config.to_dict()
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    arch = "qwen3moe" if family == "qwen3_moe" else "llama"
    weights, extra = {}, {}
    for k, v in model.state_dict().items():
        w = v.detach().numpy()
        if k.endswith(("q_norm.weight", "k_norm.weight")):
            extra[f"blk.{k.split('.')[2]}.attn_{k.split('.')[-2][0]}_norm.weight"] = w
        elif k.endswith("experts.gate_up_proj"):  # [E, 2I, d]: gate rows, then up rows
            half = w.shape[1] // 2
            weights[k.replace("gate_up_proj", "gate_exps")], weights[k.replace("gate_up_proj", "up_exps")] = (
                np.ascontiguousarray(w[:, :half]), np.ascontiguousarray(w[:, half:]))  # fmt: skip
        else:
            weights[k.replace("experts.down_proj", "experts.down_exps")] = w
    E, k_used = model.config.num_local_experts, model.config.num_experts_per_tok
    meta = {f"{arch}.expert_count": E, f"{arch}.expert_used_count": k_used, **meta_over}
    if family == "qwen3_moe":
        meta[f"{arch}.expert_feed_forward_length"] = model.config.moe_intermediate_size
        meta[f"{arch}.attention.key_length"] = meta[f"{arch}.attention.value_length"] = cfg["head_dim"]
    with mock.patch.object(test_gguf, "gguf_name", _moe_gguf_name):
        path = test_gguf.write_gguf(tmp_path / f"{name}-{qtype.name}.gguf", arch, cfg, weights, qtype, meta=meta,
                                    extra=extra, types=types)  # fmt: skip
    return path, model


def _moe_gguf_name(hf: str) -> str:
    """tests/test_gguf.py's GGUF names, plus a mixture's router and stacked experts."""
    i = hf.split(".")[2] if hf.startswith("model.layers.") else None
    for part, kind in (("mlp.gate.weight", "ffn_gate_inp"), ("gate_exps", "ffn_gate_exps"),
                       ("up_exps", "ffn_up_exps"), ("down_exps", "ffn_down_exps")):  # fmt: skip
        if hf.endswith(part):
            return f"blk.{i}.{kind}.weight"
    return base_gguf_name(hf)


def converted_reference(path: Path, folder: Path):
    """transformers' model (fp32, eager attention) on ``specd convert``'s folder of the GGUF file ``path``."""
    from transformers import AutoModelForCausalLM

    sg.convert(path, folder)
    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ref.config._attn_implementation = "eager"
    return ref


@pytest.mark.parametrize("name", list(GGUF_MOE))
def test_moe_gguf_matches_transformers(tmp_path, name, monkeypatch):
    """F32 file -> specd == the transformers model; Q8_0 file -> specd on each expert's own blocks
    (fp32 activations) == transformers on the converted folder within 1e-4 (with int8 activations a
    mixture's output is within 2% of its fp32-activation output), and greedy speculation on the file is lossless."""
    import gguf

    private_cache(tmp_path, monkeypatch)
    path, model = moe_gguf(tmp_path, name, gguf.GGMLQuantizationType.F32)
    lm = load_model(path, "cpu", "float32", with_tokenizer=False)
    assert lm.config.architecture == type(model).__name__ and lm.config.moe_layers == (0, 1, 2)
    assert_rows_match(lm, model, backends=("cpu",))
    (tmp_path / "q8").mkdir()
    q8, _ = moe_gguf(tmp_path / "q8", name, gguf.GGMLQuantizationType.Q8_0)
    ref = converted_reference(q8, tmp_path / "q8-folder")
    lm = load_model(q8, "cpu", "float32", with_tokenizer=False, quantization="auto")
    ex = lm.model.layers[0].mlp.experts[1]
    assert isinstance(ex.gate_up, QuantLinear) and ex.gate_up.group == 32  # the file's Q8_0 blocks
    assert_rows_match(lm, ref, backends=("cpu",))
    moe = lm.model.layers[1].mlp  # int8 activations in the experts: the same experts, within 2%
    h = torch.randn(37, lm.config.hidden_size, generator=torch.Generator().manual_seed(0))
    exact = moe(h)
    set_act_int8(lm.model, True)
    assert 0 < (moe(h) - exact).abs().max().item() < 0.02 * exact.abs().max().item()
    set_act_int8(lm.model, False)
    assert_speculation_lossless(engine(q8), prompts())


def test_q4_0_experts_keep_their_blocks(tmp_path, monkeypatch):
    """A Q4_0 file's experts are int4 ``QuantLinear`` of the file's own blocks (scale and -8 x scale
    per 32 weights): specd (fp32 activations) == transformers on the converted folder within 1e-4."""
    import gguf

    private_cache(tmp_path, monkeypatch)
    q4, _ = moe_gguf(tmp_path, "mixtral", gguf.GGMLQuantizationType.Q4_0)
    ref = converted_reference(q4, tmp_path / "q4-folder")
    lm = load_model(q4, "cpu", "float32", with_tokenizer=False, quantization="gguf")
    down = lm.model.layers[2].mlp.experts[3].down
    assert isinstance(down, QuantLinear) and (down.fmt, down.group) == ("int4", 32)
    assert_rows_match(lm, ref, n=20, prompt=12, backends=("cpu",))


def test_moe_gguf_metadata_problems_are_one_line_errors(tmp_path, monkeypatch):
    """Shared experts, a gating function other than softmax and an impossible top-k in a GGUF are
    refused in one line naming the key."""
    import gguf

    private_cache(tmp_path, monkeypatch)
    cases = {
        "shared experts": {"qwen3moe.expert_shared_count": 1},
        "gating function 2": {"qwen3moe.expert_gating_func": 2},
        r"expert_used_count \(9\)": {"qwen3moe.expert_used_count": 9},
    }
    for n, (match, meta) in enumerate(cases.items()):
        (tmp_path / str(n)).mkdir()
        path, _ = moe_gguf(tmp_path / str(n), "qwen3_moe", gguf.GGMLQuantizationType.F32, **meta)
        with pytest.raises(LoadError, match=match) as e:
            load_model(path, "cpu", "float32")
        assert "\n" not in str(e.value)


# unsupported mixtures -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "arch,what",
    [("Qwen2MoeForCausalLM", "shared experts"), ("GptOssForCausalLM", "attention sinks"),
     ("DeepseekV3ForCausalLM", "latent attention")],
)  # fmt: skip
def test_unsupported_mixtures_of_experts_are_one_line_errors(tmp_path, arch, what):
    """A mixture specd does not compute is refused in one line naming it and what it adds, never run
    as a lookalike; so is a Qwen3-MoE config with a shared expert."""
    folder, _ = moe_folder(tmp_path, "qwen3_moe")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": [arch]}))
    with pytest.raises(LoadError, match=rf"unsupported architecture '{arch}': a mixture of experts with .*{what}.*"
                                        r"Qwen3MoeForCausalLM, MixtralForCausalLM") as e:  # fmt: skip
        load_model(folder, "cpu", "float32")
    assert "\n" not in str(e.value)
    (folder / "config.json").write_text(json.dumps({**cfg, "shared_expert_intermediate_size": 64}))
    with pytest.raises(LoadError, match=r"shared experts \(shared_expert_intermediate_size\) are unsupported"):
        load_model(folder, "cpu", "float32")


def test_unsupported_moe_gguf_architecture_is_a_one_line_error(tmp_path, monkeypatch):
    import gguf

    from tests.test_gguf import write_gguf

    private_cache(tmp_path, monkeypatch)
    model = fam.hf_model("llama")
    weights = {k: v.numpy() for k, v in model.state_dict().items()}
    path = write_gguf(tmp_path / "moe.gguf", "qwen2moe", {**model.config.to_dict(), "rope_theta": 1e4}, weights,
                      gguf.GGMLQuantizationType.F32)  # fmt: skip
    with pytest.raises(LoadError, match=r"unsupported architecture 'qwen2moe'.*shared experts.*qwen3moe") as e:
        load_model(path, "cpu", "float32")
    assert "\n" not in str(e.value)


def test_the_benchmark_runs_both_paths(capsys):
    """``python -m eval.bench_moe`` at a tiny shape: both paths decode (a table row each), the switch
    is back on the sparse path afterwards, and the dense path's bytes per step count every expert."""
    from eval import bench_moe

    args = "--hidden 64 --layers 2 --experts 4 --top-k 2 --inter 32 --vocab 128 --prompt 4 --steps 2 --passes 2"
    threads = torch.get_num_threads()
    try:
        bench_moe.main(f"{args} --threads 1 --act none".split())
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "| sparse |" in out and "| dense |" in out and "dense / sparse, median" in out
    assert not SparseMoE.all_experts
    shape = argparse.Namespace(hidden=64, layers=2, experts=4, top_k=2, inter=32, vocab=128)
    model = bench_moe.build(bench_moe.config(shape))
    ex = model.layers[0].mlp.experts[0]
    expert = ex.gate_up.nbytes() + ex.down.nbytes()
    assert bench_moe.bytes_per_step(model, True) - bench_moe.bytes_per_step(model, False) == 2 * (4 - 2) * expert


def test_a_feature_head_starts_from_a_mixture_target(tmp_path):
    """``specd distill``'s head initialisation on a mixture of experts: the attention half comes from
    the target layer, the MLP (a mixture has no one MLP to copy) keeps its random start."""
    from specd.training.head import new_head

    folder, _ = moe_folder(tmp_path, "mixtral")
    lm = load_model(folder, "cpu", "float32", with_tokenizer=False)
    d2t = torch.arange(64)
    head = new_head(lm, d2t)
    blk = lm.model.layers[head.layers[-1]]
    assert torch.equal(head.o.weight, blk.attn.o.weight.float())
    assert head.gate_up.weight.abs().max() < 0.2  # (random normal * 0.02, not copied)
