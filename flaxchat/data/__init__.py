"""Corpora and the packing data loader.

`resolve_source(spec, split)` turns "stories" (the built-in offline corpus), a local path or glob of
.txt/.jsonl/.parquet files, or an `hf:owner/name` hub dataset into a document source;
`PackingLoader` turns a source and a tokenizer into BOS-aligned, best-fit packed token batches.
"""
