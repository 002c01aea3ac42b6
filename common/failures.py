"""What a failure says to whoever asked: its root causes, not the wrapper around them.

An error delta carries the leaves of an exception group, "RuntimeError: ..." rather than
anyio's "unhandled errors in a TaskGroup (2 sub-exceptions)", so the client's 503 names what
went wrong.
"""

from __future__ import annotations


def root_causes(exc: BaseException) -> str:
    """`Type: message` of each leaf of `exc`'s exception groups, once each, joined by "; ".

    An anyio task group that fails raises an `ExceptionGroup` whose own text is only
    "unhandled errors in a TaskGroup (2 sub-exceptions)"; the leaves say what happened.
    """
    causes: list[str] = []
    pending: list[BaseException] = [exc]
    while pending:
        leaf = pending.pop(0)
        if isinstance(leaf, BaseExceptionGroup):
            pending[:0] = leaf.exceptions
            continue
        text = f"{type(leaf).__name__}: {leaf}" if str(leaf) else type(leaf).__name__
        if text not in causes:
            causes.append(text)
    return "; ".join(causes)
