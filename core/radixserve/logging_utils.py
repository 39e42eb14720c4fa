from __future__ import annotations

import logging


def configure_logging(level: str = "info", prefix: str = "") -> None:
    tag = f"[{prefix}] " if prefix else ""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {tag}%(levelname)s %(name)s: %(message)s",
        force=True,
    )
