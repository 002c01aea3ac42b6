"""`--speculative-config`, in vLLM's form: a JSON object, checked at start-up with errors
that name the field.

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 3,
                           "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# "mtp" drafts with the checkpoint's multi-token-prediction layer (DeepSeek's), in `mtp.py`.
# "ngram" drafts from the sequence's own tokens (prompt lookup), in `ngram.py`.
METHODS = ("mtp", "ngram")
MAX_SPECULATIVE_TOKENS = 8
# By default, steps with more running sequences than this do not speculate; the limit
# depends on the method. It was measured on 2 cores (docs/benchmarks.md, "What speculation
# gives"). For n-gram, a verify step of k = 1 costs 1.18x a plain step at 1 sequence and
# about 1.3x from 16 sequences on; k = 3 costs 1.6x and 1.9-2.3x. A busy server is bound by
# throughput, which drafts rejected at that price would cut. MTP also pays a pass of its
# layer each step. Served, the bundled model's k = 2 gained at 1 to 4 concurrent requests
# and lost 10-12% of its throughput at 8 and 16.
DISABLE_BY_BATCH_SIZE = {"mtp": 4, "ngram": 8}


@dataclass(frozen=True)
class SpeculativeConfig:
    """The parsed `--speculative-config`.

    method: where drafts come from. "mtp" uses the checkpoint's MTP layer, run again for
        each further draft; "ngram" uses the sequence's own tokens.
    num_speculative_tokens: the most drafts a sequence takes a step (k).
    prompt_lookup_min, prompt_lookup_max: the n-gram lengths tried, longest first.
    disable_by_batch_size: a step with more running sequences than this does not
        speculate. Unless given, it is the method's `DISABLE_BY_BATCH_SIZE`. null means
        speculation is never turned off."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    disable_by_batch_size: int | None = DISABLE_BY_BATCH_SIZE["ngram"]

    @property
    def mtp(self) -> bool:
        return self.method == "mtp"


def check_speculative(config: SpeculativeConfig | None, mtp_served: bool) -> None:
    """Raise a ValueError where the deployment cannot draft as `config` asks. MTP drafts
    need a dispatch backend whose expert ranks serve the MTP layer (`Backend.mtp`)."""
    if config is not None and config.mtp and not mtp_served:
        raise ValueError("--speculative-config: method 'mtp' needs a dispatch backend whose "
                         "expert ranks serve the MTP layer (local, rpc, torch or nccl; "
                         "deepep's rounds take the decoder's layers only: use 'ngram')")


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """The flag's JSON, parsed. None or empty text means no speculation and gives None.
    Raises ValueError naming the field that is wrong."""
    if not text:
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--speculative-config must be a JSON object")
    known = set(SpeculativeConfig.__dataclass_fields__)
    if unknown := sorted(set(raw) - known):
        raise ValueError(f"--speculative-config: unknown field {unknown[0]!r} (known: "
                         f"{', '.join(sorted(known))})")
    method = raw.get("method")
    if method not in METHODS:
        raise ValueError(f"--speculative-config: method must be one of {list(METHODS)}, "
                         f"not {method!r}")
    if "num_speculative_tokens" not in raw:
        raise ValueError("--speculative-config: num_speculative_tokens is required")
    config = SpeculativeConfig(**{"disable_by_batch_size": DISABLE_BY_BATCH_SIZE[method],
                                  **raw})
    for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"--speculative-config: {name} must be a whole number, at "
                             f"least 1, not {value!r}")
    if config.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"--speculative-config: num_speculative_tokens must be at most "
                         f"{MAX_SPECULATIVE_TOKENS}")
    if config.prompt_lookup_max < config.prompt_lookup_min:
        raise ValueError("--speculative-config: prompt_lookup_max must be at least "
                         "prompt_lookup_min")
    limit = config.disable_by_batch_size
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)
                              or limit < 1):
        raise ValueError(f"--speculative-config: disable_by_batch_size must be a whole "
                         f"number, at least 1, not {limit!r}")
    return config
