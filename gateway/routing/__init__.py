"""Routing over the attention groups: a connection per group (`engine_client`), the pool
that picks a group and fails requests over (`engine_pool`, `prefix_affinity`), and the
expert rebalancer."""
