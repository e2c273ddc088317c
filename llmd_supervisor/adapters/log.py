"""structlog configuration: JSON lines when not on a TTY, readable console otherwise."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


def configure(
    *, json: bool | None = None, level: int = logging.INFO, stream: TextIO | None = None
) -> None:
    """Configure structlog once for the process; `json=None` picks JSON unless `stream` is a TTY."""
    out = stream if stream is not None else sys.stderr
    if json is None:
        json = not out.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
