"""A small transformer with the shapes that matter: square, tall and wide matrices in blocks,
an embedding, norms and an output head (the same layout as torchtitan's llama3)."""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn


class CausalAttention(nn.Module):
    """The attention kernel as a child module (torchtitan's ``inner_attention``): q of
    (batch, heads, seq, head_dim), k and v of (batch, kv_heads, seq, head_dim)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.inner_attention = CausalAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # (-1 heads: under tensor parallelism each rank has its share of them)
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        out = self.inner_attention(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class ToyTransformer(nn.Module):
    def __init__(
        self,
        vocab: int = 64,
        dim: int = 32,
        hidden: int = 48,
        n_layers: int = 3,
        n_heads: int = 4,
        n_kv_heads: int = 2,
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            [Block(dim, hidden, n_heads, n_kv_heads) for _ in range(n_layers)]
        )
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init that works on any device (used after ``to_empty``)."""
        state = getattr(self, "_dmuon_state", None)
        stacks = {p.fqn: p for p in state.params if p.stacked} if state else {}
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.numel() == 0:  # a dedicated placeholder: the owner initializes it
                    continue
                # One generator per name: values do not depend on which rank owns what.
                # (Wrapper segments, from activation checkpointing or torch.compile, are not
                # part of the name.)
                for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod."):
                    name = name.replace(wrapper, "")
                stack = stacks.get(name)
                full = init_value(name, stack.shape if stack else p.shape, seed)
                if stack is not None:  # this rank's experts of a DMuon stack
                    full = full[stack.piece[0] : stack.piece[1]]
                local = p.to_local() if hasattr(p, "to_local") else p
                local.copy_(_local_piece(p, full).to(local.dtype))


def init_value(name: str, shape, seed: int = 0) -> torch.Tensor:
    """What ``init_weights`` writes into parameter ``name``: one generator per name, so the
    value does not depend on which rank owns what."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if len(shape) == 1:
        return 1.0 + 0.1 * torch.randn(shape, generator=generator)
    return torch.randn(shape, generator=generator) / shape[-1] ** 0.5


def _local_piece(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The slice of ``full`` that this rank stores for ``param`` (FSDP2 DTensor or plain)."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(
            full.to(param.device), param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
    return full


def dedicated_predicate(name: str, param: torch.Tensor) -> bool:
    """The Muon matrices: 2-D weights inside the blocks (embedding and head stay on AdamW)."""
    return param.ndim == 2 and name.startswith("layers.")


def loss_fn(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, at least in float32 (float64 models keep float64)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


class TiedTransformer(ToyTransformer):
    """The output head shares the embedding's weight (qwen3's small flavors)."""

    def __init__(self, vocab: int = 64, **kwargs) -> None:
        super().__init__(vocab=vocab, **kwargs)
        self.output.weight = self.tok_embeddings.weight


class ReuseTransformer(ToyTransformer):
    """``layers.0`` runs twice per forward; ``layers.1.spare`` is a matrix nobody uses."""

    def __init__(self, vocab: int = 64, **kwargs) -> None:
        super().__init__(vocab=vocab, **kwargs)
        dim = self.output.in_features
        self.layers[1].spare = nn.Linear(dim, dim, bias=False)

    #: the blocks in the order one forward runs them
    order = (0, 1, 0, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for i in self.order:
            h = self.layers[i](h)
        return self.output(self.norm(h))


# ---------------------------------------------------------------- data-dependent participation
class BranchBlock(Block):
    """A block with one more matrix, ``branch``, applied to the samples flagged by ``mask``
    only, and not called at all when no sample of the batch is flagged."""

    def __init__(self, dim: int, hidden: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__(dim, hidden, n_heads, n_kv_heads)
        self.branch = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = super().forward(x)
        if mask is not None and bool(mask.any()):
            h = h + mask[:, None, None].to(h.dtype) * self.branch(h)
        return h


#: the first token that flags a sample for ``BranchTransformer``'s branch
BRANCH_TOKEN = 0


class BranchTransformer(ToyTransformer):
    """``layers.1.branch`` runs only on batches with a sample that starts with BRANCH_TOKEN:
    with data chosen so, on some ranks only (a dedicated matrix without a local gradient)."""

    def __init__(self, vocab: int = 64, **kwargs) -> None:
        super().__init__(vocab=vocab, **kwargs)
        dim, layer = self.output.in_features, self.layers[1]
        heads = layer.attention.n_heads, layer.attention.n_kv_heads
        self.layers[1] = BranchBlock(dim, layer.feed_forward.w1.out_features, *heads)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        mask = tokens[:, 0] == BRANCH_TOKEN
        for i, layer in enumerate(self.layers):
            h = layer(h, mask) if i == 1 else layer(h)
        return self.output(self.norm(h))


class Expert(nn.Module):
    """The seed's MoE expert (custom-hook-boundaries, Example 2)."""

    def __init__(self, d: int, d_ff: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)))


class MoELayer(nn.Module):
    """The seed's MoE layer with top-1 routing: each token goes to expert ``token % E`` (a
    fixed hash, so tests choose which experts a rank's data uses), scaled by the router's
    softmax gate. An expert without tokens is not called at all."""

    def __init__(self, d: int, d_ff: int, n_experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList([Expert(d, d_ff) for _ in range(n_experts)])
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat, ids = x.reshape(-1, d), expert_ids.reshape(-1)
        gates = torch.softmax(self.router(flat), dim=-1).gather(1, ids[:, None])
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (ids == e).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            out = out.index_add(0, rows, gates[rows] * expert(flat[rows]))
        return self.o_proj(out.view(b, t, d))


class MoEBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.moe_norm = nn.RMSNorm(dim)
        self.moe = MoELayer(dim, hidden, n_experts)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.moe_norm(x), expert_ids)


class MoETransformer(nn.Module):
    """Embedding, MoE blocks (router, experts as separate modules, o_proj), head."""

    init_weights = ToyTransformer.init_weights
    block = MoEBlock

    def __init__(
        self,
        vocab: int = 64,
        dim: int = 32,
        hidden: int = 48,
        n_layers: int = 2,
        n_experts=4,
        **block_kwargs,
    ) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            [self.block(dim, hidden, n_experts, **block_kwargs) for _ in range(n_layers)]
        )
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, tokens % self.n_experts)
        return self.output(self.norm(h))


def moe_predicate(name: str, param: torch.Tensor) -> bool:
    """The seed's Example 2: 2-D matrices except the router's (and the embedding/head)."""
    return dedicated_predicate(name, param) and "router" not in name


def moe_boundary(module: nn.Module) -> bool:
    """The seed's Example 2: each expert is a hook site, the layer holds the rest."""
    return isinstance(module, (Expert, MoELayer))


# ---------------------------------------------------------------- grouped experts (3-D stacks)
class GroupedExperts(nn.Module):
    """torchtitan's ``GroupedExperts`` layout: ``w1``/``w3`` ``[E, hidden, dim]``, ``w2``
    ``[E, dim, hidden]``, run expert by expert on its tokens (an expert without tokens still
    gets a zero gradient, as with torchtitan's for-loop and grouped-mm paths).

    ``sliced``: the same weights as one 2-D parameter per expert (``w1.0``, ``w1.1``, ...), so
    that the reference's ``torch.optim.Muon`` steps every slice as a matrix of its own."""

    def __init__(self, dim: int, hidden: int, n_experts: int, sliced: bool = False) -> None:
        super().__init__()
        self.n_experts, self.sliced = n_experts, sliced
        shapes = {"w1": (hidden, dim), "w2": (dim, hidden), "w3": (hidden, dim)}
        for name, shape in shapes.items():
            if sliced:
                slices = [nn.Parameter(torch.empty(shape)) for _ in range(n_experts)]
                setattr(self, name, nn.ParameterList(slices))
            else:
                setattr(self, name, nn.Parameter(torch.empty(n_experts, *shape)))

    #: expert parallelism: the group whose ranks hold equal shares of the experts (set by the
    #: test after dedicate_params with an expert mesh); None: every expert here
    ep_group = None

    def stack(self, name: str) -> torch.Tensor:
        weight = getattr(self, name)
        if self.sliced:
            return torch.stack(list(weight))
        return weight.to_local() if hasattr(weight, "to_local") else weight  # EP's Shard(0)

    def _run(self, x: torch.Tensor, ids: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """Experts ``first ..`` (``count`` of them, this rank's) on their tokens, ungated."""
        w1, w2, w3 = self.stack("w1"), self.stack("w2"), self.stack("w3")
        out = torch.zeros_like(x)
        for e in range(count):
            rows = (ids == first + e).nonzero().squeeze(1)
            xe = x[rows]
            h = F.silu(xe @ w1[e].T) * (xe @ w3[e].T)
            out = out.index_add(0, rows, h @ w2[e].T)
        return out

    def forward(self, x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        if self.ep_group is None:
            return gates * self._run(x, ids, 0, self.n_experts)
        return gates * self._dispatched(x, ids)

    def _dispatched(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: tokens to the rank that holds their expert and back (all-to-all
        over ``ep_group``), as torchtitan's ExpertParallel does."""
        import torch.distributed as dist
        from torch.distributed.nn.functional import all_to_all_single

        ep = dist.get_world_size(self.ep_group)
        per_rank = self.n_experts // ep
        order = torch.argsort(ids // per_rank, stable=True)
        send = torch.bincount(ids // per_rank, minlength=ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.ep_group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        ids_in = ids.new_empty(sum(recv_sizes))
        dist.all_to_all_single(ids_in, ids[order], recv_sizes, send_sizes, group=self.ep_group)
        x_in = all_to_all_single(
            x.new_empty(sum(recv_sizes), x.shape[1]),
            x[order],
            recv_sizes,
            send_sizes,
            group=self.ep_group,
        )
        first = dist.get_rank(self.ep_group) * per_rank
        y_in = self._run(x_in, ids_in, first, per_rank)
        y = all_to_all_single(
            x.new_empty(x.shape), y_in, send_sizes, recv_sizes, group=self.ep_group
        )
        return torch.zeros_like(y).index_copy(0, order, y)


class _TakeSlice(torch.autograd.Function):
    """This tensor-parallel rank's rows of a tensor every tp rank holds whole; backward
    all-gathers the rows' gradients (each rank's slice fed its own rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        rows = x.shape[0] // dist.get_world_size(group)
        start = dist.get_rank(group) * rows
        return x[start : start + rows].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_rows(grad.contiguous(), ctx.group), None


class _GatherSlices(torch.autograd.Function):
    """Every tensor-parallel rank's rows, concatenated (what every rank then computes with,
    alike); backward keeps this rank's rows of the gradient (every rank has all of it)."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group, ctx.rows = group, part.shape[0]
        ctx.start = dist.get_rank(group) * part.shape[0]
        return _gather_rows(part.contiguous(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.start : ctx.start + ctx.rows].clone(), None


def _gather_rows(part: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    out = part.new_empty((part.shape[0] * dist.get_world_size(group), *part.shape[1:]))
    dist.all_gather_into_tensor(out, part, group=group)
    return out


class GroupedMoE(nn.Module):
    """Router (top-1 by the ``token % E`` hash of ``MoELayer``, gated by its softmax), grouped
    experts, and a shared expert every token goes through.

    ``tp_group`` (tensor parallelism with expert parallelism, set by the test): every tp rank
    holds every token; each routes its own share of them through the experts and the results
    are gathered, as torchtitan's sequence-parallel reorderer does (else each expert would see
    every token once per tp rank)."""

    tp_group = None

    def __init__(self, dim: int, hidden: int, n_experts: int, sliced: bool = False) -> None:
        super().__init__()
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, n_experts, sliced)
        self.shared_expert = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat, ids = x.reshape(-1, d), expert_ids.reshape(-1)
        gates = torch.softmax(self.router(flat), dim=-1).gather(1, ids[:, None])
        if self.tp_group is None:
            routed = self.experts(flat, ids, gates)
        else:
            import torch.distributed as dist

            rows = ids.shape[0] // dist.get_world_size(self.tp_group)
            mine = ids[dist.get_rank(self.tp_group) * rows :][:rows]
            part = self.experts(_TakeSlice.apply(flat, self.tp_group), mine, 1.0)
            routed = gates * _GatherSlices.apply(part, self.tp_group)
        out = routed + self.shared_expert(flat)
        return out.view(b, t, d)


class GroupedMoEBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, n_experts: int, sliced: bool = False) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, 4, 2)
        self.moe_norm = nn.RMSNorm(dim)
        self.moe = GroupedMoE(dim, hidden, n_experts, sliced)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.moe(self.moe_norm(h), expert_ids)


class GroupedMoETransformer(MoETransformer):
    """Blocks of attention + a grouped-experts MoE layer (3-D expert stacks, a shared expert,
    a router), as torchtitan's MoE models lay them out."""

    block = GroupedMoEBlock

    def __init__(self, vocab: int = 64, hidden: int = 24, sliced: bool = False, **kwargs) -> None:
        super().__init__(vocab=vocab, hidden=hidden, sliced=sliced, **kwargs)


def grouped_moe_predicate(name: str, param: torch.Tensor) -> bool:
    """Attention, shared-expert and expert matrices (3-D stacks included); not the router."""
    return name.startswith("layers.") and param.ndim in (2, 3) and "router" not in name


def sliced_to_stacked(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ``sliced=True`` model's state dict with each ``<stack>.<e>`` list stacked back into
    ``<stack>``, the keys of the stacked model."""
    out, slices = {}, {}
    for key, value in state.items():
        head, _, tail = key.rpartition(".")
        if ".experts.w" in key and tail.isdigit():
            slices.setdefault(head, {})[int(tail)] = value
        else:
            out[key] = value
    for head, parts in slices.items():
        out[head] = torch.stack([parts[e] for e in sorted(parts)])
    return out


def stacked_to_sliced(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if ".experts.w" in key and value.ndim == 3:
            out.update({f"{key}.{e}": value[e] for e in range(value.shape[0])})
        else:
            out[key] = value
    return out


def rotary(x: torch.Tensor) -> torch.Tensor:
    """A fixed rotary embedding of x (batch, seq, heads, dim) by position, in pairs."""
    t, d = x.shape[1], x.shape[-1]
    freqs = 0.5 ** torch.arange(d // 2, dtype=x.dtype, device=x.device)
    angles = torch.arange(t, dtype=x.dtype, device=x.device)[:, None] * freqs
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class ScaledCausalAttention(nn.Module):
    """The kernel child with the ``scale`` keyword torchtitan's SDPA wrapper takes."""

    def forward(self, q, k, v, *, scale: float | None = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


class LatentAttention(nn.Module):
    """Multi-head latent attention laid out as torchtitan's deepseek_v3 builds it: q from
    ``wq`` (or ``wq_a`` → ``q_norm`` → ``wq_b``), per head a content part and a rotary part;
    k's content part per head from ``wkv_a`` → ``kv_norm`` → ``wkv_b``, its rotary part one
    shared head from ``wkv_a``; a softmax scale of its own."""

    def __init__(self, dim: int, n_heads: int, q_lora_rank: int = 0) -> None:
        super().__init__()
        self.n_heads, self.q_lora_rank, self.kv_lora_rank = n_heads, q_lora_rank, 16
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = 8, 4, 8
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if q_lora_rank == 0:
            self.wq = nn.Linear(dim, n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(q_lora_rank)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(self.kv_lora_rank)
        self.wkv_b = nn.Linear(
            self.kv_lora_rank, n_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.wo = nn.Linear(n_heads * self.v_head_dim, dim, bias=False)
        self.softmax_scale = self.qk_head_dim**-0.5 * 1.3  # (as deepseek's mscale changes it)
        self.inner_attention = ScaledCausalAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(b, t, -1, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, rotary(q_pe)], dim=-1)
        kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = rotary(k_pe.unsqueeze(2))
        kv = self.wkv_b(self.kv_norm(kv)).view(b, t, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = self.inner_attention(q, k, v, scale=self.softmax_scale)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class LatentTransformer(ToyTransformer):
    """The toy with MLA blocks, alternately without and with a query latent (q_lora_rank)."""

    def __init__(self, vocab: int = 64, **kwargs) -> None:
        super().__init__(vocab=vocab, **kwargs)
        dim, heads = self.tok_embeddings.embedding_dim, kwargs.get("n_heads", 4)
        for i, block in enumerate(self.layers):
            block.attention = LatentAttention(dim, heads, q_lora_rank=12 * (i % 2))
