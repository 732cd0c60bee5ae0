"""The messages between a rank and the relay that carries its collectives (``relay.py``).

One Unix socket per rank; on it, frames: an 8-byte little-endian length, then a value in the
data-only format (``autograder.wire``). A reader checks the length against its cap before it
reads the body, so a peer can make it hold at most one capped frame.

- relay -> rank, once every rank has connected: ``{"welcome": {"rank", "world_size",
  "max_message_bytes", "timeout_s"}}``. The socket is the rank's identity: a rank is told who it
  is, it never says;
- rank -> relay: ``{"id": int, "op": str, ...}``, sent the moment the call is made (``OPS``
  lists the fields of each); the relay answers every request once, in any order:
  ``{"id", "tensors": [...], "src"?: int}`` (what to copy into the call's outputs, in order) or
  ``{"id", "error": str}``. After a world has failed, every answer is that error. A ``mark``
  moves no data: the relay logs its label at the relay's clock (a phase of the rank's own
  program, as the rank's code says it).

A tensor's *spec* is ``[dtype name, shape]``: what a rank declares about a tensor it receives
into, where it hands over no data (a broadcast's receivers, a recv's buffer).
"""

from __future__ import annotations

import math
import socket
import struct

import torch

from autograder import wire

FRAME = struct.Struct("<Q")

# op -> what its request carries besides "id" and "op" ("tensors" are data, the rest numbers,
# names and specs). Collectives are matched across ranks by their place in each rank's sequence.
OPS = {
    "all_reduce": ("tensors", "reduce"),
    "reduce": ("tensors", "reduce", "root"),
    "broadcast": ("tensors (the root's; [] elsewhere)", "specs", "root"),
    "all_gather": ("tensors: [input]", "outputs: one spec per rank"),
    "all_gather_single": ("tensors: [input]", "output: spec of world_size * input"),
    "reduce_scatter": ("tensors: one input per rank", "output", "reduce"),
    "reduce_scatter_single": ("tensors: [world_size * output]", "output", "reduce"),
    "gather": ("tensors: [input]", "outputs (the root's; [] elsewhere)", "root"),
    "scatter": ("tensors: one per rank (the root's; [] elsewhere)", "output", "root"),
    "barrier": (),
    "send": ("tensors: [tensor]", "dst", "tag"),
    "recv": ("output", "src (None: any source)", "tag"),
    "mark": ("label",),
}
MARK_CHARS = 100
REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")


class ProtocolError(Exception):
    """The other side closed the socket, sent a frame over the cap, or sent something that is not data."""


def spec(t: torch.Tensor) -> list:
    """``[dtype name, shape]`` of a tensor, as the format names dtypes."""
    name = str(t.dtype).removeprefix("torch.")
    if name not in wire.DTYPES:
        raise TypeError(f"the relay carries tensors of {sorted(wire.DTYPES)}, not {t.dtype}")
    return [name, list(t.shape)]


def spec_numel(s: list) -> int:
    return math.prod(s[1])


def spec_bytes(s: list) -> int:
    return spec_numel(s) * wire.DTYPES[s[0]].itemsize


def shown(s: list) -> str:
    """``float32[4, 5]``."""
    return f"{s[0]}[{', '.join(str(n) for n in s[1])}]"


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    data = bytearray(n)
    view, got = memoryview(data), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ProtocolError("the other side closed the socket")
        got += k
    return data


def encode(value) -> bytes:
    data = wire.encode(value)
    return FRAME.pack(len(data)) + data


def send(sock: socket.socket, value, cap: int | None = None) -> int:
    """Send one frame; its size. ``cap``: refuse (``ValueError``) a frame the other side would refuse."""
    frame = encode(value)
    if cap is not None and len(frame) - FRAME.size > cap:
        raise ValueError(f"a message of {len(frame) - FRAME.size} bytes; the relay takes at most {cap}")
    sock.sendall(frame)
    return len(frame)


def recv(sock: socket.socket, cap: int):
    """The next frame's value; ``ProtocolError`` when it is over ``cap`` bytes (nothing of its body
    is read then) or not data."""
    (n,) = FRAME.unpack(_recv_exact(sock, FRAME.size))
    if n > cap:
        raise ProtocolError(f"a message of {n} bytes, more than the {cap} a message may hold")
    try:
        return wire.decode(_recv_exact(sock, n))
    except wire.WireError as exc:
        raise ProtocolError(f"a message that is not data: {exc}") from None
