"""Mixture-of-experts MLPs (Qwen3-MoE, Mixtral): a router picks each token's experts, and only those run.

Vocabulary: a layer has ``E`` *experts* (gated MLPs, each ``moe_intermediate_size`` wide); the *router*
scores every expert for a token; the token's *chosen* experts are its top ``k``; its output is the sum
of the chosen experts' outputs, each times its *routing weight*.

Routing, exactly as transformers computes it (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``)::

    logits  = h @ W_router^T                      # [T, E], in the activations' dtype
    probs   = softmax(float32(logits))            # over all E experts
    w, idx  = torch.topk(probs, k)                # [T, k]: ties as torch.topk breaks them
    w       = w / w.sum(-1)                       # Mixtral always; Qwen3-MoE where norm_topk_prob
    out[t]  = sum_j w[t, j] * expert_idx[t, j](h[t])

Softmax-then-renormalise over the top k is the same as a softmax over the top-k logits (Mixtral's
paper form). Qwen3-MoE rounds the weights to the activations' dtype before the products, Mixtral keeps
them in fp32 (``SparseMoE.fp32_weights``); in fp32 the two agree.

Worked example (E = 4, k = 2, three tokens routed to experts (2, 0), (0, 3), (2, 1)): the six
(token, slot) assignments sorted by expert are expert 0: tokens 0, 1; expert 1: token 2; expert 2:
tokens 0, 2; expert 3: token 1. Each expert's gate/up and down run once on its own rows (expert 0 on
two rows, ...); an expert no token chose is never touched, so its weights (a ``QuantLinear``'s
quantized blocks too) are not read in that step. Each result lands in its assignment's slot, and a
token's k slots are summed in rank order (a decode step's one row runs its k experts directly). A
token's bits depend on its own row only, given row-independent projections (the CPU kernel's quantized
ones; the router's logits one GEMV per row on a CPU, the batch-invariant kernels on CUDA greedy
steps), so a draft tree's rows verify exactly as decoding computes them.

``SparseMoE.all_experts = True`` runs every expert on every token instead and weights the unchosen
ones by 0 (a dense reference, for the benchmark in docs/benchmarks.md; the same result).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from specd.config import ModelConfig
from specd.model import invariant
from specd.model.quant import QuantLinear


class Expert(nn.Module):
    """One expert: a SwiGLU MLP, gate/up fused by rows (``gate_up`` [2 I, d], ``down`` [d, I]); either
    may be a ``QuantLinear``."""

    def __init__(self, d: int, inter: int):
        super().__init__()
        self.inter = inter
        self.gate_up = nn.Linear(d, 2 * inter, bias=False)
        self.down = nn.Linear(inter, d, bias=False)

    def forward(self, x: torch.Tensor, ops: invariant.InvariantOps = invariant.OFF) -> torch.Tensor:
        """x [n, d] (the rows routed here) -> [n, d]."""
        gu = ops.linear(x, _weight(self.gate_up))  # [n, 2 I]
        return ops.linear(F.silu(gu[:, : self.inter]) * gu[:, self.inter :], _weight(self.down))


class SparseMoE(nn.Module):
    """A layer's router (``router`` [E, d], kept in floats) and its ``experts``; ``forward(h)`` is
    the MLP's output for the normed rows h [T, d] (see the module doc)."""

    all_experts = False  # the dense reference: every expert on every token (benchmarks only)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.fp32_weights = cfg.architecture == "MixtralForCausalLM"
        self.router = nn.Linear(d, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, inter) for _ in range(cfg.num_experts))

    def route(self, h: torch.Tensor, ops: invariant.InvariantOps = invariant.OFF) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights [T, k] fp32 (Mixtral) or h's dtype, chosen experts [T, k] int64) of rows h
        [T, d]; ``ops``: the router's GEMM batch-invariant where it applies (a CUDA greedy step), so a
        token's choice never depends on the rows beside it."""
        logits = self._router_logits(h, ops)  # [T, E]
        probs = torch.softmax(logits.float(), dim=-1)
        w, idx = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk:
            w = w / w.sum(dim=-1, keepdim=True)
        return (w if self.fp32_weights else w.to(h.dtype)), idx

    def _router_logits(self, h: torch.Tensor, ops: invariant.InvariantOps) -> torch.Tensor:
        """h @ W_router^T [T, E] in h's dtype, a token's row independent of the rows beside it: the
        batch-invariant kernel where the step's ops take it (CUDA), one GEMV per row on a CPU (a BLAS
        GEMM picks its kernel, and its sum order, by the row count, which would make a token's routing
        weights differ by an ulp between a decode step and a verification step)."""
        w = self.router.weight
        if ops.applies(h, w) or h.device.type != "cpu":
            return ops.linear(h, w)
        return torch.stack([torch.mv(w, row) for row in h]) if h.shape[0] > 1 else torch.mv(w, h[0]).unsqueeze(0)

    def forward(self, h: torch.Tensor, ops: invariant.InvariantOps = invariant.OFF) -> torch.Tensor:
        """The mixture's output [T, d] for normed rows h [T, d] (the residual is the caller's)."""
        w, idx = self.route(h, ops)
        if self.all_experts:
            return self._dense(h, w, idx, ops)
        T, k = idx.shape
        if T == 1:  # a decode row: its k experts in rank order, nothing to group
            y = torch.cat([self.experts[e](h, ops) for e in idx[0].tolist()]).unsqueeze(0)  # [1, k, d]
        else:
            y = self._grouped(h, idx, ops).view(T, k, -1)  # [T, k, d]
        return (y * w.unsqueeze(-1)).sum(dim=1).to(h.dtype)

    def _grouped(self, h, idx, ops) -> torch.Tensor:
        """Each chosen expert on the rows of the tokens that chose it: [T k, d], row j the output of
        token j // k's slot j % k."""
        k = idx.shape[1]
        flat = idx.reshape(-1)  # [T k]: assignment j = token j // k, slot j % k
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # (one host read per layer)
        rows = h.index_select(0, order // k)  # [T k, d]: each assignment's token row, by expert
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                outs.append(self.experts[e](rows[start : start + n], ops))
                start += n
        return torch.empty_like(rows).index_copy_(0, order, torch.cat(outs))  # back to (token, slot) order

    def _dense(self, h, w, idx, ops) -> torch.Tensor:
        """Every expert on every row, the unchosen ones weighted 0 (``all_experts``)."""
        gates = torch.zeros(h.shape[0], len(self.experts), dtype=w.dtype, device=h.device)
        gates.scatter_(1, idx, w)  # [T, E]
        out = torch.zeros(h.shape, dtype=w.dtype, device=h.device)
        for e, expert in enumerate(self.experts):
            out += expert(h, ops) * gates[:, e : e + 1]
        return out.to(h.dtype)


def _weight(mod):
    """A projection for ``invariant.InvariantOps.linear``: a ``QuantLinear`` as is, else its weight."""
    return mod if isinstance(mod, QuantLinear) else mod.weight


def mlp_projections(mlp: nn.Module) -> list:
    """(parent module, attribute) of every projection of a layer's MLP: a dense MLP's gate/up and down,
    or each expert's (a mixture's router stays in floats), for quantizing them in place."""
    if isinstance(mlp, SparseMoE):
        return [(ex, name) for ex in mlp.experts for name in ("gate_up", "down")]
    return [(mlp, "gate_up"), (mlp, "down")]


# loading ------------------------------------------------------------------------------------------
def hf_expert_names(cfg: ModelConfig, i: int) -> tuple[str, list]:
    """(layer i's router tensor, per expert its (gate, up, down) tensor names) in a Hugging Face
    checkpoint: Qwen3-MoE's ``mlp.experts.{e}.{gate,up,down}_proj``, Mixtral's
    ``block_sparse_moe.experts.{e}.w1 / w3 / w2``."""
    p = f"model.layers.{i}."
    if cfg.architecture == "MixtralForCausalLM":
        m = p + "block_sparse_moe."
        names = [tuple(f"{m}experts.{e}.{w}.weight" for w in ("w1", "w3", "w2")) for e in range(cfg.num_experts)]
        return m + "gate.weight", names
    m = p + "mlp."
    parts = ("gate_proj", "up_proj", "down_proj")
    return m + "gate.weight", [tuple(f"{m}experts.{e}.{w}.weight" for w in parts) for e in range(cfg.num_experts)]


def fused_expert_names(cfg: ModelConfig, i: int) -> tuple[str, str]:
    """Layer i's experts as transformers 5 holds them in memory (and some checkpoints store them):
    ``mlp.experts.gate_up_proj`` [E, 2 I, d] and ``mlp.experts.down_proj`` [E, d, I]."""
    m = f"model.layers.{i}.mlp.experts."
    return m + "gate_up_proj", m + "down_proj"


def expert_tensors(ours: dict, cfg: ModelConfig, i: int, take, has) -> None:
    """Layer i's router and experts under our names (``layers.i.mlp.router.weight``,
    ``layers.i.mlp.experts.e.gate_up.weight`` gate | up by rows, ``...down.weight``), from the
    per-expert tensors of a checkpoint or its fused 3-D ones. ``take(name)`` reads a tensor (a
    missing one is its error), ``has(name)`` tests for one."""
    router, names = hf_expert_names(cfg, i)
    q = f"layers.{i}.mlp."
    ours[q + "router.weight"] = take(router if has(router) else router.replace("block_sparse_moe.", "mlp."))
    gate_up, down = fused_expert_names(cfg, i)
    if has(gate_up):
        gu, dn = take(gate_up), take(down)
        for e in range(cfg.num_experts):
            ours[f"{q}experts.{e}.gate_up.weight"], ours[f"{q}experts.{e}.down.weight"] = gu[e], dn[e]
        return
    for e, (g, u, d) in enumerate(names):
        ours[f"{q}experts.{e}.gate_up.weight"] = torch.cat([take(g), take(u)], 0)
        ours[f"{q}experts.{e}.down.weight"] = take(d)


class _ExpertSlice:
    """Expert ``e`` of a 3-D GGUF expert tensor (``blk.N.ffn_*_exps``, torch shape [E, N, K]) as a
    2-D tensor of the reader's kind: its rows' raw blocks (a view of the memory map, no copy), type,
    ggml shape and a name, which ``quant_load.projection`` takes like any reader tensor."""

    def __init__(self, t, e: int):
        self.tensor_type, self.name = t.tensor_type, f"{t.name}[{e}]"
        self.shape = t.shape[:2].copy()  # ggml dims, innermost first: (K, N)
        self.data = t.data[e]  # [N, bytes per row] (block-quantized) or [N, K]
        self.n_bytes = self.data.nbytes


def gguf_experts(moe: SparseMoE, i: int, tensors: dict, path) -> list:
    """Layer i's router from a GGUF file's ``ffn_gate_inp`` (dequantized to floats: routing as
    transformers computes it), and per expert ``(expert, "gate_up", [gate, up])`` and ``(expert,
    "down", [down])``: its slices of the 3-D ``ffn_{gate,up,down}_exps`` tensors, which
    ``specd.model.quant_load`` turns into projections as it does a dense layer's (Q8_0 / Q4_0 / Q4_1
    blocks kept as they are under gguf / auto)."""
    from specd.model.gguf import _dequantize

    def t(kind):
        return tensors[f"blk.{i}.{kind}.weight"]

    router = torch.from_numpy(_dequantize(t("ffn_gate_inp"), path))  # [E, d]
    moe.router = nn.Linear(router.shape[1], router.shape[0], bias=False)
    moe.router.weight = nn.Parameter(router, requires_grad=False)
    out = []
    for e, ex in enumerate(moe.experts):
        gate_up = [_ExpertSlice(t("ffn_gate_exps"), e), _ExpertSlice(t("ffn_up_exps"), e)]
        out += [(ex, "gate_up", gate_up), (ex, "down", [_ExpertSlice(t("ffn_down_exps"), e)])]
    return out
