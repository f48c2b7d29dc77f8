"""Never two commanders: hearing another node on a robot's trajectory topics, or a goal on
its controllers' follow_joint_trajectory actions.

The link remembers (by hash) what it sent lately; a trajectory heard on its own topics that
is not among those came from another node. A controller whose topic is
``<controller>/joint_trajectory`` also takes goals on ``<controller>/follow_joint_trajectory``
(MoveIt, ``ros2 action send_goal``): the action's status topic lists them, and one accepted,
executing or cancelling is another commander (this node sends no goals). ``commanders`` says
who, asking the ROS graph, and can listen a while first (a node just started, or a host back
from a partition, has not discovered everyone yet).
"""

from __future__ import annotations

import collections
import threading
import time

from oxygen_ros.ros.topics import take

UNDISCOVERED = 'a node not yet discovered by name'
TOPIC_SUFFIX = '/joint_trajectory'
ACTION = 'follow_joint_trajectory'
# action_msgs/GoalStatus: accepted, executing, canceling. A goal in any of them moves the arm.
ACTIVE = (1, 2, 3)


def action_of(topic: str) -> str | None:
    """The follow_joint_trajectory action of the controller that listens on `topic` (a
    resolved trajectory topic), or None when the topic does not say which controller."""
    if not topic.endswith(TOPIC_SUFFIX):
        return None
    return topic[:-len(TOPIC_SUFFIX)] + '/' + ACTION


def unwatched(topics: list[str]) -> list[str]:
    """The trajectory topics whose controller's action cannot be watched (see action_of)."""
    return [t for t in topics if action_of(t) is None]


class Commanders:
    """``node``: the rclpy node (its graph); ``topics``: the robot's resolved trajectory
    topics; ``subs``: raw subscriptions to them (taken here, from the node's threads);
    ``on_error(sub, exception)``: a message that could not be handled."""

    def __init__(self, node, topics: list[str], on_error):
        self.node = node
        self.topics = topics
        self.subs = []
        self.on_error = on_error
        self.lock = threading.Lock()
        # (time, hash) of what this link published lately, and the hashes counted.
        self.mine: collections.deque = collections.deque()
        self.mine_set: dict[int, int] = {}
        self.heard_at: dict[str, float] = {}  # topic -> when another node was last heard
        # action -> the ids of its goals that are active now, by its status topic
        self.goals: dict[str, list[str]] = {}
        self.actions = {t: a for t in topics if (a := action_of(t)) is not None}

    def watch_goals(self, create_subscription) -> list:
        """Subscribe to each controller action's status (``create_subscription`` is the
        node's); the subscriptions, for the link to destroy."""
        from action_msgs.msg import GoalStatusArray
        from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

        # rcl_action's status QoS: the latest list, kept for late joiners.
        status = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                            durability=DurabilityPolicy.TRANSIENT_LOCAL)
        return [create_subscription(GoalStatusArray, f'{a}/_action/status',
                                    lambda m, a=a: self.on_status(a, m), status)
                for a in self.actions.values()]

    def on_status(self, action: str, msg):
        active = [bytes(s.goal_info.goal_id.uuid).hex()[:8] for s in msg.status_list
                  if s.status in ACTIVE]
        with self.lock:
            self.goals[action] = active

    MINE_S = 5.0  # how long what this link sent is remembered, s

    def sent(self, data: bytes):
        now = time.monotonic()
        h = hash(data)
        with self.lock:
            self.mine.append((now, h))
            self.mine_set[h] = self.mine_set.get(h, 0) + 1
            while self.mine and self.mine[0][0] < now - self.MINE_S:
                _, old = self.mine.popleft()
                left = self.mine_set[old] - 1
                if left:
                    self.mine_set[old] = left
                else:
                    del self.mine_set[old]

    def on_heard(self, topic: str, data: bytes):
        with self.lock:
            if hash(data) not in self.mine_set:
                self.heard_at[topic] = time.monotonic()

    HEARD_S = 1.0  # another node heard within this long counts as commanding, s

    def heard(self) -> list[str]:
        """The topics of this robot on which another node sent a trajectory within HEARD_S
        (what waits is taken now: the node's watchdog does so every WATCH_S)."""
        for sub in self.subs:
            take(sub, self.on_error)
        now = time.monotonic()
        with self.lock:
            goals = sorted(a for a, ids in self.goals.items() if ids)
        return sorted(t for t, at in self.heard_at.items() if now - at < self.HEARD_S) + goals

    def others(self, topics=None) -> dict[str, list[str]]:
        """topic -> the other nodes with a publisher on it (the ROS graph)."""
        me = (self.node.get_name(), self.node.get_namespace())
        out = {}
        for topic in topics or self.topics:
            # rmw names a publisher whose node it has not discovered yet (a host just back
            # from a partition) _NODE_NAME_UNKNOWN_.
            names = sorted({UNDISCOVERED if i.node_name == '_NODE_NAME_UNKNOWN_' else
                            f'{i.node_namespace.rstrip("/")}/{i.node_name}'
                            for i in self.node.get_publishers_info_by_topic(topic)
                            if (i.node_name, i.node_namespace) != me})
            if names:
                out[topic] = names
        return out

    def commanders(self, listen: float = 0.0, blind: float = 0.0) -> str | None:
        """Another node commanding this robot: what was heard, listening up to ``listen`` s
        where another node has a publisher on a trajectory topic, and up to ``blind`` s where
        none shows yet (the graph not discovered yet); None if nobody else."""
        heard = self.heard()
        start, shown = time.monotonic(), False
        while not heard and listen:
            shown = shown or bool(self.others())  # the graph is asked until it shows one
            if time.monotonic() - start >= (listen if shown else min(blind, listen)):
                break
            time.sleep(0.05)
            heard = self.heard()
        if not heard:
            return None
        with self.lock:
            goals = {a: list(self.goals.get(a, [])) for a in heard if a in self.goals}
        topics = [t for t in heard if t not in goals]
        others = self.others(topics) if topics else {}
        # Heard before the graph names who sent it (a node just started): while listening,
        # give discovery the rest of the window to name it.
        while listen and topics and time.monotonic() - start < listen and any(
                UNDISCOVERED in others.get(t, [UNDISCOVERED]) for t in topics):
            time.sleep(0.05)
            others = self.others(topics)
        who = [f'{t} <- {", ".join(others.get(t) or ["an unknown node"])}' for t in topics]
        who += [f'{a}: goal {", ".join(ids)} active' for a, ids in goals.items()]
        return f'another node commands this robot: {"; ".join(who)}'
