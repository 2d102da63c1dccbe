"""Measurement helpers: trimmed means, peak memory over a block, the machine the numbers were measured on.

Imports only the standard library and torch (see :mod:`vase.bench`).
"""

from __future__ import annotations

import datetime as _dt
import gc
import os
import platform
import resource
import subprocess
import sys

import torch

from vase.bench import REPO


def trimmed_mean(xs: list[float]) -> float:
    """Mean without the min and the max (the paper's protocol); the plain mean for fewer than 3 values."""
    xs = sorted(xs)
    if len(xs) >= 3:
        xs = xs[1:-1]
    return sum(xs) / len(xs) if xs else float("nan")


def proc_status_bytes(field: str) -> int | None:
    """``VmRSS`` / ``VmHWM`` of this process in bytes (Linux), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (``VmHWM``) of this process; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak memory over a block: CUDA max allocated, or the process's peak RSS on CPU (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = self.baseline = None
        self.source = ""

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            self.source = "cuda_max_memory_allocated"
        else:
            self.baseline = proc_status_bytes("VmRSS")
            self.source = "VmHWM(reset)" if reset_peak_rss() else "ru_maxrss(process lifetime)"
        return self

    def __exit__(self, *exc: object) -> bool:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        elif self.source.startswith("VmHWM"):
            self.peak = proc_status_bytes("VmHWM")
        else:
            self.peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return False


def load_1m() -> float:
    """The 1-minute load average (NaN where unsupported)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def machine_info(device: str) -> dict:
    """What the numbers were measured on."""
    info = {
        "time": _dt.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "argv": sys.argv,
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    mem = proc_meminfo_total()
    if mem:
        info["mem_total_bytes"] = mem
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available() and str(device).startswith("cuda"):
        info["cuda_device"] = torch.cuda.get_device_name()
        info["cuda_version"] = torch.version.cuda
        try:
            import flash_attn

            info["flash_attn"] = flash_attn.__version__
        except ImportError:
            info["flash_attn"] = None
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "vase", "baselines"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        info["engine_files_modified"] = dirty.splitlines() if dirty else []
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def proc_meminfo_total() -> int | None:
    """``MemTotal`` of the machine in bytes (Linux), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class TimeCap(RuntimeError):
    """Raised from a decoder's ``on_step`` hook when a section's deadline has passed (:func:`deadline_hook`)."""


def deadline_hook(deadline: float | None, then=None):
    """An ``on_step`` hook that raises :class:`TimeCap` once ``time.perf_counter()`` passes ``deadline`` (None: never),
    after calling ``then(info)`` if given."""
    import time

    def on_step(info) -> None:
        if then is not None:
            then(info)
        if deadline is not None and time.perf_counter() > deadline:
            raise TimeCap(f"time cap reached at decode step {info.step}")

    return on_step
