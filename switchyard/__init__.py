"""Switchyard: serving Mixture-of-Experts language models as asyncio microservices.

This package is the top: the command line, the launcher and its supervision, the
deployment's description and its renderings, and the client tools (bench, eval, probe).
Nothing below imports it.

Its modules: `cli` (the command line); `launcher` (`switchyard serve`), `children` (the
processes it starts), `supervisor` (the restart policy), `serve_process` (`serve` as a
process tree, for eval and tests) and `dcp_leader` (this process as a DCP group's leader
over peer processes, for tests and benchmarks); `topology` (one description of a
deployment), rendered by `local`, `compose` and `k8s` as `serve`'s processes, docker compose
and Kubernetes; the bundled demo model (`models/arith-moe`: a small DeepSeek-V3 with one MTP
layer, trained by `training/train_demo.py`) and its task (`demo_task`); and the client tools
`eval` (accuracy harness), `bench` (load generator) and `probe` (healthchecks).
"""

from common import __version__

__all__ = ["__version__"]
