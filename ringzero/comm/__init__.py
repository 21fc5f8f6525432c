"""The communication layer: hand-written collectives on MPI point-to-point.

``ring`` holds ``Ring`` (reduce-scatter, all-gather, all-reduce and their
schedules, the byte ledger, timeouts); ``backend`` picks NumPy or CuPy and
stages device buffers through pinned host memory when the MPI is not
CUDA-aware; ``kernels`` are the float16 loops (an optional C extension with a
bitwise-equal NumPy fallback). Nothing here knows about models or stages.
"""
