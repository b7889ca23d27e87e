"""`metrale-worker serve` and `metrale-worker fetch-default-model`."""

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from metrale.runtime.errors import ModelLoadError, WorkerError
from metrale.runtime.own_thread import run_on_own_thread
from metrale.service.config import WorkerConfig, add_serve_flags, config_from_args
from metrale.service.log import configure_logging
from metrale.service.preflight import check_before_load

if TYPE_CHECKING:
    from metrale.runtime.loading import Checkpoint

log = structlog.get_logger()


def _cache_dir(config_dir: str | None) -> Path:
    from metrale.runtime.default_model import default_cache_dir
    return Path(config_dir) if config_dir else default_cache_dir()


def model_path(config: WorkerConfig) -> Path:
    """The --model path, or the embedded default model (fetched on first use)."""
    if config.model:
        return Path(config.model)
    from metrale.runtime.default_model import fetch_default_model
    return fetch_default_model(_cache_dir(config.cache_dir))


def run_serve(config: WorkerConfig) -> None:
    # Before the slow imports and the load: a wrong file or a taken port costs a second, not a load.
    check_before_load(config)
    from metrale.service.server import serve

    # Until the server drains on signals itself, a SIGTERM during loading is a clean exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    path = model_path(config)
    log.info("loading", model=str(path))
    asyncio.run(serve(run_on_own_thread(lambda: load_model(path), name="load"), config))


def load_model(path: Path) -> "Checkpoint":
    """The checkpoint, or one ModelLoadError for a file that is empty, truncated, corrupt or not a model."""
    from metrale.runtime.loading import load_checkpoint

    try:
        return load_checkpoint(path)
    except WorkerError:
        raise                              # the loader's own errors already name the file and the problem
    except Exception as error:             # whatever safetensors, gguf, numpy or torch raise on a bad file
        raise ModelLoadError(path, _one_line(f"{type(error).__name__}: {error}")) from error


def _one_line(text: str) -> str:
    return " ".join(text.split())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="metrale-worker", description="GPU model worker for LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_flags(commands.add_parser("serve", help="load a model and serve the gRPC API"))
    fetch = commands.add_parser("fetch-default-model", help="download the embedded default model's GGUF")
    fetch.add_argument("--cache-dir", default=None, help="default ~/.cache/metrale [env METRALE_CACHE_DIR]")
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        if args.command == "fetch-default-model":
            from metrale.runtime.default_model import fetch_default_model
            print(fetch_default_model(_cache_dir(config.cache_dir)))
            return 0
        configure_logging(config.log_format)
        run_serve(config)
    except WorkerError as error:
        print(f"metrale-worker: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
