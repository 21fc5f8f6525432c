"""The communication layer: hand-written collectives on MPI point-to-point.

``ring`` holds ``Ring`` (reduce-scatter, all-gather, all-reduce, the byte
ledger, timeouts); ``plan`` compiles each call's schedule into persistent
requests; ``schedule`` is the rule that picks a schedule (no MPI: the
models read it too); ``checks`` are the argument checks made before any message;
``watchdog`` is the stall inspector (RINGZERO_STALL_WARN / RINGZERO_TIMEOUT);
``backend`` picks NumPy or CuPy, decides CUDA-awareness and stages device
buffers through pinned host memory when the MPI is not CUDA-aware;
``kernels`` are the float16 loops (an optional C extension with a
bitwise-equal NumPy fallback). Nothing here knows about models or stages.
"""
