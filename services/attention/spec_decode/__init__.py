"""Speculative decoding: drafts (`ngram`), and their verification by the target model's
probabilities (`rejection`)."""
