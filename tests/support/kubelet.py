"""A simulated kubelet node: pod volumes as real tmpfs mounts where the kubelet puts them.

The kubelet mounts a pod's ``emptyDir`` with ``medium: Memory`` as its own tmpfs at
``<kubelet>/pods/<POD_UID>/volumes/kubernetes.io~empty-dir/<NAME>``; deleting the pod
unmounts it and removes the pod's directory. ``KubeletNode`` does the same under a
temporary directory (root only; the test skips elsewhere), and unmounts everything it
mounted when it closes, whatever happened.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from types import TracebackType

import pytest

VOLUMES = Path("volumes") / "kubernetes.io~empty-dir"


class KubeletNode:
    """``base/pods/UID/volumes/kubernetes.io~empty-dir/NAME`` tmpfs mounts, one per pod."""

    def __init__(self, base: Path) -> None:
        if os.geteuid() != 0:
            pytest.skip("a simulated kubelet mounts tmpfs volumes: needs root")
        self.base = base
        (base / "pods").mkdir(parents=True, exist_ok=True)
        self.volumes: dict[str, Path] = {}

    @property
    def glob(self) -> str:
        """The ``--root`` glob that matches every pod's memory volume on this node."""
        return str(self.base / "pods" / "*" / VOLUMES / "*")

    def add_pod(self, uid: str | None = None, *, volume: str = "dshm", size: str = "16m") -> Path:
        """Mount a new pod's memory volume; its path."""
        uid = uid or str(uuid.uuid4())
        point = self.base / "pods" / uid / VOLUMES / volume
        point.mkdir(parents=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(point)],
            check=False,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            shutil.rmtree(self.base / "pods" / uid)
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
        self.volumes[uid] = point
        return point

    def delete_pod(self, uid: str) -> None:
        """Unmount the pod's volume and remove its directory, as the kubelet does."""
        point = self.volumes.pop(uid)
        unmount(point)
        shutil.rmtree(self.base / "pods" / uid)

    def close(self) -> None:
        for uid in list(self.volumes):
            self.delete_pod(uid)

    def __enter__(self) -> KubeletNode:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def unmount(point: Path) -> None:
    """``umount``, retried while a scan holds the directory open (EBUSY for a few ms); lazily at last."""
    for _ in range(50):
        if subprocess.run(["umount", str(point)], check=False, capture_output=True).returncode == 0:
            return
        if not os.path.ismount(point):
            return
        time.sleep(0.01)
    subprocess.run(["umount", "-l", str(point)], check=True, capture_output=True)
