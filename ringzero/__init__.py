"""ringzero: a from-scratch sharded data-parallel (ZeRO / FSDP) training runtime over MPI.

The public API, one import away::

    from ringzero import Ring, Zero, GPT, GPTConfig, Llama, LlamaConfig

``Ring`` (ringzero.comm.ring) holds the hand-written collectives, ``Zero``
(ringzero.runtime.zero) the stages, ``GPT`` and ``GPTConfig`` (ringzero.nn.gpt)
and ``Llama`` and ``LlamaConfig`` (ringzero.nn.llama) the two model families.
The names are imported on first use, so ``import ringzero`` loads neither MPI
nor NumPy. The commands are modules of their own:
``python -m ringzero.train``, ``bench``, ``estimate``, ``explain``, ``fit``,
``plot``, ``sample``, ``simulate``, ``data`` and ``checkpoint``.
"""
import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_API = {
    "Ring": "ringzero.comm.ring",
    "Zero": "ringzero.runtime.zero",
    "StepResult": "ringzero.runtime.zero",
    "GPT": "ringzero.nn.gpt",
    "GPTConfig": "ringzero.nn.gpt",
    "Llama": "ringzero.nn.llama",
    "LlamaConfig": "ringzero.nn.llama",
}
__all__ = list(_API)


def __getattr__(name):
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ringzero' has no attribute {name!r}")
