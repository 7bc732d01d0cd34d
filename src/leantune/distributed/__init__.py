"""Beyond one device: the process group (``context``) and FSDP2 sharding (``fsdp``)."""

from leantune.distributed.context import SINGLE_PROCESS, DistContext, init_distributed

__all__ = ["DistContext", "SINGLE_PROCESS", "init_distributed"]
