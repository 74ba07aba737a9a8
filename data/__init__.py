"""Data: the embedded corpora, user files, tokenisation cache, Grain pipelines."""
