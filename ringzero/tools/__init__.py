"""The teaching and measuring tools, each a ``python -m ringzero.X`` command.

``bench`` (collectives against the MPI library's own), ``estimate`` (memory
per rank for any Ψ and Nd), ``explain`` (the arithmetic, derived step by
step), ``fit`` (an α-β model of the bench), ``plot``. Tools read the runtime
and the metrics format; none imports the trainer.
"""
