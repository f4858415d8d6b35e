"""The options a user sets, as dataclasses validated once.

:class:`DedicateOptions` says how :func:`dmuon_titan.dedicate_params` places and moves the
matrices; :class:`MuonOptions` holds :class:`dmuon_titan.Muon`'s hyper-parameters. Both check
every field when built and raise :class:`OptionError` (a ``ValueError``) naming the field, its
value and what it must be; the torchtitan adapter maps the same error onto its ``[dmuon]``
key (``dmuon_titan/titan/config.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from .ops.newton_schulz import (
    JORDAN_COEFFICIENTS,
    NS_PRECONDITIONERS,
    Coefficients,
    normalize_coefficients,
)
from .ops.ns_cost import NS_ALGORITHMS
from .ops.update import ADJUST_LR_FNS
from .plan.collectives import BOUNDARY_COLLECTIVES
from .plan.partition import DEFAULT_SMALL_PARAM_NUMEL, TP_NS_MODES

#: Default chunk of batched Newton–Schulz: 2**27 elements (256 MiB in bf16, plus NS's own
#: working copies of that size).
DEFAULT_NS_BATCH_NUMEL = 2**27


class OptionError(ValueError):
    """A bad option value: ``field``, ``value`` and ``why`` (``"must be ..."``)."""

    def __init__(self, owner: str, field: str, value: Any, why: str) -> None:
        self.owner, self.field, self.value, self.why = owner, field, value, why
        super().__init__(f"{owner}: {field} {why}, got {value!r}")


class _Checks:
    """Field checks of one dataclass instance; each raises :class:`OptionError`."""

    def __init__(self, owner: str, options: object) -> None:
        self.owner, self.options = owner, options

    def fail(self, name: str, why: str) -> OptionError:
        return OptionError(self.owner, name, getattr(self.options, name), why)

    def number(self, name: str, low: float, *, above: bool = False, below=None) -> None:
        value = getattr(self.options, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(name, "must be a number")
        if value < low or (above and value == low):
            raise self.fail(name, f"must be a number {'>' if above else '>='} {low}")
        if below is not None and value >= below:
            raise self.fail(name, f"must be in [{low}, {below})")

    def integer(self, name: str, low: int, below: int | None = None) -> None:
        value = getattr(self.options, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise self.fail(name, f"must be an integer >= {low}")
        if below is not None and value >= below:
            raise self.fail(name, f"must be an integer in [{low}, {below})")

    def boolean(self, name: str) -> None:
        if not isinstance(getattr(self.options, name), bool):
            raise self.fail(name, "must be True or False")

    def choice(self, name: str, options: Sequence) -> None:
        if getattr(self.options, name) not in options:
            raise self.fail(name, f"must be one of {list(options)}")


@dataclass(frozen=True)
class DedicateOptions:
    """How :func:`dmuon_titan.dedicate_params` places the matrices and moves them (the
    arguments of the same names; see there)."""

    hook_boundary_strict: bool = True
    reshard_after_forward: bool = True
    replicate_async: bool = True
    small_param_numel: int = DEFAULT_SMALL_PARAM_NUMEL
    ns_algorithm: str = "plain"
    collectives: str = "broadcast"
    tp_ns: str = "auto"

    def __post_init__(self) -> None:
        check = _Checks("dedicate_params", self)
        check.choice("tp_ns", TP_NS_MODES)
        for name in ("hook_boundary_strict", "reshard_after_forward", "replicate_async"):
            check.boolean(name)
        check.integer("small_param_numel", 0)
        check.choice("ns_algorithm", NS_ALGORITHMS)
        check.choice("collectives", BOUNDARY_COLLECTIVES)


@dataclass(frozen=True)
class MuonOptions:
    """:class:`dmuon_titan.Muon`'s hyper-parameters (the arguments of the same names; see
    there). ``adamw_lr`` is resolved: ``lr`` where ``adjust_lr_fn="match_rms_adamw"`` left
    it unset. ``ns_algorithm`` ``None``: the one the owners were planned for."""

    lr: float
    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: Coefficients | Sequence[Coefficients] | str = JORDAN_COEFFICIENTS
    ns_steps: int = 5
    eps: float = 1e-7
    weight_decay: float = 0.1
    adjust_lr_fn: str | None = None
    ns_dtype: torch.dtype = torch.bfloat16
    adamw_lr: float | None = None
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    adamw_eps: float = 1e-8
    adamw_weight_decay: float = 0.1
    adamw_foreach: bool | None = None
    adamw_fused: bool | None = None
    ns_batch_numel: int = DEFAULT_NS_BATCH_NUMEL
    ns_algorithm: str | None = None
    cuda_graph: bool = True
    async_step: bool = False
    ns_preconditioner: str = "frobenius"

    def __post_init__(self) -> None:
        check = _Checks("Muon", self)
        check.choice("ns_preconditioner", NS_PRECONDITIONERS)
        check.boolean("cuda_graph")
        check.boolean("async_step")
        if self.adamw_lr is None:
            if self.adjust_lr_fn != "match_rms_adamw":
                raise check.fail(
                    "adamw_lr",
                    "is required unless adjust_lr_fn='match_rms_adamw' (which makes Muon's lr "
                    "an AdamW-scale lr)",
                )
            object.__setattr__(self, "adamw_lr", self.lr)
        for name in ("lr", "adamw_lr", "weight_decay", "adamw_weight_decay"):
            check.number(name, 0.0)
        check.number("momentum", 0.0, below=1.0)
        check.integer("ns_steps", 1, below=100)
        check.number("eps", 0.0, above=True)
        check.number("adamw_eps", 0.0, above=True)
        check.boolean("nesterov")
        check.choice("adjust_lr_fn", ADJUST_LR_FNS)
        if not isinstance(self.ns_dtype, torch.dtype) or not self.ns_dtype.is_floating_point:
            raise check.fail("ns_dtype", "must be a floating-point torch.dtype")
        betas = self.adamw_betas
        if (
            not isinstance(betas, (tuple, list))
            or len(betas) != 2
            or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)
        ):
            raise check.fail("adamw_betas", "must be two numbers in [0, 1)")
        object.__setattr__(self, "adamw_betas", tuple(betas))
        check.integer("ns_batch_numel", 0)
        if self.ns_algorithm is not None:
            check.choice("ns_algorithm", NS_ALGORITHMS)
        try:
            normalize_coefficients(self.ns_coefficients)
        except ValueError as err:
            raise check.fail("ns_coefficients", f"is not usable: {err}") from None


def options_kwargs(options: DedicateOptions | MuonOptions) -> dict[str, Any]:
    """The options as keyword arguments of the function they belong to."""
    return {f.name: getattr(options, f.name) for f in fields(options)}
