"""Frozen, validated configuration dataclasses. Each component gets only its own sub-config."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
# mixtures of experts specd does not run, and what they add that it does not compute
_OTHER_MOE = {
    "Qwen2MoeForCausalLM": "shared experts",
    "DeepseekV2ForCausalLM": "shared experts and multi-head latent attention",
    "DeepseekV3ForCausalLM": "shared experts and multi-head latent attention",
    "GptOssForCausalLM": "gpt-oss's router biases, clamped SwiGLU and attention sinks",
    "OlmoeForCausalLM": "OLMoE's q/k norms over all heads",
    "PhimoeForCausalLM": "Phi-MoE's sparsemixer routing",
    "Qwen3NextForCausalLM": "shared experts and linear attention",
}
_MODEL_TYPES = {  # config.json's model_type -> architecture, where "architectures" is missing
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
# q/k/v biases whatever attention_bias says (transformers' Qwen2 always has them, Mistral, Mixtral and Phi-3 never)
_FIXED_BIAS = {"Qwen2ForCausalLM": True, "MistralForCausalLM": False, "Phi3ForCausalLM": False,
               "MixtralForCausalLM": False}  # fmt: skip
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder, read from an HF ``config.json``.

    Beyond Llama's layer (RMSNorm, q/k/v, RoPE, attention, o, RMSNorm, SwiGLU): q/k/v biases
    (Qwen2), an o bias, per-head RMSNorms on q and k before RoPE (Qwen3, Gemma 3), sliding windows
    on all or some layers (Mistral, Qwen2, Gemma), and Gemma's layer: norms weighted by 1 + w, a
    norm on the attention's and on the MLP's output before each residual add, GeGLU, embeddings
    scaled by sqrt(d), its own attention scale, tanh soft-capping of attention scores and logits
    (Gemma 2), a second RoPE base for the sliding layers (Gemma 3); Phi-3's partial rotary and
    LongRoPE tables (``rope_scaling``); a mixture of experts in place of the MLP in the layers
    ``moe_layers`` (Qwen3-MoE, Mixtral: ``specd.model.moe``)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v carry a bias (Qwen2 always; Llama's attention_bias)
    o_bias: bool = False  # the output projection carries a bias (Llama's attention_bias)
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear" | "longrope", ...}
    sliding_window: int | None = None  # keys this many positions behind a query or more are masked
    # per layer "sliding_attention" | "full_attention" (empty: every layer slides when sliding_window is set)
    layer_types: tuple = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple = ()
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # the gate's activation: silu (SwiGLU) | gelu_pytorch_tanh (GeGLU)
    gemma_norms: bool = False  # norms weighted by 1 + w; attention and MLP outputs normed before the residual
    embed_scale: float = 1.0  # token embeddings multiplied by this (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # attention scores' scale (None: head_dim ** -0.5)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask (Gemma 2)
    final_softcap: float | None = None  # the same on the logits (Gemma 2)
    rope_local_theta: float | None = None  # the sliding layers' RoPE base (Gemma 3), unscaled
    partial_rotary: float = 1.0  # the share of each head's dims RoPE rotates (the first ones)
    num_experts: int = 0  # experts of each MoE layer (0: every layer has a dense MLP)
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # each expert's gate/up width
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum 1 (Mixtral: always)
    moe_layers: tuple = ()  # indices of the layers whose MLP is a mixture of experts

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"config.json: sliding_window must be a positive integer, got {self.sliding_window!r}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"config.json: layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(
                f"config.json: unsupported activation {self.hidden_act!r}; supported: silu, gelu_pytorch_tanh"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"config.json: partial_rotary_factor {self.partial_rotary} gives an odd or empty rotary part"
            )
        self._check_moe()

    def _check_moe(self) -> None:
        if not self.moe_layers:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
                f"({self.num_experts})"
            )
        if self.moe_intermediate_size <= 0:
            raise ValueError(
                f"config.json: the experts' intermediate size must be positive, got {self.moe_intermediate_size}"
            )
        if not all(0 <= i < self.num_layers for i in self.moe_layers):
            raise ValueError(f"config.json: MoE layers {self.moe_layers} outside 0..{self.num_layers - 1}")

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        return layer in self.moe_layers

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dims RoPE rotates (the first ones; all but for Phi-4-mini's 0.75)."""
        return int(self.head_dim * self.partial_rotary)

    def beyond_llama(self) -> list:
        """What this architecture's layers add to Llama's (the layer tensor-parallel ranks compute)."""
        out = []
        if self.sliding_window is not None:
            out.append(f"a sliding window ({self.sliding_window})")
        if self.o_bias:
            out.append("an output-projection bias")
        out += self.beyond_kernel()
        return out

    def beyond_kernel(self) -> list:
        """What the CPU kernel's fused layer (``specd_layers``) does not compute: these models run
        their layers op by op (``specd.model.fused.kernel_arch``)."""
        out = []
        for on, what in (
            (self.qk_norm, "q/k norms"),
            (self.gemma_norms, "Gemma's norms"),
            (self.hidden_act != "silu", self.hidden_act),
            (self.embed_scale != 1.0, "scaled embeddings"),
            (self.attn_scale is not None, "its own attention scale"),
            (self.attn_softcap is not None, "attention soft-capping"),
            (self.final_softcap is not None, "logit soft-capping"),
            (self.rope_local_theta is not None, "two RoPE bases"),
            (self.rotary_dim != self.head_dim, "partial rotary embeddings"),
            (bool(self.moe_layers), "a mixture of experts"),
        ):
            if on:
                out.append(what)
        return out

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (None: it attends to the whole context)."""
        if self.sliding_window is None or self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @classmethod
    def from_hf(cls, cfg: dict, generation_config: dict | None = None) -> ModelConfig:
        arch = _architecture(cfg)
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            theta, scaling, local = _rope(cfg, arch)
            # transformers' Qwen2 always has q/k/v biases and Mistral never: an attention_bias key in their
            # config.json (it may say false for Qwen2) is not read by transformers, so not by us either
            bias = _FIXED_BIAS.get(arch, bool(cfg.get("attention_bias", False)))
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in GEMMA)),
                attention_bias=bias,
                o_bias=bias and arch not in ("Qwen2ForCausalLM",),
                rope_scaling=scaling,
                sliding_window=window,
                layer_types=_layer_types(cfg, arch, window),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=_eos_ids(cfg, generation_config),
                rope_local_theta=local,
                partial_rotary=float(cfg.get("partial_rotary_factor", 1.0)),
                **_family_fields(cfg, arch, hidden),
                **_moe_fields(cfg, arch),
            )
        except KeyError as e:
            raise ValueError(f"config.json is missing required field {e.args[0]!r}") from None


def _architecture(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else _MODEL_TYPES.get(cfg.get("model_type", ""), "?")
    if arch in _OTHER_MOE:
        raise ValueError(
            f"unsupported architecture {arch!r}: a mixture of experts with {_OTHER_MOE[arch]}; supported "
            f"mixtures of experts: {', '.join(MOE_ARCHITECTURES)}"
        )
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r} (model_type {cfg.get('model_type')!r}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _rope(cfg: dict, arch: str) -> tuple:
    """(RoPE base, scaling dict or None, the sliding layers' own base or None) from ``rope_parameters``
    (transformers 5; Gemma 3 keeps one per layer type) or ``rope_theta`` / ``rope_scaling`` (older)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    local = None
    if "full_attention" in rope:  # Gemma 3: {"full_attention": {...}, "sliding_attention": {...}}
        loc = rope.get("sliding_attention") or {}
        if loc.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope scaling {loc.get('rope_type')!r} on the sliding layers")
        local = float(loc.get("rope_theta", 10000.0))
        rope = rope["full_attention"]
    elif arch == "Gemma3ForCausalLM":
        local = float(cfg.get("rope_local_base_freq", 10000.0))
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = None
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        scaling = dict(rope)
        if scaling.get("rope_type", scaling.get("type")) == "su":  # (early Phi-3 128k configs' name for it)
            scaling["rope_type"] = "longrope"
        if scaling.get("rope_type", scaling.get("type")) == "longrope":  # Phi-3: the factors' context
            orig = scaling.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
            scaling["original_max_position_embeddings"] = int(orig or cfg.get("max_position_embeddings", 4096))
            scaling.setdefault("max_position_embeddings", int(cfg.get("max_position_embeddings", 4096)))
    return theta, scaling, local


def _family_fields(cfg: dict, arch: str, hidden: int) -> dict:
    """The fields only some families set: q/k norms (Qwen3, Gemma 3) and Gemma's layer."""
    out: dict = {"qk_norm": arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM")}
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    out["hidden_act"] = "gelu_pytorch_tanh" if act in ("gelu_pytorch_tanh", "gelu_tanh") else act
    if arch in GEMMA:
        out.update(
            gemma_norms=True,
            embed_scale=math.sqrt(hidden),
            attn_scale=float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256) ** -0.5,
        )
        if arch == "Gemma2ForCausalLM":
            for key, name in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "final_softcap")):
                if cfg.get(key) is not None:
                    out[name] = float(cfg[key])
    return out


def _moe_fields(cfg: dict, arch: str) -> dict:
    """A mixture of experts' fields as transformers reads them: Qwen3-MoE's experts sit in the layers
    not in ``mlp_only_layers`` whose number (from 1) is a multiple of ``decoder_sparse_step``, the
    others keep a dense MLP of ``intermediate_size``; Mixtral's in every layer, ``intermediate_size``
    wide, their top-k weights always renormalised. Shared experts (Qwen2-MoE's) are refused."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    n = int(cfg["num_hidden_layers"])
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or (8 if arch == "MixtralForCausalLM" else 0))
    top_k = int(cfg.get("num_experts_per_tok") or 2)
    if arch == "MixtralForCausalLM":
        return dict(num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                    moe_intermediate_size=int(cfg["intermediate_size"]), moe_layers=tuple(range(n)))  # fmt: skip
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError("config.json: shared experts (shared_expert_intermediate_size) are unsupported in Qwen3-MoE")
    step, dense = int(cfg.get("decoder_sparse_step") or 1), {int(i) for i in cfg.get("mlp_only_layers") or ()}
    layers = tuple(i for i in range(n) if experts > 0 and i not in dense and (i + 1) % step == 0)
    return dict(num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0), moe_layers=layers)  # fmt: skip


def _eos_ids(cfg: dict, generation_config: dict | None) -> tuple:
    eos = []
    for src in (generation_config or {}, cfg):
        e = src.get("eos_token_id")
        if e is None:
            continue
        eos.extend(e if isinstance(e, list) else [e])
        break
    return tuple(dict.fromkeys(int(x) for x in eos))


def _layer_types(cfg: dict, arch: str, window: int | None) -> tuple:
    """Which layers slide (transformers' ``layer_types``): as config.json lists them, else Qwen's rule
    (layers from ``max_window_layers`` on slide), Gemma 2's (every other layer, the first one
    included), Gemma 3's (all but every ``sliding_window_pattern``-th), else every layer (Mistral)."""
    if window is None:
        return ()
    n = int(cfg["num_hidden_layers"])
    if cfg.get("layer_types"):
        return tuple(str(t) for t in cfg["layer_types"])
    slide = None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("max_window_layers") is not None:
        slide = [i >= int(cfg["max_window_layers"]) for i in range(n)]
    elif arch == "Gemma2ForCausalLM":
        slide = [i % 2 == 0 for i in range(n)]
    elif arch == "Gemma3ForCausalLM":
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        slide = [(i + 1) % pattern != 0 for i in range(n)]
    if slide is None:
        return ()
    return tuple("sliding_attention" if s else "full_attention" for s in slide)


KV_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. ``num_blocks`` wins over ``memory_bytes`` when both are given."""

    block_size: int = 16
    num_blocks: int | None = None
    memory_bytes: int | None = None  # budget for target + draft caches together
    dtype: str = "auto"  # the target cache's elements: auto | float32 | float16 | bfloat16 (builder.kv_dtype)

    def __post_init__(self):
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV cache dtype must be one of {', '.join(KV_DTYPES)}, got {self.dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be positive, got {self.memory_bytes}")


class SpecMode(str, enum.Enum):
    """How a request speculates (``speculation.mode``; a str, so ``SpecMode.TREE == "tree"``).

    ``auto`` (requests only): the server's default, adaptive when ``SpecConfig.adaptive``;
    ``off``; ``chain`` / ``tree`` / ``static`` (the draft model: a top-1 chain, a dynamic tree, a
    fixed Medusa-style shape; ``static`` is a server setting only); ``head`` (a tree grown by the
    feature head); ``ngram`` (model-free: prompt lookup, then the tenant's earlier requests);
    ``hybrid`` (a model tree with a lookup branch laid over it)."""

    AUTO = "auto"
    OFF = "off"
    CHAIN = "chain"
    TREE = "tree"
    STATIC = "static"
    HEAD = "head"
    NGRAM = "ngram"
    HYBRID = "hybrid"

    def __str__(self) -> str:
        return self.value


REQUEST_MODES = tuple(m.value for m in SpecMode if m is not SpecMode.STATIC)  # what a request may ask for
SERVER_MODES = tuple(m.value for m in SpecMode if m is not SpecMode.AUTO)  # what a server may run
# modes that draft with a model proposer (the draft model or the feature head)
MODEL_MODES = frozenset({SpecMode.CHAIN, SpecMode.TREE, SpecMode.STATIC, SpecMode.HEAD, SpecMode.HYBRID})


class TreeChoices(NamedTuple):
    """A static tree shape parsed by :func:`static_tree_choices`; index 0 is the root.

    parents  parent node of each node (parents[0] = -1), BFS order
    ranks    rank of each node among its parent's candidates (0 = the draft's top-1 token); -1 for
             the root
    paths    the choice tuple of each node (``()`` for the root)
    """

    parents: list[int]
    ranks: list[int]
    paths: list[tuple[int, ...]]


def static_tree_choices(spec: Sequence[Sequence[int]]) -> TreeChoices:
    """Parse a Medusa/SpecInfer-style list of choices into a parent array.

    Each choice is a path of top-rank indices from the root: ``(0,)`` is the draft's top-1 token
    after the root, ``(0, 1)`` the top-2 token after that, and so on. Every prefix of a choice must
    also be a choice (the empty prefix, the root, is implicit; listing ``()`` is allowed). Nodes
    come out in BFS order (by depth, then lexicographically), so siblings are in rank order and
    ``parents[i] < i``.

    >>> static_tree_choices([(0,), (1,), (0, 0), (0, 1), (1, 0)])
    TreeChoices(parents=[-1, 0, 0, 1, 1, 2], ranks=[-1, 0, 1, 0, 1, 0], paths=[(), (0,), (1,), (0, 0), (0, 1), (1, 0)])
    """
    seen: set[tuple[int, ...]] = set()
    for c in spec:
        try:
            t = tuple(c)
        except TypeError:
            raise ValueError(f"tree choice {c!r} is not a sequence of ranks") from None
        for r in t:
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise ValueError(f"tree choice {c!r}: ranks must be non-negative ints")
        if t in seen and t:
            raise ValueError(f"duplicate tree choice {t!r}")
        seen.add(t)
    seen.discard(())
    for t in seen:
        if len(t) > 1 and t[:-1] not in seen:
            raise ValueError(
                f"tree choice {t!r} has no parent choice {t[:-1]!r} (every prefix of a choice must also be a choice)"
            )
    paths: list[tuple[int, ...]] = [()] + sorted(seen, key=lambda t: (len(t), t))
    index = {p: i for i, p in enumerate(paths)}
    parents = [-1] + [index[p[:-1]] for p in paths[1:]]
    ranks = [-1] + [p[-1] for p in paths[1:]]
    return TreeChoices(parents, ranks, paths)


@dataclass(frozen=True)
class SpecConfig:
    """Default speculation settings (requests may narrow them)."""

    mode: str = "tree"  # off | chain | tree | static (the draft model) | head | ngram (prompt lookup) | hybrid
    num_draft_tokens: int = 4  # chain length k
    tree_budget: int = 16  # dynamic tree: nodes kept (excluding the root)
    tree_topk: int = 4  # dynamic tree: children per expanded node and nodes expanded per level
    tree_depth: int = 6  # dynamic tree: max depth
    static_tree: tuple | None = None  # Medusa-style choices for mode "static"
    adaptive: bool = True
    ngram_tokens: int = 8  # prompt lookup: draft tokens per continuation
    ngram_branches: int = 1  # prompt lookup: distinct continuations in the tree (1 = a chain)
    ngram_extend: int = 1  # prompt lookup: draft at most the match length + this many tokens (-1: ngram_tokens)
    suffix_store: bool = True  # ngram mode: also draft from the same tenant's earlier requests

    def __post_init__(self):
        if self.mode not in SERVER_MODES:
            raise ValueError(f"speculation mode must be {'|'.join(SERVER_MODES)}, got {self.mode!r}")
        object.__setattr__(self, "mode", SpecMode(self.mode))
        if not isinstance(self.ngram_branches, int) or not 1 <= self.ngram_branches <= 8:
            raise ValueError(f"ngram_branches must be an integer in 1..8, got {self.ngram_branches!r}")
        if not isinstance(self.ngram_extend, int) or not -1 <= self.ngram_extend <= 256:
            raise ValueError(f"ngram_extend must be an integer in -1..256, got {self.ngram_extend!r}")
        for name in ("num_draft_tokens", "tree_budget", "tree_topk", "tree_depth", "ngram_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v > 256:
                raise ValueError(f"{name} must be an integer in 1..256, got {v!r}")
        if self.mode == "static":
            if not self.static_tree:
                raise ValueError("speculation mode 'static' needs static_tree choices")
            static_tree_choices(self.static_tree)  # validates (every prefix present, ranks >= 0)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024  # per-step token budget (prefill chunks + verification trees)
    prefill_chunk: int = 256
    batch_starvation_s: float = 2.0  # a batch request waiting this long is served ahead of new interactive work
    batch_seqs_with_interactive: int = 1  # batch requests per step while interactive work is active (0 = no cap)
    enable_prefix_cache: bool = True

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 16 or self.prefill_chunk < 1:
            raise ValueError("scheduler limits must be positive (max_num_batched_tokens >= 16)")
        if self.batch_seqs_with_interactive < 0:
            raise ValueError("batch_seqs_with_interactive must be >= 0")
        if not math.isfinite(self.batch_starvation_s) or self.batch_starvation_s <= 0:
            raise ValueError("batch_starvation_s must be a positive number")


@dataclass(frozen=True)
class EngineConfig:
    target: str
    draft: str | None = None
    head: str | None = None  # an EAGLE-style feature head folder (specd.model.head_files); excludes draft
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"  # auto | cpu | torch | triton
    # weights: auto | none | int8 | int4 | gguf (specd.model.quant_load); the engine passes it to
    # load_model for the target and the draft (each resolves it for its own checkpoint)
    quantization: str = "auto"
    # CPU kernel activations for quantized weights: none (fp32, equal to the dequantized matmul) |
    # int8 (per row in blocks of 32, integer products: faster, row-independent; specd.model.qgemm.cpp) |
    # auto (int8 where the target's weights are quantized and the CPU kernel runs, else none; the
    # command line's default)
    act_quant: str = "none"
    threads: int | None = None  # CPU math threads, applied by the launchers (specd.model.cpu.set_threads)
    # the target split over this many ranks (specd.engine.tensor_parallel); threads then count per rank
    tensor_parallel_size: int = 1
    tensor_parallel_lm_head: str = "split"  # split (by vocabulary, gathered once) | rank0 (whole head on rank 0)
    # CUDA GEMMs / RMSNorm whose reduction order does not depend on the step's rows (specd.model.invariant):
    # on | off | auto (on in any step that holds a greedy row); a CPU is batch-invariant already
    batch_invariant: str = "auto"
    # the target's step, the draft model's / feature head's forwards as CUDA graphs at bucketed widths
    # (specd.model.graphs, captured when the engine is built): on | off | auto (on for CUDA + Triton)
    cuda_graphs: str = "auto"
    # constrained requests' grammar masks filled on a worker thread while the target's forward runs
    # (specd.engine.constraints): on | off (on the engine thread, before the forward)
    mask_overlap: str = "on"
    cache: CacheConfig = field(default_factory=CacheConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self):
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto|cpu|cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")
        if self.quantization not in ("auto", "none", "int8", "int4", "gguf"):
            raise ValueError(f"quantization must be auto|none|int8|int4|gguf, got {self.quantization!r}")
        if self.act_quant not in ("auto", "none", "int8"):
            raise ValueError(f"act_quant must be auto|none|int8, got {self.act_quant!r}")
        if self.attention_backend not in ("auto", "cpu", "torch", "triton"):
            raise ValueError(f"attention backend must be auto|cpu|torch|triton, got {self.attention_backend!r}")
        if not isinstance(self.tensor_parallel_size, int) or not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError(f"tensor_parallel_size must be an integer in 1..64, got {self.tensor_parallel_size!r}")
        if self.batch_invariant not in ("auto", "on", "off"):
            raise ValueError(f"batch_invariant must be auto|on|off, got {self.batch_invariant!r}")
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graphs must be auto|on|off, got {self.cuda_graphs!r}")
        if self.mask_overlap not in ("on", "off"):
            raise ValueError(f"mask_overlap must be on|off, got {self.mask_overlap!r}")
        if self.tensor_parallel_lm_head not in ("split", "rank0"):
            raise ValueError(f"tensor_parallel_lm_head must be split|rank0, got {self.tensor_parallel_lm_head!r}")
        if self.tensor_parallel_size > 1 and self.quantization in ("int8", "int4", "gguf"):
            raise ValueError(
                f"--quantization {self.quantization} cannot be combined with --tensor-parallel-size "
                f"{self.tensor_parallel_size}: quantized blocks are not split across ranks yet "
                "(use --quantization none)"
            )
