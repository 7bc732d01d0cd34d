"""leantune: fine-tune Llama-family models on as little accelerator memory as possible."""

__version__ = "0.1.0"
