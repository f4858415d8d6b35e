"""torchtitan 0.2.2 plugin for DMuon: ``[experimental] custom_import = "dmuon_titan.titan"``.

Importing this package (torchtitan does it at the start of ``Trainer.__init__``) registers:

- the ``dmuon`` model converter (``[model] converters = ["dmuon"]``),
- ``[optimizer] name = "DMuon"`` in the optimizer builders of torchtitan's language models
  (``MODEL_NAMES``; every other name goes to the spec's own builder, unchanged, and DMuon's
  container gets what the spec's builder adds, e.g. MoE load balancing),
- validation for every language model (:mod:`.validation`: torchtitan 0.2.2's validator
  gives SDPA models masks they refuse, and two train specs lack one),
- owner-only checkpoints with a drain before every save, global-norm gradient clipping over
  owned matrices, DMuon figures in the metrics (model size and FLOPs counted with the dedicated
  matrices whole; progress and summary lines).

``[job] custom_config_module = "dmuon_titan.titan.config"`` adds the ``[dmuon]`` section. The
repository's toy runs (CPU, offline data) import :mod:`dmuon_titan.toy` instead, which adds
what they need on top.
"""

from __future__ import annotations

import dataclasses

import torch

from .errors import ConfigError, check_torchtitan_version

# Before anything imports torchtitan's modules: another release lacks what they hook into.
check_torchtitan_version()

from .checkpoint import install_checkpoint_hooks  # noqa: E402
from .clip import install_clip  # noqa: E402
from .converter import MODEL_NAMES, DMuonConverter  # noqa: E402
from .metrics import build_metrics_processor, count_full_sizes  # noqa: E402
from .optimizer import builder_for  # noqa: E402
from .parallelize import (  # noqa: E402
    install_expert_parallel_patch,
    install_no_parallel_patch,
    wrap_parallelize,
    wrap_pipelining,
)
from .validation import install_validation_fix, validator_for  # noqa: E402

_installed = False


class _NoGpu:
    """torchtitan's device module on a machine without a GPU (where it still picks
    ``torch.cuda``): its trainer's first use of it, ``set_device`` right after importing
    ``custom_import``, ends in one line saying what runs on CPU instead of torch's error.
    The repository's CPU harness (``custom_import = "dmuon_titan.toy"``) replaces it first."""

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)

    def set_device(self, device) -> None:
        raise ConfigError(
            "no GPU on this machine, and torchtitan 0.2.2 trains on CUDA only: for a CPU run "
            'set [experimental] custom_import = "dmuon_titan.toy" (this repository\'s CPU '
            "harness: gloo ranks, offline data; see the README)"
        )


def check_device() -> None:
    """Without a GPU, torchtitan's device module becomes :class:`_NoGpu`."""
    if torch.cuda.is_available():
        return
    from torchtitan.tools import utils

    if utils.device_module is torch.cuda:
        utils.device_module = _NoGpu()


def install() -> None:
    """Idempotent: register everything listed in the module docstring."""
    global _installed
    if _installed:
        return
    check_device()
    from torchtitan.protocols import train_spec as train_spec_module
    from torchtitan.protocols.model_converter import (
        _registry_model_converter_cls,
        register_model_converter,
    )

    if "dmuon" not in _registry_model_converter_cls:
        register_model_converter(DMuonConverter, "dmuon")
    for name in MODEL_NAMES:
        if name in train_spec_module._extra_train_specs:
            continue
        spec = train_spec_module.get_train_spec(name)
        for args in spec.model_args.values():
            count_full_sizes(type(args))
        train_spec_module.register_train_spec(
            name,
            dataclasses.replace(
                spec,
                parallelize_fn=wrap_parallelize(spec.parallelize_fn),
                pipelining_fn=wrap_pipelining(spec.pipelining_fn),
                build_optimizers_fn=builder_for(spec.build_optimizers_fn),
                build_metrics_processor_fn=build_metrics_processor,
                build_validator_fn=validator_for(spec.build_validator_fn),
            ),
        )
    install_checkpoint_hooks()
    install_expert_parallel_patch()
    install_no_parallel_patch()
    install_clip()
    install_validation_fix()
    _installed = True


install()
