"""HF checkpoint folder (config.json + *.safetensors + tokenizer) -> our model + tokenizer.

A ``.gguf`` file is converted once into a cached folder (``specd.model.gguf``) and loaded from there.
Errors are one line that names the problem and what is supported (``LoadError``).
"""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from specd.config import SUPPORTED_ARCHITECTURES, ModelConfig
from specd.model.errors import LoadError
from specd.model.llama import NORM_WEIGHTS, LlamaModel, hf_layer_names
from specd.model.moe import expert_tensors
from specd.model.tokenizer_load import FAST_AS_IS, load_tokenizer, tokenizer_folder  # noqa: F401 (re-exported)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise LoadError(f"device {device!r} requested but CUDA is not available (use --device cpu)")
    return torch.device(device)


def resolve_dtype(
    dtype: str, device: torch.device, cfg: ModelConfig | None = None, widths: tuple = (1, 8)
) -> torch.dtype:
    """``auto``: bf16 on CUDA; on a CPU whichever of fp32 and bf16 runs the model's MLP shapes at the
    row ``widths`` the engine will use faster on this machine (``specd.model.cpu.choose_dtype``, timed
    once per machine and cached; fp32 without a model config)."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        if cfg is None:
            return torch.float32
        from specd.model.cpu import choose_dtype

        return choose_dtype(cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, tuple(widths))
    if dtype not in DTYPES:
        raise LoadError(f"unsupported dtype {dtype!r}; supported: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


@dataclass
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    tokenizer: object  # transformers PreTrainedTokenizerBase
    path: Path
    dtype: torch.dtype
    device: torch.device
    generation_config: dict


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise LoadError(
            f"{path}: missing (a Hugging Face checkpoint folder needs config.json, *.safetensors and tokenizer files)"
        ) from None
    except json.JSONDecodeError as e:
        raise LoadError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None


def read_config(path: Path) -> tuple[ModelConfig, dict]:
    path = Path(path)
    if not path.is_dir():
        raise LoadError(f"{path}: not a directory (expected a Hugging Face checkpoint folder)")
    cfg = _read_json(path / "config.json")
    gen = _read_json(path / "generation_config.json") if (path / "generation_config.json").exists() else {}
    try:
        return ModelConfig.from_hf(cfg, gen), gen
    except ValueError as e:
        raise LoadError(f"{path}: {e}") from None


def _safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(_read_json(index).get("weight_map", {}).values()))
        missing = [f for f in files if not (path / f).exists()]
        if missing:
            raise LoadError(f"{path}: shard {missing[0]} named in model.safetensors.index.json is missing")
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{path}: no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


def _read_safetensors(path: Path, progress: bool) -> dict:
    """Every tensor of the folder's ``*.safetensors`` files (a progress bar over 64 MiB)."""
    from safetensors import safe_open

    files = _safetensor_files(path)
    tensors: dict[str, torch.Tensor] = {}
    total = sum(f.stat().st_size for f in files)
    bar = None
    if progress and total > 64 * 1024 * 1024:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {path.name}")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                tensors[name] = sf.get_tensor(name)
        if bar is not None:
            bar.update(f.stat().st_size)
    if bar is not None:
        bar.close()
    return tensors


def _our_names(tensors: dict, cfg: ModelConfig, path: Path, shared_embeddings: bool) -> dict:
    """HF tensor names -> ours, q/k/v and gate/up fused; LoadError naming a missing weight."""

    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise LoadError(f"{path}: weight {name!r} missing from the checkpoint")
        used.add(name)
        return tensors[name]

    ours: dict[str, torch.Tensor] = {"norm.weight": take("model.norm.weight")}
    if not shared_embeddings:
        ours["embed.weight"] = take("model.embed_tokens.weight")
        if not cfg.tie_word_embeddings:
            ours["lm_head.weight"] = take("lm_head.weight")
    for i in range(cfg.num_layers):
        _layer_names(ours, i, cfg, take)
        if cfg.is_moe(i):  # the router and each expert's gate | up, down (specd.model.moe)
            expert_tensors(ours, cfg, i, take, tensors.__contains__)
    _check_all_used(tensors, used, cfg, path)
    if cfg.gemma_norms:  # Gemma applies its norms as 1 + w: stored so, the forward is every family's
        for name in ours:
            if name == "norm.weight" or name.split(".", 2)[-1].removesuffix(".weight") in NORM_WEIGHTS:
                ours[name] = ours[name].float() + 1.0
    return ours


def _layer_names(ours: dict, i: int, cfg: ModelConfig, take) -> None:
    """Layer i's tensors under our names: q/k/v and gate/up fused by rows (Phi-3's come fused)."""
    p = f"model.layers.{i}."
    for k, hf in hf_layer_names(i, cfg).items():
        ours[f"layers.{i}.{k}"] = take(hf)
    if cfg.architecture == "Phi3ForCausalLM":
        ours[f"layers.{i}.attn.qkv.weight"] = take(p + "self_attn.qkv_proj.weight")
        ours[f"layers.{i}.mlp.gate_up.weight"] = take(p + "mlp.gate_up_proj.weight")
        return
    ours[f"layers.{i}.attn.qkv.weight"] = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], 0)
    if cfg.attention_bias:
        ours[f"layers.{i}.attn.qkv.bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"], 0)
    if cfg.o_bias:
        ours[f"layers.{i}.attn.o.bias"] = take(p + "self_attn.o_proj.bias")
    if not cfg.is_moe(i):
        ours[f"layers.{i}.mlp.gate_up.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], 0
        )


def _check_all_used(tensors: dict, used: set, cfg: ModelConfig, path: Path) -> None:
    """A decoder weight the checkpoint has and specd would not read (a bias its config does not
    announce, an MLP bias, a layer past ``num_hidden_layers``) is a LoadError: dropping it silently
    gives wrong logits."""
    for name in tensors:
        if name.startswith("model.layers.") and name not in used and not name.endswith("rotary_emb.inv_freq"):
            raise LoadError(
                f"{path}: weight {name!r} is not used by specd's {cfg.architecture} (its config.json does not "
                f"call for it); this checkpoint is unsupported"
            )


def load_weights(
    model: LlamaModel,
    cfg: ModelConfig,
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool = False,
    shared_embeddings: bool = False,
) -> dict:
    """Load the checkpoint's weights into ``model``; returns the tensors it did not use (``specd.*``
    extras). ``shared_embeddings``: the checkpoint has no embeddings or LM head (a draft that uses
    its target's, see ``load_model``)."""
    tensors = _read_safetensors(path, progress)
    ours = _our_names(tensors, cfg, path, shared_embeddings)
    own = model.state_dict()
    for name, t in ours.items():
        if name in own and tuple(own[name].shape) != tuple(t.shape):
            raise LoadError(
                f"{path}: shape mismatch for {name}: checkpoint {tuple(t.shape)} vs config {tuple(own[name].shape)}"
            )
    provided = {"embed.weight", "lm_head.weight"} if shared_embeddings else set()
    missing = [
        n
        for n in own
        if n not in ours and n not in provided and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
    ]
    if missing:
        raise LoadError(f"{path}: weights missing for {missing[0]}")
    model.load_state_dict(ours, strict=False)
    model.to(device=device, dtype=dtype)
    model.rotary.cos = model.rotary.cos.float()
    model.rotary.sin = model.rotary.sin.float()
    return {k: v for k, v in tensors.items() if k.startswith("specd.")}


def checkpoint_folder(path, progress: bool = False) -> Path:
    """The Hugging Face folder of a checkpoint: a folder as is, a GGUF file's converted folder in
    the cache (converted on first use, see ``specd.model.gguf.cached_folder``)."""
    path = Path(path)
    if path.is_dir():
        return path
    from specd.model.gguf import cached_folder, is_gguf_path

    return cached_folder(path, progress=progress) if is_gguf_path(path) else path


def load_model(
    path,
    device: str = "auto",
    dtype: str = "auto",
    max_positions: int | None = None,
    with_tokenizer: bool = True,
    progress: bool = True,
    widths: tuple = (1, 8),
    target: LoadedModel | None = None,
    quantization: str = "none",
) -> LoadedModel:
    """``widths``: the row counts one forward will have (decode batch, verification tree), which
    ``dtype="auto"`` weighs on a CPU (``resolve_dtype``). ``target``: for a draft that shares its
    target's embeddings (``draft_spec``), the loaded target. ``quantization``: auto | none | int8 |
    int4 | gguf (``specd.model.quant_load``; a draft's is its own, independent of its target's)."""
    from specd.model.gguf import is_gguf_path
    from specd.model.quant_load import load_gguf, quantize_model, resolve

    path = Path(path)
    gguf_file = not path.is_dir() and is_gguf_path(path)
    mode = resolve(quantization, gguf_file, path)
    direct = gguf_file and mode != "none"  # the file's blocks, never a full-precision copy
    folder = cached_folder_of(path, progress, weights=not direct)
    cfg, gen = read_config(folder)
    dev = resolve_device(device)
    if dtype == "auto" and dev.type == "cpu" and mode != "none":
        dt = torch.float32  # the CPU kernel computes in fp32 from the codes: 16-bit activations only add casts
    else:
        dt = resolve_dtype(dtype, dev, cfg, widths)
    shared = draft_spec(folder)
    if shared is not None:
        return _load_shared_draft(path, folder, cfg, gen, shared, target, dt, dev, max_positions, mode)
    # the tokenizer (transformers' import, a few seconds) loads on a thread while the weights load
    pool = ThreadPoolExecutor(1, thread_name_prefix="specd-tokenizer") if with_tokenizer else None
    tok_future = pool.submit(load_tokenizer, folder) if pool is not None else None
    if pool is not None:
        pool.shutdown(wait=False)
    if direct:
        model = load_gguf(path, mode, cfg, _read_json(folder / "config.json"), max_positions)
        model.to(device=dev, dtype=dt)
    else:
        model = LlamaModel(cfg, max_positions=max_positions)
        load_weights(model, cfg, folder, dt, dev, progress=progress)
        if mode in ("int8", "int4"):
            quantize_model(model, mode)
    model.eval()
    tok = tok_future.result() if tok_future is not None else None
    return LoadedModel(model, cfg, tok, path, dt, dev, gen)


def cached_folder_of(path: Path, progress: bool, weights: bool) -> Path:
    """``checkpoint_folder``, or for a GGUF file loaded quantized its config + tokenizer folder only."""
    if weights or path.is_dir():
        return checkpoint_folder(path, progress=progress)
    from specd.model.gguf import cached_folder

    return cached_folder(path, progress=progress, weights=False)


def draft_spec(folder: Path) -> dict | None:
    """The ``specd_draft`` section of a draft folder's config.json (None for an ordinary checkpoint):
    ``{"target_embeddings": true, "draft_vocab_size": N, ...}``."""
    spec = _read_json(folder / "config.json").get("specd_draft")
    return spec if isinstance(spec, dict) else None


def _load_shared_draft(path, folder, cfg, gen, spec, target, dt, dev, max_positions, mode="none") -> LoadedModel:
    """A draft that uses its target's token embeddings and head rows by reference: its files hold
    only its decoder layers, final norm and the draft-to-target id map ``specd.d2t``. ``mode``
    int8 / int4 quantizes its own layers; the embeddings and head rows are the target's, in the
    target's format (a quantized target's head rows stay quantized)."""
    from specd.model.quant import QuantLinear
    from specd.model.quant_load import quantize_model

    if target is None:
        raise LoadError(f"{path}: this draft uses its target's embeddings; load it with its target")
    tc = target.config
    if (cfg.vocab_size, cfg.hidden_size) != (tc.vocab_size, tc.hidden_size):
        raise LoadError(
            f"{path}: made for a target with vocabulary {cfg.vocab_size} and hidden size "
            f"{cfg.hidden_size}, not {tc.vocab_size} / {tc.hidden_size} ({target.path})"
        )
    cfg = dataclasses.replace(cfg, tie_word_embeddings=True)  # (one placeholder table, replaced at once)
    model = LlamaModel(cfg, max_positions=max_positions)
    if isinstance(target.model.embed, torch.nn.Embedding):  # (no placeholder table kept meanwhile)
        model.embed.weight = model.lm_head.weight = target.model.embed.weight
    extras = load_weights(model, cfg, folder, dt, dev, shared_embeddings=True)
    model.embed = target.model.embed  # by reference: never copied, never saved
    model.lm_head = target.model.lm_head
    d2t = extras.get("specd.d2t")
    if d2t is None or d2t.dim() != 1 or int(d2t.max()) >= tc.vocab_size or int(d2t.min()) < 0:
        raise LoadError(f"{path}: missing or invalid draft-to-target id map specd.d2t")
    d2t = d2t.to(device=dev, dtype=torch.long)
    head = target.model.lm_head
    rows = head.select(d2t) if isinstance(head, QuantLinear) else head.weight.detach().index_select(0, d2t)
    model.set_draft_vocab(d2t, rows)
    if mode in ("int8", "int4"):
        quantize_model(model, mode, head=False)
    model.eval()
    return LoadedModel(model, cfg, None, Path(path), dt, dev, gen)


__all__ = [
    "LoadError",
    "LoadedModel",
    "checkpoint_folder",
    "load_model",
    "load_tokenizer",
    "read_config",
    "tokenizer_folder",
    "SUPPORTED_ARCHITECTURES",
]
