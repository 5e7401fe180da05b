"""Which process of a run this is: DDP ranks share a run directory, and only rank zero writes
its files and tracking."""

from __future__ import annotations

import os


def rank_zero() -> bool:
    """True in the process that owns files and tracking (always, without DDP)."""
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


def rank_name() -> str:
    """This process's name among a run's DDP processes (for the files each one writes)."""
    return f"{os.environ.get('NODE_RANK', '0')}-{os.environ.get('LOCAL_RANK', '0')}"
