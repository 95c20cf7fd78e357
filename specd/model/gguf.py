"""GGUF checkpoints (llama.cpp's single-file format) -> a Hugging Face folder that specd and transformers load.

``convert(in.gguf, out_dir)`` writes model.safetensors (fp32), config.json, generation_config.json,
tokenizer.json, tokenizer_config.json (with the chat template) and special_tokens_map.json.
``cached_folder(in.gguf)`` does that once per file into a cache folder, so ``--target x.gguf`` costs a
dequantization on the first start only. Every problem is a one-line ``LoadError`` naming the file.

GGUF layout facts this module relies on (llama.cpp's docs/gguf.md, the ``gguf`` package):

* A file starts with the 4 bytes ``b"GGUF"``, a uint32 version, uint64 tensor and metadata counts,
  then typed key/value metadata, then one info record per tensor (name, dims, ggml type, offset)
  and the tensor data, aligned to ``general.alignment``. ``gguf.GGUFReader`` parses all of it and
  memory-maps the data.
* Metadata keys are namespaced. ``general.architecture`` names the architecture ("llama", "qwen2",
  ...) and its hyper-parameters live under that prefix (``llama.block_count``,
  ``llama.attention.head_count_kv``, ``llama.rope.freq_base``, ...). The tokenizer lives under
  ``tokenizer.ggml.*`` and the chat template is ``tokenizer.chat_template``.
* ggml lists dimensions innermost first, so a torch ``[out, in]`` Linear weight has ggml dims
  ``(in, out)``. ``GGUFReader`` exposes each tensor in numpy (row-major) order, with the last axis
  in bytes for block-quantized types; ``gguf.quants.dequantize`` turns that into float32 of the
  torch shape.
* llama.cpp's converter permutes the rows of the Llama/Mistral q and k projections so that the two
  halves of every rotary pair sit next to each other (see ``unpermute_qk``); Qwen2 is stored as is.
* Llama 3.x files carry their RoPE scaling as a ``rope_freqs.weight`` tensor of per-frequency
  divisors instead of metadata (see ``_llama3_rope``).
* Qwen3 adds ``attn_q_norm`` / ``attn_k_norm`` [head_dim] per layer. Gemma 2 / 3 add
  ``post_attention_norm`` and ``post_ffw_norm`` (their ``ffn_norm`` is the pre-MLP norm) and store
  every norm weight as 1 + w (llama.cpp's converter adds the 1 transformers adds at run time); the
  rest of Gemma's hyper-parameters are llama.cpp's fixed ones (sliding layers: every other one for
  Gemma 2, five of six for Gemma 3, whose local RoPE base is 10000; attention scale 1/sqrt(head
  size), 1/sqrt(d / heads) for the 27B models).
* Mixtures of experts (Qwen3-MoE as "qwen3moe", Mixtral as "llama" with ``llama.expert_count``) keep
  per layer a router ``ffn_gate_inp`` [E, d] and the experts' projections stacked in 3-D tensors
  ``ffn_gate_exps`` / ``ffn_up_exps`` [E, I, d] and ``ffn_down_exps`` [E, d, I] (ggml dims innermost
  first, so one expert's rows are a contiguous slab); ``{arch}.expert_count``,
  ``expert_used_count`` and (qwen3moe) ``expert_feed_forward_length`` size them. llama.cpp routes
  both with a softmax and renormalises the top k (``expert_weights_norm``, default on), and puts
  experts in every layer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import struct
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from specd.model.errors import LoadError

GGUF_MAGIC = b"GGUF"
FORMAT_VERSION = 1  # part of the cache key: bump when the conversion output changes
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# general.architecture (Mistral and Mixtral: "llama")
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3moe")
OTHER_MOE = {  # mixtures of experts specd does not run, and what they add
    "qwen2moe": "shared experts",
    "deepseek2": "shared experts and multi-head latent attention",
    "gpt-oss": "router biases, clamped SwiGLU and attention sinks",
    "olmoe": "q/k norms over all heads",
    "phimoe": "sparsemixer routing",
    "qwen3next": "shared experts and linear attention",
}
HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
# config.json's model_type where it is not the GGUF architecture
MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}
GEMMA = ("gemma2", "gemma3")
PERMUTED_QK = ("llama", "mistral", "mixtral")  # model types whose q/k rows llama.cpp stores permuted

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}  # Qwen3, Gemma 3
_EXPERTS = {  # a mixture's tensors; "{e}": one HF tensor per expert, stacked in the GGUF tensor
    "qwen3moe": {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
                 "ffn_up_exps": "mlp.experts.{e}.up_proj", "ffn_down_exps": "mlp.experts.{e}.down_proj"},
    "mixtral": {"ffn_gate_inp": "block_sparse_moe.gate", "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
                "ffn_up_exps": "block_sparse_moe.experts.{e}.w3", "ffn_down_exps": "block_sparse_moe.experts.{e}.w2"},
}  # fmt: skip
_GEMMA_NORMS = {  # Gemma's four norms per layer
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def layer_names(arch: str | None = None) -> dict:
    """GGUF layer tensor kinds -> HF module names for a GGUF architecture (Llama's by default)."""
    names = dict(_LAYER_NAMES)
    if arch in ("qwen3", "gemma3", "qwen3moe"):
        names.update(_QK_NORMS)
    names.update(_EXPERTS.get(arch or "", {}))
    if arch in GEMMA:
        names.update(_GEMMA_NORMS)
    if arch == "phi3":  # fused as transformers' Phi-3 keeps them (llama.cpp's ffn_up is gate and up)
        names.update({"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"})
    return names


def layer_projections(tensors: dict, i: int) -> tuple[list, list]:
    """(the q/k/v tensor kinds, the gate/up ones) of layer i in a file: one fused tensor each in a
    Phi-3 file (``attn_qkv``, ``ffn_up``), else three and two, stacked by rows in this order."""
    if f"blk.{i}.attn_qkv.weight" in tensors:
        return ["attn_qkv"], ["ffn_up"]
    return ["attn_q", "attn_k", "attn_v"], ["ffn_gate", "ffn_up"]


def layer_norms(blk) -> list:
    """(norm module, GGUF tensor kind) for every norm of one of our decoder layers
    (``specd.model.llama.Block``), for loading them from a file."""
    out = [(blk.input_norm, "attn_norm"), (blk.post_norm, "ffn_norm")]
    if hasattr(blk.attn, "q_norm"):
        out += [(blk.attn.q_norm, "attn_q_norm"), (blk.attn.k_norm, "attn_k_norm")]
    if hasattr(blk, "attn_out_norm"):
        out += [(blk.attn_out_norm, "post_attention_norm"), (blk.mlp_out_norm, "post_ffw_norm")]
    return out


ROPE_FREQS = "rope_freqs.weight"
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's LongRoPE
NOT_WEIGHTS = (ROPE_FREQS, *ROPE_FACTORS)  # tensors that are RoPE parameters, not model weights
log = logging.getLogger("specd.gguf")


def _gguf():
    import gguf  # the PyPI package (absolute import), not this module

    return gguf


def _f32(x) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(x)))


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


# reading -----------------------------------------------------------------------------------------
def open_gguf(path: Path) -> GGUFFile:
    """The file's header read (``GGUFFile``: metadata decoded, tensors mapped); missing, empty,
    foreign or truncated files are a LoadError.

    The magic and version are checked and every tensor mapped; a file cut short fails there (a
    tensor's bytes run past the end) and is reported as truncated with the file's size.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise LoadError(f"{path}: cannot read the GGUF file ({e.strerror or e})") from None
    if size == 0:
        raise LoadError(f"{path}: empty file (expected a GGUF checkpoint)")
    if head != GGUF_MAGIC:
        raise LoadError(
            f"{path}: not a GGUF file (it starts with {head!r}, a GGUF file with b'GGUF'); "
            f"--target/--draft take a Hugging Face folder or a .gguf file"
        )
    try:
        return GGUFFile(path)
    except LoadError:
        raise
    except Exception as e:  # noqa: BLE001 - struct.error, ValueError, IndexError, ... from a damaged header
        raise LoadError(f"{path}: truncated or corrupt GGUF file ({size} bytes): {_one_line(e)}") from None


_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}  # GGUF value types
_STRING, _ARRAY = 8, 9
_NUMPY = {k: np.dtype("<" + f) for k, f in _SCALARS.items()}  # an array of scalars, read at once
_U64 = struct.Struct("<Q")
READ_VERSIONS = (2, 3)  # the GGUF versions read (as the ``gguf`` package's reader)


class _Header:
    """A cursor over a GGUF header in ``buf`` (a memory map). ``value(kind, keep)`` reads one
    metadata value: a Python scalar, str, or list (an array of scalars in one ``numpy`` read, an
    array of strings in one tight loop); ``keep=False`` skips an array's items and returns its length."""

    def __init__(self, buf, pos: int = 0):
        self.buf, self.pos = buf, pos

    def take(self, fmt: str):
        out = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize("<" + fmt)
        return out

    def text(self) -> str:
        n = self.take("Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError(f"a string runs past the end of the file (byte {end})")
        out, self.pos = self.buf[self.pos : end].decode("utf-8"), end
        return out

    def value(self, kind: int, keep: bool = True):
        if kind == _STRING:
            return self.text()
        if kind != _ARRAY:
            return self.take(_SCALARS[kind])
        item, n = self.take("I"), self.take("Q")
        if item == _STRING:
            return self._strings(n, keep)
        if item == _ARRAY:  # (arrays of arrays: no key specd reads has them)
            return [self.value(self.take("I"), keep) for _ in range(n)] if keep else self._skip_arrays(n)
        dt = _NUMPY[item]
        end = self.pos + n * dt.itemsize
        if end > len(self.buf):
            raise ValueError(f"an array runs past the end of the file (byte {end})")
        out = np.frombuffer(self.buf, dt, n, self.pos).tolist() if keep else n
        self.pos = end
        return out

    def _strings(self, n: int, keep: bool):
        buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
        out: list = []
        add = out.append
        for _ in range(n):
            k = unpack(buf, pos)[0]
            pos += 8
            if keep:
                add(buf[pos : pos + k])
            pos += k
        if pos > len(buf):
            raise ValueError(f"a string array runs past the end of the file (byte {pos})")
        self.pos = pos
        return [b.decode("utf-8") for b in out] if keep else n

    def _skip_arrays(self, n: int) -> int:
        for _ in range(n):
            self.value(self.take("I"), keep=False)
        return n


def read_header(buf, arrays: bool = True) -> tuple[dict, list, int]:
    """(metadata, tensor infos, where the tensor data starts) of the GGUF file in ``buf``: every
    key/value (``arrays=False``: each array's length instead of its items), and per tensor
    ``(name, ggml dims, ggml type number, offset from the data start)``. Raises ValueError (or
    ``struct.error``, UnicodeDecodeError) on a header it cannot parse."""
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ValueError("not a GGUF file")
    h = _Header(buf, 4)
    version = h.take("I")
    if version not in READ_VERSIONS:
        raise ValueError(f"GGUF version {version} is not read (versions {READ_VERSIONS})")
    n_tensors, n_kv = h.take("Q"), h.take("Q")
    meta: dict = {}
    for _ in range(n_kv):
        key = h.text()
        if key in meta:
            raise ValueError(f"duplicate metadata key {key}")
        meta[key] = h.value(h.take("I"), arrays)
    infos = []
    for _ in range(n_tensors):
        name = h.text()
        dims = [h.take("Q") for _ in range(h.take("I"))]
        infos.append((name, dims, h.take("I"), h.take("Q")))
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"invalid general.alignment {align!r}: must be a power of two")
    return meta, infos, h.pos + (-h.pos % align)


class GGUFFile:
    """A GGUF file as this module reads it, from its header: ``meta`` (every key/value as Python
    values, the ``read_metadata`` of it) and ``tensors`` as ``gguf.GGUFReader`` gives them (name,
    tensor_type, shape in ggml order, n_elements, n_bytes, data: a view of one read-only memory map:
    float32 / float16 arrays of the torch shape, the rows' bytes for block-quantized types).

    ``gguf.GGUFReader`` builds numpy views for every part of every metadata item: ~2 s of CPU for
    a 49k-token vocabulary, on every first start of a file. This reads the arrays in bulk (a
    numpy read per array of numbers, one loop per array of strings): tens of milliseconds."""

    def __init__(self, path: Path):
        import mmap

        gguf = _gguf()
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.meta, infos, start = read_header(self._map)
        data = np.frombuffer(self._map, np.uint8)
        self.tensors = []
        seen = set()
        for name, dims, kind, off in infos:
            if name in seen:
                raise ValueError(f"duplicate tensor {name}")
            seen.add(name)
            qtype = gguf.GGMLQuantizationType(kind)
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims))
            a = start + off
            b = a + n // block * size
            if b > len(data):
                raise ValueError(f"tensor {name} ends at byte {b}, past the end of the file")
            rows = tuple(reversed(dims))
            plain = {"F32": np.float32, "F16": np.float16}.get(qtype.name)
            view = data[a:b].view(plain).reshape(rows) if plain else data[a:b].reshape(*rows[:-1], -1)
            self.tensors.append(
                SimpleNamespace(
                    name=name,
                    tensor_type=qtype,
                    shape=np.array(dims, np.uint64),
                    n_elements=n,
                    n_bytes=b - a,
                    data=view,
                    data_offset=a,
                )  # fmt: skip
            )


def quick_metadata(path) -> dict:
    """The file's scalar metadata, each array's length (not its items), and each tensor's torch
    shape (under its name), read from the header alone (``read_header``, arrays skipped): for checks
    before a load; raises ValueError (or OSError) on a file it cannot parse."""
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        try:
            meta, infos, _ = read_header(m, arrays=False)
        except (struct.error, UnicodeDecodeError) as e:
            raise ValueError(str(e)) from None
    for name, dims, _, _ in infos:
        meta[name] = tuple(reversed(dims))
    return meta


def _field_value(field):
    """A ``GGUFReader`` metadata value as Python: str, int, float, bool, or a list of them (arrays)."""
    gguf = _gguf()
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        items = [field.parts[i] for i in field.data]
        if field.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(p).decode("utf-8") for p in items]
        return np.concatenate(items).tolist() if items else []
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]][0].item()


def read_metadata(reader, path: Path) -> dict:
    """All key/value metadata of the file: a ``GGUFFile``'s ``meta``, or read from a
    ``gguf.GGUFReader`` (its ``GGUF.*`` header fields left out)."""
    if isinstance(reader, GGUFFile):
        return dict(reader.meta)
    try:
        return {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    except (UnicodeDecodeError, ValueError, IndexError) as e:
        raise LoadError(f"{path}: corrupt GGUF metadata: {_one_line(e)}") from None


# config --------------------------------------------------------------------------------------------
def _architecture(meta: dict, path: Path) -> tuple[str, str]:
    """(GGUF architecture, HF model type). llama.cpp writes Mistral models as "llama"; like
    transformers, a "mistral" in ``general.name`` / ``general.basename`` makes them Mistral again."""
    arch = meta.get("general.architecture")
    if arch in OTHER_MOE:
        raise LoadError(
            f"{path}: unsupported architecture {arch!r} (general.architecture): a mixture of experts with "
            f"{OTHER_MOE[arch]}; supported mixtures of experts: qwen3moe, llama with experts (Mixtral)"
        )
    if arch not in ARCHITECTURES:
        raise LoadError(
            f"{path}: unsupported architecture {arch!r} (general.architecture); supported: "
            f"{', '.join(ARCHITECTURES)} (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3)"
        )
    names = f"{meta.get('general.name', '')} {meta.get('general.basename', '')}".lower()
    if arch == "llama" and int(meta.get("llama.expert_count", 0)) > 0:
        return arch, "mixtral"
    return arch, ("mistral" if arch == "llama" and "mistral" in names else MODEL_TYPES.get(arch, arch))


def _rope_parameters(meta: dict, arch: str, head_dim: int, freq_factors, path: Path) -> dict:
    """HF ``rope_parameters`` from ``{arch}.rope.*`` metadata or a Llama 3 ``rope_freqs.weight``."""
    theta = _f32(meta.get(f"{arch}.rope.freq_base", 10000.0))
    if freq_factors is not None:
        return {
            "rope_type": "llama3",
            "rope_theta": theta,
            **_llama3_rope(meta, arch, theta, head_dim, freq_factors, path),
        }
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear" and f"{arch}.rope.scaling.factor" in meta:
        return {"rope_type": "linear", "rope_theta": theta, "factor": _f32(meta[f"{arch}.rope.scaling.factor"])}
    raise LoadError(
        f"{path}: unsupported rope scaling {kind!r} ({arch}.rope.scaling.type); supported: none, "
        f"linear, llama3 (rope_freqs.weight)"
    )


def _llama3_rope(meta: dict, arch: str, theta: float, head_dim: int, factors: np.ndarray, path: Path) -> dict:
    """Llama 3 scaling parameters that reproduce the file's ``rope_freqs.weight`` divisors.

    llama.cpp divides each rotary frequency by its entry: ``factor`` for long wavelengths, 1 for
    short ones, a smooth blend between. The file does not keep the parameters, so the standard
    ones (low 1, high 4, original context 8192 unless the metadata says otherwise) are checked
    against the tensor.
    """
    old = float(meta.get(f"{arch}.rope.scaling.original_context_length", 8192))
    params = {
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": int(old),
    }
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv
    smooth = np.clip((old / wavelen - 1.0) / (4.0 - 1.0), 0.0, 1.0)
    expect = 1.0 / ((1 - smooth) / params["factor"] + smooth)
    if factors.shape != expect.shape or not np.allclose(factors, expect, rtol=1e-3):
        raise LoadError(
            f"{path}: rope_freqs.weight does not match Llama 3 rope scaling (factor "
            f"{params['factor']:g}, original context {int(old)}); other frequency tables are unsupported"
        )
    return params


def hf_config(meta: dict, reader, path: Path) -> tuple[dict, dict]:
    """(config.json, generation_config.json) dicts from the file's metadata and tensor shapes."""
    arch, model_type = _architecture(meta, path)

    def need(key):
        if f"{arch}.{key}" not in meta:
            raise LoadError(f"{path}: metadata {arch}.{key} missing")
        return meta[f"{arch}.{key}"]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    if hidden <= 0 or heads <= 0:
        raise LoadError(f"{path}: metadata {arch}.embedding_length / attention.head_count must be positive")
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    rot = meta.get(f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim and arch != "phi3":
        raise LoadError(
            f"{path}: partial rotary embeddings ({arch}.rope.dimension_count {rot}, head size "
            f"{head_dim}) are unsupported"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise LoadError(f"{path}: tensor token_embd.weight missing")
    freqs = _dequantize(tensors[ROPE_FREQS], path) if ROPE_FREQS in tensors else None
    cfg = {
        "architectures": [HF_CLASSES[arch if arch in GEMMA else model_type]],
        "model_type": model_type,
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(_ffn_length(meta, arch) or need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "rope_parameters": _rope_parameters(meta, arch, head_dim, freqs, path),
        "tie_word_embeddings": "output.weight" not in tensors,
        "dtype": "float32",
    }
    cfg.update(_family_config(meta, arch, model_type, cfg, tensors))
    if model_type in ("qwen3_moe", "mixtral"):
        cfg.update(_moe_config(meta, arch, model_type, cfg, path))
    gen = _special_ids(meta)
    cfg.update(gen)
    _validate(cfg, gen, path)
    return cfg, gen


def _ffn_length(meta: dict, arch: str) -> int:
    """The dense MLP's width; a Qwen3-MoE file (experts in every layer) may name its experts' only."""
    return int(meta.get(f"{arch}.feed_forward_length") or meta.get(f"{arch}.expert_feed_forward_length") or 0)


def _family_config(meta: dict, arch: str, model_type: str, cfg: dict, tensors: dict) -> dict:
    """config.json keys only some families have (biases, windows, Gemma's hyper-parameters)."""
    out: dict = {}
    if arch in ("qwen2", "qwen3", "qwen3moe"):
        out.update(use_sliding_window=False, sliding_window=None)
    elif model_type == "mistral":
        out["sliding_window"] = meta.get(f"{arch}.attention.sliding_window")  # llama.cpp keeps none
    if arch != "qwen2":
        out.update(attention_bias="blk.0.attn_q.bias" in tensors, mlp_bias=False)
    if arch == "phi3":
        out.update(_phi3_config(meta, cfg, tensors))
    if arch in GEMMA:
        heads, d, n = cfg["num_attention_heads"], cfg["hidden_size"], cfg["num_hidden_layers"]
        big = n == (46 if arch == "gemma2" else 62)  # the 27B models: llama.cpp scales by d / heads
        out.update(
            hidden_activation="gelu_pytorch_tanh",
            hidden_act="gelu_pytorch_tanh",
            query_pre_attn_scalar=d // heads if big else cfg["head_dim"],
            sliding_window=int(meta.get(f"{arch}.attention.sliding_window", 4096)),
        )
        if arch == "gemma2":
            for key in ("attn_logit_softcapping", "final_logit_softcapping"):
                if f"{arch}.{key}" in meta:
                    out[key] = _f32(meta[f"{arch}.{key}"])
            out["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        else:  # local RoPE base 10000 (unscaled), the global one as the metadata says (transformers 5's form)
            local = {"rope_type": "default", "rope_theta": 10000.0}
            out["rope_parameters"] = {"full_attention": cfg["rope_parameters"], "sliding_attention": local}
            out["layer_types"] = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    return out


def _moe_config(meta: dict, arch: str, model_type: str, cfg: dict, path: Path) -> dict:
    """A mixture of experts' config.json keys as llama.cpp runs it: experts in every layer, softmax
    routing, the top k renormalised unless ``expert_weights_norm`` says otherwise (Mixtral: always).
    Shared experts and other gating functions are refused in one line."""
    experts, used = int(meta.get(f"{arch}.expert_count", 0)), int(meta.get(f"{arch}.expert_used_count", 0))
    if not 0 < used <= experts:
        raise LoadError(f"{path}: {arch}.expert_used_count ({used}) must be in 1..{arch}.expert_count ({experts})")
    if int(meta.get(f"{arch}.expert_shared_count", 0)) > 0:
        raise LoadError(f"{path}: shared experts ({arch}.expert_shared_count) are unsupported")
    if int(meta.get(f"{arch}.expert_gating_func", 1)) != 1:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise LoadError(
            f"{path}: expert gating function {meta[f'{arch}.expert_gating_func']} is unsupported (softmax only)"
        )
    norm = bool(meta.get(f"{arch}.expert_weights_norm", True))
    if model_type == "mixtral":
        if not norm:
            raise LoadError(f"{path}: Mixtral without renormalised expert weights is unsupported")
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    ff = int(meta.get(f"{arch}.expert_feed_forward_length") or 0)
    if ff <= 0:
        raise LoadError(f"{path}: metadata {arch}.expert_feed_forward_length missing")
    return {"num_experts": experts, "num_experts_per_tok": used, "moe_intermediate_size": ff, "norm_topk_prob": norm,
            "decoder_sparse_step": 1, "mlp_only_layers": []}  # fmt: skip


def _phi3_config(meta: dict, cfg: dict, tensors: dict) -> dict:
    """Phi-3's partial rotary (``rope.dimension_count``), sliding window (0: none, Phi-4) and LongRoPE
    (``rope_factors_long`` / ``_short`` tensors, the original context in the metadata)."""
    out: dict = {"sliding_window": int(meta.get("phi3.attention.sliding_window", 0)) or None}
    rot = int(meta.get("phi3.rope.dimension_count") or cfg["head_dim"])
    if rot != cfg["head_dim"]:
        out["partial_rotary_factor"] = rot / cfg["head_dim"]
    orig = meta.get("phi3.rope.scaling.original_context_length")
    if orig is not None:
        out["original_max_position_embeddings"] = int(orig)
    if all(n in tensors for n in ROPE_FACTORS):
        out["rope_parameters"] = {
            "rope_type": "longrope",
            "rope_theta": cfg["rope_parameters"]["rope_theta"],
            "long_factor": [float(x) for x in _dequantize(tensors[ROPE_FACTORS[0]], "")],
            "short_factor": [float(x) for x in _dequantize(tensors[ROPE_FACTORS[1]], "")],
            "original_max_position_embeddings": int(orig or cfg["max_position_embeddings"]),
        }
        if rot != cfg["head_dim"]:
            out["rope_parameters"]["partial_rotary_factor"] = rot / cfg["head_dim"]
    return out


def _special_ids(meta: dict) -> dict:
    """bos/eos/pad ids for config.json and generation_config.json; end-of-turn ids (Llama 3's eot)
    count as eos, so generation stops at the end of an assistant turn."""
    out = {}
    for name, key in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            out[name] = int(meta[f"tokenizer.ggml.{key}"])
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    eos = list(dict.fromkeys(int(meta[k]) for k in keys if k in meta))
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return out


def _validate(cfg: dict, gen: dict, path: Path) -> None:
    from specd.config import ModelConfig

    try:
        ModelConfig.from_hf(cfg, gen)
    except ValueError as e:
        raise LoadError(f"{path}: {_one_line(e)}") from None


# weights -------------------------------------------------------------------------------------------
def hf_name(name: str, arch: str | None = None) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor of a file of GGUF architecture ``arch``
    (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``); None for a name with
    no counterpart."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    names = layer_names(arch)
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m[2] in names:
        return f"model.layers.{m[1]}.{names[m[2]]}.{m[3]}"
    return None


def expected_shapes(cfg: dict) -> dict:
    """HF parameter name -> torch shape, for every parameter the config calls for."""
    d, inter, D = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    out = {"model.embed_tokens.weight": (cfg["vocab_size"], d), "model.norm.weight": (d,)}
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = (cfg["vocab_size"], d)
    bias = cfg.get("attention_bias", cfg["model_type"] == "qwen2")
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if cfg["model_type"] in ("qwen3", "gemma3_text", "qwen3_moe"):
            out.update({p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)})
        if cfg["model_type"] in ("gemma2", "gemma3_text"):
            out.update({p + n + ".weight": (d,) for n in _GEMMA_NORMS.values()})
        if bias and cfg["model_type"] != "qwen2":  # (Llama's attention_bias: the o projection's too)
            out[p + "self_attn.o_proj.bias"] = (d,)
        out.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (q, d),
                p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d),
                p + "self_attn.o_proj.weight": (d, q),
                p + "mlp.gate_proj.weight": (inter, d),
                p + "mlp.up_proj.weight": (inter, d),
                p + "mlp.down_proj.weight": (d, inter),
            }
        )
        if cfg["model_type"] == "phi3":
            for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                del out[p + n + ".weight"]
            out.update(
                {p + "self_attn.qkv_proj.weight": (q + 2 * kv, d), p + "mlp.gate_up_proj.weight": (2 * inter, d)}
            )
        if cfg["model_type"] in ("qwen3_moe", "mixtral"):  # experts in place of the dense MLP
            for n in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
                del out[p + n + ".weight"]
            out.update(_expert_shapes(cfg, i))
        if bias:
            out.update(
                {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
            )
    return out


def _expert_shapes(cfg: dict, i: int) -> dict:
    """Layer i of a mixture (experts in every layer, as llama.cpp has them): its router and 3-D expert
    tensors under their "{e}" names."""
    p, d = f"model.layers.{i}.", cfg["hidden_size"]
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    names = _EXPERTS["mixtral" if cfg["model_type"] == "mixtral" else "qwen3moe"]
    return {p + names["ffn_gate_inp"] + ".weight": (experts, d),
            p + names["ffn_gate_exps"] + ".weight": (experts, inter, d),
            p + names["ffn_up_exps"] + ".weight": (experts, inter, d),
            p + names["ffn_down_exps"] + ".weight": (experts, d, inter)}  # fmt: skip


def check_tensors(reader, cfg: dict, path: Path) -> None:
    """Every tensor has a supported type, a known name and the shape the config implies; none missing."""
    want = expected_shapes(cfg)
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise LoadError(
                f"{path}: unsupported tensor type {kind} for {t.name}; supported: {', '.join(SUPPORTED_TYPES)}"
            )
        if t.name in NOT_WEIGHTS:
            continue
        name = hf_name(t.name, gguf_arch(cfg))
        if name not in want:
            raise LoadError(
                f"{path}: unexpected tensor {t.name} for a {cfg['num_hidden_layers']}-layer {cfg['model_type']} model"
            )
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # ggml dims are innermost first
        if shape != want[name]:
            raise LoadError(f"{path}: tensor {t.name} has shape {shape}, the metadata implies {want[name]}")
        seen.add(name)
    missing = [n for n in want if n not in seen]
    if missing:
        raise LoadError(f"{path}: tensor for {missing[0]} missing ({len(missing)} missing in all)")


def _dequantize(t, path: Path) -> np.ndarray:
    """float32 array of the tensor in torch layout; ``gguf.quants.dequantize`` does the block math."""
    try:
        w = _gguf().quants.dequantize(t.data, t.tensor_type)
    except (NotImplementedError, ValueError) as e:
        raise LoadError(f"{path}: cannot dequantize {t.name} ({t.tensor_type.name}): {_one_line(e)}") from None
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    return np.array(w, dtype=np.float32).reshape(shape)  # a copy: F32 data would be a view of the mmap


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for one projection of ``n_heads`` heads.

    Within each head, transformers' rotary (``rotate_half``) pairs row j with row j + D/2, while
    llama.cpp's pairs rows 2j and 2j + 1; its converter reorders each head's rows
    ``[x0..x(D/2-1), y0..y(D/2-1)]`` to ``[x0, y0, x1, y1, ...]``. Reading the rows back as
    (head, j, pair) and swapping the last two axes restores the halves.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_state_dict(reader, cfg: dict, path: Path, progress: bool = False) -> dict:
    """HF name -> float32 torch tensor for every weight of the file (q/k un-permuted for Llama/Mistral)."""
    import torch

    check_tensors(reader, cfg, path)
    permuted = cfg["model_type"] in PERMUTED_QK
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    arch = gguf_arch(cfg)
    out = {}
    tensors = [t for t in reader.tensors if t.name not in NOT_WEIGHTS]
    for t in _progress(tensors, progress, path):
        w = _dequantize(t, path)
        kind = t.name.split(".")[-2]
        if permuted and kind in heads:
            w = unpermute_qk(w, heads[kind])
        if arch in GEMMA and t.name.endswith("norm.weight"):  # stored as 1 + w; transformers adds the 1
            w = w - np.float32(1.0)
        name = hf_name(t.name, arch)
        if "{e}" in name:  # a mixture's experts stacked in one tensor: one HF tensor each
            out.update({name.format(e=e): torch.from_numpy(np.ascontiguousarray(x)) for e, x in enumerate(w)})
        else:
            out[name] = torch.from_numpy(np.ascontiguousarray(w))
    return out


def gguf_arch(cfg: dict) -> str:
    """The GGUF architecture whose tensor names a converted config.json's model reads."""
    mt = cfg["model_type"]
    return next((a for a, t in MODEL_TYPES.items() if t == mt), mt)


def _progress(items: list, on: bool, path: Path):
    if not on or sum(t.n_bytes for t in items) < 64 * 1024 * 1024:
        return items
    from tqdm import tqdm

    return tqdm(items, unit="tensor", desc=f"dequantizing {path.name}")


# tokenizer -----------------------------------------------------------------------------------------
# llama.cpp's pre-tokenizer ("tokenizer.ggml.pre") -> how text is split before byte-level BPE.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = range(1, 7)


def _tokenizer_fields(meta: dict, path: Path) -> tuple[str, list, list]:
    """(tokenizer model, tokens, token types); a file without a tokenizer is a LoadError."""
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if model is None or not tokens:
        raise LoadError(
            f"{path}: no tokenizer in the file's metadata (tokenizer.ggml.model / tokenizer.ggml.tokens "
            f"missing); specd needs the tokenizer inside the GGUF"
        )
    if model not in ("gpt2", "llama"):
        raise LoadError(
            f"{path}: unsupported tokenizer model {model!r} (tokenizer.ggml.model); supported: "
            f"gpt2 (byte-level BPE), llama (sentencepiece BPE)"
        )
    types = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise LoadError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    return model, tokens, types


def _byte_level_bpe(meta: dict, tokens: list, path: Path):
    """GPT-2 style byte-level BPE: tokens are spelled in the byte alphabet, merges are "a b" strings."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise LoadError(f"{path}: tokenizer.ggml.merges missing (a gpt2 tokenizer needs its merges)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        log.warning("%s: unknown pre-tokenizer %r (tokenizer.ggml.pre); splitting text like GPT-2", path, pre)
    split = PRE_TOKENIZERS.get(pre, "gpt2")
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = Tokenizer(
        models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], ignore_merges=split is _LLAMA3_SPLIT)
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split in ("gpt2", "digits"))
    if split == "digits":
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif split == "gpt2":
        tk.pre_tokenizer = byte_level
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
        )
    tk.decoder = decoders.ByteLevel()
    return tk


def _sentencepiece_bpe(meta: dict, tokens: list, types: list, path: Path):
    """llama/Mistral sentencepiece BPE: "▁" marks spaces, <0xNN> tokens cover bytes the vocab lacks."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    merges = meta.get("tokenizer.ggml.merges")
    if merges:
        merges = [tuple(m.split(" ", 1)) for m in merges]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if not scores or len(scores) != len(tokens):
            raise LoadError(f"{path}: tokenizer.ggml.scores missing (a llama tokenizer without merges needs them)")
        merges = _merges_from_scores(tokens, types, scores)
    unk_id = int(meta.get("tokenizer.ggml.unknown_token_id", 0))
    unk = tokens[unk_id] if 0 <= unk_id < len(tokens) else None
    tk = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True
        )
    )
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tk.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tk


def _merges_from_scores(tokens: list, types: list, scores: list) -> list:
    """Sentencepiece files keep scores, not merges: every split of a token into two vocabulary
    pieces is a merge, ranked by the merged token's score (higher first), then by the pieces' ids."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (TOKEN_NORMAL, TOKEN_USER_DEFINED)}
    ranked = []
    for tok, i in vocab.items():
        for k in range(1, len(tok)):
            a, b = tok[:k], tok[k:]
            if a in vocab and b in vocab:
                ranked.append((-scores[i], vocab[a], vocab[b]))
    ranked.sort()
    return [(tokens[a], tokens[b]) for _, a, b in ranked]


def _special_tokens(meta: dict, tokens: list) -> dict:
    """bos/eos/unk/pad token strings named by the ``tokenizer.ggml.*_token_id`` keys."""
    keys = {
        "bos_token": "bos_token_id",
        "eos_token": "eos_token_id",
        "unk_token": "unknown_token_id",
        "pad_token": "padding_token_id",
    }
    out = {}
    for name, key in keys.items():
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None and 0 <= int(i) < len(tokens):
            out[name] = tokens[int(i)]
    return out


def _post_processor(meta: dict, model: str, tokens: list):
    """(post-processor or None, add_bos, add_eos): BOS/EOS added around every encoding when
    ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say so (BOS defaults to on for
    sentencepiece files, as llama.cpp does, and to off for byte-level ones)."""
    from tokenizers import processors

    added = {}
    for key, default in (("bos", model == "llama"), ("eos", False)):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if meta.get(f"tokenizer.ggml.add_{key}_token", default) and i is not None and 0 <= int(i) < len(tokens):
            added[key] = (tokens[int(i)], int(i))
    if not added:
        return (processors.ByteLevel(trim_offsets=False) if model == "gpt2" else None), False, False
    bos = [added["bos"][0]] if "bos" in added else []
    eos = [added["eos"][0]] if "eos" in added else []
    single = " ".join(bos + ["$A"] + eos)
    pair = single + " " + " ".join(bos + ["$B:1"] + eos)
    proc = processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(added.values()))
    return proc, "bos" in added, "eos" in added


def build_tokenizer(meta: dict, path: Path):
    """(tokenizers.Tokenizer, tokenizer_config dict, special_tokens_map dict) from the metadata.

    Control (type 3) and unknown (type 2) tokens become special added tokens and user-defined ones
    (type 4) plain added tokens, so all stay whole in text instead of being cut into pieces.
    """
    from tokenizers import AddedToken

    model, tokens, types = _tokenizer_fields(meta, path)
    try:
        tk = _byte_level_bpe(meta, tokens, path) if model == "gpt2" else _sentencepiece_bpe(meta, tokens, types, path)
    except LoadError:
        raise
    except Exception as e:  # noqa: BLE001 - tokenizers rejects e.g. a merge of tokens not in the vocabulary
        raise LoadError(f"{path}: invalid tokenizer in the metadata: {_one_line(e)}") from None
    tk.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types)
            if k in (TOKEN_CONTROL, TOKEN_UNKNOWN)
        ]
    )
    tk.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED]
    )
    proc, add_bos, add_eos = _post_processor(meta, model, tokens)
    if proc is not None:
        tk.post_processor = proc
    names = _special_tokens(meta, tokens)
    context = meta.get(f"{meta.get('general.architecture')}.context_length", 2048)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **names,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(context),
    }
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tk, config, names


# conversion ----------------------------------------------------------------------------------------
def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def convert(in_path, out_dir, progress: bool = False, overwrite: bool = False, weights: bool = True) -> dict:
    """Write a Hugging Face folder for the GGUF file ``in_path``; returns its config.json dict.
    ``weights=False``: config, generation config and tokenizer only (a quantized load reads the
    weights from the GGUF file itself, see ``specd.model.quant_load``).

    Everything (metadata, tokenizer, tensor types, names and shapes) is checked before anything
    is written, so a bad file leaves no half-written folder.
    """
    path, out = Path(in_path), Path(out_dir)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
        raise LoadError(f"{out}: already exists and is not an empty folder (pass --force to overwrite)")
    reader = open_gguf(path)
    meta = read_metadata(reader, path)
    cfg, gen = hf_config(meta, reader, path)
    tok, tok_config, special = build_tokenizer(meta, path)
    tensors = hf_state_dict(reader, cfg, path, progress=progress) if weights else None
    try:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        if tensors is not None:
            save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        _write_json(out / "config.json", cfg)
        _write_json(out / "generation_config.json", gen)
        tok.save(str(out / "tokenizer.json"))
        _write_json(out / "tokenizer_config.json", tok_config)
        _write_json(out / "special_tokens_map.json", special)
    except OSError as e:
        raise LoadError(f"{out}: cannot write the converted checkpoint ({e.strerror or e})") from None
    return cfg


# cache ---------------------------------------------------------------------------------------------
def cache_root() -> Path:
    """``gguf/`` in the model cache (``specd.model.errors.cache_dir``: ``$SPECD_CACHE_DIR``, default
    ``~/.cache/specd``)."""
    from specd.model.errors import cache_dir

    return cache_dir() / "gguf"


def _where(path: Path) -> str:
    """The cache's name for the place of ``path`` (its resolved path, hashed)."""
    return hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:10]


def _cache_folder(path: Path, weights: bool) -> Path:
    """Where ``cached_folder`` keeps the conversion of ``path`` in its current state."""
    try:
        st = path.resolve().stat()
    except OSError as e:
        raise LoadError(f"{path}: cannot read the GGUF file ({e.strerror or e})") from None
    where = _where(path)
    state = hashlib.sha256(f"{FORMAT_VERSION}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
    return cache_root() / f"{path.stem}-{where}-{'' if weights else 'meta-'}{state}"


def converted_folder(in_path, weights: bool = True) -> Path | None:
    """``cached_folder``'s folder where it is there already (None: not converted yet; nothing done)."""
    folder = _cache_folder(Path(in_path), weights)
    return folder if folder.is_dir() else None


def cached_folder(in_path, progress: bool = False, weights: bool = True) -> Path:
    """The converted folder for a GGUF file, converting it on first use.

    The folder is named after the file's resolved path and keyed by its size and mtime (and
    ``FORMAT_VERSION``), so a changed file converts again and the stale folder is removed. A
    conversion goes to a temporary folder renamed into place, so a crash or a concurrent start
    never leaves a half-written folder behind. ``weights=False``: a folder without weights (config
    and tokenizer, for a load that keeps the file's quantized blocks), cached beside the full one.
    """
    path = Path(in_path)
    folder = _cache_folder(path, weights)
    if folder.is_dir():
        return folder
    root, kind, where = folder.parent, "" if weights else "meta-", _where(path)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.stem}-", dir=root))
    except OSError as e:
        raise LoadError(
            f"{root}: cannot create the GGUF conversion cache ({e.strerror or e}); "
            f"set SPECD_CACHE_DIR to a writable folder"
        ) from None
    try:
        convert(path, tmp, progress=progress, overwrite=True, weights=weights)
        try:
            tmp.rename(folder)
        except OSError:
            if not folder.is_dir():  # not a concurrent conversion that got there first
                raise LoadError(f"{folder}: cannot store the converted checkpoint") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in root.glob(f"{path.stem}-{where}-{kind}*"):
        if old != folder and (kind or not old.name.startswith(f"{path.stem}-{where}-meta-")):
            shutil.rmtree(old, ignore_errors=True)
    return folder


def cached_folders(in_path) -> list:
    """Every folder the cache keeps for the GGUF file ``in_path`` (the full conversion and the config
    + tokenizer one, for any size and mtime the file had): what its first load creates here."""
    path = Path(in_path)
    return sorted(cache_root().glob(f"{path.stem}-{_where(path)}-*"))


def is_gguf_path(path) -> bool:
    """A ``.gguf`` name or any existing file (a Hugging Face checkpoint is a folder)."""
    path = Path(path)
    return path.suffix.lower() == ".gguf" or path.is_file()


__all__ = [
    "convert",
    "cached_folder",
    "cached_folders",
    "converted_folder",
    "is_gguf_path",
    "open_gguf",
    "read_metadata",
    "hf_config",
    "hf_state_dict",
    "build_tokenizer",
    "unpermute_qk",
    "hf_name",
    "SUPPORTED_TYPES",
    "ARCHITECTURES",
    "HF_CLASSES",
]
