"""Many processes on PyTorch's own stack: ``torchrun`` + FSDP2 (``fully_shard``).

``init_distributed`` reads the environment ``torchrun`` sets (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``...) and joins the process
group: NCCL on CUDA, gloo on CPU. Without ``torchrun`` it returns a
:class:`Dist` of world size 1 and nothing changes: every collective helper
below is then a local no-op, so the loop has one code path.

Launch (one node, N processes; multi-node adds ``--nnodes``, ``--node-rank``
and ``--rdzv-endpoint``)::

    torchrun --nproc-per-node N -m unison train CONFIG --out DIR

Sharding (:func:`shard`): ``fully_shard`` on every decoder layer and on the
root module, as verl, SkyRL and prime-rl shard their trainers. The optimizer
then holds only this rank's shard of the fp32 master weights.
"""

from __future__ import annotations

import atexit
import datetime
import os
from dataclasses import dataclass, field

import torch

from unison.errors import UnisonError


def under_torchrun() -> bool:
    """True when this process was started by ``torchrun`` (or any launcher that sets its env)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


@dataclass
class Dist:
    """This process's place in the job. ``enabled`` is False for a plain single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    enabled: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: object | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------- collectives
    def all_gather_object(self, obj) -> list:
        """``[obj of rank 0, obj of rank 1, ...]`` on every rank (``[obj]`` for one process)."""
        if not self.enabled:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj, src: int = 0):
        """Rank ``src``'s ``obj`` on every rank."""
        if not self.enabled:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_reduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce of a tensor (``sum`` | ``max`` | ``min``)."""
        if not self.enabled:
            return t
        import torch.distributed as dist

        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        dev = t.device
        buf = t.to(self.comm_device)
        dist.all_reduce(buf, op=ops[op])
        if buf is not t:
            t.copy_(buf.to(dev))
        return t

    def all_true(self, flag: bool) -> bool:
        """True on every rank iff ``flag`` is True on every rank."""
        t = torch.tensor([0.0 if flag else 1.0])
        return float(self.all_reduce_(t, "max")) == 0.0

    def barrier(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            dist.barrier()

    @property
    def comm_device(self) -> torch.device:
        """Where collective buffers live (CUDA for NCCL, CPU for gloo)."""
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def finish(self) -> None:
        """The normal end of a job: wait for every rank, then end the group. A rank that left while
        another still worked (rank 0 writing the report) ended its group alone, and a gloo group torn
        down that way can abort its process on the way out. A colocated vLLM engine that joined the
        group (external_launcher) takes the group down with it when it shuts: nothing is left to wait on."""
        if self.enabled:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()
        self.close()

    def close(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.enabled = False


_CURRENT = Dist()


def current() -> Dist:
    """The :class:`Dist` of this process (world size 1 until :func:`init_distributed` ran)."""
    return _CURRENT


def init_distributed(device: str = "cpu", timeout_s: float = 600.0) -> Dist:
    """Join the ``torchrun`` process group, or return the single-process :class:`Dist`.

    ``timeout_s`` bounds every collective: when a rank dies, the others fail
    with an error after at most this long instead of hanging.
    """
    global _CURRENT
    if _CURRENT.enabled:
        return _CURRENT
    if not under_torchrun():
        _CURRENT = Dist(device=torch.device(device))
        return _CURRENT
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    dev_type = torch.device(device).type
    if dev_type == "cuda":
        if not torch.cuda.is_available():
            raise UnisonError("device is 'cuda' but CUDA is not available: set device=cpu")
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        backend = "nccl"
    elif dev_type == "cpu":
        dev, backend = torch.device("cpu"), "gloo"
    else:
        raise UnisonError(f"device '{device}' is not supported under torchrun: use cpu or cuda")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                                **({"device_id": dev} if backend == "nccl" else {}))
    mesh = init_device_mesh(dev_type, (world,), mesh_dim_names=("dp",))
    _CURRENT = Dist(rank=rank, world_size=world, local_rank=local, enabled=True, device=dev, mesh=mesh)
    # a process that exits with the group alive (a script driving Trainer, an error path) can abort in gloo's
    # teardown ("terminate called without an active exception", SIGABRT) once the interpreter is finalising:
    # end the group while Python is still alive (a no-op after close())
    atexit.register(_CURRENT.close)
    return _CURRENT


def decoder_layers(lm) -> list[torch.nn.Module]:
    """The repeated blocks of a causal LM: the modules whose class the model declares as
    ``_no_split_modules`` (what Hugging Face's own sharding uses), else every ``layers``/``h``/
    ``blocks`` list found under the base model."""
    names = set(getattr(lm, "_no_split_modules", None) or [])
    found = [m for m in lm.modules() if type(m).__name__ in names]
    if found:
        return found
    base = getattr(lm, "base_model", lm)
    for attr in ("layers", "h", "blocks"):
        seq = getattr(base, attr, None)
        if isinstance(seq, torch.nn.ModuleList):
            return list(seq)
    raise UnisonError(f"cannot find the decoder layers of {type(lm).__name__} to shard: "
                      f"run it without torchrun, or report the architecture")


def shard(root: torch.nn.Module, layers: list[torch.nn.Module], dist_: Dist,
          param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = torch.float32) -> None:
    """``fully_shard`` every layer, then the root. ``param_dtype`` is the dtype parameters are
    all-gathered in for compute (None: their own fp32); gradients are reduced in ``reduce_dtype``.
    The sharded parameters (the optimizer's master weights) stay fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in layers:
        fully_shard(layer, mesh=dist_.mesh, mp_policy=mp)
    fully_shard(root, mesh=dist_.mesh, mp_policy=mp)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly) sharded tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly) sharded one (a collective for a DTensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
