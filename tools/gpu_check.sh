#!/usr/bin/env bash
# The GPU check (tools/gpu_check.py): on a CUDA machine, no arguments; --cpu runs the same
# steps on the small config on the CPU. Needs torch and this package's Python dependencies
# (the venv tools/ws.sh sets up, $OXYGEN_VENV, or $PYTHON); no network, no ROS.
# Stops after 9.5 minutes (GPU_CHECK_TIMEOUT, seconds), the time it is sized for.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${OXYGEN_VENV:-$HOME/.cache/oxygen_ros/venv}"
if [ -n "${PYTHON:-}" ]; then
  py="$PYTHON"
elif [ -n "${VIRTUAL_ENV:-}" ]; then
  py="$VIRTUAL_ENV/bin/python"
elif [ -x "$venv/bin/python" ]; then
  py="$venv/bin/python"
else
  py=python3
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
exec timeout "${GPU_CHECK_TIMEOUT:-570}" "$py" tools/gpu_check.py "$@"
