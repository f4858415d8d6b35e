"""MuonClip (QK-clip, Kimi K2) on DMuon's owners: each attention module's per-head maximum
logit is tracked in the forward, reduced with MAX over the ranks that saw other data, and
after each optimizer step the owner of every query and key matrix rescales its master rows
(:mod:`dmuon_titan.ops.qk_clip`) before the next broadcast carries them to the other ranks.

Served: multi-head and grouped-query attention whose module holds ``wq`` and ``wk``
projections (bias-free) and ``n_heads``, ``n_kv_heads``, ``head_dim``, and calls its kernel
as a child module (``inner_attention`` or ``sdpa``) with ``(q, k, v)`` shaped (batch, heads,
sequence, head_dim) after any rotary embedding: torchtitan's llama3 layout. Under tensor
parallelism (wq and wk colwise, whole heads per rank) each rank tracks its heads and the MAX
places them. Refused in one line: query/key norms (the weights' scale no longer bounds the
logits), biases, masks other than causal, rowwise or head-splitting tensor parallelism.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from .ops import qk_clip as math_ops
from .runtime.owned_param import dedicated_slot_owner

#: names of the attention kernel child module, in the order they are looked for
KERNEL_NAMES = ("inner_attention", "sdpa")
#: kernels whose masks the tracker cannot read (block masks, packed sequences)
UNSERVED_KERNELS = ("FlexAttentionWrapper", "VarlenAttentionWrapper")

_untracked_depth = 0


@contextlib.contextmanager
def not_tracked() -> Iterator[None]:
    """Forwards inside are not the step's (a pipeline stage's metadata inference, which runs
    its layers on uninitialized inputs): no clip tracks their logits."""
    global _untracked_depth
    _untracked_depth += 1
    try:
        yield
    finally:
        _untracked_depth -= 1


@dataclasses.dataclass
class ClippedAttention:
    """One attention module the clip serves: its name, projections and head layout, and
    where its heads sit in the clip's packed vectors of every served head."""

    name: str
    module: nn.Module
    n_heads: int
    n_kv_heads: int
    #: under tensor parallelism this rank's kernel sees query heads [head_offset,
    #: head_offset + local_heads) of the n_heads (colwise wq and wk: whole heads per rank)
    head_offset: int = 0
    local_heads: int = 0
    #: its first query head's and first key head's index in the packed vectors
    start: int = 0
    kv_start: int = 0
    #: the projections whose head rows make q and k (MLA: wq or wq_b, and wkv_b)
    query_proj: str = "wq"
    key_proj: str = "wk"
    #: MLA (deepseek_v3): per head (qk_nope_head_dim, qk_rope_head_dim, v_head_dim); the
    #: shared rotary key (from wkv_a) is not rescaled
    latent: tuple[int, int, int] | None = None

    @property
    def query_heads(self) -> slice:
        return slice(self.start, self.start + self.n_heads)

    @property
    def key_heads(self) -> slice:
        return slice(self.kv_start, self.kv_start + self.n_kv_heads)

    @property
    def tracked_heads(self) -> slice:
        """The packed places of the query heads this rank's kernel sees."""
        first = self.start + self.head_offset
        return slice(first, first + self.local_heads)


def find_attention(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every attention module of ``model`` in the served layouts (a
    kernel child, and ``wq`` and ``wk``, or MLA's ``wkv_b`` with ``wq`` or ``wq_b``), in
    ``named_modules`` order."""
    found = []
    for name, module in model.named_modules():
        if _projections(module) is not None and _kernel_of(module) is not None:
            found.append((_clean(name), module))
    return found


def _projections(module: nn.Module) -> tuple[str, str] | None:
    """(query, key) projection names of an attention module, None if it has neither
    layout."""
    if isinstance(getattr(module, "wkv_b", None), nn.Module):
        query = "wq" if isinstance(getattr(module, "wq", None), nn.Module) else "wq_b"
        return (query, "wkv_b") if isinstance(getattr(module, query, None), nn.Module) else None
    if all(isinstance(getattr(module, n, None), nn.Module) for n in ("wq", "wk")):
        return "wq", "wk"
    return None


def served_attention(model: nn.Module, allow_empty: bool = False) -> list[ClippedAttention]:
    """The attention modules of ``model`` the clip serves (:func:`find_attention`); one
    line naming the first that cannot be served, or saying that there is none (unless
    ``allow_empty``), as a ValueError (checked before any collective)."""
    served = [_serve(name, module) for name, module in find_attention(model)]
    start = kv_start = 0
    for attention in served:
        attention.start, attention.kv_start = start, kv_start
        start, kv_start = start + attention.n_heads, kv_start + attention.n_kv_heads
    if not served and not allow_empty:
        raise ValueError(
            "qk_clip: the model has no attention module with wq and wk (or MLA's wkv_b) and "
            f"an {' or '.join(KERNEL_NAMES)} child: nothing to clip"
        )
    return served


def _serve(name: str, module: nn.Module) -> ClippedAttention:
    query, key = _projections(module)
    latent = None
    if key == "wkv_b":  # (MLA: one key head per query head)
        dims = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        latent = tuple(getattr(module, n, None) for n in dims)
    heads = getattr(module, "n_heads", None)
    kv_heads = heads if latent else getattr(module, "n_kv_heads", None) or heads
    problem = _layout_problem(module, query, key, heads, kv_heads, latent)
    tp = (1, 0)
    for proj in (query, key):
        owner = dedicated_slot_owner(getattr(module, proj), "weight")
        if problem is not None:
            break
        if owner is not None and owner.tp_size > 1:
            problem = _tensor_parallel_problem(proj, owner, heads, kv_heads)
            tp = (owner.tp_size, owner.tp_rank)
        elif owner is None and hasattr(getattr(module, proj).weight, "device_mesh"):
            problem = (
                f"its {proj} is a DTensor on AdamW; select it for Muon (dedicate_params' predicate)"
            )
    if problem is not None:
        raise ValueError(f"qk_clip: attention module {name!r} is not served: {problem}")
    local = heads // tp[0]
    return ClippedAttention(
        name, module, heads, kv_heads, tp[1] * local, local, 0, 0, query, key, latent
    )


def _layout_problem(module, query, key, heads, kv_heads, latent) -> str | None:
    """Why the clip's rule does not hold for this attention module, or None."""
    kernel = _kernel_of(module)
    if type(kernel).__name__ in UNSERVED_KERNELS:
        return f"its kernel {type(kernel).__name__} takes masks the clip cannot read"
    # (MLA's q_norm and kv_norm act on the latents, before wq_b and wkv_b: the head rows'
    # scale still bounds the logits)
    if latent is None and any(getattr(module, n, None) is not None for n in ("q_norm", "k_norm")):
        return "its query/key norms make the logits independent of the weights' scale"
    if any(getattr(getattr(module, n), "bias", None) is not None for n in (query, key)):
        return f"its {query}/{key} have biases"
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads == 0):
        return "it has no n_heads (and n_kv_heads) dividing its projections"
    if latent is not None and not all(isinstance(n, int) and n > 0 for n in latent):
        return "it has no qk_nope_head_dim, qk_rope_head_dim and v_head_dim"
    return None


def _tensor_parallel_problem(proj: str, owner, heads: int, kv_heads: int) -> str | None:
    """What keeps a tensor-parallel wq or wk from being served: not (yet) placed colwise, or
    heads that the degree does not divide."""
    if owner.tp_dim is None:
        return f"its {proj} is not placed yet; build QKClip after parallelize_module"
    if owner.tp_dim != 0:
        return f"its {proj} is rowwise tensor-parallel (heads are its output rows: colwise)"
    if heads % owner.tp_size or kv_heads % owner.tp_size:
        return (
            f"the tensor-parallel degree {owner.tp_size} does not divide its {heads} query "
            f"and {kv_heads} key heads"
        )
    return None


class QKClip:
    """QK-clip with threshold τ for the attention modules of ``model`` (a model of
    :func:`dmuon_titan.dedicate_params`, or a plain one), stepped by ``optimizer``.

    Args:
        model: the model; its attention modules are found by :func:`find_attention`.
        optimizer: the :class:`dmuon_titan.Muon` that steps it; the clip runs after each of
            its steps, before replicas receive the updated matrices.
        threshold: τ, the largest attention logit a head may keep (Kimi K2: 100).
        alpha: the query's share of the rescale (the key's is ``1 - alpha``).
        process_group: the ranks whose maxima are combined with MAX: those that saw other
            data or hold other heads of the same layers (tensor parallelism); default: every
            rank, when torch.distributed is initialized. Every rank of it must step, since
            the combination is a collective. Under pipeline parallelism: the ranks of this
            stage (they hold the same layers).
        allow_empty: a model without a served attention module clips nothing instead of
            being refused (a pipeline stage without attention layers; every rank of
            ``process_group`` must then hold none).

    After each step, :attr:`max_logit` is the largest logit of that step's forwards (before
    the clip) and :attr:`clipped_heads` the number of heads rescaled (0-dim tensors, written
    behind an asynchronous step: read them with :meth:`figures`).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer,
        threshold: float,
        *,
        alpha: float = 0.5,
        process_group: dist.ProcessGroup | None = None,
        allow_empty: bool = False,
    ) -> None:
        if not threshold > 0 or not math.isfinite(threshold):
            raise ValueError(f"qk_clip threshold = {threshold!r}: use a positive number")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"qk_clip alpha = {alpha!r}: use a value in [0, 1]")
        self.threshold, self.alpha = float(threshold), float(alpha)
        self.group = process_group
        self.reduce = dist.is_available() and dist.is_initialized()
        self.attention = served_attention(model, allow_empty)
        self.heads = sum(a.n_heads for a in self.attention)
        #: the step's running maximum logit of every served head, packed (−inf: not seen
        #: yet); made at the step's first tracked forward, handed to the clip after it
        self._maxima: torch.Tensor | None = None
        #: the wait for the optimizer's step in flight (the figures are written behind it)
        self._wait_for_step = getattr(getattr(optimizer, "step_graph", None), "wait", None)
        self.max_logit: torch.Tensor | None = None
        self.clipped_heads: torch.Tensor | None = None
        self._hooks = [
            # (a forward hook, not a pre-hook: it sees the inputs as the kernel ran on them,
            # after every pre-hook, those of a context-parallel style applied later too)
            _kernel_of(a.module).register_forward_hook(self._tracker(a), with_kwargs=True)
            for a in self.attention
        ]
        optimizer.register_update_hook(self.clip)

    def _tracker(self, attention: ClippedAttention):
        def track(kernel, args, kwargs, output):
            # evaluation is not the step's; a recomputation in the backward (activation
            # checkpointing) sees the forward's q and k again
            if (
                not kernel.training
                or torch._C._current_graph_task_id() != -1
                or _untracked_depth
                or args[0].is_meta
            ):
                return None
            self._observe(attention, args[0], args[1], kwargs)
            return None

        return track

    @torch.no_grad()
    def _observe(self, attention: ClippedAttention, q, k, kwargs) -> None:
        """Fold this forward's maxima into the step's. Under context parallelism q and k
        come as DTensors sharded on the sequence: this rank's query rows are held against
        every rank's keys (one all-gather of k over the cp mesh; the causal mask by each
        row's place in torch's layout), and the step's MAX over the ranks completes it."""
        context = isinstance(q, DTensor)
        if context and (q.device_mesh.ndim != 1 or q.placements != (Shard(2),)):
            raise ValueError(
                f"qk_clip: attention module {attention.name!r} got q as a DTensor placed "
                f"{q.placements} on {q.device_mesh}; context parallelism's Shard(2) on one "
                "mesh dimension is served"
            )
        local = q.to_local() if context else q
        if local.shape[1] != attention.local_heads:
            raise ValueError(
                f"qk_clip: attention module {attention.name!r} ran with {local.shape[1]} "
                f"query heads where its layout gives this rank {attention.local_heads}"
            )
        if self._maxima is None:
            dtype = math_ops.logit_dtype(local.dtype)
            self._maxima = torch.full((self.heads,), -math.inf, dtype=dtype, device=local.device)
        out, causal = self._maxima[attention.tracked_heads], kwargs.get("is_causal", True)
        if not context:
            math_ops.max_logits(q, k, causal=causal, scale=kwargs.get("scale"), out=out)
            return
        math_ops.context_parallel_max_logits(
            local,
            k.full_tensor(),
            rank=q.device_mesh.get_local_rank(),
            world=q.device_mesh.size(),
            load_balanced=_context_parallel_load_balanced(),
            causal=causal,
            scale=kwargs.get("scale"),
            out=out,
        )

    @torch.no_grad()
    def clip(self) -> None:
        """Combine this step's maxima and rescale the owned query and key rows (run by the
        optimizer after its step, its GPU work queued behind the step); the next forward
        starts a new running maximum. A fixed number of launches, plus one foreach call,
        whatever the number of layers."""
        if not self.attention:  # (none, or removed: on every rank of the group alike)
            return
        maxima = self._combined_maxima()
        self.max_logit = maxima.max()
        self.clipped_heads = (maxima > self.threshold).sum()
        gamma = math_ops.head_scales(maxima, self.threshold)
        q_scales, k_scales = self._query_key_scales(gamma)
        rows, factors, cast = [], [], {}

        def add(weight, heads: int, part: slice | None, scales, slot: slice) -> None:
            key = (id(scales), weight.dtype)
            if key not in cast:  # (one cast per dtype, not per layer)
                cast[key] = scales.to(weight.dtype)
            blocks = weight.view(heads, -1, weight.shape[-1])
            rows.append(blocks if part is None else blocks[:, part])
            factors.append(cast[key][slot])

        for a in self.attention:
            query = _stepped_weight(getattr(a.module, a.query_proj))
            key = _stepped_weight(getattr(a.module, a.key_proj))
            if a.latent is None:
                if query is not None:
                    add(query, a.n_heads, None, q_scales, a.query_heads)
                if key is not None:
                    add(key, a.n_kv_heads, None, k_scales, a.key_heads)
                continue
            # MLA: q's content part × γ^α and rotary part × γ, k's content part × γ^(1−α)
            nope = slice(0, a.latent[0])
            if query is not None:
                add(query, a.n_heads, nope, q_scales, a.query_heads)
                add(query, a.n_heads, slice(a.latent[0], None), gamma, a.query_heads)
            if key is not None:
                add(key, a.n_heads, nope, k_scales, a.key_heads)
        math_ops.scale_heads_rows_(rows, factors)

    def _query_key_scales(self, gamma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed (per query head γ^α, per key head its group's smallest γ^(1−α)): one
        call for all layers when they share a group size."""
        groups = {a.n_heads // a.n_kv_heads for a in self.attention}
        if len(groups) == 1:
            return math_ops.query_key_scales(gamma, self.heads // groups.pop(), self.alpha)
        per_layer = [
            math_ops.query_key_scales(gamma[a.query_heads], a.n_kv_heads, self.alpha)
            for a in self.attention
        ]
        return torch.cat([q for q, _ in per_layer]), torch.cat([k for _, k in per_layer])

    def _combined_maxima(self) -> torch.Tensor:
        """Every served head's maximum logit, packed in module order (−inf: none seen),
        float64, combined over ``process_group`` (under tensor parallelism its tp ranks'
        heads too, each in its place); one collective, the same on every rank."""
        maxima, self._maxima = self._maxima, None
        if maxima is None:  # (no tracked forward since the last step)
            first = self.attention[0]
            device = getattr(first.module, first.query_proj).weight.device
            maxima = torch.full((self.heads,), -math.inf, dtype=torch.float64, device=device)
        elif maxima.is_cuda:  # (made on the compute stream, read on the step's)
            maxima.record_stream(torch.cuda.current_stream(maxima.device))
        # (float64: γ as exact as the masters it scales)
        packed = maxima.to(torch.float64)
        if self.reduce:
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=self.group)
        return packed

    def figures(self) -> tuple[float, int] | None:
        """(largest logit before the clip, heads rescaled) of the last step, read on the host
        (one synchronization); None before a step."""
        if self.max_logit is None:
            return None
        if self._wait_for_step is not None:
            self._wait_for_step()
        return float(self.max_logit), int(self.clipped_heads)

    def remove(self) -> None:
        """Stop tracking (the optimizer's hook stays, clipping nothing)."""
        for hook in self._hooks:
            hook.remove()
        self.attention, self.heads, self._maxima = [], 0, None


def _context_parallel_load_balanced() -> bool:
    """Whether torch's context parallelism lays the sequence out head-tail (its default)."""
    from torch.distributed.tensor.experimental._attention import _cp_options

    return bool(_cp_options.enable_load_balance)


def _kernel_of(module: nn.Module) -> nn.Module | None:
    for name in KERNEL_NAMES:
        child = getattr(module, name, None)
        if isinstance(child, nn.Module):
            return child
    return None


def _stepped_weight(projection: nn.Module) -> torch.Tensor | None:
    """The tensor this rank updates for ``projection.weight``: a dedicated matrix's master
    on its owner (None elsewhere), or the plain parameter itself."""
    owner = dedicated_slot_owner(projection, "weight")
    if owner is not None:
        return owner.owned if owner.is_owner else None
    return projection.weight


def _clean(name: str) -> str:
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name
