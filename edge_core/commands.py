"""``edge plan``, ``edge run``, ``edge accept`` and ``edge parity``: the commands that need a checkpoint."""

from __future__ import annotations

import argparse
from typing import Any, Callable


def add_stage_commands(sub: Any, common: Callable[..., None], mask_option: Callable[..., None]) -> None:
    pass
