"""The model's recommended sampling defaults, from its `generation_config.json`.

This works like vLLM's default, `--generation-config auto`. A request that leaves a
parameter out gets the model creator's value instead of the neutral one. Only the values
that differ from the defaults of transformers' `GenerationConfig` count, because vLLM
reads them through `to_diff_dict()`. The source `vllm` keeps the neutral defaults. A
directory as the source means reading the file in that directory instead.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The GenerationConfig defaults of transformers 4, the version that vLLM pins. A file that
# repeats one of these changes nothing.
_HF_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50,
                                "min_p": None, "repetition_penalty": 1.0,
                                "max_new_tokens": None}


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that omits a parameter gets. None means the neutral default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # max_new_tokens from the file; it caps every request

    @classmethod
    def load(cls, source: str, model_dir: Path) -> SamplingDefaults:
        """Load the defaults from `source`.

        `source` is "auto" for the file in the model directory, "vllm" for no defaults, or
        a directory that holds the file.

        Raises:
            ValueError: if the file is not a JSON object, or if a value has the wrong type
                or lies outside the range that a request's own value must be in.
        """
        if source == "vllm":
            return cls()
        path = (model_dir if source == "auto" else Path(source)) / "generation_config.json"
        if not path.is_file():
            if source != "auto":
                raise ValueError(f"{path} does not exist")
            return cls()
        try:
            raw = json.loads(path.read_text())
            if not isinstance(raw, dict):
                raise TypeError("not a JSON object")
            given = {k: raw[k] for k in _HF_DEFAULTS
                     if raw.get(k) is not None and raw[k] != _HF_DEFAULTS[k]}
            defaults = cls(
                temperature=_number(given, "temperature", float),
                top_p=_number(given, "top_p", float), top_k=_number(given, "top_k", int),
                min_p=_number(given, "min_p", float),
                repetition_penalty=_number(given, "repetition_penalty", float),
                max_tokens=_number(given, "max_new_tokens", int))
            defaults.check()
        except (ValueError, TypeError, OverflowError) as exc:
            raise ValueError(f"{path}: {exc}") from exc
        return defaults

    def check(self) -> None:
        """Check the values against the ranges the engine takes, which are vLLM's.

        This way no request fails because of a default it never asked for.
        """
        ranges = {"temperature": (self.temperature, 0.0, math.inf),
                  "top_p": (self.top_p, 1e-9, 1.0), "top_k": (self.top_k, -1, math.inf),
                  "min_p": (self.min_p, 0.0, 1.0),
                  "repetition_penalty": (self.repetition_penalty, 1e-9, math.inf),
                  "max_new_tokens": (self.max_tokens, 1, math.inf)}
        for name, (value, low, high) in ranges.items():
            if value is not None and not (low <= value <= high and math.isfinite(value)):
                raise ValueError(f"{name} {value} is out of range")

    def describe(self) -> str:
        """Describe what differs from the neutral defaults, such as "temperature=0.6, top_k=20"."""
        return ", ".join(f"{k}={v}" for k, v in vars(self).items() if v is not None)


NEUTRAL = SamplingDefaults()  # what vLLM's `--generation-config vllm` gives


def _number(given: dict[str, Any], key: str, kind: type) -> Any:
    value = given.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or (
            kind is int and value != int(value)):
        raise TypeError(f"{key} must be {'an integer' if kind is int else 'a number'}, got "
                        f"{value!r}")
    return kind(value)
