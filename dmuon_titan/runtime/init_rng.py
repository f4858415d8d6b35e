"""Random initialization of dedicated matrices that does not depend on who owns them.

Frameworks seed every data-parallel rank alike (torchtitan does) and let DTensor's RNG
tracker give each shard of an FSDP2 parameter its own part of one stream. A dedicated
matrix is a plain tensor on its owner, initialized from the owner's own stream: two matrices
that different owners reach at the same point of their streams get the same values (and the
pieces of one expert stack held by different owners, too).

Inside :func:`independent_init`, every random in-place initialization of a dedicated master
draws from a generator seeded by ``(torch.initial_seed(), the matrix's FQN)`` — per expert
for the pieces of a stack — so each matrix's initial value depends on its name and the job's
seed only: not on which rank owns it, nor on the world size, nor on the order of init calls.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

#: Initializers whose distribution does not depend on the tensor's shape: a stack's piece is
#: initialized expert by expert with them (same values as the whole stack would get, expert
#: for expert, whatever the cut). Others (kaiming, xavier, orthogonal: fan-dependent) get one
#: seed per piece.
_ELEMENTWISE = {
    torch.nn.init.normal_,
    torch.nn.init.trunc_normal_,
    torch.nn.init.uniform_,
    torch.Tensor.normal_,
    torch.Tensor.uniform_,
    torch.Tensor.bernoulli_,
    torch.Tensor.cauchy_,
    torch.Tensor.exponential_,
    torch.Tensor.geometric_,
    torch.Tensor.log_normal_,
    torch.Tensor.random_,
}


def seed_of(base: int, fqn: str, expert: int | None = None) -> int:
    """The generator seed for matrix ``fqn`` (and ``expert`` of a stack) under job seed
    ``base``: 63 bits of a hash, the same on every rank."""
    key = f"{base}:{fqn}" if expert is None else f"{base}:{fqn}:{expert}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


@contextlib.contextmanager
def _seeded(device: torch.device, seed: int) -> Iterator[None]:
    """Draw from a generator at ``seed`` on ``device`` only; the streams are left as before."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        yield


class _IndependentInit(TorchFunctionMode):
    def __init__(self, masters: dict[int, tuple[torch.Tensor, str, int | None]]):
        super().__init__()
        self.masters = masters
        self.inside = False  # an initializer's own calls (trunc_normal_'s uniform_) pass

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        entry = self.masters.get(id(target)) if isinstance(target, torch.Tensor) else None
        in_place = getattr(func, "__name__", "").endswith("_")
        if self.inside or entry is None or entry[0] is not target or not in_place:
            return func(*args, **kwargs)
        _, fqn, first_expert = entry
        base = torch.initial_seed()  # the job's seed at the time of the call
        self.inside = True
        try:
            with torch.no_grad():
                if first_expert is None:  # a matrix
                    with _seeded(target.device, seed_of(base, fqn)):
                        return func(*args, **kwargs)
                if func in _ELEMENTWISE:  # a stack's piece: expert by expert
                    for i in range(target.shape[0]):
                        with _seeded(target.device, seed_of(base, fqn, first_expert + i)):
                            func(target[i], *args[1:], **kwargs)
                    return target
                with _seeded(target.device, seed_of(base, fqn, first_expert)):
                    return func(*args, **kwargs)
        finally:
            self.inside = False


@contextlib.contextmanager
def independent_init(model: nn.Module) -> Iterator[None]:
    """Initialize ``model``'s dedicated matrices inside this context (``model.init_weights()``
    or any ``torch.nn.init`` / in-place random calls): each one's values then depend only on
    its FQN and ``torch.initial_seed()`` at the time of the call (per expert for stacks, for elementwise
    initializers), not on which rank owns it or the world size. Everything else (FSDP2's
    DTensors, buffers) initializes exactly as without it. A model without dedicated matrices
    is left alone."""
    state = getattr(model, "_dmuon_state", None)
    if state is None:
        yield
        return
    masters = {}
    for p in state.params:
        if p.owned.numel() == 0:  # a placeholder: another rank's matrix
            continue
        masters[id(p.owned)] = (p.owned, p.fqn, p.piece[0] if p.stacked else None)
    with _IndependentInit(masters):
        yield


def wrap_init_weights(model: nn.Module) -> None:
    """Make ``model.init_weights`` run inside :func:`independent_init` (idempotent)."""
    init = getattr(model, "init_weights", None)
    if init is None or getattr(init, "_dmuon_independent", False):
        return

    @functools.wraps(init)
    def init_weights(*args, **kwargs):
        with independent_init(model):
            return init(*args, **kwargs)

    init_weights._dmuon_independent = True
    model.init_weights = init_weights
