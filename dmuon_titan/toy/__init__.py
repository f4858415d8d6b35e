"""The toy harness: what the repository's own configs need beyond the plugin.

``[experimental] custom_import = "dmuon_titan.toy"`` installs the torchtitan plugin
(:mod:`dmuon_titan.titan`) and, on top of it:

- CPU/gloo training when no accelerator is present (``cpu.py``);
- the offline ``pystdlib`` / ``pystdlib_val`` datasets, the Python standard library's own
  source, and a locally trained tokenizer (``data.py``; ``python -m dmuon_titan.toy`` builds
  it);
- llama3 flavors for the benchmarks and loss curves (``flavors.py``);
- a clean exit of finished CPU runs (``exit.py``).

A user's own job needs none of it: ``custom_import = "dmuon_titan.titan"``.
"""

from __future__ import annotations

from .. import titan
from .cpu import install_cpu_device
from .data import register_datasets
from .exit import install_fast_exit
from .flavors import add_llama3_flavors

titan.install()
install_cpu_device()
register_datasets()
add_llama3_flavors()
install_fast_exit()
