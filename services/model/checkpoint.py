"""Reading tensors from a Hugging Face safetensors checkpoint, one tensor at a time.

Services load only the tensors they own, so nothing here materialises the whole model. The
attention service never touches expert weights, and an expert service reads only its
placement's experts.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from services.model.config import INDEX_FILE, tensor_files
from services.model.families import CheckpointError

__all__ = ["INDEX_FILE", "Checkpoint"]


class Checkpoint:
    """A directory of `*.safetensors` files: a single file, or shards with an index."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}
        self._files: dict[str, Path] = tensor_files(self.dir)

    def _open(self, path: Path) -> Any:  # safetensors' handle (no public type)
        if path not in self._handles:
            try:
                self._handles[path] = self._stack.enter_context(safe_open(path, "pt"))
            except Exception as exc:
                raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from exc
        return self._handles[path]

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def names(self) -> list[str]:
        """Every tensor's name."""
        return list(self._files)

    def file_of(self, name: str) -> Path:
        if name not in self._files:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        return self._files[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.file_of(name)).get_slice(name).get_shape())

    def check_shapes(self, expected: Iterable[tuple[str, tuple[int, ...]]]) -> None:
        """Raise `CheckpointError` naming the first missing or wrongly shaped tensor."""
        for name, shape in expected:
            actual = self.shape(name)
            if actual != shape:
                raise CheckpointError(
                    f"{self.file_of(name)}: tensor {name!r} has shape {list(actual)}, "
                    f"expected {list(shape)}"
                )

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
        """Load one tensor, checking its shape, converted to `dtype`; None keeps it as
        stored."""
        self.check_shapes([(name, shape)])
        tensor = self._open(self.file_of(name)).get_tensor(name)
        return tensor if dtype is None else tensor.to(dtype)

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
