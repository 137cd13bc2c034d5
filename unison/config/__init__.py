"""The training configuration: the typed tree (:mod:`unison.config.schema`, a leaf) and its loading
(:mod:`unison.config.load`: YAML, ``--set``, did-you-mean, paths next to the config). Every key: docs/config.md."""

from unison.config.load import (BUILTIN, PATH_KEYS, config_from_dict, dump_config, load_config, merge,
                                override_keys, parse_override, read_yaml, resolve_paths)
from unison.config.schema import (CheckpointConfig, Config, DistributedConfig, LogConfig, LoRAConfig,
                                  MismatchBudgetConfig, MismatchConfig, MoEConfig, PolicyConfig, RolloutConfig,
                                  ScalerConfig, SFTConfig, SurgeConfig, TaskConfig, TrainConfig, VLLMConfig)
from unison.config.values import (ENGINES, GEMM_CHOICES, PRECISIONS, parse_engine, parse_gemm, parse_precision,
                                  parse_threads)

__all__ = ["BUILTIN", "PATH_KEYS", "config_from_dict", "dump_config", "load_config", "merge", "override_keys",
           "parse_override", "read_yaml", "resolve_paths", "ENGINES", "GEMM_CHOICES", "PRECISIONS", "CheckpointConfig",
           "Config", "DistributedConfig", "LogConfig", "LoRAConfig", "MismatchBudgetConfig", "MismatchConfig",
           "MoEConfig", "PolicyConfig", "RolloutConfig", "ScalerConfig", "SFTConfig", "SurgeConfig", "TaskConfig",
           "TrainConfig", "VLLMConfig", "parse_engine", "parse_gemm", "parse_precision", "parse_threads"]
