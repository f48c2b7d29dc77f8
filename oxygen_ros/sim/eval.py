"""Task success of a policy on the MuJoCo ALOHA, as LeRobot evaluates pi0 on gym-aloha.

    oxygen-eval --env aloha-insertion --episodes 10 --seed 0 [--checkpoint DIR] [--out DIR]
    oxygen-eval --env aloha-transfer-cube --episodes 50 --direct

Default: the real ROS path. oxygen_mujoco_aloha (the scene, the followers' controllers, the
cameras, /clock) and oxygen_node (aloha.yaml + aloha_mujoco.yaml, use_sim_time) run as their
own processes; per episode this resets the scene (~/reset, seed = --seed + episode), activates
the node, records the task reward of every step and the top camera (cam_high) as the node
sees it, and deactivates the node at the end. --direct: the engine and the same scene in one
loop, no ROS (the fast path): each chunk's first n_action_steps actions are played, then the
next chunk is computed from a new observation, as LeRobot's rollout does.

An episode succeeds when the reward reaches 4 (gym-aloha's is_success); the report gives the
success rate, the mean of each episode's largest and summed reward (LeRobot's avg_max_reward,
avg_sum_reward), each episode's reward curve, a video of the top camera (mp4 through
imageio-ffmpeg, or gif) and the wall time. Without a checkpoint the weights are random and
succeed at nothing: then it measures the harness.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import yaml

from oxygen_ros.engine.requests import ENDED_EARLY
from oxygen_ros.engine.scheduler import MODES
from oxygen_ros.robot.aloha import ARM_JOINTS, CAMERAS, gripper_from_finger, normalized_from_gripper
from oxygen_ros.robot.share import config_dir
from oxygen_ros.robot.stamps import seconds
from oxygen_ros.sim.aloha_sim import DT, SUCCESS_REWARD, Unstable
from oxygen_ros.sim.demos import (
    ANSWERS,
    QUESTIONS,
    Episode,
    Observer,
    closed_loop_phase,
    observe,
    phases_for,
    transferred,
    write,
)

ENVS = {'aloha-insertion': 'insertion', 'aloha-transfer-cube': 'transfer_cube'}
LIFT_REWARD = 2  # gym-aloha's transfer-cube: 2 = the cube lifted in the right gripper
# LeRobot's task descriptions for gym-aloha's two tasks.
PROMPTS = {'insertion': 'Insert the peg into the socket.',
           'transfer_cube': 'Pick up the cube with the right arm and transfer it to the '
                            'left arm.'}
VIDEO_FPS = 25
# What the ROS path reads from the node's /diagnostics at the end of each episode: how old a
# frame's chunk is when it comes out (and so when it starts playing), how far apart chunks
# come, and how long a frame takes.
NODE_FIGURES = ('action_latency_ms_p50', 'action_latency_ms_p99', 'chunk_interval_ms_p99',
                'frame_ms_p50', 'frame_ms_p99')
# And its counters, as each episode's share: control ticks a period or more late, and ticks
# that held the robot (a chunk used up before the next came, among other reasons).
NODE_COUNTS = ('missed_ticks', 'hold_ticks')


def robot_params(name: str = 'aloha.yaml') -> dict:
    return yaml.safe_load((config_dir() / name).read_text())['/**']['ros__parameters']


def cameras(slots) -> list[tuple[str, str, str]]:
    """(camera, topic, slot) of aloha.yaml's cameras whose slot the model has: a policy
    trained on the top camera alone is given the top camera alone."""
    p = robot_params()
    out = [(c, t, s) for c, t, s in zip(p['cameras'], p['camera_topics'], p['camera_slots'],
                                        strict=True) if s in slots]
    if not out:
        raise RuntimeError(f'none of aloha.yaml\'s camera slots {p["camera_slots"]} is a slot '
                           f'of the model ({list(slots)})')
    return out


def model_slots(args) -> tuple[str, ...]:
    """The image slots of the policy the node will run (its files read, not its weights:
    the node loads those)."""
    from oxygen_ros.model import load_config
    from oxygen_ros.model.checkpoint import checkpoint_slots

    if args.checkpoint:
        return checkpoint_slots(args.checkpoint, load_config(args.model) if args.model
                                else None)
    return load_config(args.model).image_slots


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a rate of k in n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return float(max(0.0, mid - half)), float(min(1.0, mid + half))


def summary(episodes: list[dict]) -> dict:
    n = len(episodes)
    wins = sum(e['success'] for e in episodes)
    lifts = sum(e['max_reward'] >= LIFT_REWARD for e in episodes)
    out = {
        'episodes': n,
        'successes': wins,
        'success_rate': wins / n if n else 0.0,
        'success_95': wilson(wins, n),
        'lifts': lifts,
        'lift_rate': lifts / n if n else 0.0,
        'lift_95': wilson(lifts, n),
        'avg_max_reward': float(np.mean([e['max_reward'] for e in episodes])) if n else 0.0,
        'avg_sum_reward': float(np.mean([e['sum_reward'] for e in episodes])) if n else 0.0,
        'wall_s_per_episode': float(np.mean([e['wall_s'] for e in episodes])) if n else 0.0,
    }
    if episodes and 'transferred' in episodes[0]:
        k = sum(e['transferred'] for e in episodes)
        out.update(transfers=k, transfer_rate=k / n, transfer_95=wilson(k, n))
    for what in ('narrations', 'answers'):
        if episodes and what in episodes[0]:
            m = sum(e[what] for e in episodes)
            k = sum(e[f'{what}_right'] for e in episodes)
            out.update({what: m, f'{what}_right': k,
                        f'{what}_accuracy': k / m if m else 0.0,
                        f'{what}_95': wilson(k, m)})
    for what in ('unanswered', 'narrations_ended_early'):
        if episodes and what in episodes[0]:
            out[what] = sum(e[what] for e in episodes)
    figures = [e['node'] for e in episodes if e.get('node')]
    if figures:
        # The median episode's: one slow start-up does not stand for the run.
        out['node'] = {k: float(np.median([f[k] for f in figures if k in f]))
                       for k in NODE_FIGURES if any(k in f for f in figures)}
        out['node'].update({k: int(sum(f.get(k, 0) for f in figures))
                            for k in NODE_COUNTS if any(k in f for f in figures)})
    if episodes and 'sim_time_factor' in episodes[0]:
        # The simulator's achieved speed against real time, the median episode's.
        out['sim_time_factor'] = float(np.median([e['sim_time_factor'] for e in episodes]))
    return out


def episode_result(seed: int, rewards: list[float], wall: float, frames: int,
                   video: str | None, facts: dict | None = None) -> dict:
    """`facts`: transfer_cube's facts about the cube after the last step (SimStep's)."""
    r = [float(x) for x in rewards]
    out = {'seed': seed, 'steps': len(r), 'success': bool(r) and max(r) >= SUCCESS_REWARD,
           'max_reward': max(r) if r else 0.0, 'sum_reward': float(sum(r)), 'rewards': r,
           'wall_s': wall, 'sim_time_factor': len(r) * DT / wall if wall > 0 else 0.0,
           'frames': frames, 'video': video}
    if facts is not None:
        # gym-aloha's success (reward 4 once) also comes while the right gripper still
        # holds the cube: a transfer is the cube in the air, in the left gripper alone, at
        # the end, with the task's reward 4 there.
        out['final_facts'] = dict(facts)
        out['transferred'] = bool(r) and r[-1] >= SUCCESS_REWARD and transferred(facts)
    return out


def facts_at(steps: list[tuple[float, dict]], stamp: float) -> dict | None:
    """The scene's facts in the picture stamped `stamp`: those of the last step at or before
    it (the cameras render after a step, stamped with its time). `steps`: (stamp, facts),
    in time order."""
    return _scene(steps)(stamp)


def _scene(steps: list[tuple[float, dict]]):
    """facts_at over `steps`, their times read once for all the stamps judged."""
    times = np.array([t for t, _ in steps])

    def at(stamp: float) -> dict | None:
        i = int(np.searchsorted(times, stamp + 1e-6, side='right')) - 1
        return steps[i][1] if i >= 0 else None
    return at


def _judge(what: str, said: list[tuple], steps: list[tuple[float, dict]], verdict) -> dict:
    """Each (frame stamp, ...) in `said` that has a scene to be judged by: verdict(item,
    facts) -> (right, the record kept of it)."""
    at, right, judged = _scene(steps), 0, []
    for item in said:
        facts = at(item[0])
        if facts is not None:
            ok, record = verdict(item, facts)
            right += ok
            judged.append({'stamp': item[0], **record, 'right': ok})
    return {what: len(judged), f'{what}_right': right, f'{what}_judged': judged}


def judge_narrations(narrations: list[tuple],
                     steps: list[tuple[float, dict]]) -> dict:
    """Narrations (frame stamp, text[, why it ended]) against the phases the scene's facts at
    that frame agree with (demos.phases_for): right when the text is one of them. One that
    ended early (dropped for a newer request, cancelled, rejected: its text cut short) is
    counted apart, not judged: it says how the scheduler treated it, not what the model
    knows."""
    def verdict(item, facts):
        agrees = phases_for(facts)
        return item[1].strip().lower() in agrees, {'text': item[1], 'agrees': list(agrees)}
    whole = [x for x in narrations if len(x) < 3 or x[2] not in ENDED_EARLY]
    return {**_judge('narrations', whole, steps, verdict),
            'narrations_ended_early': len(narrations) - len(whole)}


def judge_answers(answers: list[tuple[float, str, str]],
                  steps: list[tuple[float, dict]]) -> dict:
    """~/ask answers (frame stamp, fact asked about, text) against the scene's fact at
    that frame: right when the text is ANSWERS[fact]."""
    def verdict(item, facts):
        _, key, text = item
        truth = ANSWERS[facts[key]]
        return text.strip().lower() == truth, {'question': QUESTIONS[key], 'text': text,
                                               'truth': truth}
    return _judge('answers', answers, steps, verdict)


def write_video(path: Path, frames: list[np.ndarray], fps: int = VIDEO_FPS) -> str | None:
    """mp4 (imageio-ffmpeg, a gym-aloha dependency); a gif where ffmpeg is missing."""
    if not frames:
        return None
    import imageio.v2 as imageio

    try:
        imageio.mimsave(str(path), frames, fps=fps, macro_block_size=1)
        return str(path)
    except Exception:  # no ffmpeg backend
        gif = path.with_suffix('.gif')
        imageio.mimsave(str(gif), frames, duration=1000 / fps)
        return str(gif)


def plot_rewards(path: Path, episodes: list[dict], title: str):
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for e in episodes:
        ax.plot(np.arange(1, e['steps'] + 1) * DT, e['rewards'], label=f'seed {e["seed"]}')
    ax.set_xlabel('simulated time (s)')
    ax.set_ylabel('reward (4 = success)')
    ax.set_ylim(-0.2, 4.2)
    ax.set_title(title)
    if len(episodes) <= 10:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# -- the direct path: engine + scene, no ROS ---------------------------------------------------

def policy(args, p: dict):
    """(profile, engine, {camera: image slot}) of the direct path and open loop: the engine
    alone on the checkpoint, the ALOHA profile as robot file `p` sets it."""
    from oxygen_ros.engine import Engine, EngineConfig
    from oxygen_ros.robot.profiles import make_profile

    profile = make_profile('aloha', **yaml.safe_load(p['profile_options']))
    engine = Engine(EngineConfig(model=args.model, checkpoint=args.checkpoint,
                                 tokenizer=args.tokenizer, device=args.device,
                                 threads=args.threads, denoise_steps=args.denoise_steps,
                                 compile=args.compile))
    return profile, engine, {c: s for c, _, s in cameras(engine.slots)}


def direct(args, task: str, out: Path) -> list[dict]:
    from oxygen_ros.engine import Observation
    from oxygen_ros.sim.aloha_sim import AlohaSim

    p = robot_params()
    profile, engine, slots = policy(args, p)
    play = args.play_steps or engine.n_action_steps or engine.action_horizon
    prompt = args.prompt or PROMPTS[task]
    # As the node refuses it: past max_token_len the tokenizer would cut off the state.
    n, room = engine.prompt_tokens(prompt, profile.state_dim), engine.model_cfg.max_token_len
    if n > room:
        raise RuntimeError(f'the prompt takes {n} tokens with the {profile.state_dim}-d state, '
                           f'over the model\'s max_token_len of {room}')
    sim = AlohaSim(task, args.width, args.height)
    guard = Guard(p['joint_limits'])
    observer = None
    episodes = []
    if args.record:
        Path(args.record).mkdir(parents=True, exist_ok=True)
    for i in range(args.episodes):
        seed = args.seed + i
        sim.reset(seed)
        if task == 'transfer_cube' and observer is None:
            observer = Observer(sim)
        rec = Recording(sim, observer, tuple(slots)) if args.record else None
        t0 = time.monotonic()
        rewards, frames = [], []
        guard.start(sim.state())
        plan = Plan(play, args.delay_steps)
        unstable = ''
        for k in range(args.steps):
            if rec is not None:
                rec.observe()
            if plan.due():
                state = sim.state()
                obs = Observation(stamp=sim.time,
                                  # a recorded step has rendered them already
                                  images={slots[c]: rec.images[c][-1] if rec else sim.render(c)
                                          for c in slots},
                                  state=np.asarray(profile.encode_state(state), np.float32),
                                  prompt=prompt)
                plan.got(profile.decode_actions(engine.step(obs).actions, state))
            a = plan.next()
            a = guard(guard.last if a is None else a)
            a[[6, 13]] = normalized_from_gripper(a[[6, 13]])  # servo angle -> gym's 0..1
            if rec is not None:
                rec.action.append(a.astype(np.float32))
            try:
                rewards.append(sim.step(a))
            except Unstable as e:  # the episode fails; the next one starts afresh
                unstable = str(e)
                break
            # Rendering is most of a direct episode's time: only for a video.
            if args.video and k % round(1 / (DT * VIDEO_FPS)) == 0:
                frames.append(sim.render('cam_high'))
        wall = time.monotonic() - t0
        video = write_video(out / f'direct_{task}_seed{seed}.mp4', frames) if args.video else None
        facts = observer.facts() if observer is not None else None
        episodes.append(episode_result(seed, rewards, wall, len(frames), video, facts))
        episodes[-1]['unstable'] = unstable
        if rec is not None and not unstable:
            rec.write(Path(args.record) / f'episode_{i}.hdf5', seed, rewards)
        note = f' ({unstable})' if unstable else ''
        print(f'oxygen-eval: direct episode {i + 1}/{args.episodes} seed {seed}: max reward '
              f'{max(rewards, default=0):g}, {wall:.1f} s{note}', flush=True)
    return episodes


class Recording:
    """A direct episode in oxygen-demos' layout (--record), so that oxygen-train can learn
    from the policy's own closed loop: the states it reaches, its failures included. Each
    step's observation is the state before its action; the narration target is
    demos.closed_loop_phase of that step, from the scene (not the script's clock alone)."""

    def __init__(self, sim, observer: Observer | None, cams: tuple[str, ...]):
        if observer is None:
            raise RuntimeError('--record: only transfer-cube has the facts its language needs')
        self.sim, self.observer, self.cams = sim, observer, cams
        self.pose = observer.pose()  # as the reset set it
        self.qpos, self.qvel, self.action = [], [], []
        self.images = {c: [] for c in cams}
        self.answers = {k: [] for k in QUESTIONS}

    def observe(self):
        q, v = observe(self.sim)
        self.qpos.append(q)
        self.qvel.append(v)
        for k, v in self.observer.answers().items():
            self.answers[k].append(v)
        for c in self.cams:
            self.images[c].append(self.sim.render(c))

    def write(self, path: Path, seed: int, rewards: list[float]):
        n = len(self.action)
        answers = {k: np.array(v[:n], bool) for k, v in self.answers.items()}
        phases = [closed_loop_phase(t, {k: bool(v[t]) for k, v in answers.items()})
                  for t in range(n)]
        success = max(rewards, default=0) >= SUCCESS_REWARD
        write(path, Episode(seed, self.pose, np.array(self.qpos[:n], np.float32),
                            np.array(self.qvel[:n], np.float32),
                            np.array(self.action, np.float32), rewards, answers,
                            {CAMERAS[c]: np.stack(v[:n]) for c, v in self.images.items()},
                            '' if success else f'max reward {max(rewards, default=0):g}',
                            source='policy', phases=phases))


def open_loop(args, out: Path) -> dict:
    """The policy's chunks against what the script did, on recorded episodes it was not
    trained on: at every `--open-loop-every`-th step of each episode in `--open-loop`, the
    chunk predicted from that step's top camera and joints (as the direct path observes the
    scene), decoded to the robot's targets, against the episode's recorded targets over the
    chunk's horizon. Per joint: the mean absolute error over the horizon, and at its first,
    middle and last action."""
    import h5py

    from oxygen_ros.engine import Observation
    from oxygen_ros.sim.train import robot_state, robot_targets

    profile, engine, slots = policy(args, robot_params())
    # The seeds the checkpoint was trained on (oxygen-train records them): file names repeat
    # from one oxygen-demos run to the next, seeds do not.
    trained = set()
    meta = Path(args.checkpoint) / 'config.json' if args.checkpoint else None
    if meta is not None and meta.is_file():
        trained = set(json.loads(meta.read_text()).get('training', {}).get('seeds', []))
    files = []
    for path in sorted(Path(args.open_loop).glob('episode_*.hdf5')):
        with h5py.File(path, 'r') as f:
            if int(f.attrs['seed']) not in trained:
                files.append(path)
    if not files:
        raise RuntimeError(f'no episode in {args.open_loop} that the policy was not trained on')
    files = files[:args.episodes]
    horizon = engine.action_horizon
    errors, names = [], []
    for path in files:
        with h5py.File(path, 'r') as f:
            prompt = args.prompt or str(f.attrs['prompt'])
            state = robot_state(f['observations/qpos'][()])
            targets = robot_targets(f['action'][()])
            images = {c: f[f'observations/images/{CAMERAS[c]}'] for c in slots}
            for t in range(0, len(targets) - horizon + 1, args.open_loop_every):
                obs = Observation(stamp=t * DT, images={slots[c]: images[c][t] for c in slots},
                                  state=np.asarray(profile.encode_state(state[t]), np.float32),
                                  prompt=prompt)
                got = profile.decode_actions(engine.step(obs).actions, state[t])
                errors.append(np.abs(got[:horizon] - targets[t:t + horizon]))
                names.append(f'{path.name}@{t}')
    e = np.stack(errors)  # [chunks, horizon, 14]
    joints = [f'{side}/{j}' for side in ('left', 'right') for j in (*ARM_JOINTS, 'gripper')]
    per = {j: {'mean': float(e[:, :, i].mean()), 'first': float(e[:, 0, i].mean()),
               'middle': float(e[:, horizon // 2, i].mean()), 'last': float(e[:, -1, i].mean())}
           for i, j in enumerate(joints)}
    report = {'checkpoint': args.checkpoint or None, 'episodes': [f.name for f in files],
              'chunks': len(names), 'every': args.open_loop_every, 'horizon': horizon,
              'units': 'rad (arm joints and gripper servo)', 'per_joint': per,
              'mean': float(e.mean())}
    (out / 'open_loop_report.json').write_text(json.dumps(report, indent=1))
    print(f'oxygen-eval: open loop on {len(files)} held-out episodes, {len(names)} chunks: '
          f'mean |error| {report["mean"]:.4f} rad')
    for j, v in per.items():
        print(f'  {j:22s} mean {v["mean"]:.4f}  first {v["first"]:.4f}  middle '
              f'{v["middle"]:.4f}  last {v["last"]:.4f}')
    return report


class Plan:
    """Which action the direct path plays at each step. With no delay, ``play`` actions of a
    chunk, then the next chunk from its first action (the scene waits for the model). With
    ``delay`` steps, the ROS path's timing: the chunk observed when ``play`` actions of the
    current one are out arrives ``delay`` steps later, the current one plays on meanwhile,
    and the new one starts at its action ``delay`` (the earlier ones are past), as the node
    plays a chunk from its observation's stamp. Before the first chunk, and past a chunk's
    end, the robot holds (None)."""

    def __init__(self, play: int, delay: int = 0):
        if delay < 0 or (delay and delay >= play):
            raise ValueError(f'--delay-steps must be in [0, {play}) for {play} actions a '
                             f'chunk, got {delay}')
        self.play, self.delay = play, delay
        self.chunk, self.i = None, 0  # the chunk playing, and its next action
        self.pending, self.wait = None, 0  # the chunk being computed, steps until it is out
        self.asked = False

    def due(self) -> bool:
        """Whether to observe now."""
        if self.pending is not None or self.asked:
            return False
        return self.chunk is None or self.i >= self.play

    def got(self, chunk: np.ndarray):
        self.asked = True
        if self.delay:
            self.pending, self.wait = chunk, self.delay
        else:
            self.chunk, self.i, self.asked = chunk, 0, False

    def next(self) -> np.ndarray | None:
        if self.pending is not None:
            if self.wait == 0:
                self.chunk, self.i, self.asked = self.pending, self.delay, False
                self.pending = None
            self.wait -= 1
        if self.chunk is None or self.i >= len(self.chunk):
            return None
        self.i += 1
        return np.array(self.chunk[self.i - 1], float)


class Guard:
    """What the node does to every chunk, in short, for the direct path: each arm target
    clamped into aloha.yaml's joint range and moving no faster than its speed limit (the
    node's limits also shape the motion between points; JTC then follows a cubic)."""

    def __init__(self, limits: dict):
        lo, hi, vel = np.full(14, -np.inf), np.full(14, np.inf), np.full(14, np.inf)
        for base, side in ((0, 'left'), (7, 'right')):
            for i, j in enumerate(ARM_JOINTS):
                lim = limits[f'{side}_arm'][j]
                lo[base + i], hi[base + i] = lim.get('lower', -np.inf), lim.get('upper', np.inf)
                vel[base + i] = lim.get('velocity', np.inf)
            vel[base + 6] = limits[f'{side}_gripper']['gripper'].get('velocity', np.inf)
        self.lo, self.hi, self.step = lo, hi, vel * DT

    def start(self, state: np.ndarray):
        self.last = np.array(state, float)
        self.last[[6, 13]] = gripper_from_finger(self.last[[6, 13]])

    def __call__(self, target: np.ndarray) -> np.ndarray:
        t = np.where(np.isfinite(target), target, self.last)  # a NaN target: stay
        t = np.clip(t, self.lo, self.hi)
        t = self.last + np.clip(t - self.last, -self.step, self.step)
        self.last = t
        return t.copy()


# -- the ROS path: oxygen_node + oxygen_mujoco_aloha -------------------------------------------

def ros_env(domain: str | None) -> dict:
    env = dict(os.environ)
    env.setdefault('OMP_NUM_THREADS', '1')
    env.setdefault('MUJOCO_GL', 'egl')
    env.setdefault('FASTRTPS_DEFAULT_PROFILES_FILE', str(config_dir() / 'fastdds.xml'))
    env.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    if domain is not None:
        env['ROS_DOMAIN_ID'] = domain
    return env


def start_rig(out: Path, domain: str | None, name: str, overlay: dict,
              node_files: tuple = ()) -> Processes:
    """The MuJoCo ALOHA and oxygen_node as processes on pi05.yaml, aloha.yaml and
    aloha_mujoco.yaml, then `overlay` (written to out/name), then, for the node alone,
    `node_files`; this process joins their domain and DDS profile, to listen to them."""
    cfg = config_dir()
    (out / name).write_text(yaml.safe_dump(overlay))
    files = [cfg / 'pi05.yaml', cfg / 'aloha.yaml', cfg / 'aloha_mujoco.yaml', out / name]
    params = [a for f in files for a in ('--params-file', str(f))]
    ours = [a for f in node_files for a in ('--params-file', str(Path(f).resolve()))]
    env = ros_env(domain)
    os.environ.update({k: env[k] for k in ('ROS_DOMAIN_ID', 'ROS_AUTOMATIC_DISCOVERY_RANGE',
                                           'FASTRTPS_DEFAULT_PROFILES_FILE') if k in env})
    procs = Processes(out, env)
    procs.start('robot', 'oxygen_ros.sim.mujoco_aloha', *params)
    procs.start('node', 'oxygen_ros.ros.node', *params, *ours)
    return procs


class Processes:
    """The robot and the node as child processes, logs in `out`; stopped with SIGINT."""

    def __init__(self, out: Path, env: dict):
        self.out, self.env, self.procs = out, env, {}

    def start(self, name: str, module: str, *ros_args: str):
        log = open(self.out / f'{name}.log', 'w')
        # cwd: `python -m` puts it first on the path, and from a source checkout's root the
        # sources (without the generated oxygen_ros.msg) would shadow the installed package.
        self.procs[name] = (subprocess.Popen(
            [sys.executable, '-m', module, '--ros-args', *ros_args],
            stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.out), log)

    def dead(self) -> list[str]:
        return [n for n, (p, _) in self.procs.items() if p.poll() is not None]

    def log(self, name: str) -> str:
        return (self.out / f'{name}.log').read_text()

    def stop(self):
        for p, _ in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p, log in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            log.close()


def ros(args, task: str, out: Path) -> list[dict]:
    import rclpy
    from diagnostic_msgs.msg import DiagnosticArray
    from lifecycle_msgs.msg import Transition
    from lifecycle_msgs.srv import ChangeState
    from rclpy.action import ActionClient
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import Image

    from oxygen_ros.action import Ask
    from oxygen_ros.msg import Narration, SimStep
    from oxygen_ros.sim.mujoco_aloha import FACTS
    from oxygen_ros.srv import SimReset

    cams = cameras(model_slots(args))
    node_params = {'model': args.model, 'checkpoint': args.checkpoint,
                   'cameras': [c for c, _, _ in cams],
                   'camera_topics': [t for _, t, _ in cams],
                   'camera_slots': [s for _, _, s in cams],
                   'tokenizer': args.tokenizer, 'device': args.device,
                   'threads': args.threads, 'denoise_steps': args.denoise_steps,
                   'compile': args.compile, 'allow_random_weights': not args.checkpoint,
                   'autostart': False,
                   'prompt': args.prompt or PROMPTS[task], 'play_steps': args.play_steps,
                   'replan_after': args.replan_after, 'mode': args.mode,
                   'narration_every_n_frames': args.narrate}
    procs = start_rig(out, args.domain, 'eval_params.yaml', {
        'oxygen_node': {'ros__parameters': node_params},
        'oxygen_mujoco_aloha': {'ros__parameters': {
            'task': task, 'seed': args.seed, 'real_time_factor': args.real_time_factor,
            'image_width': args.width, 'image_height': args.height}}},
        node_files=args.params_file)

    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node('oxygen_eval', context=context)
    lock = threading.Lock()
    steps: list = []
    frames: list = []
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    reliable = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
    narrations: list = []  # (frame stamp, text, why it ended) of each ended narration
    diagnostics: dict = {}  # the node's latest /diagnostics values
    counted: dict = {}  # its NODE_COUNTS at the end of the last episode
    asker = Asker(round(args.ask_every / DT) if args.ask_every > 0 else 0)
    ask = ActionClient(node, Ask, '/oxygen_node/ask')

    def on_answer(key, future):
        r = future.result().result
        with lock:
            if r.reason in (Ask.Result.DONE, Ask.Result.BUDGET):
                asker.answered(seconds(r.stamp), key, r.text)
                if args.show_language:
                    print(f'  ~/ask at {seconds(r.stamp):7.2f} s: {QUESTIONS[key]} '
                          f'{r.text.strip()}', flush=True)
            else:
                asker.unanswered()

    def on_goal(key, future):
        handle = future.result()
        if not handle.accepted:
            with lock:
                asker.unanswered()
            return
        handle.get_result_async().add_done_callback(lambda f: on_answer(key, f))

    def on_step(m):
        with lock:
            steps.append(m)
            key = asker.due(m.episode, m.step, m.done) if ask.server_is_ready() else None
        if key is not None:
            ask.send_goal_async(Ask.Goal(question=QUESTIONS[key])).add_done_callback(
                lambda f: on_goal(key, f))

    shown = ['']  # the narration printed last: a narration every frame mostly repeats it

    def on_narration(m):
        if m.done:
            _add(lock, narrations, (seconds(m.header.stamp), m.text, m.reason))
            if (args.show_language and m.reason not in ENDED_EARLY
                    and m.text.strip() != shown[0]):
                shown[0] = m.text.strip()
                print(f'  narration at {seconds(m.header.stamp):7.2f} s: {shown[0]}',
                      flush=True)

    def on_diagnostics(m):
        for st in m.status:
            if st.name.startswith('oxygen_node'):
                with lock:
                    diagnostics.clear()
                    diagnostics.update({kv.key: kv.value for kv in st.values})

    node.create_subscription(SimStep, '/oxygen_mujoco_aloha/step', on_step, reliable)
    node.create_subscription(Narration, '/oxygen_node/narration', on_narration, reliable)
    node.create_subscription(DiagnosticArray, '/diagnostics', on_diagnostics, 10)
    if args.video:  # cam_high's pictures, only for the video: each is ~1 MB to take and keep
        cam_topic = robot_params()['camera_topics'][0]
        node.create_subscription(Image, cam_topic, lambda m: _add(lock, frames, m),
                                 qos_profile_sensor_data)
    change = node.create_client(ChangeState, '/oxygen_node/change_state')
    reset = node.create_client(SimReset, '/oxygen_mujoco_aloha/reset')
    ex = SingleThreadedExecutor(context=context)
    ex.add_node(node)
    threading.Thread(target=ex.spin, daemon=True).start()

    def call(client, req, timeout):
        if not client.wait_for_service(timeout_sec=timeout):
            raise RuntimeError(f'{client.srv_name} did not appear ({procs.dead() or "alive"})')
        fut = client.call_async(req)
        t = time.monotonic() + timeout
        while not fut.done():
            if time.monotonic() > t or procs.dead():
                raise RuntimeError(f'{client.srv_name}: no answer ({procs.dead() or "alive"})')
            time.sleep(0.01)
        return fut.result()

    def transition(label, timeout=args.startup_timeout):
        req = ChangeState.Request()
        req.transition = Transition(label=label)
        if not call(change, req, timeout).success:
            raise RuntimeError(f'oxygen_node refused {label}:\n{procs.log("node")[-3000:]}')

    episodes = []
    try:
        transition('configure')
        for i in range(args.episodes):
            seed = args.seed + i
            r = call(reset, SimReset.Request(seed=seed, steps=args.steps), 30.0)
            if not r.success:
                raise RuntimeError(f'reset failed: {r.message}')
            since = seconds(r.stamp)
            t0 = time.monotonic()
            with lock:
                asker.start(r.episode)
            transition('activate')
            limit = t0 + args.steps * DT / 0.02 + 120  # a 50x slower than real time floor
            while True:
                with lock:
                    done = any(m.episode == r.episode and m.done for m in steps)
                if done:
                    break
                if procs.dead() or time.monotonic() > limit:
                    raise RuntimeError(f'episode {i + 1} did not finish '
                                       f'({procs.dead() or "timeout"}):\n'
                                       f'{procs.log("robot")[-2000:]}')
                time.sleep(0.02)
            wall = time.monotonic() - t0
            with lock:
                told, unanswered = asker.end()
                diag = dict(diagnostics)
            transition('deactivate')
            time.sleep(0.2)  # the hold trajectory arrives before the next reset
            with lock:
                ours = sorted((m for m in steps if m.episode == r.episode), key=lambda m: m.step)
                end = seconds(ours[-1].header.stamp)
                shots = [m for m in frames if since <= seconds(m.header.stamp) <= end]
                steps[:] = [m for m in steps if m.episode != r.episode]
                frames.clear()
                said = [x for x in narrations if since <= x[0] <= end]
                told = [x for x in told if since <= x[0] <= end]
                narrations.clear()
            rewards = [m.reward for m in ours]
            if len(rewards) != args.steps:
                raise RuntimeError(f'episode {i + 1}: {len(rewards)} step messages of '
                                   f'{args.steps}')
            pics = [np.frombuffer(bytes(m.data), np.uint8).reshape(m.height, m.width, 3)
                    for m in shots]
            video = (write_video(out / f'ros_{task}_seed{seed}.mp4', pics)
                     if args.video else None)
            facts = ({k: bool(getattr(ours[-1], k)) for k in FACTS}
                     if task == 'transfer_cube' else None)
            episodes.append(episode_result(seed, rewards, wall, len(pics), video, facts))
            if task == 'transfer_cube':
                scene = [(seconds(m.header.stamp), {k: bool(getattr(m, k)) for k in FACTS})
                         for m in ours]
                episodes[-1].update(judge_narrations(said, scene))
                episodes[-1].update(judge_answers(told, scene), unanswered=unanswered)
            # The node's own figures over the episode's last chunks (its clock: simulated),
            # and its control ticks missed or spent holding during the episode.
            episodes[-1]['node'] = {k: float(diag[k]) for k in NODE_FIGURES if k in diag}
            for k in NODE_COUNTS:
                if k in diag:
                    n = int(float(diag[k]))
                    episodes[-1]['node'][k] = n - counted.get(k, 0)
                    counted[k] = n
            fig = episodes[-1]['node']
            rates = (f'; chunks {fig["action_latency_ms_p50"]:.0f} ms after their frame (p50), '
                     f'frames {fig["frame_ms_p50"]:.0f} ms (p50)'
                     if {'action_latency_ms_p50', 'frame_ms_p50'} <= fig.keys() else '')
            print(f'oxygen-eval: ROS episode {i + 1}/{args.episodes} seed {seed}: max reward '
                  f'{max(rewards):g}, {wall:.1f} s'
                  + (f', {len(pics)} pictures' if args.video else '') + rates, flush=True)
    finally:
        ask.destroy()
        ex.shutdown(timeout_sec=1.0)
        node.destroy_node()
        rclpy.try_shutdown(context=context)
        procs.stop()
    return episodes


def _add(lock, items, m):
    with lock:
        items.append(m)


class Asker:
    """When the ROS path asks ~/ask about the cube: one question at a time, at every
    `every`-th step of the episode being run, the facts' questions in turn; a question
    without an answer for a second of simulated time, refused or ended otherwise counts as
    unanswered. Not thread-safe: the caller holds its lock."""

    def __init__(self, every: int):
        self.every, self.asked = every, 0
        self.episode = self.open = None  # the episode run; the step the question out went at
        self.answers: list = []  # (frame stamp, fact asked about, text)
        self.missed = 0

    def start(self, episode: int):
        self.episode, self.open, self.answers, self.missed = episode, None, [], 0

    def due(self, episode: int, step: int, done: bool) -> str | None:
        """The fact to ask about at this step, if a question is due."""
        if self.open is not None and step - self.open > round(1.0 / DT):
            self.unanswered()
        if (not self.every or step % self.every or done or self.open is not None
                or episode != self.episode):
            return None
        self.open = step
        self.asked += 1
        return sorted(QUESTIONS)[(self.asked - 1) % len(QUESTIONS)]

    def answered(self, stamp: float, key: str, text: str):
        self.open = None
        self.answers.append((stamp, key, text))

    def unanswered(self):
        self.open = None
        self.missed += 1

    def end(self) -> tuple[list, int]:
        """(answers, unanswered) of the episode; no more questions until the next start."""
        out = (self.answers, self.missed)
        self.start(None)
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--env', choices=sorted(ENVS), default='aloha-insertion')
    ap.add_argument('--episodes', type=int, default=10)
    ap.add_argument('--seed', type=int, default=0, help='episode i has seed SEED + i')
    ap.add_argument('--steps', type=int, default=400, help='steps of 0.02 s per episode '
                    "(LeRobot's episode_length for gym-aloha)")
    ap.add_argument('--direct', action='store_true', help='engine + scene without ROS')
    ap.add_argument('--model', default=None, help="tiny, small, pi05 or a YAML path; default: "
                    "small without a checkpoint, else the checkpoint's own dims")
    ap.add_argument('--checkpoint', default='', help="LeRobot/openpi pi05 directory; '' = "
                    'random weights')
    ap.add_argument('--tokenizer', default='', help="the checkpoint's SentencePiece tokenizer "
                    "(pi0.5: paligemma_tokenizer.model); '' = the one in its directory")
    ap.add_argument('--device', default='cpu')
    ap.add_argument('--threads', type=int, default=1)
    ap.add_argument('--denoise-steps', type=int, default=10)
    ap.add_argument('--no-compile', dest='compile', action='store_false',
                    help='run the model eagerly, direct and in the node (skips the one-off '
                         'compile of a new model\'s programs: tens of seconds each)')
    ap.add_argument('--play-steps', type=int, default=0, help='actions played per chunk; '
                    "0 = the checkpoint's n_action_steps (direct) / the node's default")
    ap.add_argument('--delay-steps', type=int, default=0, metavar='D',
                    help='direct path: each chunk arrives D steps after its observation (the '
                    "ROS path's chunk age in steps), the previous one playing meanwhile; 0 = "
                    'the scene waits for the model')
    ap.add_argument('--replan-after', type=int, default=0, metavar='N',
                    help="ROS path: the node's replan_after, the next frame once N actions of "
                    'the chunk are out (the direct path plays --play-steps, then re-plans); '
                    '0 = a frame whenever new inputs come')
    ap.add_argument('--prompt', default='', help="'' = LeRobot's task description")
    ap.add_argument('--mode', default='oxygen', choices=MODES,
                    help="ROS path: the node's scheduling of language beside actions")
    ap.add_argument('--narrate', type=int, default=0, metavar='N',
                    help="ROS path: a narration every N frames (the node's "
                         'narration_every_n_frames); 0 = none')
    ap.add_argument('--ask-every', type=float, default=0.0, metavar='S',
                    help='ROS path, transfer-cube: a ~/ask question about the cube every S '
                         'simulated seconds, judged against the scene; 0 = none')
    ap.add_argument('--width', type=int, default=640)
    ap.add_argument('--height', type=int, default=480)
    ap.add_argument('--real-time-factor', type=float, default=1.0,
                    help='ROS path: simulated s per wall s at most; 0 = unpaced')
    ap.add_argument('--show-language', action='store_true',
                    help='ROS path: print each answer, and each narration that says something '
                         'new, as it ends')
    ap.add_argument('--params-file', action='append', default=[], metavar='YAML',
                    help='ROS path: a parameters file for the node alone, after the robot '
                         "files (a robot file's change, say); may be repeated")
    ap.add_argument('--domain', default=None, help='ROS_DOMAIN_ID for the ROS path')
    ap.add_argument('--startup-timeout', type=float, default=600.0,
                    help='ROS path: seconds to wait for each lifecycle transition of the node '
                         '(a dead node is seen at once); configure compiles the model on a '
                         'cold cache, which took 3 minutes on a 2-core machine')
    ap.add_argument('--no-video', dest='video', action='store_false')
    ap.add_argument('--record', default='', metavar='DIR',
                    help="direct path, transfer-cube: each episode into DIR in oxygen-demos' "
                         'layout (source: policy), its narration targets from the scene, for '
                         "oxygen-train's language stage")
    ap.add_argument('--open-loop', default='', metavar='DIR',
                    help="instead of closed loop: the policy's chunks against the recorded "
                         "targets of DIR's episodes (oxygen-demos') it was not trained on, "
                         'at most --episodes of them')
    ap.add_argument('--open-loop-every', type=int, default=25, metavar='K',
                    help='open loop: a chunk at every K-th step')
    ap.add_argument('--out', default='', help='report directory (default: a new temp dir)')
    args = ap.parse_args(argv)
    if args.episodes < 1 or args.steps < 1:
        ap.error('--episodes and --steps must be >= 1')
    if args.record and not args.direct:
        ap.error('--record records the direct path: give --direct')
    if args.record and args.env != 'aloha-transfer-cube':
        ap.error('--record: only aloha-transfer-cube has the facts its language needs')
    if args.model is None:
        args.model = '' if args.checkpoint else 'small'
    # The node runs in the report directory (see Processes.start): paths given from here
    # must not depend on this working directory.
    for key in ('checkpoint', 'tokenizer', 'model', 'record'):
        value = getattr(args, key)
        if value and (key != 'model' or Path(value).suffix in ('.yaml', '.yml')
                      or Path(value).is_file()):
            setattr(args, key, str(Path(value).resolve()))
    task = ENVS[args.env]
    out = Path(args.out or tempfile.mkdtemp(prefix='oxygen-eval-')).resolve()
    out.mkdir(parents=True, exist_ok=True)
    from oxygen_ros.sim.aloha_sim import egl, require

    if args.open_loop:
        if args.open_loop_every < 1:
            ap.error('--open-loop-every must be >= 1')
        try:
            open_loop(args, out)
        except RuntimeError as e:
            print(f'oxygen-eval: {e}', file=sys.stderr)
            return 1
        return 0
    require()
    egl()
    mode = 'direct' if args.direct else 'ros'
    t0 = time.monotonic()
    try:
        episodes = (direct if args.direct else ros)(args, task, out)
    except RuntimeError as e:
        print(f'oxygen-eval: {e}', file=sys.stderr)
        return 1
    report = {'env': args.env, 'task': task, 'mode': mode, 'model': args.model,
              'checkpoint': args.checkpoint or None, 'seed': args.seed, 'steps': args.steps,
              **summary(episodes), 'wall_s': time.monotonic() - t0, 'per_episode': episodes}
    plot_rewards(out / f'{mode}_rewards.png', episodes, f'{args.env} ({mode})')
    report['reward_plot'] = str(out / f'{mode}_rewards.png')
    path = out / f'{mode}_report.json'
    path.write_text(json.dumps(report, indent=1))
    moved = (f', transferred {report["transfers"]}/{len(episodes)}' if 'transfers' in report
             else '')
    print(f'oxygen-eval: {args.env} ({mode}): success {report["successes"]}/{len(episodes)} '
          f'({100 * report["success_rate"]:.0f} %){moved}, lift {report["lifts"]}/'
          f'{len(episodes)}, avg max reward {report["avg_max_reward"]:.2f}'
          f', {report["wall_s_per_episode"]:.1f} s per episode; report {path}')
    node = report.get('node', {})
    if node:
        print('oxygen-eval: the node (median episode): ' + ', '.join(
            f'{k} {v:.0f}' for k, v in node.items() if k in NODE_FIGURES)
            + ''.join(f'; {k} {node[k]} in all' for k in NODE_COUNTS if k in node)
            + (f'; simulator at {report["sim_time_factor"]:.2f} x real time'
               if 'sim_time_factor' in report else ''), flush=True)
    for what, asked in (('narrations', args.narrate), ('answers', args.ask_every)):
        if what in report and asked:
            print(f'oxygen-eval: {what} right {report[what + "_right"]}/{report[what]}'
                  + (f', {report["unanswered"]} questions unanswered' if what == 'answers'
                     else f', {report["narrations_ended_early"]} more ended early (not judged)'),
                  flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
