"""The teaching and measuring tools, each a ``python -m ringzero.X`` command.

``bench`` (collectives against the MPI library's own; its cases in
bench_cases.py, its timing in bench_timing.py, the sched/dtypes/median words
in bench_extra.py), ``estimate`` (memory per rank for any Ψ and Nd; the
activation counts in activations.py), ``explain`` (the arithmetic, derived
step by step), ``fit`` (an α-β model of the bench), ``plot``, ``simulate``
(the step-time model; its command line in simulate_cli.py), ``sample``.
Tools read the runtime and the metrics format; none imports the trainer.
Sizes typed on any command line are read by ``ringzero.sizes``.
"""
