"""The communication layer: hand-written collectives on MPI point-to-point.

    ring         Ring: the public ops (reduce-scatter, all-gather, all-reduce) and the dispatcher
    progress     the nonblocking forms (*_start -> Pending.wait): the same plans on a progress thread
    nodes        which ranks share a node (MPI_COMM_TYPE_SHARED), the node-aware schedule's groups
    objects      small Python objects agreed over a Ring (watched, unlike MPI's own bcast)
    schedule     which schedule a call takes, its rounds and bytes (one table, no MPI: the models read it)
    cache        kept plans (LRU), their scratch, the byte ledger
    plan         a call compiled into a CollectivePlan (the schedule picked, views cut, scratch handed)
    algorithms   the schedules, each written once: ring, tree, recursive doubling, direct
    builder      the primitives they are written in (persistent requests, waits, adds)
    steps        the plan's named step records and CollectivePlan
    trace        the timeline recorder (--trace): per-thread event buffers, written as Chrome trace JSON
    executor     runs a plan: waits inside MPI, checks every count, raises on the caller's thread
    diagnostics  the limits and the words of every stall, timeout and bad count
    watchdog     the stall inspector thread (RINGZERO_STALL_WARN / RINGZERO_TIMEOUT)
    checks       the argument checks made before any message
    staging      device buffers through pinned host memory when MPI is not CUDA-aware
    backend      NumPy or CuPy (the ``xp``), CUDA-awareness, pinned buffers
    kernels      the float16 loops (an optional C extension with a bitwise-equal NumPy fallback)
    quant        blockwise int8 / int4 quantization (an optional C extension, the same bits as NumPy)
    quant_cuda   the same as CuPy ElementwiseKernels (the C loops, no FMA)
    quantized    ZeRO++'s quantized all-gather (qwZ) and two-hop reduce-scatter (qgZ)
    qledger      what those move (codes / scales, inside / across nodes) and the 3Ψ -> 0.75Ψ formula
    threads      BLAS/OpenMP threads per rank

Nothing here knows about models or stages.
"""
