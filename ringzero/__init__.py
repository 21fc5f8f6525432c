"""ringzero: a from-scratch sharded data-parallel (ZeRO / FSDP) training runtime over MPI."""
__version__ = "0.1.0"
