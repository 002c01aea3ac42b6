"""Switchyard: serving Mixture-of-Experts language models as asyncio microservices.

This package is the top: the command line, the launcher and its supervision, the
deployment's description and its renderings, and the client tools (bench, eval, probe).
Nothing below imports it.

Its modules and parts:

- `cli`: the command line.
- `launcher`: `switchyard serve`. `children` holds the processes it starts, and
  `supervisor` the restart policy.
- `serve_process`: `serve` as a process tree, for eval and tests.
- `dcp_leader`: this process as a DCP group's leader over peer processes, for tests and
  benchmarks.
- `topology`: one description of a deployment, rendered by `local`, `compose` and `k8s` as
  `serve`'s processes, docker compose and Kubernetes.
- The bundled demo model, `models/arith-moe`: a small DeepSeek-V3 with one MTP layer,
  trained by `training/train_demo.py`. Its task is `demo_task`.
- The client tools: `eval`, the accuracy harness; `bench`, the load generator; and
  `probe`, for healthchecks.
"""

from common import __version__

__all__ = ["__version__"]
