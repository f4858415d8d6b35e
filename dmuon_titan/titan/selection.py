"""Which parameters of a torchtitan model go to Muon: chosen from what they are.

Without ``[dmuon] params`` (the default) Muon gets the matrices that Muon is for:

- the 2-D weights of the ``nn.Linear`` layers inside the transformer blocks (``layers.N``):
  attention projections (llama's wq/wk/wv/wo, DeepSeek's wq/wkv_a/wkv_b/wo), feed-forward and
  shared-expert projections;
- the 3-D expert stacks of grouped-experts modules (torchtitan's ``GroupedExperts`` w1/w2/w3,
  gpt-oss's ``mlp1_weight``/``mlp2_weight``): ``[experts, out, in]``, every expert a matrix
  of its own.

AdamW keeps everything else: embeddings and the output head (outside the blocks), norms,
biases, attention sinks, the routers' gates (which score experts rather than transform
features) and tied weights (one tensor under two names cannot live whole on one owner and
be sharded by FSDP2 at once).

Under tensor parallelism the default also leaves on AdamW the block matrices that
torchtitan's tensor-parallel plan keeps whole on every tp rank (``NoParallel``: DeepSeek's
``attention.wkv_a`` and ``attention.wq_a``, :data:`TP_KEPT_WHOLE`). DMuon serves a
tensor-parallel matrix as colwise or rowwise shards only; an explicit ``[dmuon] params`` that
selects one is refused in one line when the plan reaches it (``parallelize.py``).

With ``[dmuon] params`` (regular expressions on the names) the user picks; a 3-D match must
still be an expert stack.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from ..api import clean_fqn
from .errors import ConfigError

_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.")

#: per ``[model] name``, the block modules torchtitan 0.2.2's tensor-parallel plan keeps whole
#: on every tp rank (``NoParallel`` in ``models/<name>/infra/parallelize.py``); the routers'
#: gates are NoParallel too, and on AdamW anyway
TP_KEPT_WHOLE: dict[str, tuple[str, ...]] = {
    "deepseek_v3": ("attention.wkv_a", "attention.wq_a"),
}


def is_expert_stack(module: nn.Module, param: torch.Tensor) -> bool:
    """A 3-D parameter of a grouped-experts module (its class name ends with
    ``GroupedExperts``): torchtitan's, gpt-oss's, and any user's of the same name."""
    return param.ndim == 3 and type(module).__name__.endswith("GroupedExperts")


def _is_router(fqn: str) -> bool:
    return ".router." in f".{fqn}"


def _tied(model: nn.Module) -> set[str]:
    """Every name of a parameter that has more than one."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(clean_fqn(name))
    return {n for group in names.values() if len(group) > 1 for n in group}


def _owners(model: nn.Module) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    """clean fqn -> (the module holding it, the parameter), every name of every parameter."""
    out = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None:
                out[clean_fqn(f"{path}.{attr}" if path else attr)] = (module, p)
    return out


def default_muon(fqn: str, module: nn.Module, param: torch.Tensor) -> bool:
    """The default rule (module doc), for one parameter that is not tied."""
    if is_expert_stack(module, param):
        return True
    inside_block = _LAYER.search(f".{fqn}") is not None
    return (
        inside_block
        and isinstance(module, nn.Linear)
        and param is module.weight
        and param.ndim == 2
        and not _is_router(fqn)
    )


def muon_predicate(
    patterns: list[str], model: nn.Module, kept_whole: tuple[str, ...] = ()
) -> Callable[[str, torch.Tensor], bool]:
    """``(fqn, param) -> bool`` selecting the Muon parameters: the default rule when
    ``patterns`` is empty, else the ``[dmuon] params`` regexes (each must match something;
    every match must be a matrix or an expert stack, and not tied). ``kept_whole``: module
    names (within a block) that tensor parallelism keeps whole on every tp rank, which the
    default rule leaves on AdamW (:data:`TP_KEPT_WHOLE`)."""
    owners = _owners(model)
    tied = _tied(model)
    if not patterns:
        whole = re.compile(
            rf"(?:^|.*\.)layers\.\d+\.(?:{'|'.join(map(re.escape, kept_whole))})\.weight"
        )
        chosen = {
            n
            for n, (m, p) in owners.items()
            if n not in tied and default_muon(n, m, p) and not (kept_whole and whole.fullmatch(n))
        }
        if not chosen:
            raise ConfigError(
                "[dmuon] params is empty (the default rule) but the model has no matrices it "
                "would put on Muon (2-D nn.Linear weights inside layers.N, expert stacks): "
                "list the Muon parameters in [dmuon] params"
            )
    else:
        chosen = _matches(patterns, owners, tied)

    def predicate(name: str, param: torch.Tensor) -> bool:
        return clean_fqn(name) in chosen

    return predicate


def _matches(patterns: list[str], owners: dict, tied: set[str]) -> set[str]:
    chosen = set()
    for pattern in patterns:
        regex = re.compile(pattern)
        hits = [n for n in owners if regex.fullmatch(n)]
        if not hits:
            examples = [n for n, (_, p) in owners.items() if p.ndim >= 2][:4] or list(owners)[:4]
            raise ConfigError(
                f"[dmuon] params pattern {pattern!r} matches no parameter of the model "
                f"(its matrices are named like {', '.join(map(repr, examples))}, ...)"
            )
        for n in hits:
            module, p = owners[n]
            if n in tied:
                raise ConfigError(
                    f"[dmuon] params pattern {pattern!r} matches {n!r}, a tied weight (one "
                    "tensor under two names stays on AdamW): narrow the pattern"
                )
            if p.ndim == 3 and not is_expert_stack(module, p):
                raise ConfigError(
                    f"[dmuon] params pattern {pattern!r} matches {n!r} of shape "
                    f"{tuple(p.shape)} in a {type(module).__name__}, which is not an expert "
                    "stack (3-D parameters are taken as [experts, out, in]): narrow the pattern"
                )
            if p.ndim not in (2, 3):
                raise ConfigError(
                    f"[dmuon] params pattern {pattern!r} matches {n!r} of shape "
                    f"{tuple(p.shape)}; Muon needs 2-D matrices or 3-D expert stacks"
                )
        chosen.update(hits)
    return chosen


def describe_selection(model: nn.Module, predicate) -> str:
    """One line for the start-up log: what went to Muon and what stays on AdamW, names with
    their block index folded (``layers.N``), counted."""
    muon, adamw = Counter(), Counter()
    experts = 0
    for name, p in model.named_parameters():
        name = clean_fqn(name)
        key = re.sub(r"(?:^|(?<=\.))layers\.\d+\.", "layers.N.", name)
        if predicate(name, p):
            muon[key] += 1
            experts += p.shape[0] if p.ndim == 3 else 0
        else:
            adamw[key] += 1

    def listing(counter: Counter) -> str:
        return ", ".join(f"{k} x{n}" if n > 1 else k for k, n in counter.items())

    stacks = f" (expert stacks: {experts} experts in all)" if experts else ""
    return (
        f"DMuon params: Muon {sum(muon.values())}{stacks}: {listing(muon)}; "
        f"AdamW {sum(adamw.values())}: {listing(adamw)}"
    )
