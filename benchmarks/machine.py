"""What the benchmarks say about the machine they ran on (imported by the sibling scripts)."""

from __future__ import annotations

from pathlib import Path


def cpu_model() -> str:
    """The CPU's name (/proc/cpuinfo), for every benchmark's JSON line."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"
