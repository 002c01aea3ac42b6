"""The prefix cache's keys: a chain hash over spans of tokens. The attention service keys
its cached KV blocks by them; the gateway routes by the same keys (prefix affinity), so
both compute them here, without torch.

The gateway's keys are those of a prompt's whole blocks, salt included, so its guess of a
group's cache matches what the group would find.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def chain_keys(token_ids: Sequence[int], width: int, salt: str | None, keys: list[bytes],
               num_spans: int) -> list[bytes]:
    """Extend `keys` to `num_spans` keys, in place, and return it.

    `keys` holds the keys of the first len(keys) spans of `width` tokens of `token_ids`. A
    span's key is sha256 of the previous span's key and its own tokens. For the first span
    the salt's bytes stand in for the previous key.
    """
    for s in range(len(keys), num_spans):
        parent = keys[-1] if keys else (salt or "").encode()
        tokens = array("q", token_ids[s * width:(s + 1) * width]).tobytes()
        keys.append(hashlib.sha256(parent + tokens).digest())
    return keys
