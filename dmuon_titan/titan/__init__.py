"""torchtitan 0.2.2 plugin for DMuon: ``[experimental] custom_import = "dmuon_titan.titan"``.

Importing this package (torchtitan does it at the start of ``Trainer.__init__``) registers:

- the ``dmuon`` model converter (``[model] converters = ["dmuon"]``),
- ``[optimizer] name = "DMuon"`` in the llama3 train spec's optimizer builder (every other
  name goes to torchtitan's own builder, unchanged),
- owner-only checkpoints with a drain before every save, global-norm gradient clipping over
  owned matrices, DMuon figures in the metrics,
- CPU/gloo training when no accelerator is present, and the offline ``pystdlib`` datasets.

``[job] custom_config_module = "dmuon_titan.titan.config"`` adds the ``[dmuon]`` section.
"""

from __future__ import annotations

import dataclasses

from .checkpoint import install_checkpoint_hooks
from .clip import install_clip
from .converter import DMuonConverter
from .cpu import install_cpu_device
from .data import register_datasets
from .metrics import build_metrics_processor
from .optimizer import build_optimizers
from .parallelize import wrap_parallelize

#: Train specs whose builders learn DMuon (models of torchtitan 0.2.2 with llama-style blocks).
MODEL_NAMES = ("llama3",)

#: Extra llama3 flavors. ``"170M"`` for the loss-curve comparison: 12 blocks of width 1024 on
#: an 8192-token BPE vocabulary, 171 M parameters, sized for one H200. ``"8B_8layers"``: the
#: first 8 of llama3-8B's 32 blocks (same shapes, vocabulary and heads), so one GPU can run and
#: profile the 8B step's per-block work without FSDP.
EXTRA_LLAMA3_FLAVORS = {
    "170M": dict(dim=1024, n_layers=12, n_heads=16, vocab_size=8192, rope_theta=500000),
    "8B_8layers": dict(base="8B", n_layers=8),
}

_installed = False


def install() -> None:
    """Idempotent: register everything listed in the module docstring."""
    global _installed
    if _installed:
        return
    from torchtitan.protocols import train_spec as train_spec_module
    from torchtitan.protocols.model_converter import (
        _registry_model_converter_cls,
        register_model_converter,
    )

    install_cpu_device()
    _add_llama3_flavors()
    if "dmuon" not in _registry_model_converter_cls:
        register_model_converter(DMuonConverter, "dmuon")
    for name in MODEL_NAMES:
        if name in train_spec_module._extra_train_specs:
            continue
        spec = train_spec_module.get_train_spec(name)
        train_spec_module.register_train_spec(
            name,
            dataclasses.replace(
                spec,
                parallelize_fn=wrap_parallelize(spec.parallelize_fn),
                build_optimizers_fn=build_optimizers,
                build_metrics_processor_fn=build_metrics_processor,
            ),
        )
    install_checkpoint_hooks()
    install_clip()
    register_datasets()
    _installed = True


def _add_llama3_flavors() -> None:
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.args import TransformerModelArgs

    for flavor, kwargs in EXTRA_LLAMA3_FLAVORS.items():
        kwargs = dict(kwargs)
        base = kwargs.pop("base", None)
        args = (
            dataclasses.replace(llama3_args[base], **kwargs)
            if base
            else TransformerModelArgs(**kwargs)
        )
        llama3_args.setdefault(flavor, args)


install()
