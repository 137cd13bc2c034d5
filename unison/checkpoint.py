"""Checkpoints that are either complete or absent, and that say when they are damaged.

A checkpoint ``checkpoints/step_NNNNNN/`` holds:

* ``model/`` — a Hugging Face directory with the full weights (transformers
  and vLLM load it as is);
* ``optimizer/`` — the optimizer state, written with
  ``torch.distributed.checkpoint`` (every rank writes its shard; keyed by
  parameter name, so it loads on another world size);
* ``trainer_state.pt`` — step, schedule, prompt sampler, gradient-noise EMA,
  loss scaler, reward-error counters; ``rng_rank{R}.pt`` — each rank's RNGs;
* ``versions/`` — with ``rollout.max_staleness`` K ≥ 1 on the native worker: the weights of the
  older versions (up to K) the batches in flight are generated with, so that a resumed run trains
  on exactly the batches the uninterrupted run would;
* ``manifest.json`` — written last: every file with its size, and a SHA-256
  for the small ones.

It is written into ``.tmp-step_NNNNNN`` and renamed when complete, so a crash
(SIGKILL included) leaves either the previous checkpoint or the new one.
:func:`verify` compares a checkpoint against its manifest before anything is
loaded: a truncated or altered file makes the run fall back to the previous
complete checkpoint instead of stranding it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import warnings
from pathlib import Path

import numpy as np
import torch

from unison import lora
from unison.config.values import parse_compile, parse_gemm
from unison.errors import UnisonError
from unison.models import load_model, save_model_dir
from unison.sync import weights_of

PREFIX = "step_"
MANIFEST = "manifest.json"
KEPT = "versions"
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


# ------------------------------------------------------------------ the learner's weights and optimizer
def full_state_dict(scorer) -> dict[str, torch.Tensor]:
    """Full model weights (rank 0; empty on the others), names as in the HF model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(scorer.forward_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k[len("lm."):]: v for k, v in sd.items()}


def save_model(scorer, path: Path, tokenizer) -> None:
    """The model for others to load (collective; rank 0 writes): a Hugging Face directory with the full weights,
    or with LoRA the adapters in PEFT's format (+ the tokenizer)."""
    weights = full_state_dict(scorer)
    if scorer.dist.is_main:
        if scorer.peft is not None:
            lora.save(scorer.peft, weights, path)
            tokenizer.save_pretrained(path)
        else:
            save_model_dir(scorer.model, tokenizer, path, state_dict=weights)


def read_model(scorer, path: Path) -> dict[str, torch.Tensor]:
    """The weights :func:`save_model` wrote (rank 0 reads; the others get ``{}``). Raises on a file that cannot be
    read; :class:`UnisonError` when they do not fit this model."""
    if not scorer.dist.is_main:
        return {}
    from safetensors.torch import load_file

    if scorer.peft is not None:
        weights = lora.load(path)
        expected = {n for n, p in scorer.model.named_parameters() if ".lora_" in n}
        if set(weights) != expected:
            raise UnisonError(f"checkpoint '{path}' holds other adapters than lora.* describes: resume "
                              f"with the run's own config")
        return weights
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(load_file(f))
    if set(weights) - set(scorer.model.state_dict()) and (path / "config.json").exists():
        # save_pretrained writes some models in their hub layout (Nemotron-H: backbone.*, the module model.*):
        # transformers' loader maps them back, bit for bit (fp32 in, fp32 out)
        weights = load_model(path).state_dict()
    check_model_keys(scorer.model, weights, str(path))
    return weights


def save_optimizer(learner, path: Path) -> None:
    """Optimizer state with ``torch.distributed.checkpoint`` (sharded: every rank writes its part; keyed by
    parameter name, so it loads on another world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    with _quiet_dcp():
        dcp.save({"optimizer": get_optimizer_state_dict(learner.forward_module, learner.opt)}, checkpoint_id=str(path))


def load_optimizer(learner, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(learner.forward_module, learner.opt)}
    with _quiet_dcp():
        dcp.load(state, checkpoint_id=str(path))
    set_optimizer_state_dict(learner.forward_module, learner.opt, state["optimizer"])


@contextlib.contextmanager
def _quiet_dcp():
    """DCP warns that it runs "in a single process" when there is no process group: intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def check_model_keys(model, weights: dict, where: str) -> None:
    """Refuse weights that do not fit the model (tied output embeddings are stored once)."""
    expected = set(model.state_dict())
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [k for k in expected - set(weights) if not (tied and k == "lm_head.weight")]
    unexpected = sorted(set(weights) - expected)
    if missing or unexpected:
        raise UnisonError(f"checkpoint '{where}' does not match the model (missing {sorted(missing)[:3]}, "
                          f"unexpected {unexpected[:3]}): resume with the run's own config")


# ------------------------------------------------------------------ the run's checkpoints
class Checkpointer:
    """The run's ``checkpoints/``: one checkpoint holds the learner's model (a Hugging Face directory, or PEFT's
    adapters) and optimizer state (``torch.distributed.checkpoint``: every rank writes its shard), the rollout
    source's state and the older weights its batches in flight need, every other component's ``state_dict()``
    under its name in ``states`` (torchtitan's ``CheckpointManager`` shape: the LR schedule, the gradient-noise
    tracker, the watchdogs' counters, the learner's scaler) and each rank's RNGs. :meth:`resume` loads the newest
    usable one, falling back past damaged ones. Collective under torchrun."""

    def __init__(self, run_dir: Path, dist, keep: int, learner, tokenizer, source, states: dict,
                 log=lambda m: None):
        self.dir, self.dist, self.keep, self.log = Path(run_dir) / "checkpoints", dist, keep, log
        self.learner, self.tokenizer, self.source, self.states = learner, tokenizer, source, dict(states)

    def saved(self) -> list[Path]:
        return complete(self.dir)

    def save(self, step: int) -> Path:
        """Write ``checkpoints/step_N`` for the run at ``step``."""
        import random

        d = self.dist
        name = f"{PREFIX}{step:06d}"
        final, tmp = self.dir / name, self.dir / f".tmp-{name}"
        if d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        d.barrier()
        save_model(self.learner, tmp / "model", self.tokenizer)  # collective; rank 0 writes
        save_optimizer(self.learner, tmp / "optimizer")  # collective
        kept = self.source.kept_versions(step)  # the older weights the batches in flight need (async)
        if d.is_main and kept:
            save_kept_versions(tmp / KEPT, kept)
        kind, keys, pos, has_gauss, gauss = np.random.get_state()  # plain data and tensors: loads weights_only
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate(),
                    "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))},
                   tmp / f"rng_rank{d.rank}.pt")
        d.barrier()
        if d.is_main:
            source = self.source.state_dict()
            state = {"step": step, "world_size": d.world_size, "source": source, "sampler": source["sampler"],
                     **{key: obj.state_dict() for key, obj in self.states.items()}}
            torch.save(state, tmp / "trainer_state.pt")
            publish(tmp, final, self.keep)
        d.barrier()
        return final

    def resume(self) -> int:
        """Load the newest usable checkpoint (falling back past damaged ones) into every component; its step."""
        found = list(reversed(self.saved()))
        if not found:
            self.log("[train] --resume: no checkpoint yet, starting from step 0")
            return 0
        for i, ck in enumerate(found):
            problem = verify(ck) if self.dist.is_main else None
            problem = self.dist.broadcast_object(problem)
            step = None
            if problem is None:
                step, problem = self._load(ck)
            if problem is None:
                newest = ", the newest usable checkpoint" if i else ""
                self.log(f"[train] resumed from {ck.name} (step {step}){newest}")
                return step
            later = f"; falling back to {found[i + 1].name}" if i + 1 < len(found) else ""
            self.log(f"[train] --resume: checkpoint {ck.name} is damaged ({problem}){later}")
        raise UnisonError(f"--resume: no usable checkpoint in '{self.dir}' (every one is damaged): "
                          f"start a new run with another --out")

    def _load(self, ck: Path) -> tuple[int | None, str | None]:
        """Load ``ck``: (its step, None), or (None, a one-line reason it cannot be read)."""
        import random

        try:
            state = load_data(ck / "trainer_state.pt")
            weights = read_model(self.learner, ck / "model")
        except UnisonError:
            raise
        except Exception as e:  # noqa: BLE001 - any unreadable piece makes the checkpoint unusable
            return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        self.learner.load_full_state_dict(weights)
        load_optimizer(self.learner, ck / "optimizer")
        for key, obj in self.states.items():
            # a checkpoint of an older unison kept the watchdogs' counters at the top level
            obj.load_state_dict(state[key] if key in state else state if key == "watchdogs" else {})
        self.source.load_state_dict(state.get("source") or {"sampler": state["sampler"]})
        rng = ck / f"rng_rank{self.dist.rank}.pt"
        if rng.exists():  # absent when resuming on more ranks than wrote the checkpoint
            r = load_data(rng)
            torch.set_rng_state(r["torch"])
            random.setstate(r["python"])
            kind, keys, *rest = r["numpy"]  # the keys: a tensor, or a numpy array (written by an older unison)
            np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
        step = state["step"]

        self.source.resume(weights_of(self.learner), step, read_kept_versions(ck / KEPT))
        return step, None


def save_kept_versions(folder: Path, kept: dict[int, dict[str, torch.Tensor]]) -> None:
    """``versions/version_V.safetensors``: the fp32 weights of each older version the batches in flight
    at a checkpoint are generated with (``rollout.max_staleness`` K ≥ 1: up to K copies of the model)."""
    from safetensors.torch import save_file

    folder.mkdir()
    for v, weights in kept.items():  # views of one shared buffer: each tensor is copied out
        save_file({n: t.contiguous().clone() for n, t in weights.items()}, folder / f"version_{v:06d}.safetensors")


def read_kept_versions(folder: Path) -> dict[int, dict[str, torch.Tensor]]:
    """What :func:`save_kept_versions` wrote ({} when the checkpoint kept none)."""
    from safetensors.torch import load_file

    if not folder.is_dir():
        return {}
    return {int(p.stem.removeprefix("version_")): load_file(p) for p in sorted(folder.glob("version_*.safetensors"))}


def resumed_choice(cfg, run_dir: Path, key: str) -> str:
    """``gemm: auto`` / ``compile: auto`` on --resume: what the run chose at its start (its config.yaml), so that
    the resumed steps round as the first ones did; an explicit choice is taken as given."""
    import yaml

    parse = {"gemm": parse_gemm, "compile": parse_compile}[key]
    if getattr(cfg, key) != "auto":
        return getattr(cfg, key)
    try:
        saved = (yaml.safe_load((Path(run_dir) / "config.yaml").read_text(encoding="utf-8")) or {}).get(key)
        decided = parse(saved)
    except Exception:  # noqa: BLE001 - unreadable or hand-edited: decide anew
        return "auto"
    return decided if "auto" not in decided.split("/") else "auto"


def _numpy_arrays() -> list:
    """What numpy arrays and scalars of plain dtypes need to unpickle (RNG files written before the keys
    became a tensor; a numpy number in a component's state), under numpy 2's names and numpy 1's."""
    try:
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # pragma: no cover - numpy < 2
        from numpy.core.multiarray import _reconstruct, scalar
    dtypes = [type(np.dtype(t)) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                          np.uint32, np.uint64, np.float16, np.float32, np.float64)]
    return [_reconstruct, (_reconstruct, "numpy.core.multiarray._reconstruct"), scalar,
            (scalar, "numpy.core.multiarray.scalar"), np.ndarray, np.dtype, *dtypes]


def load_data(path: Path):
    """A checkpoint's small state, read as data only (``weights_only``: tensors, numbers, strings,
    containers, numpy arrays): a run directory written by someone else cannot run code here. Anything
    else is refused in one line, not skipped over as damage."""
    import pickle
    import re

    try:
        with torch.serialization.safe_globals(_numpy_arrays()):
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        if not str(e).startswith("Weights only load failed"):
            raise
        what = re.findall(r"GLOBAL (\S+)", str(e))
        raise UnisonError(f"--resume: {path} holds more than data{f' (a pickled {what[0]})' if what else ''}: unison "
                          f"reads checkpoints as data only and will not run code from a run directory; resume only "
                          f"from checkpoints unison wrote, or start a new run with another --out") from None


class SignalStop:
    """SIGTERM / SIGINT in a one-process run: finish the step in progress, save, stop (exit 143 /
    130). A second signal stops at once, without saving (the last checkpoint stays)."""

    CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}

    def __init__(self, log):
        self.log, self.signum = log, None
        self._old = {}
        try:
            for s in self.CODES:
                self._old[s] = signal.signal(s, self._handle)
        except ValueError:  # not the main thread: leave the handlers alone
            self._old = {}

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        self.log(f"[train] {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
                 f"(send it again to stop now without saving)")

    @property
    def code(self) -> int:
        return self.CODES.get(self.signum, 143)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
