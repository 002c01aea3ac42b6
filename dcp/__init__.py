"""Decode context parallelism: KV sharded along the sequence across an attention group,
partial attention outputs merged by log-sum-exp. Built by the DCP issue; empty until then."""
