"""Live parameters: `ros2 param set` on a running node.

The set callback checks every value first, against each robot contract it touches (a horizon
against the robot's action period, a prompt against its state and limit, `command` against
shadow mode's agreement), and only when all pass are they applied, each by its owners: the
robot links, the engine (engine.LIVE), the node's reporter. A value that fails leaves nothing
half applied.
"""

from __future__ import annotations

import traceback

from rcl_interfaces.msg import SetParametersResult

from oxygen_ros.engine.engine import LIVE as ENGINE_LIVE
from oxygen_ros.robot.params import BY_NAME, StartError


class LiveParams:
    """The node's set-parameters callback."""

    def __init__(self, node):
        self.node = node

    def __call__(self, params) -> SetParametersResult:
        try:
            return self.set(params)
        except Exception as e:  # the node's own fault: nothing may be left half applied
            self.node.fail(f'setting parameters {[p.name for p in params]} failed: '
                           f'{type(e).__name__}: {e}', traceback.format_exc())
            return SetParametersResult(successful=False, reason=f'internal error: {e}')

    def set(self, params) -> SetParametersResult:
        node, checked = self.node, {}
        links = getattr(node, 'by_name', {})  # none yet while the node declares its own
        for param in params:
            robot, _, base = param.name.partition('.')
            if param.name in BY_NAME:
                # A node parameter is every robot's: each robot's contract must take it.
                name, only = param.name, None
                cfgs = [(link.label(), link.cfg) for link in links.values()] if node.fleet \
                    else [('', node.cfg)]
            elif robot in node.fleet and robot in links:
                name, only = base, links[robot]
                cfgs = [('', only.cfg)]
            else:
                continue  # rclpy's own (use_sim_time), read-only ones, or before the links
            for label, cfg in cfgs:
                try:
                    value = cfg.check_live(name, param.value)
                except StartError as e:
                    return self.refuse(param.name, f'{label}{e}')
            if name == 'command' and value:
                why = self.may_command([only] if only is not None else links.values())
                if why:
                    return self.refuse(param.name, why)
            checked[param.name] = (name, value, only)
        for full, (name, value, only) in checked.items():
            self.apply(name, value, only, full)
        return SetParametersResult(successful=True)

    def refuse(self, name: str, reason: str) -> SetParametersResult:
        self.node.log.warning(f'parameter {name} not set: {reason}')
        return SetParametersResult(successful=False, reason=reason)

    def may_command(self, links) -> str | None:
        """Why shadow mode may not turn to commanding these robots now, or None. The gate
        judges the prediction against the motion of the last seconds, which only an active
        node measures: inactive, a robot in shadow mode stays in it (else deactivate, set
        command, activate would command with no comparison at all)."""
        for link in links:
            if link.cfg.p.command:
                continue
            if self.node.state != 'active':
                return (f'{link.label()}not commanding: shadow mode turns to commanding only '
                        'while active, once its prediction agrees with the motion')
            why = link.shadow_problem()
            if why:
                return f'{link.label()}not commanding: {why}'
        return None

    def apply(self, name: str, value, only=None, full: str = ''):
        """A checked value, applied by each owner: the robots' links, then (a node-wide
        one) the node's Config, reporter and the engine."""
        node = self.node
        for link in (node.links if only is None else [only]):
            link.apply(name, value)
        if only is None:
            node.cfg.p[name] = value  # a single robot's Config is the node's: set by now
            if name == 'report_period':
                node.reporter.period = value
            if node.engine is not None and name in ENGINE_LIVE:
                node.engine.apply(name, value)
        if name == 'command':
            node.log.info(f'parameter {full or name} = {value!r}: '
                          + ('commanding' if value else 'shadow mode, not commanding'))
        else:
            node.log.info(f'parameter {full or name} = {value!r}')
