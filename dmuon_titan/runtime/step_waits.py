"""The optimizer steps that may still run on their own streams (``Muon(async_step=True)``),
and the waits the model's readers make for them.

The optimizer is coupled through a narrow protocol: what it attaches (its captured step) has
``wait()`` (the current stream waits for the last replay, on the GPU), ``in_flight()``
(whether that replay may still run) and ``may_capture`` (whether its step may still be
captured, which a clip's deferred factor needs). Held weakly: an optimizer dropped for a new one takes
its step along, unless a replay of it is still waited for (:attr:`StepWaits.held`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable


class WeakList:
    """Objects held weakly, in the order added: iterating it costs a weak reference call per
    object, where a ``weakref.WeakSet``'s iteration guard costs the forward's waits more host
    time (docs/design_notes.md#host-time-of-the-forward)."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []

    def add(self, obj) -> None:
        if obj not in self:
            self.refs.append(weakref.ref(obj, self._drop))

    def _drop(self, ref: weakref.ref) -> None:
        if ref in self.refs:
            self.refs.remove(ref)

    def __iter__(self):
        return (obj for ref in self.refs if (obj := ref()) is not None)

    def __len__(self) -> int:
        return sum(ref() is not None for ref in self.refs)

    def __contains__(self, obj) -> bool:
        return any(ref() is obj for ref in self.refs)


def may_run(step) -> bool:
    """Whether an attached step's replay may still be running (a stand-in without
    ``in_flight`` counts as one)."""
    in_flight = getattr(step, "in_flight", None)
    return in_flight is None or in_flight()


class StepWaits:
    """The attached optimizer steps of one model, and the boundaries' wait hooks (DMuon's
    direct path) armed while one may be in flight."""

    def __init__(self) -> None:
        #: the attached steps (weak)
        self.steps = WeakList()
        #: the steps whose replay may still run when the waits were armed, held (strongly)
        #: until a forward finds them done: an optimizer dropped meanwhile must not take
        #: along a replay that the forwards still have to wait for, nor free its gradients
        self.held: list = []
        #: whether the boundaries' modules hold their wait hooks
        self.armed = False

    def wait(self) -> None:
        """The current stream waits (on the GPU) for every attached step still in flight."""
        for ref in self.steps.refs:
            step = ref()
            if step is not None:
                step.wait()

    def in_flight(self) -> bool:
        return any(may_run(step) for step in self.steps)

    def arm(self, groups, register: Callable[[object], list]) -> None:
        """Every group's module gets ``register(group)``'s wait hooks, if a step may be in
        flight and they are not armed yet."""
        self.held = [step for step in self.steps if may_run(step)]
        if self.armed or not self.held:
            return
        self.armed = True
        for group in groups:
            group.hook_handles = register(group)

    def disarm(self, groups) -> None:
        """The groups' wait hooks removed (and the steps held for them let go)."""
        self.armed = False
        self.held = []
        for group in groups:
            for handle in group.hook_handles:
                handle.remove()
            group.hook_handles = []
