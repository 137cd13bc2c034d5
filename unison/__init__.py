"""unison: RL fine-tuning of language models in which the trainer and the sampler agree."""

from unison.errors import UnisonError

__version__ = "0.1.0"
__all__ = ["UnisonError", "__version__"]
