"""The plugin's one-line errors, and the checks that must pass before torchtitan is touched."""

from __future__ import annotations

import os
from importlib import metadata

#: the torchtitan release this plugin is written against
SUPPORTED_TORCHTITAN = "0.2.2"


class ConfigError(SystemExit):
    """A bad configuration value: every rank exits (code 1) with no traceback; the message,
    one line, is printed by the first rank only (``RANK`` as torchrun sets it)."""

    def __init__(self, message: str) -> None:
        self.message = f"dmuon_titan config error: {message}"
        first = os.environ.get("RANK", "0") == "0"
        super().__init__(self.message if first else 1)

    def __str__(self) -> str:
        return self.message


def check_torchtitan_version() -> None:
    """The installed torchtitan is the one this plugin serves, or one line naming both."""
    try:
        installed = metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        installed = None
    if installed != SUPPORTED_TORCHTITAN:
        raise ConfigError(
            f"torchtitan {installed or '(not installed)'} is installed; this plugin serves "
            f"torchtitan {SUPPORTED_TORCHTITAN}: pip install torchtitan=={SUPPORTED_TORCHTITAN}"
        )
