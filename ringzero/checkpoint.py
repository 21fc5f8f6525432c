"""``python -m ringzero.checkpoint``: inspect and export a checkpoint (serial).

A launcher only: the code is ``ringzero.runtime.export``, and this module runs its ``main``,
with the GPT-2 export (``--format hf``, ``ringzero.interop.hf_export``) handed in: the runtime
imports no model, and the GPT-2 names are the model's.
"""
import sys

from ringzero.interop.hf_export import cli as hf_cli
from ringzero.runtime.export import main

if __name__ == "__main__":
    sys.exit(main(formats={"hf": hf_cli}))
