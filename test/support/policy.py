"""The shipped policy (models/aloha_sim_transfer_cube) run through oxygen-eval, as the
policy tests run it: test_policy_direct.py (no ROS) and test_policy.py (through ROS)."""
import json
import os
import subprocess
import sys

from oxygen_ros.robot.share import shipped_policy

POLICY = shipped_policy()


def evaluate(tmp_path, *args, checkpoint=POLICY, cwd=None):
    """oxygen-eval on the transfer-cube task with `args`: (its report, its directory)."""
    out = tmp_path / 'out'
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    r = subprocess.run([sys.executable, '-m', 'oxygen_ros.sim.eval', '--env', 'aloha-transfer-cube',
                        '--checkpoint', str(checkpoint), '--no-video', '--out', str(out), *args],
                       capture_output=True, text=True, env=env, timeout=900, cwd=cwd)
    logs = ''.join(f'\n== {p.name}\n{p.read_text()[-3000:]}' for p in out.glob('*.log'))
    assert r.returncode == 0, r.stdout + r.stderr + logs
    [path] = out.glob('*_report.json')  # open_loop_, direct_ or ros_report.json
    report = json.loads(path.read_text())
    print(r.stdout)
    return report, out
