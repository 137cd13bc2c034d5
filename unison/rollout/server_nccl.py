"""The NCCL weight transport of a ``vllm serve`` server (``vllm.weight_sync: nccl``, GPU): vLLM's own weight
transfer, a broadcast from trainer rank 0 to the server's workers, set up at the first sync; everything it needs is
checked before the first step. UNTESTED until run on a GPU (its set-up checks run against a stub server here)."""

from __future__ import annotations

import os

from unison.errors import UnisonError
from unison.rollout.vllm_engine import _find_key, check_vllm


def _local_transfer_engine() -> None:
    """The trainer side of vLLM's NCCL weight transfer must import here."""
    check_vllm()
    from vllm.distributed.weight_transfer import factory  # noqa: F401


def _rendezvous() -> tuple[str, int]:
    """Where the NCCL weight transfer listens: UNISON_WEIGHT_SYNC_ADDR/PORT, else MASTER_ADDR, else loopback."""
    addr = os.environ.get("UNISON_WEIGHT_SYNC_ADDR", os.environ.get("MASTER_ADDR", "127.0.0.1"))
    return addr, int(os.environ.get("UNISON_WEIGHT_SYNC_PORT", "29555"))


def _check_nccl(eng) -> None:
    """Everything the NCCL weight transfer needs, checked before the first step (each would
    otherwise fail or hang after a whole step): vLLM installed here (its trainer-side transfer
    engine), a server in dev mode with a weight-transfer config, and a rendezvous address the server
    can reach."""
    import socket
    from urllib.parse import urlparse

    try:
        _local_transfer_engine()
    except (UnisonError, ImportError) as e:
        raise UnisonError(f"vllm.weight_sync nccl sends the weights from this process with vLLM's transfer "
                          f"engine, which needs vLLM 0.32 installed here too ({e}): pip install "
                          f"'unison[vllm]', or use vllm.weight_sync=disk") from e
    r = eng.http.get("/get_world_size", timeout=10.0)
    if r.status_code == 404:
        raise UnisonError(f"vLLM server at {eng.url} lacks the development endpoints the NCCL weight transfer "
                          f"uses: start it with VLLM_SERVER_DEV_MODE=1")
    info = eng.http.get("/server_info", params={"config_format": "json"}, timeout=10.0)
    if info.status_code != 200 or _find_key(info.json(), "weight_transfer_config") is None:
        raise UnisonError(f"vLLM server at {eng.url} has no weight-transfer config: start it with "
                          f"--weight-transfer-config '{{\"backend\": \"nccl\"}}', or use vllm.weight_sync=disk")
    addr, port = _rendezvous()
    host = urlparse(eng.url).hostname or ""
    loopback = {"127.0.0.1", "localhost", "::1"}
    if addr in loopback and host not in loopback:
        raise UnisonError(f"the NCCL weight transfer would ask the server at {host} to connect to {addr}, this "
                          f"machine's loopback: set UNISON_WEIGHT_SYNC_ADDR to an address of this machine the "
                          f"server can reach")
    if eng.dist.is_main:
        with socket.socket() as sock:
            try:
                sock.bind((addr, port))
            except OSError as e:
                raise UnisonError(f"the NCCL weight transfer cannot listen on {addr}:{port} ({e.strerror}): set "
                                  f"UNISON_WEIGHT_SYNC_ADDR / UNISON_WEIGHT_SYNC_PORT to a free address of this "
                                  f"machine") from e


class NcclTransport:
    """Weights to a server through vLLM's NCCL weight transfer: ``shapes`` announced, then the stream sent."""

    def __init__(self, engine):
        self.engine = engine
        self._nccl = None
        self._pushed = None

    def check(self) -> None:
        _check_nccl(self.engine)

    def close(self) -> None:
        if self._nccl is not None:
            self._nccl.shutdown()
            self._nccl = None

    def prepare(self, update) -> dict:
        """The stream itself (sent when applied) and what it yields, in its order."""
        return {"tensors": update.tensors, "shapes": update.shapes()}

    def send(self, prepared: dict, pause_mode: str = "wait") -> None:  # pragma: no cover - GPU only, UNTESTED
        """vLLM's own weight transfer (NCCL broadcast from trainer rank 0 to the server's workers): the shapes
        announced, then the tensors streamed; the server paused (waiting for the requests in flight) meanwhile."""
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        eng, transport, dtype = self.engine, self, self.engine.dtype
        self._pushed = (prepared["tensors"], prepared["shapes"])  # the source set up by the first sync reads it

        class PushedSource(WeightSource):  # vLLM 0.32's interface (check_vllm pins it): metadata() + __iter__
            def metadata(self):  # what the iteration yields, in its order (LoRA: merged, under the base names)
                return [ParamMeta(n, dtype, shape) for n, shape in transport._pushed[1]]

            def __iter__(self):
                return iter(transport._pushed[0])

        if self._nccl is None:
            ws = int(eng._request("GET", "/get_world_size", "the world size")["world_size"])
            addr, port = _rendezvous()
            self._nccl = WeightTransferTrainerFactory.trainer_init(
                NCCLTrainerInitInfo(master_address=addr, master_port=port, world_size=ws + 1, rank=eng.dist.rank),
                client=HTTPVLLMWeightSyncClient(eng.url, timeout=eng.timeout), source=PushedSource())
        if eng.dist.is_main:
            eng._request("POST", "/pause", "pause", params={"mode": "wait"})
        eng.version = eng._pending_version
        try:
            self._nccl.send_weights()
        finally:
            if eng.dist.is_main:
                eng._request("POST", "/reset_prefix_cache", "the prefix-cache reset")
                eng._request("POST", "/resume", "resume")
