"""~/ask from a test: a robot and lifecycle user with an action client, and the node
parameters the ask tests run."""
import time

import pytest

rclpy = pytest.importorskip('rclpy')
from action_msgs.msg import GoalStatus  # noqa: E402
from rclpy.action import ActionClient  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy  # noqa: E402

import oxygen_ros.action as action_mod  # noqa: E402 (built by colcon; must import)
from oxygen_ros.ros.ask_server import SERVICE_QOS  # noqa: E402
from support.node import PARAMS, User  # noqa: E402
from support.process import wait_for  # noqa: E402

Ask = action_mod.Ask


ROWS = 2


BUDGET = 40  # max_new_tokens: at one token per 30 Hz frame, a full answer takes ~1.3 s


# No narration unless asked for, so the rows are the questions'; one token per frame, so
# an answer lasts long enough to be cancelled while it streams.
ASKING = dict(PARAMS, autostart=False, narration_every_n_frames=0, decode_k=1,
              max_requests=ROWS, max_new_tokens=BUDGET, admission='reject_newest')


SUCCEEDED, ABORTED, CANCELED = (GoalStatus.STATUS_SUCCEEDED, GoalStatus.STATUS_ABORTED,
                                GoalStatus.STATUS_CANCELED)


class Asker(User):
    """The robot and lifecycle user of test_lifecycle, plus ~/ask's client and, as a second
    witness, the action's feedback topic itself."""

    def __init__(self, node):
        super().__init__(node)
        # As deep as the node's server: with ROS's default 10, a burst of 36 refusals'
        # results overflowed this side while the test flooded, and a goal the node had ended
        # never got its result here.
        self.client = ActionClient(node, Ask, '/oxygen_node/ask',
                                   goal_service_qos_profile=SERVICE_QOS,
                                   result_service_qos_profile=SERVICE_QOS,
                                   cancel_service_qos_profile=SERVICE_QOS)
        self.wire = []  # every Ask feedback message on the topic, whoever's goal
        node.create_subscription(Ask.Impl.FeedbackMessage, '/oxygen_node/ask/_action/feedback',
                                 lambda m: self.wire.append(m.feedback),
                                 QoSProfile(depth=500, reliability=ReliabilityPolicy.RELIABLE))

    def send(self, *questions, budget=0):
        """All sent before any is waited for, so they reach the node together."""
        sent = []
        for q in questions:
            feedback = []
            sent.append((self.client.send_goal_async(
                Ask.Goal(question=q, max_new_tokens=budget),
                feedback_callback=lambda m, f=feedback: f.append(m.feedback)), feedback))
        goals = []
        for future, feedback in sent:
            assert wait_for(future.done, 30), 'goal not answered'
            handle = future.result()
            assert handle.accepted  # every goal is; a refusal is its result
            goals.append(Goal(handle, feedback))
        return goals


class Goal:
    def __init__(self, handle, feedback):
        self.handle, self.feedback = handle, feedback
        self.future = handle.get_result_async()

    def result(self, timeout=60):
        assert wait_for(self.future.done, timeout), 'no result'
        time.sleep(0.3)  # feedback is a topic, the result a service: let the last piece come
        r = self.future.result()
        return r.status, r.result

    def deltas(self):
        return ''.join(f.delta for f in self.feedback)

    def adds_up(self, text, timeout=5.0):
        """Whether the feedback deltas make `text`: feedback is a topic and the result a
        service, so the last pieces may land after the result (ROS 2 orders neither)."""
        return wait_for(lambda: self.deltas() == text, timeout)
