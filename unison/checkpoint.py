"""Checkpoints that are either complete or absent, and that say when they are damaged.

A checkpoint ``checkpoints/step_NNNNNN/`` holds:

* ``model/`` — a Hugging Face directory with the full weights (transformers
  and vLLM load it as is);
* ``optimizer/`` — the optimizer state, written with
  ``torch.distributed.checkpoint`` (every rank writes its shard; keyed by
  parameter name, so it loads on another world size);
* ``trainer_state.pt`` — step, schedule, prompt sampler, gradient-noise EMA,
  loss scaler, reward-error counters; ``rng_rank{R}.pt`` — each rank's RNGs;
* ``manifest.json`` — written last: every file with its size, and a SHA-256
  for the small ones.

It is written into ``.tmp-step_NNNNNN`` and renamed when complete, so a crash
(SIGKILL included) leaves either the previous checkpoint or the new one.
:func:`verify` compares a checkpoint against its manifest before anything is
loaded: a truncated or altered file makes the run fall back to the previous
complete checkpoint instead of stranding it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

PREFIX = "step_"
MANIFEST = "manifest.json"
#: files up to this size also get a SHA-256 in the manifest (weights are checked by size)
HASH_LIMIT = 64 * 2**20


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(ck: Path) -> None:
    files = {}
    for p in sorted(ck.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            size = p.stat().st_size
            entry = {"size": size}
            if size <= HASH_LIMIT:
                entry["sha256"] = _sha256(p)
            files[str(p.relative_to(ck))] = entry
    tmp = ck / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"files": files}, indent=1) + "\n")
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, ck / MANIFEST)


def verify(ck: Path) -> str | None:
    """None if ``ck`` matches its manifest, else what is wrong (one line)."""
    man = ck / MANIFEST
    if not man.exists():
        return "it has no manifest.json (written by an older unison, or not complete)"
    try:
        files = json.loads(man.read_text())["files"]
    except (json.JSONDecodeError, KeyError, UnicodeDecodeError):
        return "its manifest.json is damaged"
    for rel, entry in files.items():
        p = ck / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != entry["size"]:
            return f"{rel} has {p.stat().st_size} bytes, {entry['size']} were written"
        if "sha256" in entry and _sha256(p) != entry["sha256"]:
            return f"{rel} does not match its checksum"
    return None


def complete(ckdir: Path) -> list[Path]:
    """Renamed (finished) checkpoints, oldest first."""
    if not ckdir.is_dir():
        return []
    return sorted(p for p in ckdir.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def publish(tmp: Path, final: Path, keep: int) -> None:
    """Make the finished ``tmp`` the checkpoint ``final``; keep the newest ``keep``."""
    write_manifest(tmp)
    fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    for old in complete(final.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def clean_partial(ckdir: Path) -> None:
    """Remove checkpoints interrupted mid-write (``.tmp-*``)."""
    if ckdir.is_dir():
        for tmp in ckdir.glob(".tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)
