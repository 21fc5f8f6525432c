"""The application: ``train`` (the main job, ``python -m ringzero.train``) and
``data`` (the corpus and the deterministic batches). It builds a model from
``ringzero.nn`` and hands it to the runtime. ``hf_import`` / ``hf_export`` move
GPT-2 checkpoints between Hugging Face's files and ringzero's shards;
``tokens`` encodes text with a BPE tokenizer.json."""
