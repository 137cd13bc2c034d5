"""What the benchmarks say about the machine they ran on (imported by the sibling scripts)."""

from __future__ import annotations


def cpu_model() -> str:
    """The CPU's name, for every benchmark's JSON line (unison.threads.cpu_name: the one the package keeps its
    per-machine measurements under)."""
    from unison.threads import cpu_name

    return cpu_name()
