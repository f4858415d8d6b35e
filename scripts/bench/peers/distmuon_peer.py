"""torchtitan 0.3.0 ``DistMuon`` as a peer baseline, loaded without touching torchtitan 0.2.2.

torchtitan 0.3.0 ships Muon for FSDP2 in ``torchtitan/distributed/flex_shard`` (five files that
import only ``torch``). This module loads that sub-package from ``.peers/torchtitan030`` (the
unpacked wheel, ignored by git) under the private module name ``_peer_tt030_flex_shard``. Nothing
is added to ``sys.path`` and the name ``torchtitan`` is never bound, so the installed torchtitan
0.2.2 stays the one that ``import torchtitan`` finds.

DistMuon works on the parameters FSDP2's ``fully_shard`` already made (DTensors, ``Shard(0)`` on
a 1-D mesh); it does not need its own wrapper. Two conditions come from its code:

- the storage mesh must have named axes (``init_device_mesh(..., mesh_dim_names=("dp_shard",))``);
  an unnamed mesh is rejected;
- it takes exactly one parameter group and every parameter of it must be a 2-D matrix given an
  ``Owned`` (whole matrix on one rank) or ``BlockShard`` layout; here every matrix is ``Owned``
  on the mesh's single axis, one bucket per layer (``layers.<i>``), as the colleague's 682 ms
  measurement did.

Use::

    from peers.distmuon_peer import build_distmuon  # with scripts/ on sys.path
    optimizer = build_distmuon(model, mesh, lr=1e-3)  # after fully_shard(...) on a named mesh

Its update, per matrix (``dist_muon.py``): ``buf.lerp_(g, 1 - momentum)``; Nesterov input
``lerp(g, buf, momentum)``; Newton–Schulz in bf16 on the whole matrix on its owner rank (Jordan
coefficients (3.4445, -4.7750, 2.0315), 5 steps, Frobenius normalisation with eps 1e-7, transposed
when rows > cols); ``p *= 1 - lr * weight_decay``; ``p -= adjusted_lr * O`` with
``adjusted_lr = lr * sqrt(max(1, rows / cols))`` for ``adjust_lr_fn=None`` — the same semantics
as ``torch.optim.Muon`` and ``dmuon_titan.Muon``. Transport: packed ``all_to_all_single`` on a
side stream, in the parameter dtype (fp32 here), with the momentum kept on the local shard.

CPU (gloo) runs are for tests only: DistMuon refuses non-CUDA parameters and ``torch.cpu.Stream``
takes no ``device`` argument, so with ``allow_cpu=True`` the private copy is given a CPU-permitting
storage check and a no-op stream/event handle. Neither patch is active on CUDA.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import sys
from collections import OrderedDict
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dmuon_titan.api import clean_fqn

PEER_ROOT = Path(__file__).resolve().parents[3] / ".peers" / "torchtitan030"
FLEX_SHARD_DIR = PEER_ROOT / "torchtitan" / "distributed" / "flex_shard"
PRIVATE_NAME = "_peer_tt030_flex_shard"


def load_flex_shard() -> ModuleType:
    """Import torchtitan 0.3.0's ``flex_shard`` package under a private name (once)."""
    if PRIVATE_NAME in sys.modules:
        return sys.modules[PRIVATE_NAME]
    init = FLEX_SHARD_DIR / "__init__.py"
    if not init.is_file():
        raise FileNotFoundError(
            f"{init} is missing: unpack torchtitan==0.3.0's torchtitan/distributed/flex_shard "
            f"under {PEER_ROOT}"
        )
    spec = importlib.util.spec_from_file_location(
        PRIVATE_NAME, init, submodule_search_locations=[str(FLEX_SHARD_DIR)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[PRIVATE_NAME] = module  # needed for its relative imports
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for name in [
            n for n in sys.modules if n == PRIVATE_NAME or n.startswith(PRIVATE_NAME + ".")
        ]:
            del sys.modules[name]
        raise
    return module


def _bucket_key(fqn: str) -> str:
    match = re.match(r"^(.*?layers\.\d+)\.", fqn)
    return match.group(1) if match else fqn


class _NullStream:
    """Stands in for a device stream on CPU, where work is synchronous."""

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event


class _NullEvent:
    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _NullDeviceHandle:
    """The few members of a device module (``torch.cuda``) that the flex_shard runtime uses."""

    _current = _NullStream()

    @staticmethod
    def Stream(device: Any = None, priority: int = 0) -> _NullStream:  # noqa: N802
        return _NullStream()

    @staticmethod
    def Event(*args: Any, **kwargs: Any) -> _NullEvent:  # noqa: N802
        return _NullEvent()

    @classmethod
    def current_stream(cls, device: Any = None) -> _NullStream:
        return cls._current

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


_CPU_PATCHED = False


def _enable_cpu(flex: ModuleType) -> None:
    """Let the private copy run on CPU/gloo (tests only); CUDA paths are unchanged."""
    global _CPU_PATCHED
    if _CPU_PATCHED:
        return
    dist_muon = sys.modules[PRIVATE_NAME + ".dist_muon"]
    runtime = sys.modules[PRIVATE_NAME + "._optimizer_reshard_runtime"]
    original_validate = dist_muon.DistMuon._validate_parameter_storage

    def validate_parameter_storage(self) -> torch.device:
        devices = {p.to_local().device for g in self.param_groups for p in g["params"]}
        if len(devices) == 1 and next(iter(devices)).type == "cpu":
            if not all(isinstance(p, DTensor) for g in self.param_groups for p in g["params"]):
                raise TypeError("DistMuon requires DTensor parameters")
            return devices.pop()
        return original_validate(self)

    context_cls = runtime._CommunicationContext
    original_create = context_cls.create.__func__

    def create(cls, device: torch.device):
        if device.type != "cpu":
            return original_create(cls, device)
        handle = _NullDeviceHandle
        slots = tuple(
            runtime._PipelineSlot(
                buffers=runtime._BufferSlot(),
                compute_input_ready=handle.Event(),
                compute_done=handle.Event(),
                done=handle.Event(),
            )
            for _ in range(runtime._NUM_PIPELINE_SLOTS)
        )
        return cls(device_handle=handle, transfer_stream=handle.Stream(), slots=slots)

    dist_muon.DistMuon._validate_parameter_storage = validate_parameter_storage
    context_cls.create = classmethod(create)
    # With no redistributed bucket the runtime asks torch for the device module directly.
    original_get_device_module = torch.get_device_module

    class _TorchProxy:
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def get_device_module(device: Any = None) -> Any:
            if isinstance(device, torch.device) and device.type == "cpu":
                return _NullDeviceHandle
            return original_get_device_module(device)

    runtime.torch = _TorchProxy()  # only the private runtime module sees the proxy
    _CPU_PATCHED = True


def build_distmuon(
    model: nn.Module,
    mesh: Any,
    lr: float,
    *,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
    eps: float = 1e-7,
    adjust_lr_fn: str | None = None,
    allow_cpu: bool | None = None,
) -> torch.optim.Optimizer:
    """torchtitan 0.3.0 DistMuon over every trainable parameter of an FSDP2-sharded ``model``.

    Every trainable parameter must be a 2-D DTensor on ``mesh`` (1-D, with a named axis): each
    gets ``ComputeLayout({axis: Owned()})``, and the buckets are one per ``layers.<i>`` prefix in
    model order (any other matrix gets a bucket of its own). ``allow_cpu`` (default: when the
    parameters are on CPU) enables the CPU/gloo test shims.
    """
    if mesh.ndim != 1 or not mesh.mesh_dim_names:
        raise ValueError(
            "DistMuon needs a 1-D storage mesh with a named axis, e.g. "
            "init_device_mesh(device_type, (world,), mesh_dim_names=('dp_shard',))"
        )
    axis = mesh.mesh_dim_names[0]
    flex = load_flex_shard()

    params, names = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim != 2:
            raise ValueError(
                f"DistMuon here takes only 2-D matrices; {name} is {tuple(param.shape)}"
            )
        if not isinstance(param, DTensor):
            raise TypeError(f"{name} is not a DTensor: apply fully_shard before build_distmuon")
        if param.device_mesh.mesh_dim_names != mesh.mesh_dim_names or not torch.equal(
            param.device_mesh.mesh, mesh.mesh
        ):
            raise ValueError(f"{name} is not sharded on the given mesh")
        params.append(param)
        names.append(clean_fqn(name))  # wrapper segments dropped, as torchtitan does
    if not params:
        raise ValueError("no trainable parameters")

    if allow_cpu is None:
        allow_cpu = params[0].to_local().device.type == "cpu"
    if allow_cpu:
        _enable_cpu(flex)

    owned = flex.ComputeLayout(shardings_by_mesh_axis={axis: flex.Owned()})
    buckets: OrderedDict[str, list[str]] = OrderedDict()
    for fqn in names:
        buckets.setdefault(_bucket_key(fqn), []).append(fqn)
    bucket_configs = [
        flex.BucketConfig(patterns=tuple(fqns), name=key) for key, fqns in buckets.items()
    ]
    # fnmatch patterns: our FQNs must not contain glob characters.
    assert not any(set(fqn) & set("*?[]") for fqn in names), names

    return flex.build_dist_muon(
        [{"params": params, "param_names": names}],
        compute_sharding_by_fqn={fqn: owned for fqn in names},
        bucket_configs=bucket_configs,
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        ns_coefficients=ns_coefficients,
        eps=eps,
        ns_steps=ns_steps,
        adjust_lr_fn=adjust_lr_fn,
    )
