"""The data format between the grader and a student's process: what it carries back unchanged, and
what it refuses to read (code, expansion, counts that the bytes do not back)."""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import struct

import numpy as np
import pytest
import torch

from autograder import wire


def _roundtrip(value):
    return wire.decode(wire.encode(value))


def test_data_comes_back_as_it_went():
    value = {
        "t": torch.arange(12, dtype=torch.float32).reshape(3, 4), "bf": torch.randn(5, dtype=torch.bfloat16),
        "view": torch.arange(20).reshape(4, 5)[:, 1::2], "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 7),
        "mask": torch.tensor([True, False]), "array": np.arange(6, dtype=np.int32).reshape(2, 3),
        "numbers": [1, -2, 3.25, float("nan"), float("inf"), -float("inf"), None, True, False, 2 ** 70],
        "nested": ({"a": [1, (2, 3)]}, "text ü"), 7: "int key", "blob": b"\x00\x01binary",
        "dtype": torch.float16, "size": torch.Size([2, 3]), "npscalar": np.float32(1.5), "npint": np.int64(4),
    }
    back = _roundtrip(value)
    for key in ("t", "bf", "view", "scalar", "empty", "mask"):
        assert type(back[key]) is torch.Tensor and back[key].dtype == value[key].dtype
        assert torch.equal(back[key], value[key])
    assert back["array"].dtype == np.int32 and (back["array"] == value["array"]).all()
    got = back["numbers"]
    assert got[:3] == [1, -2, 3.25] and math.isnan(got[3]) and got[4:] == [math.inf, -math.inf, None, True, False, 2 ** 70]
    assert back["nested"] == ({"a": [1, (2, 3)]}, "text ü") and back[7] == "int key"
    assert back["blob"] == b"\x00\x01binary" and back["dtype"] is torch.float16 and back["size"] == (2, 3)
    assert back["npscalar"] == 1.5 and back["npint"] == 4


@pytest.mark.parametrize("value", [object(), {1.5: 2}, [lambda: 0], torch.randn(2).to_sparse(),
                                   torch.randn(2, dtype=torch.complex64), np.array(["a"], dtype=object)])
def test_what_is_not_data_is_refused_when_written(value):
    with pytest.raises(wire.WireError):
        wire.encode(value)


def test_tensor_subclasses_arrive_as_plain_tensors():
    back = _roundtrip([torch.nn.Parameter(torch.ones(2))])
    assert type(back[0]) is torch.Tensor and not back[0].requires_grad


def _forge(header: dict, payload: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    head = wire.MAGIC + struct.pack("<Q", len(raw)) + raw
    return head + b"\0" * ((-len(head)) % wire.ALIGN) + payload


def test_a_pickle_is_not_read():
    class Boom:
        def __reduce__(self):
            return (os.system, ("true",))

    for data in (pickle.dumps(Boom()), b""):
        with pytest.raises(wire.WireError, match="not the grader's data format"):
            wire.decode(data)
    buffer = io.BytesIO()
    torch.save({"x": torch.ones(1)}, buffer)
    with pytest.raises(wire.WireError):
        wire.decode(buffer.getvalue())


def test_counts_must_be_backed_by_bytes():
    # A tensor that claims a terabyte from eight bytes.
    with pytest.raises(wire.WireError, match="8 bytes for"):
        wire.decode(_forge({"value": {"$t": 0}, "blobs": [["tensor", "float32", [1 << 38], 0, 8]]}, b"\0" * 8))
    with pytest.raises(wire.WireError, match="payload"):
        wire.decode(_forge({"value": {"$t": 0}, "blobs": [["tensor", "float32", [1 << 20], 0, 4 << 20]]}, b"\0" * 8))


def test_blobs_cannot_share_bytes_so_reading_never_expands():
    # Two views of the same 4 MiB would become 8 MiB once the checks copy them.
    blob = ["tensor", "uint8", [4 << 20], 0, 4 << 20]
    with pytest.raises(wire.WireError, match="next unused bytes"):
        wire.decode(_forge({"value": [{"$t": 0}, {"$t": 1}], "blobs": [blob, blob]}, b"\0" * (4 << 20)))
    # A million references to one blob are one object.
    data = _forge({"value": [{"$t": 0}] * 100_000, "blobs": [blob]}, b"\0" * (4 << 20))
    back = wire.decode(data)
    assert len({id(t) for t in back}) == 1


@pytest.mark.parametrize("header", [
    {"value": {"$x": 1}, "blobs": []},
    {"value": {"$t": 3}, "blobs": []},
    {"value": {"a": 1, "b": 2}, "blobs": []},
    {"value": {"$d": [[1.5, 2]]}, "blobs": []},
    {"value": 1, "blobs": [["pickle", "object", [1], 0, 1]]},
    {"value": 1},
])
def test_malformed_headers_are_refused(header):
    with pytest.raises(wire.WireError):
        wire.decode(_forge(header, b"\0" * 64))


def test_nesting_and_header_size_are_capped():
    deep = "[" * 100_000 + "]" * 100_000
    raw = ('{"value":' + deep + ',"blobs":[]}').encode()
    data = wire.MAGIC + struct.pack("<Q", len(raw)) + raw
    with pytest.raises(wire.WireError):
        wire.decode(data)
    with pytest.raises(wire.WireError, match="header of"):
        wire.decode(wire.MAGIC + struct.pack("<Q", wire.MAX_HEADER + 1) + b"{}")
    with pytest.raises(wire.WireError, match="deeper"):
        value: list = []
        for _ in range(wire.MAX_DEPTH + 2):
            value = [value]
        wire.encode(value)


def test_files_are_read_as_capped_regular_files(tmp_path):
    good = tmp_path / "good.wire"
    wire.dump({"x": torch.ones(3)}, str(good))
    assert torch.equal(wire.load(str(good), cap=1 << 20)["x"], torch.ones(3))
    with pytest.raises(FileExistsError):
        wire.dump(1, str(good))
    with pytest.raises(wire.TooLarge):
        wire.load(str(good), cap=16)
    link = tmp_path / "link"
    link.symlink_to(good)
    with pytest.raises(wire.WireError, match="link"):
        wire.load(str(link), cap=1 << 20)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(wire.WireError, match="regular"):
        wire.load(str(fifo), cap=1 << 20)
