"""The generated interfaces import from the install space and carry the documented fields."""
import pytest

msg = pytest.importorskip('oxygen_ros.msg', reason='oxygen_ros.msg exists only in a colcon build')


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
    back = deserialize_message(serialize_message(m), msg.Narration)
    assert back.header.stamp.sec == 12 and back.header.stamp.nanosec == 345
    assert back.request_id == 2**40 + 7
    assert (back.delta, back.text, back.tokens, back.done) == (' cup', 'pick the cup', 3, True)


def test_narration_field_types():
    assert msg.Narration.get_fields_and_field_types() == {
        'header': 'std_msgs/Header',
        'request_id': 'uint64',
        'delta': 'string',
        'text': 'string',
        'tokens': 'uint32',
        'done': 'boolean',
    }
