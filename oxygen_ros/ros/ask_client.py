"""oxygen_ask: ask a running oxygen_node a question and print the answer as it streams.

    oxygen_ask "is the cup in the gripper?" [--node /oxygen_node] [--max-new-tokens N]

The answer goes to stdout piece by piece, then a newline; the request id, the frame it
answered and, when it did not finish normally, why, go to stderr. Exit status: 0 when the
answer ended by end of sequence or its token budget, 1 when it was refused, dropped or
cancelled, 2 when no action server answered. Ctrl-C cancels the question.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time


def main(argv=None) -> int:
    import rclpy
    from rclpy.action import ActionClient
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.signals import SignalHandlerOptions

    from oxygen_ros.action import Ask

    argv = sys.argv[1:] if argv is None else argv
    args = rclpy.utilities.remove_ros_args(['oxygen_ask', *argv])[1:]
    p = argparse.ArgumentParser(prog='oxygen_ask', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('question')
    p.add_argument('--node', default='/oxygen_node', help='the oxygen_node to ask')
    p.add_argument('--max-new-tokens', type=int, default=0, help='0 = the node\'s maximum')
    p.add_argument('--prompt-format', default='', help='with {question} where it goes')
    p.add_argument('--wait', type=float, default=10.0,
                   help='seconds to wait for the action server and the goal\'s acceptance')
    opts = p.parse_args(args)
    if not 0 <= opts.max_new_tokens < 2**32:
        p.error('--max-new-tokens must be >= 0')

    # Ctrl-C only sets a flag that the waits below look at: a KeyboardInterrupt raised inside
    # rclpy (while an executor is being made, say) leaves it half-built and prints tracebacks
    # at exit. The context stays up to send the cancel.
    rclpy.init(args=['oxygen_ask', *argv], signal_handler_options=SignalHandlerOptions.NO)
    interrupts = []
    signal.signal(signal.SIGINT, lambda signum, _frame: interrupts.append(signum))
    node = rclpy.create_node('oxygen_ask')
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    name = f'{opts.node.rstrip("/")}/ask'
    client = ActionClient(node, Ask, name)
    shown = []

    def wait(future, timeout=None, until_interrupts=1):
        """Spin until `future` is done, `timeout` s have passed or Ctrl-C was pressed
        `until_interrupts` times in all."""
        end = None if timeout is None else time.monotonic() + timeout
        while not future.done() and len(interrupts) < until_interrupts:
            if end is not None and time.monotonic() >= end:
                return
            executor.spin_once(timeout_sec=0.05)

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        shown.append(text)

    def on_feedback(msg):
        fb = msg.feedback
        # Feedback may repeat or trail the result: only text not yet shown is printed.
        have = ''.join(shown)
        if fb.text.startswith(have) and len(fb.text) > len(have):
            show(fb.text[len(have):])

    try:
        end = time.monotonic() + opts.wait
        while not client.server_is_ready() and time.monotonic() < end and not interrupts:
            executor.spin_once(timeout_sec=0.05)
        if interrupts:
            print('oxygen_ask: interrupted', file=sys.stderr)
            return 1
        if not client.server_is_ready():
            print(f'oxygen_ask: no action server {name} (is oxygen_node running and active?)',
                  file=sys.stderr)
            return 2
        goal = Ask.Goal(question=opts.question, max_new_tokens=opts.max_new_tokens,
                        prompt_format=opts.prompt_format)
        sent = client.send_goal_async(goal, feedback_callback=on_feedback)
        # A Ctrl-C before the acceptance arrives does not stop this wait: the goal may already
        # run on the node, and its handle is needed to cancel it.
        wait(sent, opts.wait, until_interrupts=2)
        handle = sent.result() if sent.done() else None
        if handle is None and len(interrupts) > 1:
            print('oxygen_ask: interrupted before the goal was accepted', file=sys.stderr)
            return 1
        if handle is None or not handle.accepted:
            print(f'oxygen_ask: {name} did not accept the goal', file=sys.stderr)
            return 1 if interrupts else 2
        done = handle.get_result_async()
        wait(done)
        if interrupts and not done.done():
            handle.cancel_goal_async()
            # A second Ctrl-C stops waiting for the cancelled goal's result.
            wait(done, opts.wait, until_interrupts=2)
        if not done.done():
            print('oxygen_ask: no result', file=sys.stderr)
            return 1
        r = done.result().result
        have = ''.join(shown)
        if r.text.startswith(have):
            show(r.text[len(have):])
        show('\n')
        print(f'[request {r.request_id}, frame {r.stamp.sec}.{r.stamp.nanosec:09d}, '
              f'{r.tokens} tokens, {r.reason}]' + (f' {r.message}' if r.message else ''),
              file=sys.stderr)
        return 0 if r.reason in (Ask.Result.DONE, Ask.Result.BUDGET) else 1
    finally:
        client.destroy()
        executor.shutdown(timeout_sec=1.0)
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == '__main__':
    sys.exit(main())
