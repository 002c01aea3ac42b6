"""Faults injected into real service processes, for tests: put this folder on PYTHONPATH
and name the fault in SWITCHYARD_TEST_FAULT; processes it does not name are untouched.

- `expert-compute:R`: expert rank R answers every handshake but cannot compute (each
  layer call fails in its expert FFN).
- `wire-bytes:FILE`: an attention service's tensors cannot become wire bytes while FILE
  exists, with the error torch gives for `Tensor.numpy()` where numpy is missing.
"""

import os
import sys
from pathlib import Path

_fault = os.environ.get("SWITCHYARD_TEST_FAULT", "")
_argv = sys.orig_argv
_role = _argv[_argv.index("switchyard") + 1] if "switchyard" in _argv[:-1] else None


def _flag(name: str) -> str | None:
    return _argv[_argv.index(name) + 1] if name in _argv[:-1] else None


if _fault.startswith("expert-compute:") and _role == "expert" and \
        _flag("--rank") == _fault.split(":", 1)[1]:
    from services.model.experts import ExpertBank

    def _cannot_compute(*args: object, **kwargs: object) -> object:
        raise RuntimeError("injected fault: this expert rank cannot compute")

    ExpertBank.forward = _cannot_compute  # type: ignore[method-assign]

if _fault.startswith("wire-bytes:") and _role == "attention":
    import ep_dispatch.wire

    _armed = Path(_fault.split(":", 1)[1])
    _tensor_bytes = ep_dispatch.wire.tensor_bytes

    def _without_numpy(t: object) -> bytes:
        if _armed.exists():
            raise RuntimeError("Numpy is not available")
        return _tensor_bytes(t)  # type: ignore[arg-type]

    ep_dispatch.wire.tensor_bytes = _without_numpy
