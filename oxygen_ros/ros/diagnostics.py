"""/diagnostics: one DiagnosticStatus per robot, with the engine's figures and the robot's."""

from __future__ import annotations

import traceback

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

from oxygen_ros.robot.stats import counts, shadow_summary, status


class Diagnostics:
    """``node``: the OxygenNode (its engine, robot links and fault)."""

    def __init__(self, node):
        self.node = node
        self.pub = node.create_publisher(DiagnosticArray, '/diagnostics', 10)

    def summary(self, link=None) -> dict:
        """Everything /diagnostics reports (for one robot of a fleet), as plain numbers."""
        link = link or self.node.links[0]
        s = dict(self.node.engine.stats())
        if self.node.fleet:
            s.update(self.node.engine.robot_stats(link.name))
        s.update(robot_summary(link, self.node.engine.action_horizon))
        s.update(link.asks.stats())
        s.update(counts(link.reporter, link.errors))
        return s

    def publish(self):
        try:
            arr = DiagnosticArray()
            arr.header.stamp = self.node.get_clock().now().to_msg()
            arr.status = [self.status(link) for link in self.node.links]
        except Exception as e:  # an executor callback must not end the executor
            for link in self.node.links:
                link.fault(f'diagnostics failed: {type(e).__name__}: {e}',
                           traceback.format_exc())
            return
        try:
            self.pub.publish(arr)
        except Exception:  # shutting down
            pass

    def status(self, link):
        s = self.summary(link)
        st = DiagnosticStatus()
        st.name = f'{self.node.get_name()}: ' + (link.name if self.node.fleet else 'inference')
        st.hardware_id = self.node.cfg.p.device
        with link.lock:
            active = link.active
        level, st.message = status(s, active=active, command=link.cfg.p.command,
                                   rate_hz=link.cfg.p.control_rate_hz, faulted=link.faulted,
                                   faulted_at=link.faulted_at, yielded=link.yielded,
                                   hold_reason=link.stats.hold_reason)
        if self.node.fault:
            level, st.message = 'ERROR', f'fault: {self.node.fault}'
        st.level = getattr(DiagnosticStatus, level)
        st.values = [KeyValue(key='active', value=str(active))]
        for k, v in s.items():
            st.values.append(KeyValue(key=k, value=f'{v:.3f}' if isinstance(v, float) else str(v)))
        st.values.append(KeyValue(key='last_hold', value=link.stats.hold_reason))
        st.values.append(KeyValue(key='last_fault', value=self.node.fault or link.faulted))
        if link.reporter.recent:
            st.values.append(KeyValue(key='last_problem', value=link.reporter.recent[-1]))
        return st


def robot_summary(link, action_horizon: int) -> dict:
    """One robot's own figures for /diagnostics: its control loop, chunks and holds, the
    margin its chunks keep, and in shadow mode how its prediction compares with the
    motion."""
    cfg = link.cfg
    link.stats.c['rtc_delay'] = link.intake.rtc_delay if link.intake else 0
    s = link.stats.summary(cfg.p.control_rate_hz, 1e3 * cfg.action_period * action_horizon)
    s.update(spare_summary(link.intake))
    if not cfg.p.command:
        with link.lock:
            errors = link.shadow.errors(link.now())
        s.update(shadow_summary(errors))
    return s


def spare_summary(intake) -> dict:
    """How early the next frame starts before the chunk being played runs out (the lead,
    when measured), and how long the chunk before still had to run when the last chunk
    came and at least over the recent ones (ms; NaN before any)."""
    lead = intake.lead() if intake is not None else None
    spare = list(intake.spare) if intake is not None else []
    nan = float('nan')
    return {'replan_lead_ms': nan if lead is None else 1e3 * lead,
            'chunk_spare_ms': 1e3 * spare[-1] if spare else nan,
            'chunk_spare_ms_min': 1e3 * min(spare) if spare else nan}
