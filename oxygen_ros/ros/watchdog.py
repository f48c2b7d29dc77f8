"""The node's watchdog, on the steady clock (it must run while simulated time stands still).

Each tick: a fault, or an engine or control thread that ended while active, takes the node
through ErrorProcessing (on_deactivate returns ERROR); questions whose frame cannot come end,
saying why; a robot another node commands is given up (a node with none left deactivates).
"""

from __future__ import annotations

import time


def watch(node) -> None:
    """Steady-clock watchdog: a fault, or a thread that ended while active, takes the
    node through ErrorProcessing (on_deactivate returns ERROR)."""
    try:
        if node.state == 'inactive':
            for link in node.links:
                link.heard()  # so that what is heard has its time when activating
        if node.state != 'active':
            return
        if node.fault is None:
            dead = [t.name for t in node._threads if not t.is_alive()]
            dead += [f'{link.label()}control' for link in node.links if link.control.dead()]
            if dead:
                node.fail(f'the {", ".join(dead)} thread ended while active')
        if node.fault is not None:
            node.diagnostics.publish()  # the ERROR goes out before cleanup ends diagnostics
            node.trigger_deactivate()
            return
        # Questions whose frame does not come (the inputs are stale) end, saying so.
        for link in node.links:
            if link.asks.open_count:
                link.asks.expire(time.monotonic(), link.waiting_for())
        # Another node commanding a robot: this one gives way (link.give_way); with no
        # robot left to command, the node deactivates.
        for link in node.links:
            if not link.cfg.p.command:
                link.heard()  # shadow mode: the operator's; heard when it was sent
                continue
            other = link.commanders()
            if other:
                link.give_way(other)
        if not any(link.active for link in node.links):
            node.log.error('every robot is commanded by another node: deactivating')
            node.trigger_deactivate()
    except Exception as e:  # the watchdog itself must not end the executor
        node.log.error(f'watchdog failed: {type(e).__name__}: {e}')

