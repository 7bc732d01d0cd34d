"""leantune: fine-tune Llama-family models on as little accelerator memory as possible."""

from leantune.optional import drop_known_noise

__version__ = "0.1.0"

drop_known_noise()  # whatever leantune's command, before any library it imports speaks
