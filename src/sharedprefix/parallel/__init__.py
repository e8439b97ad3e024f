"""Data parallelism: the DDP / FSDP2 strategy (``strategy``) and whole groups per rank (``sharding``)."""

from sharedprefix.parallel.sharding import shard_groups

__all__ = ["shard_groups"]
