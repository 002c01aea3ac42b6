"""What the tests share and are not tests: checkpoint builders, fakes, third-party tools,
interpreters for the GPU kernels, fault injection for real processes."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent  # the repository
DATA = TESTS / "data"
