"""Topics of a running system into rosbag2 recordings, as `ros2 bag record` writes them.

For where rosbag2 is not installed (the ROS 2 wheels on PyPI have none): an rclpy node's
subscriptions take each message serialised, and rosbags writes it as it came, logged at
the node's clock when it arrived, to one recording or several at once (sqlite3, MCAP).
The tests and tools/replay_bench.py record live runs with it to replay them; on a robot,
record with `ros2 bag record` (docs/robots.md, "Before the robot moves").
"""

from __future__ import annotations

import importlib
import queue
import threading
from pathlib import Path


def message_class(msgtype: str):
    """The rclpy class of 'pkg/msg/Name'."""
    pkg, _, name = msgtype.split('/')
    return getattr(importlib.import_module(f'{pkg}.msg'), name)


class Recorder:
    """``node``: the rclpy node to subscribe with; ``outputs``: (path, 'sqlite3' or 'mcap')
    of each recording to write, none existing yet; ``topics``: topic -> message type
    ('sensor_msgs/msg/Image'); ``qos``: the subscriptions' QoS profile (reliable, deep
    enough, where the publishers are reliable: nothing is lost then).

    The files are written by a thread of their own (sqlite3 objects belong to the thread
    that made them, and a callback waiting on the disk would hold up the executor): a
    callback only notes the arrival time and queues the message."""

    def __init__(self, node, outputs: list[tuple[Path, str]], topics: dict[str, str], qos):
        self.node = node
        self.counts = dict.fromkeys(topics, 0)
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        opened = threading.Event()
        self.thread = threading.Thread(target=self._write, args=(outputs, topics, opened),
                                       name='recorder', daemon=True)
        self.thread.start()
        opened.wait()
        if self.error is not None:
            raise self.error
        self.closed = False
        self.subs = [node.create_subscription(message_class(ty), t,
                                              lambda data, t=t: self._got(t, data), qos,
                                              raw=True)
                     for t, ty in topics.items()]

    def _got(self, topic: str, data: bytes) -> None:
        if not self.closed:
            self.queue.put((topic, self.node.get_clock().now().nanoseconds, data))

    def _write(self, outputs, topics, opened: threading.Event) -> None:
        from rosbags.rosbag2 import StoragePlugin, Writer
        from rosbags.typesys import Stores, get_typestore

        writers = []
        try:
            store = get_typestore(Stores.ROS2_JAZZY)
            for path, storage in outputs:
                w = Writer(Path(path), version=9,
                           storage_plugin=StoragePlugin[storage.upper()])
                w.open()
                writers.append((w, {t: w.add_connection(t, ty, typestore=store)
                                    for t, ty in topics.items()}))
        except BaseException as e:
            self.error = e
            opened.set()
            return
        opened.set()
        try:
            while True:
                item = self.queue.get()
                if item is None:
                    break
                topic, at, data = item
                for w, conns in writers:
                    w.write(conns[topic], at, data)
                self.counts[topic] += 1
        except BaseException as e:
            self.error = e
        finally:
            for w, _ in writers:
                w.close()

    def close(self) -> None:
        """Stop recording, write what is queued and finish the files (their metadata)."""
        if self.closed:
            return
        self.closed = True
        for s in self.subs:
            self.node.destroy_subscription(s)
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f'recording failed: {self.error}') from self.error
