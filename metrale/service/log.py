"""structlog set-up: JSON lines when stdout is not a terminal, a readable console otherwise."""

import logging
import sys

import structlog


def configure_logging(log_format: str = "auto") -> None:
    as_json = log_format == "json" or (log_format == "auto" and not sys.stdout.isatty())
    renderer = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True), structlog.processors.format_exc_info,
                    renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        cache_logger_on_first_use=True,
    )
