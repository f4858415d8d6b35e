"""The toy harness: what the repository's own configs need beyond the plugin.

``[experimental] custom_import = "dmuon_titan.toy"`` installs the torchtitan plugin
(:mod:`dmuon_titan.titan`) and, on top of it:

- CPU/gloo training when no accelerator is present, mixture-of-experts layers, context
  parallelism and tensor-parallel attention on DTensors included (``cpu.py``);
- the offline ``pystdlib`` / ``pystdlib_val`` datasets, the Python standard library's own
  source, and a locally trained tokenizer (``data.py``; ``python -m dmuon_titan.toy`` builds
  it);
- flavors for the benchmarks, loss curves and CPU tests (``flavors.py``);
- a clean exit of finished CPU runs (``exit.py``).

A user's own job needs none of it: ``custom_import = "dmuon_titan.titan"``.
"""

from __future__ import annotations

from .. import titan
from .cpu import (
    install_cp_cpu_shim,
    install_cpu_device,
    install_moe_cpu_shims,
    install_tp_attention_cpu_shim,
)
from .data import register_datasets
from .exit import install_fast_exit
from .flavors import add_flavors

titan.install()
if install_cpu_device():
    install_moe_cpu_shims()
    install_cp_cpu_shim()
    install_tp_attention_cpu_shim()
register_datasets()
add_flavors()
install_fast_exit()
