"""The disk weight transport of a ``vllm serve`` server (``vllm.weight_sync: disk``): the weights written as a
checkpoint directory the server can read, published atomically (it never sees a half-written file), then the
server paused, told to reload from it and resumed. A reload that fails half-way marks the server's weights
untrusted: requests in flight fail with it rather than return samples of mixed weights."""

from __future__ import annotations

import os
import shutil

from unison.errors import UnisonError


class DiskTransport:
    """Weights to a server through ``vllm.sync_dir`` (the engine's): a directory per version, the older ones
    removed once the server holds the new one."""

    def __init__(self, engine):
        self.engine = engine

    def check(self) -> None:
        eng = self.engine
        r = eng.http.get("/is_paused", timeout=10.0)
        if r.status_code == 404:
            raise UnisonError(f"vLLM server at {eng.url} lacks the development endpoints the disk weight "
                              f"sync needs: start it with VLLM_SERVER_DEV_MODE=1")

    def close(self) -> None:
        """Nothing held between syncs."""

    def prepare(self, update) -> dict:
        """The weights on the host, in the rollout dtype (rank 0's copy; every rank iterates the stream)."""
        weights = {}
        for name, t in update.tensors:  # a collective: every rank iterates
            if self.engine.dist.is_main:
                weights[name] = t.contiguous().cpu()
        return {"weights": weights}

    def send(self, prepared: dict, pause_mode: str = "wait") -> None:
        """Write the prepared weights (rank 0), publish them as version ``engine._pending_version``, then have the
        server reload them between a pause (``pause_mode``: wait for the requests in flight, or abort them) and a
        resume; a failure on rank 0 is raised on every rank."""
        from safetensors.torch import save_file

        eng = self.engine
        weights = prepared.pop("weights")
        if eng.sync_dir is None:
            raise UnisonError("vllm.weight_sync is 'disk' but vllm.sync_dir is not set: give a directory the "
                              "server can read")
        error = None
        if eng.dist.is_main:
            final = eng.sync_dir / f"v{eng._pending_version:06d}"  # named by the version it holds
            tmp = eng.sync_dir / f".tmp-v{eng._pending_version:06d}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            shutil.copy(eng.model_dir / "config.json", tmp / "config.json")
            shutil.rmtree(final, ignore_errors=True)  # a resumed run publishes its checkpoint's version again
            os.replace(tmp, final)  # the server never sees a half-written file
            del weights
            try:
                self._reload(final, pause_mode)
            except UnisonError as e:
                error = str(e)
            for old in [*eng.sync_dir.glob("v*"), *eng.sync_dir.glob(".tmp-v*")]:  # older runs' leftovers too
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
        error = eng.dist.broadcast_object(error)
        if error:
            raise UnisonError(error)

    def _reload(self, final, pause_mode: str) -> None:
        eng = self.engine
        eng._pause(pause_mode)
        try:
            eng._request("POST", "/collective_rpc", "the weight reload",
                         json={"method": "reload_weights",
                               "kwargs": {"weights_path": str(final.resolve()), "is_checkpoint_format": True}})
            eng._request("POST", "/reset_prefix_cache", "the prefix-cache reset")
        except UnisonError as e:
            # recorded before the server resumes: the requests in flight (continuations sent during the reload)
            # would go on under half-loaded layers; they are aborted, and fail with this anyway
            eng._broken = str(e)
            if pause_mode == "abort":
                try:
                    eng._request("POST", "/pause", "abort", params={"mode": "abort"})
                except UnisonError:
                    pass
            raise
        finally:
            eng._resume()
