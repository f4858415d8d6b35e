"""Hook-boundary selection: which module hosts the broadcast/reduce hooks of each parameter.

A boundary is identified by its module path (``""`` is the root). Parameters that share a
boundary are broadcast together before that module's forward and reduced together after its
backward, so a good boundary is one transformer block: big enough to amortize launches, small
enough to pipeline layer by layer.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable, Mapping

from torch import nn

# The first ``layers.N`` / ``blocks.N`` segment of a path, e.g. ``model.layers.3`` in
# ``model.layers.3.mlp.gate_proj``. Left-most wins, so nested ``layers`` inside a layer (MoE
# experts, sub-blocks) stay on the outer layer.
_LAYER_SEGMENT = re.compile(r"(?:^|\.)(?:layers|blocks)\.\d+(?=\.|$)")


def parent_path(fqn: str) -> str:
    """Module path of the module that holds the parameter ``fqn`` (``""`` for the root)."""
    return fqn.rpartition(".")[0]


def ancestor_paths(module_path: str) -> list[str]:
    """``module_path`` and each of its ancestors, bottom to top, ending with the root ``""``."""
    paths = [module_path]
    while module_path:
        module_path = module_path.rpartition(".")[0]
        paths.append(module_path)
    return paths


def default_boundary(param_fqn: str) -> str:
    """The heuristic boundary: the first ``layers.N``/``blocks.N`` ancestor, else the parent."""
    module_path = parent_path(param_fqn)
    match = _LAYER_SEGMENT.search(module_path)
    if match is None:
        return module_path
    return module_path[: match.end()]


def select_boundaries(
    param_fqns: Iterable[str],
    modules: Mapping[str, nn.Module],
    predicate: Callable[[nn.Module], bool] | None = None,
    strict: bool = True,
) -> dict[str, str]:
    """Map each parameter FQN to the module path of its hook boundary.

    Without ``predicate``: :func:`default_boundary`. With it: the lowest ancestor (starting at
    the module that holds the parameter) for which ``predicate(module)`` is true. Uncovered
    parameters raise ``ValueError`` listing all of them when ``strict``; otherwise they fall
    back to their parent module (one hook site per module, slower but correct).

    A predicate that is true for the root module warns: parameters reaching the root collapse
    onto a single site and lose layer-by-layer pipelining.
    """
    fqns = list(param_fqns)
    if predicate is None:
        return {fqn: default_boundary(fqn) for fqn in fqns}

    root = modules[""]
    if predicate(root):
        warnings.warn(
            "hook_boundary_predicate is true for the root module: parameters that reach it "
            "share one hook site, which removes layer-by-layer prefetch and overlap",
            stacklevel=3,
        )
    decided: dict[str, bool] = {}

    def matches(path: str) -> bool:
        if path not in decided:
            decided[path] = bool(predicate(modules[path]))
        return decided[path]

    result: dict[str, str] = {}
    uncovered: list[str] = []
    for fqn in fqns:
        hit = next((p for p in ancestor_paths(parent_path(fqn)) if matches(p)), None)
        if hit is None:
            uncovered.append(fqn)
            hit = parent_path(fqn)
        result[fqn] = hit
    if uncovered and strict:
        raise ValueError(
            "hook_boundary_predicate matches no ancestor of these dedicated parameters "
            f"(hook_boundary_strict=True): {uncovered}"
        )
    return result
