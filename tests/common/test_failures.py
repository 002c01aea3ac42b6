"""`common.failures`: the root causes a failure is reported by."""

from __future__ import annotations

from common.failures import root_causes


def test_root_causes_are_the_leaves_of_exception_groups_once_each() -> None:
    numpy = RuntimeError("Numpy is not available")
    nested = ExceptionGroup("unhandled errors in a TaskGroup", [
        numpy, ExceptionGroup("inner", [RuntimeError("Numpy is not available"),
                                        TimeoutError()])])
    assert root_causes(nested) == "RuntimeError: Numpy is not available; TimeoutError"
    assert root_causes(ValueError("bad")) == "ValueError: bad"
