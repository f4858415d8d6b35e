"""Keep FSDP2's ``fully_shard`` off dedicated parameters, whatever the import order.

``fully_shard`` collects the parameters it manages through two helpers,
``_get_managed_modules`` and ``_get_managed_states``, looked up at call time in the module
namespace that calls them (``_fsdp_init`` in torch 2.13, ``_fully_shard`` in earlier
releases). Wrapping those helpers (not ``fully_shard`` itself, which callers may have imported
by name before us) makes every call treat dedicated parameters as ``ignored_params``.

Tied weights (one parameter in several modules, e.g. an embedding and an output head) stay on
AdamW, in one FSDP2 group: the one of the lowest common ancestor of the modules that hold it
(torch 2.13's FSDP2 refuses a parameter managed by two groups, and torchtitan shards the
embedding and the head separately). Every other ``fully_shard`` call ignores the weight.
"""

from __future__ import annotations

import functools
import weakref

from torch import nn
from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard

from .owned_param import dedicated_params_of, is_dedicated

_PATCHED_FLAG = "_dmuon_patched"

# tied parameter -> (a weak reference to) the lowest common ancestor of the modules that hold
# it: weak both ways, so a model that is dropped is not kept alive here
_TIED: weakref.WeakKeyDictionary[nn.Parameter, weakref.ref] = weakref.WeakKeyDictionary()


def register_tied(param: nn.Parameter, common_ancestor: nn.Module) -> None:
    """Let only ``common_ancestor``'s ``fully_shard`` call manage the tied ``param``."""
    _TIED[param] = weakref.ref(common_ancestor)


def _dedicated_in(modules, recurse: bool) -> set[nn.Parameter]:
    """Dedicated parameters of ``modules`` (and their subtrees when ``recurse``): those in a
    dedicated slot, and any carrying the owner mark."""
    dedicated = set()
    for root in modules:
        for m in root.modules() if recurse else (root,):
            dedicated.update(dedicated_params_of(m))
            dedicated.update(p for p in m.parameters(recurse=False) if is_dedicated(p))
    return dedicated


def _with_dedicated_ignored(modules, ignored_params, recurse: bool):
    dedicated = _dedicated_in(modules, recurse)
    if not dedicated:
        return ignored_params
    return set(ignored_params or ()) | dedicated


def _wrap(fn, recurse: bool):
    @functools.wraps(fn)
    def wrapper(modules, ignored_params=None, *args, **kwargs):
        roots = modules if isinstance(modules, (list, tuple)) else (modules,)
        roots = [m for m in roots if isinstance(m, nn.Module)]
        ignored = _with_dedicated_ignored(roots, ignored_params, recurse)
        if recurse or not _TIED:
            return fn(modules, ignored, *args, **kwargs)
        # _get_managed_states(managed modules): tied weights only where their ancestor is.
        managed = set(roots)
        tied = {p: ancestor() for p, ancestor in _TIED.items()}
        here = [p for p, ancestor in tied.items() if ancestor is not None and ancestor in managed]
        elsewhere = {p for p, ancestor in tied.items() if ancestor not in managed}
        params, buffers = fn(modules, set(ignored or ()) | elsewhere, *args, **kwargs)
        params.extend(p for p in here if p not in set(params))
        return params, buffers

    setattr(wrapper, _PATCHED_FLAG, True)
    return wrapper


def install_fully_shard_patch() -> None:
    """Idempotent: wrap ``_get_managed_modules`` and ``_get_managed_states`` once."""
    # Root modules: search their whole subtree. Managed-module lists already hold every
    # submodule, so each contributes only its own parameters.
    for namespace in (_fsdp_init, _fully_shard):
        for name, recurse in (("_get_managed_modules", True), ("_get_managed_states", False)):
            fn = getattr(namespace, name, None)
            if fn is not None and not getattr(fn, _PATCHED_FLAG, False):
                setattr(namespace, name, _wrap(fn, recurse))


def _skip_dedicated_in_replicate(collect):
    """``replicate`` (composable DDP) collects its parameters with ``_collect_params``; at the
    root call, add the dedicated ones to the ignored set it threads through the recursion."""

    @functools.wraps(collect)
    def wrapper(self, module, ignored_modules, ignored_params, *args, **kwargs):
        if not getattr(self, "_dmuon_ignored_added", False):
            self._dmuon_ignored_added = True
            ignored_params.update(_dedicated_in([module], recurse=True))
        return collect(self, module, ignored_modules, ignored_params, *args, **kwargs)

    setattr(wrapper, _PATCHED_FLAG, True)
    return wrapper


def install_replicate_patch() -> None:
    """Idempotent: keep composable ``replicate`` (torchtitan's DDP) off dedicated params."""
    import importlib

    try:  # (the package re-exports the function under the module's name)
        replicate_module = importlib.import_module("torch.distributed._composable.replicate")
    except ImportError:  # pragma: no cover - a torch without it
        return
    state_cls = getattr(replicate_module, "_ReplicateState", None)
    collect = getattr(state_cls, "_collect_params", None)
    if collect is not None and not getattr(collect, _PATCHED_FLAG, False):
        state_cls._collect_params = _skip_dedicated_in_replicate(collect)
