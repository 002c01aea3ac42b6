#!/usr/bin/env bash
# Create or refresh the project's virtual environment; idempotent.
# usage: scripts/bootstrap.sh [EXTRAS]   (e.g. "test", "gpu"); prints the venv's python path.
# SWITCHYARD_VENV: where (default .venv); SWITCHYARD_TORCH: the torch requirement to install
# (default: the CPU build on machines without an NVIDIA GPU, a CUDA build with one).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${SWITCHYARD_VENV:-$root/.venv}
extras=${1:-}
python=${PYTHON:-python3}

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv" >&2
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)

# Re-install only when the dependency list or this script changed.
key=$(cat "$root/pyproject.toml" "$root/scripts/bootstrap.sh" | sha256sum | cut -c1-16)
stamp="$venv/.switchyard-${extras:-base}-$key"
if [ ! -f "$stamp" ]; then
  if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    if [ -n "${SWITCHYARD_TORCH:-}" ]; then
      # Chosen by the caller (the Dockerfile: a CUDA build where no GPU is visible); pip
      # arguments, split on spaces (e.g. "torch==2.9.1 --index-url URL").
      read -ra torch_args <<< "$SWITCHYARD_TORCH"
      "${pip[@]}" install "${torch_args[@]}" >&2
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      "${pip[@]}" install "torch>=2.5" >&2
    else
      # CPU machine: PyPI's Linux torch is the CUDA build (multi-GB of nvidia-* wheels);
      # PyTorch's CPU index offers 2.13.0+cpu. A local wheel directory (pip's find-links)
      # may hold it: asked first, without the index, whose every lookup would otherwise
      # be retried where it is out of reach (minutes, a package at a time).
      "${pip[@]}" install "torch==2.13.0+cpu" >&2 2>/dev/null ||
        "${pip[@]}" install "torch==2.13.0" \
          --extra-index-url https://download.pytorch.org/whl/cpu >&2
    fi
  fi
  # Pin whatever torch is installed so no dependency can swap it for another build.
  constraints="$venv/.torch-constraint.txt"
  "$venv/bin/python" -c "import torch; print('torch==' + torch.__version__)" > "$constraints"
  spec="$root"
  [ -n "$extras" ] && spec="$root[$extras]"
  # An editable install writes switchyard.egg-info into the source tree: one venv's at a
  # time (CI sets up two at once), under a lock on pyproject.toml.
  flock "$root/pyproject.toml" "${pip[@]}" install -c "$constraints" -e "$spec" >&2
  rm -f "$venv"/.switchyard-"${extras:-base}"-*
  touch "$stamp"
fi
echo "$venv/bin/python"
