"""Reading ext4 images without mounting them: the seed disk, the guest image's root filesystem."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["debugfs"]


def debugfs(image: Path, request: str) -> str:
    """The output of `debugfs -R REQUEST IMAGE` (e.g. `cat /hostname`, `ls -p /etc`)."""
    return subprocess.run(["debugfs", "-R", request, str(image)], capture_output=True, text=True, check=True,
                          timeout=60).stdout
