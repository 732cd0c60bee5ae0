"""The line between a grading child and the grader: one connection, capped frames of data, marks
stamped on the grader's clock, services answered, calls timed by the grader."""

from __future__ import annotations

import os
import socket
import struct
import sys
import time

import pytest
import torch

from autograder import wire
from autograder.engine import channel, sandbox

LIMITS = sandbox.Limits(wall_s=30, isolate_network=False, limit_address_space=False)


def _child(tmp_path, endpoint: channel.Endpoint, body: str) -> sandbox.ChildResult:
    script = "import sys, time\nfrom autograder.engine import channel\nlink = channel.Link(sys.argv[1])\n" + body
    return sandbox.run_sandboxed([sys.executable, "-c", script, endpoint.path], limits=LIMITS, cwd=str(tmp_path),
                                 env={"PYTHONPATH": os.pathsep.join(sys.path)})


def test_outputs_errors_and_marks_arrive_as_data(tmp_path):
    endpoint = channel.Endpoint(str(tmp_path))
    result = _child(tmp_path, endpoint, "import torch\n"
                    "link.send('mark', phase='start')\n"
                    "link.send('outputs', value={'x': torch.arange(4)})\n"
                    "link.send('error', status='error', error='x' * 10_000)\n")
    got = endpoint.close()
    assert result.ok and got.connected and not got.problem
    assert len(got.outputs) == 1 and torch.equal(got.outputs[0]["x"], torch.arange(4))
    assert got.errors[0]["status"] == "error" and len(got.errors[0]["error"]) == channel.ERROR_CHARS
    assert [phase for phase, _ in got.marks] == ["start"]


def test_repeated_frames_are_counted_not_held(tmp_path):
    """A child that sends its outputs, an error or a driven call's result again and again cannot
    grow the grader: one outputs value and a few errors are kept, the rest counted; results sent
    ahead of the grader's calls end the line."""
    endpoint = channel.Endpoint(str(tmp_path))
    result = _child(tmp_path, endpoint, "import torch\nbig = torch.zeros(1 << 20)\n"
                    "for i in range(200):\n    link.send('outputs', value={'x': big, 'i': i})\n"
                    "for i in range(200):\n    link.send('error', status='error', error='e' * 1000)\n")
    got = endpoint.close()
    assert result.ok, result.output_tail
    assert got.deliveries == 200 and len(got.outputs) == 1 and got.outputs[0]["i"] == 0
    assert len(got.errors) == channel.MAX_ERRORS

    (tmp_path / "flood").mkdir()
    endpoint = channel.Endpoint(str(tmp_path / "flood"))
    _child(tmp_path, endpoint, "for i in range(100):\n    link.send('result', id=i, value=i)\n")
    assert "results sent ahead" in endpoint.close().problem


class Counter:
    def __init__(self):
        self.calls = []

    def handle(self, **args):
        self.calls.append(args)
        if args.get("fail"):
            raise ValueError("asked to fail")
        return sum(args.get("values", []))


def test_services_answer_the_childs_calls_and_keep_their_own_record(tmp_path):
    counter = Counter()
    endpoint = channel.Endpoint(str(tmp_path), {"count": counter.handle})
    result = _child(tmp_path, endpoint, "assert link.call('count', values=[1, 2, 3]) == 6\n"
                    "try:\n    link.call('count', fail=True)\nexcept RuntimeError as exc:\n    assert 'asked to fail' in str(exc)\n"
                    "try:\n    link.call('nothing')\nexcept RuntimeError as exc:\n    assert 'no service' in str(exc)\n"
                    "link.send('outputs', value=None)\n")
    got = endpoint.close()
    assert result.ok, result.output_tail
    assert counter.calls == [{"values": [1, 2, 3]}, {"fail": True}] and got.calls == 3


def test_a_frame_over_the_cap_ends_the_line_before_its_body_is_read(tmp_path):
    endpoint = channel.Endpoint(str(tmp_path), max_frame=1 << 20)
    result = _child(tmp_path, endpoint, "import struct\n"
                    "link.sock.sendall(struct.pack('<Q', 1 << 40) + b'x' * 100)\n"
                    "time.sleep(0.5)\n")
    got = endpoint.close()
    assert result.ok and "more than" in got.problem and not got.outputs


def test_a_frame_that_is_not_data_is_refused(tmp_path):
    endpoint = channel.Endpoint(str(tmp_path))
    result = _child(tmp_path, endpoint, "import pickle, struct\n"
                    "data = pickle.dumps({'kind': 'outputs', 'value': 1})\n"
                    "link.sock.sendall(struct.pack('<Q', len(data)) + data)\n")
    got = endpoint.close()
    assert result.ok and "not data" in got.problem and not got.outputs


def test_only_the_first_connection_is_accepted(tmp_path):
    endpoint = channel.Endpoint(str(tmp_path))
    first = socket.socket(socket.AF_UNIX)
    first.connect(endpoint.path)
    assert endpoint.wait_connected(5)
    time.sleep(0.2)
    second = socket.socket(socket.AF_UNIX)
    with pytest.raises(OSError):
        second.connect(endpoint.path)
    channel.send(first, {"kind": "outputs", "value": 1})
    first.close()
    assert endpoint.close().outputs == [1]


def test_a_folder_deeper_than_a_socket_address_holds_still_listens(tmp_path):
    folder = tmp_path / ("deep" * 40)
    folder.mkdir()
    endpoint = channel.Endpoint(str(folder))
    result = _child(folder, endpoint, "link.send('outputs', value=7)\n")
    assert result.ok and endpoint.close().outputs == [7]


def test_a_child_that_never_connects_does_not_hold_the_grader(tmp_path):
    endpoint = channel.Endpoint(str(tmp_path))
    started = time.monotonic()
    got = endpoint.close()
    assert not got.connected and time.monotonic() - started < 2


def test_the_grader_times_each_call_it_drives(tmp_path):
    endpoint = channel.Endpoint(str(tmp_path))
    import threading

    done = {}
    body = ("while True:\n"
            "    request = link.next_request()\n"
            "    if request is None:\n        break\n"
            "    if request['args'].get('early'):\n"
            "        link.send('result', id=request['id'] + 1, value='guessed')\n"
            "    time.sleep(request['args']['sleep'])\n"
            "    link.send('result', id=request['id'], value=request['args']['sleep'] * 2)\n"
            "link.send('outputs', value=None)\n")
    thread = threading.Thread(target=lambda: done.setdefault("result", _child(tmp_path, endpoint, body)))
    thread.start()
    assert endpoint.wait_connected(20)
    value, seconds = endpoint.call("run", 20, sleep=0.2)
    assert value == 0.4 and 0.19 <= seconds < 2
    with pytest.raises(channel.ChannelError, match="no result within"):
        endpoint.call("run", 0.1, sleep=1.0)
    # A result for the next call, sent ahead of its request, answers nothing; nor does the late one.
    assert endpoint.call("run", 20, sleep=0.1, early=True)[0] == 0.2
    value, seconds = endpoint.call("run", 20, sleep=0.3)
    assert value == 0.6 and seconds >= 0.29
    endpoint.finish()
    thread.join(30)
    assert done["result"].ok, done["result"].output_tail


def test_frames_round_trip_in_the_wire_format():
    a, b = socket.socketpair()
    channel.send(a, {"kind": "x", "t": torch.ones(3, dtype=torch.float16)})
    got = channel.recv(b)
    assert got["kind"] == "x" and torch.equal(got["t"], torch.ones(3, dtype=torch.float16))
    a.sendall(struct.pack("<Q", 5) + b"12345")
    with pytest.raises(channel.ChannelError, match="not data"):
        channel.recv(b)
    a.close()
    with pytest.raises(channel.ChannelError, match="closed"):
        channel.recv(b)
    assert wire.MAGIC
