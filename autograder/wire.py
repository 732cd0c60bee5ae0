"""The one format that crosses the boundary between the grader and a student's process: data only.

Inputs go into a sandbox and outputs come back in this format. Reading it never runs code, never
names a class to build and never expands: what comes out is numbers, strings, lists, dicts,
tuples, bytes, NumPy arrays and plain ``torch.Tensor`` objects, and every byte of every array is a
byte of the file. A child that writes something else (a pickle, a tensor subclass, a storage
shared by a thousand views) gets an error, not an object.

Layout: ``MAGIC``, the header's length (8 bytes, little-endian), the header (UTF-8 JSON), zero
padding to a multiple of 64, then the payload. The header is ``{"value": TREE, "blobs": [...]}``;
each blob is ``[kind, dtype, shape, offset, nbytes]`` of one array or byte string in the payload,
and the blobs lie one after another, never overlapping, so the arrays a reader makes hold no more
bytes than the payload does. TREE is JSON with these tagged objects:

- ``{"$d": [[key, value], ...]}`` a dict (keys str or int), ``{"$u": [...]}`` a tuple,
- ``{"$t": i}`` a tensor, ``{"$a": i}`` a NumPy array, ``{"$b": i}`` bytes (blob ``i``),
- ``{"$dtype": "float32"}`` a torch dtype, ``{"$f": "nan" | "inf" | "-inf"}`` a float JSON lacks.

``decode`` checks every count against the bytes that are there before it makes anything, caps the
header (``MAX_HEADER``) and the nesting (``MAX_DEPTH``); the caller caps the file's size when it
reads it (``read_capped``). Decoding ``n`` bytes allocates about ``n`` bytes of arrays plus the
Python objects of a header of at most ``MAX_HEADER`` bytes.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import struct

import numpy as np
import torch

MAGIC = b"FDLWIRE1"
ALIGN = 64
MAX_HEADER = 16 << 20
MAX_DEPTH = 64
MAX_DIMS = 16
DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
NUMPY_DTYPES = ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")
_TORCH_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class WireError(ValueError):
    """What was handed in is not data this format carries; the message says what and where."""


class TooLarge(WireError):
    """A file larger than its reader takes."""


# --- writing ------------------------------------------------------------------------------------


class _Writer:
    def __init__(self) -> None:
        self.blobs: list[list] = []
        self.chunks: list[bytes] = []
        self.size = 0

    def _blob(self, kind: str, dtype: str, shape: list[int], data: bytes) -> int:
        pad = (-self.size) % ALIGN
        if pad:
            self.chunks.append(b"\0" * pad)
            self.size += pad
        self.blobs.append([kind, dtype, shape, self.size, len(data)])
        self.chunks.append(data)
        self.size += len(data)
        return len(self.blobs) - 1

    def tree(self, value, where: str, depth: int = 0):
        if depth > MAX_DEPTH:
            raise WireError(f"{where}: nested deeper than {MAX_DEPTH} levels")
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, (int, np.integer)) and not isinstance(value, np.bool_):
            return int(value)
        if isinstance(value, np.bool_):
            return bool(value)
        if isinstance(value, (float, np.floating)):
            value = float(value)
            return value if math.isfinite(value) else {"$f": "nan" if value != value else ("inf" if value > 0 else "-inf")}
        if isinstance(value, torch.Tensor):
            return {"$t": self._tensor(value, where)}
        if isinstance(value, np.ndarray):
            return {"$a": self._array(value, where)}
        if isinstance(value, (bytes, bytearray, memoryview)):
            return {"$b": self._blob("bytes", "uint8", [len(value)], bytes(value))}
        if isinstance(value, torch.dtype):
            if value not in _TORCH_NAMES:
                raise WireError(f"{where}: the dtype {value} is not carried")
            return {"$dtype": _TORCH_NAMES[value]}
        if isinstance(value, dict):
            items = []
            for key, item in value.items():
                if isinstance(key, (bool, np.bool_)) or not isinstance(key, (str, int, np.integer)):
                    raise WireError(f"{where}: a dict key of type {type(key).__name__} (str or int keys only)")
                key = key if isinstance(key, str) else int(key)
                items.append([key, self.tree(item, f"{where}[{key!r}]", depth + 1)])
            return {"$d": items}
        if isinstance(value, tuple) or isinstance(value, torch.Size):
            return {"$u": [self.tree(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.tree(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        raise WireError(f"{where}: a {type(value).__name__} is not data the grader carries "
                        "(numbers, strings, lists, tuples, dicts, bytes, arrays and tensors are)")

    def _tensor(self, t: torch.Tensor, where: str) -> int:
        if t.layout != torch.strided or t.is_quantized or t.is_nested or t.device.type == "meta":
            raise WireError(f"{where}: only dense tensors are carried, not a {t.layout} / quantized / nested one")
        if t.dtype not in _TORCH_NAMES:
            raise WireError(f"{where}: tensors of dtype {t.dtype} are not carried")
        t = t.detach().to("cpu").contiguous()
        shape = list(t.shape)
        flat = t.reshape(-1)
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return self._blob("tensor", _TORCH_NAMES[t.dtype], shape, data)

    def _array(self, a: np.ndarray, where: str) -> int:
        name = a.dtype.name
        if name not in NUMPY_DTYPES:
            raise WireError(f"{where}: NumPy arrays of dtype {a.dtype} are not carried")
        return self._blob("array", name, list(a.shape), np.ascontiguousarray(a).tobytes())


def encode(value) -> bytes:
    """``value`` in this format; ``WireError`` names the first part that is not data."""
    writer = _Writer()
    tree = writer.tree(value, "value")
    header = json.dumps({"value": tree, "blobs": writer.blobs}, separators=(",", ":")).encode()
    head = MAGIC + struct.pack("<Q", len(header)) + header
    head += b"\0" * ((-len(head)) % ALIGN)
    return head + b"".join(writer.chunks)


# --- reading ------------------------------------------------------------------------------------


def _count(shape, where: str) -> int:
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(
            type(n) is int and 0 <= n < (1 << 40) for n in shape):
        raise WireError(f"{where}: a shape must be a list of at most {MAX_DIMS} sizes")
    return math.prod(shape)


def _blobs(header: dict, payload: memoryview) -> list:
    blobs = header.get("blobs")
    if not isinstance(blobs, list):
        raise WireError("the header lists no blobs")
    made, end = [], 0
    for i, blob in enumerate(blobs):
        where = f"blob {i}"
        if not (isinstance(blob, list) and len(blob) == 5):
            raise WireError(f"{where}: malformed")
        kind, dtype, shape, offset, nbytes = blob
        if type(offset) is not int or type(nbytes) is not int or offset < end or nbytes < 0 \
                or offset + nbytes > len(payload):
            raise WireError(f"{where}: bytes {offset}..{offset}+{nbytes} are not the payload's next unused bytes")
        numel = _count(shape, where)
        end = offset + nbytes
        if kind == "tensor" and dtype in DTYPES:
            torch_dtype = DTYPES[dtype]
            if numel * torch_dtype.itemsize != nbytes:
                raise WireError(f"{where}: {nbytes} bytes for {numel} elements of {dtype}")
            if numel == 0:
                made.append(torch.empty(shape, dtype=torch_dtype))
            else:
                made.append(torch.frombuffer(payload, dtype=torch_dtype, count=numel, offset=offset).reshape(shape))
        elif kind == "array" and dtype in NUMPY_DTYPES:
            np_dtype = np.dtype(dtype)
            if numel * np_dtype.itemsize != nbytes:
                raise WireError(f"{where}: {nbytes} bytes for {numel} elements of {dtype}")
            made.append(np.frombuffer(payload, dtype=np_dtype, count=numel, offset=offset).reshape(shape))
        elif kind == "bytes" and dtype == "uint8":
            if shape != [nbytes]:
                raise WireError(f"{where}: a byte string's shape is its length")
            made.append(bytes(payload[offset:end]))
        else:
            raise WireError(f"{where}: unknown kind {kind!r} of dtype {dtype!r}")
    return made


def _value(node, blobs: list, used: set, depth: int = 0):
    if depth > MAX_DEPTH:
        raise WireError(f"nested deeper than {MAX_DEPTH} levels")
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_value(v, blobs, used, depth + 1) for v in node]
    if not isinstance(node, dict) or len(node) != 1:
        raise WireError("a JSON object that is not one of the format's tags")
    (tag, arg), = node.items()
    if tag in ("$t", "$a", "$b"):
        if type(arg) is not int or not 0 <= arg < len(blobs):
            raise WireError(f"{tag} names no blob")
        blob = blobs[arg]
        expected = {"$t": torch.Tensor, "$a": np.ndarray, "$b": bytes}[tag]
        if not isinstance(blob, expected):
            raise WireError(f"{tag} names a blob of another kind")
        used.add(arg)
        return blob
    if tag == "$d":
        if not isinstance(arg, list):
            raise WireError("a dict must be a list of pairs")
        out = {}
        for pair in arg:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], (str, int))
                    and not isinstance(pair[0], bool)):
                raise WireError("a dict's pair must be [str or int key, value]")
            out[pair[0]] = _value(pair[1], blobs, used, depth + 1)
        return out
    if tag == "$u":
        if not isinstance(arg, list):
            raise WireError("a tuple must be a list")
        return tuple(_value(v, blobs, used, depth + 1) for v in arg)
    if tag == "$dtype" and arg in DTYPES:
        return DTYPES[arg]
    if tag == "$f" and arg in ("nan", "inf", "-inf"):
        return float(arg)
    raise WireError(f"unknown tag {tag!r}")


def decode(data: bytes | bytearray):
    """The value ``data`` holds; ``WireError`` when it is not this format or breaks its rules.
    Arrays and tensors share the memory of ``data`` when it is a bytearray (no copy is made)."""
    if not isinstance(data, bytearray):
        data = bytearray(data)
    view = memoryview(data)
    if len(view) < len(MAGIC) + 8 or bytes(view[:len(MAGIC)]) != MAGIC:
        raise WireError("not the grader's data format (a pickle, or the wrong file?)")
    (length,) = struct.unpack("<Q", view[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    if length > MAX_HEADER or start + length > len(view):
        raise WireError(f"a header of {length} bytes (at most {MAX_HEADER}, within the file)")
    try:
        header = json.loads(bytes(view[start:start + length]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireError(f"the header is not JSON this format reads: {type(exc).__name__}") from None
    if not isinstance(header, dict) or "value" not in header:
        raise WireError("the header holds no value")
    body = start + length
    body += (-body) % ALIGN
    payload = view[min(body, len(view)):]
    blobs = _blobs(header, payload)
    used: set[int] = set()
    return _value(header["value"], blobs, used)


# --- files --------------------------------------------------------------------------------------


def read_capped(path: str, cap: int) -> bytearray:
    """A regular file's bytes, at most ``cap`` of them, read without following a link or blocking
    on a pipe: what a child left where the grader reads is never trusted to be a plain file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise WireError("a symbolic link, not a file") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise WireError("not a regular file")
        if info.st_size > cap:
            raise TooLarge(f"larger than {cap >> 20} MiB")
        data = bytearray(info.st_size)
        view, got = memoryview(data), 0
        while got < len(data):
            n = os.readv(fd, [view[got:]])
            if n == 0:
                break
            got += n
        if got != len(data) or os.read(fd, 1):
            raise WireError("the file changed size while it was read")
    finally:
        os.close(fd)
    return data


def load(path: str, cap: int):
    return decode(read_capped(path, cap))


def dump(value, path: str) -> None:
    data = encode(value)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
