"""Tokenization and detokenization: the tokenizer with its chat template, and the
incremental detokenizer."""
