"""The run's :class:`~unison.sides.Machine`, decided once before any model is loaded: the threads and each side's
matmul library (unison/runtime.py), each side's compilation (unison/compilation.py), and the two Sides they make
with the config's other knobs (unison/sides.py)."""

from __future__ import annotations

import torch

from unison import compilation, gemm
from unison.runtime import setup
from unison.sides import Machine, config_sides


def decide(cfg, model_dir, prec, shape, world_size: int = 1, gemm_setting=None, compile_setting=None,
           log=None) -> Machine:
    """The run's :class:`~unison.sides.Machine`, decided once before any model is loaded: the threads, each side's
    matmul library (:func:`setup`) and compilation (unison/compilation.py), and the two
    :class:`~unison.sides.Side` s they make with the config's other knobs (``prec``: the resolved precision;
    ``shape``: the run's shapes, :func:`unison.compilation.run_shape`). ``gemm_setting`` / ``compile_setting``:
    the settings to decide from (a resumed run's recorded choices), the config's by default."""
    native = cfg.engine == "native"
    # the native engine's products are fp32 ones in fp32, and by its fp32 copies of half weights (gemm.engine_copies)
    engine_fp32 = native and (prec.rollout_dtype == torch.float32
                              or gemm.engine_copies(prec.rollout_dtype, cfg.device, cfg.exact))
    rt = setup(cfg.threads, gemm_setting or cfg.gemm, model_dir, device=cfg.device, world_size=world_size,
               fp32=prec.learner_dtype == torch.float32, engine_fp32=engine_fp32, decode_rows=shape.rows)
    comp = compilation.decide(compile_setting or cfg.compile, model_dir, rt.sizes.params, shape, exact=cfg.exact,
                              world_size=world_size, device=cfg.device, engine_native=native,
                              engine_packed=rt.gemm.engine == "onednn" and engine_fp32,
                              quantization_aware=cfg.train.quantization_aware, log=log)
    engine, learner = config_sides(cfg, prec, world_size, gemm=(rt.gemm.engine, rt.gemm.name),
                                   compiled=(comp.engine, comp.learner))
    return Machine(rt.threads, engine, learner, rt.gemm, comp, rt.sizes)
