"""A gradient clip's factor left owed on the owned gradients.

A clip may leave its factor owed (``clip_grad_norm_(defer_owned=True)``): the gradients stay
as backward left them and the factor is recorded here. The captured step multiplies each
gradient by it as its momentum pass reads it, and the factor stays owed; whatever else reads
or changes them settles it first, multiplying them as the clip would have: an eager step, the
next clip, the next forward (before a new gradient accumulates into them). ``Muon.zero_grad``
drops it with the gradients.
"""

from __future__ import annotations

import torch

from .owned_param import dedicated_of


def scale_gradients_(params: list[torch.Tensor], factor: torch.Tensor) -> None:
    """``p.grad ← p.grad · factor`` for every one of ``params`` (one foreach multiply, as a
    gradient clip multiplies)."""
    grads = [p.grad for p in params]
    if grads:
        torch._foreach_mul_(grads, factor.to(device=grads[0].device, dtype=grads[0].dtype))


class OwedGradScale:
    """The owed factor and, per master, (the master, its gradient then, that gradient's
    version counter then)."""

    def __init__(self) -> None:
        self._owed: tuple[torch.Tensor, list[tuple]] | None = None

    def owe(self, factor: torch.Tensor, masters: list[torch.Tensor]) -> bool:
        """Record ``factor`` as owed by the float32 gradients of ``masters``; False (nothing
        recorded) if one is not float32 (a multiply of its own rounds it otherwise)."""
        # (the gradients themselves, held until settled or dropped: the next forward at the
        # latest, before it allocates anything; an id could be reused by a new gradient)
        owed = []
        for p in masters:
            grad = p.grad
            if grad.dtype != torch.float32:
                return False
            owed.append((p, grad, grad._version))
        self._owed = (factor.to(torch.float32), owed)
        return True

    def take(self) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """The owed factor and the masters whose gradients owe it (those still holding a
        gradient), or None; nothing is owed after (the caller settles it, or owes it again).
        Raises if one of those gradients was replaced or changed in place since the clip:
        the factor cannot be applied as the clip would have."""
        owed, self._owed = self._owed, None
        if owed is None:
            return None
        factor, entries = owed
        masters = []
        for p, grad, version in entries:
            if p.grad is None:  # dropped: nothing owes the factor any more
                continue
            if p.grad is not grad or grad._version != version:
                dedicated = dedicated_of(p)
                name = dedicated.fqn if dedicated is not None else f"of shape {tuple(p.shape)}"
                raise RuntimeError(
                    f"DMuon: the gradient of {name!r} was replaced or changed in place after "
                    "clip_grad_norm_(defer_owned=True), which left its clip factor owed: "
                    "call the optimizer's step() or zero_grad() right after clipping, or clip "
                    "with defer_owned=False"
                )
            masters.append(p)
        return factor, masters

    def settle(self) -> None:
        """Multiply the gradients that owe the factor, now."""
        taken = self.take()
        if taken is not None:
            scale_gradients_(taken[1], taken[0])

    def drop(self) -> None:
        """Forget the factor (its gradients are being zeroed or dropped)."""
        self._owed = None
