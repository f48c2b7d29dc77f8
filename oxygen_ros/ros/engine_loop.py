"""The node's engine thread: frames until it is stopped.

Each pass asks the planner which robots a frame takes (one robot: every frame as soon as
its images are complete; several: engine/fleet.Planner), takes each one's newest
observation, and runs the frame in its two halves: the chunks (engine.actions) go to the
robots' players at once, then the language (engine.language) runs and its events go to
~/ask goals and the narration topics. A robot that is stale, whose inputs are bad or whose
frame fails holds; the others go on. What a pass does not handle itself is the node's own
code failing: every robot holds and the node leaves commanding (node.fail).
"""

from __future__ import annotations

import functools
import threading
import traceback

from oxygen_ros.robot.inputs import problem_key
from oxygen_ros.robot.params import StartError

# After a fault outside a frame, the engine thread looks again only this much later (s), so
# a fault that repeats cannot spin a core.
FAULT_WAIT_S = 0.05


class EngineLoop:
    def __init__(self, node):
        self.node = node

    def start(self, stop: threading.Event) -> threading.Thread:
        t = threading.Thread(target=self.run, args=(stop,), name='engine', daemon=True)
        t.start()
        return t

    def stopping(self, stop: threading.Event) -> bool:
        return stop.is_set() or not self.node.context.ok()

    def run(self, stop: threading.Event):
        """Frames until ``stop``. What a pass does not handle itself (a robot's frame, its
        inputs, its outputs) is the node's own code failing: every robot holds and the
        node leaves commanding (fail)."""
        try:
            planner = self.planner()
            while not stop.is_set():
                wait = self.one(stop, planner)
                if wait:
                    stop.wait(wait)
        except Exception as e:
            if not self.stopping(stop):
                self.node.fail(f'engine thread failed: {type(e).__name__}: {e}',
                               traceback.format_exc())

    def planner(self):
        """Which robots a frame takes. One robot: every frame as soon as its images are
        complete (EveryFrame). Several: the Planner, which starts a frame when a robot's
        chunk is due and batches the robots that come due before it ends."""
        from oxygen_ros.engine.fleet import EveryFrame, Planner

        e = self.node.engine
        age = max(link.cfg.p.max_input_age for link in self.node.links)
        if len(self.node.links) == 1:
            return EveryFrame(age)
        # Due with half a chunk to spare, as the engine's frame budget leaves half a chunk
        # for the next frame's latency: the estimate is of the model's part of a frame only,
        # and this machine's load and the image conversion come on top.
        spare = 0.5 * min(link.cfg.action_period for link in self.node.links) * e.action_horizon
        return Planner(e.chunk_seconds, age, max_robots=len(self.node.links), margin=spare)

    def one(self, stop, planner) -> float:
        """One frame: the planner says which robots are due, each of those brings its
        newest observation, and one frame serves them all (one robot is a fleet of
        one). A robot that is stale, whose inputs are bad or whose frame fails holds; the
        others go on."""
        from oxygen_ros.engine import RobotInput

        e = self.node.engine
        by = self.node.by_name
        times, faulted = {}, False
        for link in self.node.links:
            try:
                times[link.name] = link.times()
            except Exception as err:
                faulted = True
                link.fault(f'taking its inputs failed: {type(err).__name__}: {err}',
                           traceback.format_exc())
        # Read after every robot's images were taken (which takes a while): an input that
        # came meanwhile must not look stamped ahead of the clock.
        now = self.node._now()
        plan = planner.plan(now, times)
        ready = {}
        for link in self.node.links:
            try:
                if link.name not in plan.take:
                    link.check(now)  # stale or missing inputs hold it
                    continue
                r, _ = link.poll(e.slots)
            except Exception as err:
                faulted = True
                link.fault(f'taking its inputs failed: {type(err).__name__}: {err}',
                           traceback.format_exc())
                continue
            if r is not None:
                ready[link.name] = r
        if not ready:
            # Nothing due: the plan's wait. Due robots whose images were not ready (poll
            # checks staleness at its own pace): look again soon.
            wait = planner.look if plan.take else plan.wait
            return max(wait, FAULT_WAIT_S) if faulted else wait
        inputs = {n: RobotInput(r.obs, narrate=r.narrate,
                                max_new_tokens=self.node.cfg.p.max_new_tokens,
                                handover=r.handover)
                  for n, r in ready.items()}
        try:
            frame = e.actions(inputs)
        except Exception as err:  # one bad frame must not end the node
            if not self.stopping(stop):
                for n in ready:
                    by[n].failed(str(err))
            return 0.0
        # The chunks go out between the frame's two halves, before its language runs.
        for n, chunk in frame.chunks.items():
            r = ready[n]
            try:
                by[n].on_actions(r.stamp, r.state, chunk)
            except Exception as err:
                if not self.stopping(stop):
                    by[n].fault(f'sending its chunk failed: {type(err).__name__}: {err}',
                                traceback.format_exc())
        try:
            result = e.language(frame)
        except Exception as err:
            if not self.stopping(stop):
                for n in ready:
                    by[n].failed(str(err))
            return 0.0
        for n, why in result.errors.items():
            by[n].failed(why)
        for n in ready:
            res = result.results.get(n)
            if res is not None:
                self.finished(stop, by[n], ready[n], res)
        # Events of robots not in this frame too: their requests decode in every frame.
        for n, events in result.events.items():
            if n in by:
                self.deliver(stop, by[n], events)
        return 0.0

    def finished(self, stop, link, ready, result):
        """A robot's frame ended: count it. A failure here is the node's own, and holds that
        robot."""
        try:
            link.finished(ready, result)
        except Exception as e:
            if not self.stopping(stop):
                link.fault(f'ending its frame failed: {type(e).__name__}: {e}',
                           traceback.format_exc())

    def deliver(self, stop, link, events):
        """A frame's events of one robot: question events to their goals, narration out."""
        try:
            unowned = link.asks.deliver(events)
        except Exception as e:
            if not self.stopping(stop):
                link.fault(f'delivering answers failed: {type(e).__name__}: {e}',
                           traceback.format_exc())
            return
        if unowned:
            link.reporter.report('ask:unowned', 'question events of requests '
                                 f'{sorted({ev.request_id for ev in unowned})} that no goal '
                                 'holds: not delivered')
        try:
            link.publish_events(events)
        except Exception as e:  # publishing fails once ROS is shutting down
            if not self.stopping(stop):
                link.reporter.report(problem_key('publish', str(e)),
                                     f'narration not sent: {e}')


def start_engine(cfg, links, fleet: bool, log=None):
    """The engine for the node's settings (``cfg``) and robots (each link's Config is checked
    against it and learns its tokenizer); StartError saying what is wrong. ``log`` (the
    node's logger) hears what takes long (compiling the model the first time)."""
    from oxygen_ros.engine import Engine, EngineConfig
    from oxygen_ros.model.tokenizer import prompt_tokens

    settings = cfg.engine_settings()
    if fleet:
        settings['robots'] = len(links)
        # The frame budget of the robot whose chunks are shortest.
        settings['control_rate_hz'] = max(2.0 / link.cfg.action_period for link in links)
    try:
        e = Engine(EngineConfig.from_dict(settings), log=log)
    except (ValueError, OSError) as err:
        raise StartError(f'cannot start the engine: {err}') from None
    except Exception as err:  # e.g. a corrupt safetensors file raises its own error type
        raise StartError(f'cannot start the engine: {type(err).__name__}: {err}') from None
    for link in links:
        link.cfg.sized_tokens = e.cfg.max_new_tokens
        # The engine's tokenizer and format, not the engine: cleanup frees the model.
        link.cfg.prompt_tokens = functools.partial(
            prompt_tokens, e.tokenizer, state_dim=link.cfg.profile.state_dim,
            prompt_format=e.cfg.prompt_format)
        link.cfg.max_token_len = e.model_cfg.max_token_len
        try:
            link.cfg.check_engine(e.slots, e.action_dim, e.state_dim,
                                  e.conventions == 'lerobot')
            why = link.cfg.check_prompt(link.cfg.p.prompt)
            if why:
                raise StartError(f'parameter prompt: {why}')
        except StartError as err:
            if not fleet:
                raise
            raise StartError(f'robot {link.name}: {err}') from None
        if fleet:
            e.add_robot(link.name)
    return e


def describe_weights(cfg, e) -> str:
    """What the engine runs, for the start-up log."""
    runs = f'run {e.backend}'
    if e.backend == 'eager' and e.cfg.compile and e.device.type == 'cpu':
        runs += f' (compile is for float32 models; this one is {e.model.dtype})'
    if cfg.random_weights:
        return (f'model {cfg.p.model or "small"} with RANDOM weights (seed '
                f'{cfg.p.seed}, no checkpoint): not a trained policy; {runs}')
    w = e.weights
    text = (f'{w["layout"]} checkpoint {cfg.p.checkpoint} ({e.conventions} conventions, '
            f'normalisation {w["normalization"] or "off"}; tokenizer {e.tokenizer.source}, '
            f'{e.tokenizer_from}); {runs}')
    if e.cfg.rtc and e.rtc_unguided:
        text += (f'; real-time chunking leaves action dims {list(e.rtc_unguided)} unguided '
                 f'(constant in the checkpoint\'s stats)')
    return text
