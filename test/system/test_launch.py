"""pi05.launch.py: run through launch where launch_ros is installed; everywhere, the same
installed executables with the same parameter files and a namespace remap must talk to
each other."""
import ast
import importlib.util
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time

import pytest
import yaml

rclpy = pytest.importorskip('rclpy')
ament = pytest.importorskip('ament_index_python.packages')
from support.launch import (  # noqa: E402
    HAVE_LAUNCH,
    NO_LAUNCH,
    NO_ROS2,
    installed,
    stop,
    tiny_sim_file,
)
from support.process import node_env  # noqa: E402


def tiny_params(tmp_path):
    # The sim setup on the tiny model, so the test starts fast (in the subtask format, as
    # tiny_sim_file).
    path = tmp_path / 'tiny.yaml'
    path.write_text(yaml.safe_dump({'/**': {'ros__parameters': {
        'model': 'tiny', 'prompt_format': 'subtask', 'device': 'cpu', 'threads': 1,
        'image_width': 64, 'image_height': 48}}}))
    return path


def test_launch_file_starts_installed_executables():
    prefix, share = installed()
    src = (share / 'launch' / 'pi05.launch.py').read_text()
    tree = ast.parse(src)
    names = {k.value.value for k in ast.walk(tree) if isinstance(k, ast.keyword)
             and k.arg == 'executable' and isinstance(k.value, ast.Constant)}
    assert names == {'oxygen_node', 'oxygen_sim_robot'}
    for name in names:
        exe = prefix / 'lib' / 'oxygen_ros' / name
        assert exe.is_file() and os.access(exe, os.X_OK), exe
    for robot in ('aloha', 'droid', 'sim', 'pi05'):
        assert (share / 'config' / f'{robot}.yaml').is_file()


@pytest.mark.skipif(not HAVE_LAUNCH, reason=NO_LAUNCH)
def test_launch_description_declares_the_arguments():
    _, share = installed()
    spec = importlib.util.spec_from_file_location('pi05_launch', share / 'launch' /
                                                  'pi05.launch.py')
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ld = mod.generate_launch_description()
    declared = {a.name for a in ld.get_launch_arguments()}
    assert declared == {'robot', 'params_file', 'checkpoint', 'tokenizer', 'device', 'autostart',
                        'command', 'namespace', 'use_sim_time', 'log_level', 'sim'}


def listen(domain, topic_traj, topic_text, seconds):
    """(trajectory count, narration texts) heard in `seconds` once trajectories start."""
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from std_msgs.msg import String
    from trajectory_msgs.msg import JointTrajectory

    os.environ['ROS_DOMAIN_ID'] = domain
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    node = rclpy.create_node('launch_listener', context=ctx)
    got, texts = [], []
    reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
    node.create_subscription(JointTrajectory, topic_traj, got.append, reliable)
    node.create_subscription(String, topic_text, lambda m: texts.append(m.data), reliable)
    ex = SingleThreadedExecutor(context=ctx)
    ex.add_node(node)
    t = threading.Thread(target=ex.spin, daemon=True)
    t.start()
    try:
        end = time.monotonic() + 60
        while not got and time.monotonic() < end:
            time.sleep(0.1)
        start = len(got)
        time.sleep(seconds)
        return len(got) - start, list(texts)
    finally:
        ex.shutdown(timeout_sec=1)
        node.destroy_node()
        rclpy.try_shutdown(context=ctx)


def test_same_executables_params_and_remaps_talk(tmp_path):
    """What `ros2 launch oxygen_ros pi05.launch.py robot:=sim sim:=true namespace:=ns`
    starts, started by hand: the installed executables, pi05.yaml then sim.yaml, the
    namespace remap."""
    prefix, share = installed()
    domain = str(random.randint(120, 220))
    cfg = share / 'config'
    ros = ['--ros-args', '--params-file', str(cfg / 'pi05.yaml'), '--params-file',
           str(cfg / 'sim.yaml'), '--params-file', str(tiny_params(tmp_path)),
           '-r', '__ns:=/lt']
    lib = prefix / 'lib' / 'oxygen_ros'
    logs = [open(tmp_path / f'{n}.log', 'w') for n in ('node', 'sim')]
    procs = [subprocess.Popen([str(lib / 'oxygen_node'), *ros],
                              stdout=logs[0], stderr=subprocess.STDOUT, env=node_env(domain)),
             subprocess.Popen([str(lib / 'oxygen_sim_robot'), *ros],
                              stdout=logs[1], stderr=subprocess.STDOUT, env=node_env(domain))]
    try:
        # 4 s: what is checked is that they talk, not how fast (docs/benchmarks.md has the
        # rates); on a machine whose hypervisor took half the CPU 2 s held 65.
        n, texts = listen(domain, '/lt/fr3_arm_controller/joint_trajectory',
                          '/lt/oxygen_node/narration/text', 4.0)
    finally:
        codes = stop(procs)
        for f in logs:
            f.close()
    node_log = (tmp_path / 'node.log').read_text()
    assert n >= 70, f'{n} trajectories in 4 s:\n{node_log[-3000:]}'
    assert texts, 'no narration'
    assert codes == [0, 0], (codes, node_log[-3000:])
    assert 'Traceback' not in node_log


@pytest.mark.skipif(not HAVE_LAUNCH or shutil.which('ros2') is None, reason=NO_ROS2)
def test_ros2_launch_sim(tmp_path):
    installed()
    domain = str(random.randint(120, 220))
    params = tiny_sim_file(tmp_path)
    log = open(tmp_path / 'launch.log', 'w')
    proc = subprocess.Popen(
        ['ros2', 'launch', 'oxygen_ros', 'pi05.launch.py', 'robot:=sim', 'sim:=true',
         f'params_file:={params}', 'device:=cpu', 'namespace:=lt'],
        stdout=log, stderr=subprocess.STDOUT, env=node_env(domain))
    try:
        n, _ = listen(domain, '/lt/fr3_arm_controller/joint_trajectory',
                      '/lt/oxygen_node/narration/text', 4.0)  # as above
    finally:
        codes = stop([proc])
        log.close()
    text = (tmp_path / 'launch.log').read_text()
    assert n >= 70, text[-3000:]
    # ros2 launch exits 0 only when every process it started did.
    assert codes == [0], (codes, text[-3000:])
    assert re.search(r'\[oxygen_node-\d+\]: process has finished cleanly', text), text[-3000:]
    assert re.search(r'\[oxygen_sim_robot-\d+\]: process has finished cleanly', text), text[-3000:]


def children(pid):
    with open(f'/proc/{pid}/task/{pid}/children') as f:
        return [int(p) for p in f.read().split()]


@pytest.mark.skipif(shutil.which('ros2') is None, reason=NO_ROS2)
def test_readme_ros2_run_with_a_remap(tmp_path):
    """The README's `ros2 run` line for an ALOHA whose RealSense driver uses the older topic
    names, with the random-weight small model on the CPU instead of a checkpoint on CUDA
    (random weights on a robot profile must be allowed explicitly)."""
    installed()
    domain = str(random.randint(120, 220))
    env = node_env(domain)
    prefix = subprocess.run(['ros2', 'pkg', 'prefix', 'oxygen_ros'], env=env, check=True,
                            capture_output=True, text=True).stdout.strip()
    cfg = f'{prefix}/share/oxygen_ros/config'
    log = open(tmp_path / 'run.log', 'w')
    proc = subprocess.Popen(
        ['ros2', 'run', 'oxygen_ros', 'oxygen_node', '--ros-args',
         '--params-file', f'{cfg}/pi05.yaml', '--params-file', f'{cfg}/aloha.yaml',
         '-p', 'model:=small', '-p', 'device:=cpu', '-p', 'autostart:=true',
         '-p', 'allow_random_weights:=true',
         # eager: what is checked is the remap; a cold compile of the small model's programs
         # (about 80 s on two cores) is test_node's to check
         '-p', 'compile:=false',
         '-r', 'cam_high/camera/color/image_rect_raw:=/cam_high/color/image_rect_raw'],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    os.environ['ROS_DOMAIN_ID'] = domain
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    node = rclpy.create_node('remap_check', context=ctx)

    def readers(topic):
        return [i.node_name for i in node.get_subscriptions_info_by_topic(topic)]

    def named(topic):
        # DDS can announce a reader before the participant's node names have arrived; its
        # node is '_NODE_NAME_UNKNOWN_' until then.
        found = readers(topic)
        return found and '_NODE_NAME_UNKNOWN_' not in found

    try:
        end = time.monotonic() + 120
        while not (named('/cam_high/color/image_rect_raw')
                   and named('/cam_left_wrist/camera/color/image_rect_raw')) \
                and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.2)
        moved = readers('/cam_high/color/image_rect_raw')
        old = readers('/cam_high/camera/color/image_rect_raw')
        wrist = readers('/cam_left_wrist/camera/color/image_rect_raw')
    finally:
        node.destroy_node()
        rclpy.try_shutdown(context=ctx)
        # ros2 run does not pass SIGINT on to the node: signal the node itself.
        node_pids = children(proc.pid) if proc.poll() is None else []
        for pid in node_pids:
            os.kill(pid, signal.SIGINT)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = 'killed'
        log.close()
    text = (tmp_path / 'run.log').read_text()
    assert moved == ['oxygen_node'], text[-3000:]
    assert old == [], old
    assert wrist == ['oxygen_node'], wrist  # the other cameras keep the file's topics
    assert node_pids and code == 0, (node_pids, code, text[-3000:])
    assert 'Traceback' not in text
