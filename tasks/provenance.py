"""What produced a run: code version, package versions and hardware, for manifests and MLflow."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

_PACKAGES = ("kiln", "torch", "prefect", "mlflow", "datatrove", "datasketch", "fasttext-numpy2-wheel",
             "lm-eval", "tokenizers", "numpy")
_REPO = Path(__file__).resolve().parent.parent
_NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")


def _git(*args: str) -> str | None:
    if not (_REPO / ".git").exists():  # an installed Kiln: not whatever repository its venv sits in
        return None
    try:
        result = subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


@lru_cache(maxsize=1)
def code_version() -> dict[str, Any]:
    """The git SHA and whether the working tree has uncommitted changes ('unknown' outside git)."""
    sha = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"git_sha": sha or "unknown", "git_dirty": bool(status) if status is not None else None}


@lru_cache(maxsize=1)
def package_versions() -> dict[str, str]:
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


@lru_cache(maxsize=1)
def hardware() -> dict[str, Any]:
    """The machine. CUDA devices come from torch when the process has loaded it (it honours
    CUDA_VISIBLE_DEVICES), else from the NVIDIA driver's /proc entries: a cached rerun must not pay
    torch's import to describe itself."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info["cuda_devices"] = torch.cuda.device_count()
        if torch.cuda.is_available():
            info["cuda_device_name"] = torch.cuda.get_device_name(0)
        return info
    gpus = sorted(_NVIDIA_PROC.glob("*/information")) if _NVIDIA_PROC.is_dir() else []
    info["cuda_devices"] = len(gpus)
    if gpus:
        model = next((line for line in gpus[0].read_text().splitlines() if line.startswith("Model:")), "")
        info["cuda_device_name"] = model.removeprefix("Model:").strip()
    return info


def provenance() -> dict[str, Any]:
    return {"code": code_version(), "packages": package_versions(), "hardware": hardware()}
