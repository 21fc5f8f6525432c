"""Interop: Hugging Face checkpoints and tokenizers, where the trainer and the tools may both import them.

What it is
    ``gpt2``: GPT-2's parameter names and config.json, both ways, and the
    GPTConfig of a ringzero manifest. ``hf_import``: ``--init-from``, each rank
    reading its own pieces of a safetensors checkpoint (single or sharded;
    fp32, fp16, bf16). ``hf_export``: ``checkpoint export --format hf``.
    ``tokens``: tokenizer.json loading, ``data encode`` and the token files.

What it is not
    No model (the models are ``ringzero.nn``'s; this package names their
    parameters), no collectives, no trainer. It sits between ``nn`` and
    ``tools`` in the layers: comm < runtime < nn < interop < tools < app.
"""
