"""The generated interfaces import from the install space and carry the documented fields."""

import oxygen_ros.msg as msg  # noqa: E402 (built by colcon; must import)


def test_narration_fields_round_trip():
    from rclpy.serialization import deserialize_message, serialize_message

    m = msg.Narration()
    m.header.stamp.sec = 12
    m.header.stamp.nanosec = 345
    m.request_id = 2**40 + 7
    m.delta = ' cup'
    m.text = 'pick the cup'
    m.tokens = 3
    m.done = True
    m.reason, m.message = 'dropped', 'for a newer request'
    back = deserialize_message(serialize_message(m), msg.Narration)
    assert back.header.stamp.sec == 12 and back.header.stamp.nanosec == 345
    assert back.request_id == 2**40 + 7
    assert (back.delta, back.text, back.tokens, back.done) == (' cup', 'pick the cup', 3, True)
    assert (back.reason, back.message) == ('dropped', 'for a newer request')


def test_narration_field_types():
    assert msg.Narration.get_fields_and_field_types() == {
        'header': 'std_msgs/Header',
        'request_id': 'uint64',
        'delta': 'string',
        'text': 'string',
        'tokens': 'uint32',
        'done': 'boolean',
        'reason': 'string',
        'message': 'string',
    }


def test_ask_action_fields_and_constants():
    from rclpy.serialization import deserialize_message, serialize_message

    import oxygen_ros.action as action  # built by colcon; must import

    Ask = action.Ask
    assert Ask.Goal.get_fields_and_field_types() == {
        'question': 'string', 'max_new_tokens': 'uint32', 'prompt_format': 'string'}
    assert Ask.Feedback.get_fields_and_field_types() == {
        'request_id': 'uint64', 'stamp': 'builtin_interfaces/Time', 'state': 'string',
        'delta': 'string', 'text': 'string', 'tokens': 'uint32'}
    assert Ask.Result.get_fields_and_field_types() == {
        'request_id': 'uint64', 'stamp': 'builtin_interfaces/Time', 'text': 'string',
        'tokens': 'uint32', 'reason': 'string', 'message': 'string'}
    # The reasons and states the ask module uses, as constants clients can compare with.
    from oxygen_ros.engine.ask import STATES
    from oxygen_ros.engine.requests import REASONS
    assert {getattr(Ask.Result, r.upper()) for r in REASONS} == set(REASONS)
    assert {getattr(Ask.Feedback, s.upper()) for s in STATES} == set(STATES)
    r = Ask.Result(request_id=9, text='yes', tokens=2, reason=Ask.Result.BUDGET)
    r.stamp.sec, r.stamp.nanosec = 4, 5
    back = deserialize_message(serialize_message(r), Ask.Result)
    assert (back.request_id, back.text, back.tokens, back.reason) == (9, 'yes', 2, 'budget')
    assert (back.stamp.sec, back.stamp.nanosec) == (4, 5)
    # The action's wrapper types exist: rclpy's ActionServer and ActionClient need them.
    assert Ask.Impl.SendGoalService and Ask.Impl.GetResultService and Ask.Impl.FeedbackMessage
