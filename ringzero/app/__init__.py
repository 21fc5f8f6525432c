"""The application: ``train`` (the main job, ``python -m ringzero.train``) and
``data`` (the corpus and the deterministic batches). It builds a model from
``ringzero.nn`` and hands it to the runtime."""
