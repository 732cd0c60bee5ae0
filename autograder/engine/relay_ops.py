"""What each operation the relay carries means (``relay.py``): a rank's request checked on its own,
the part of it every rank must agree on, and the result computed from every rank's part.

Pure functions of decoded requests, on CPU tensors; nothing here knows sockets, clocks or other
ranks' states. A request that does not hold together raises ``Refused`` (that rank is to blame),
parts that do not belong together raise ``Mismatch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autograder import wire
from autograder.engine.relay_protocol import MARK_CHARS, OPS, REDUCE_OPS, shown, spec, spec_bytes, spec_numel

REDUCING = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_single")
ROOTED = {"broadcast": "src", "scatter": "src", "reduce": "dst", "gather": "dst"}


class Refused(Exception):
    """A request the relay will not carry; the message says why."""


class Mismatch(Exception):
    """The ranks' parts of one collective, or a send and its receive, do not belong together."""


@dataclass
class Request:
    rank: int
    id: int
    op: str
    tensors: list
    fields: dict
    arrived: float

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def numel(self) -> int:
        """Elements this rank contributes: its tensors, or those it declares it receives into."""
        if self.tensors:
            return sum(t.numel() for t in self.tensors)
        declared = self.fields.get("specs") or ([self.fields["output"]] if "output" in self.fields else [])
        return sum(spec_numel(s) for s in declared)


def _spec(value, where: str) -> list:
    if not (isinstance(value, list) and len(value) == 2 and value[0] in wire.DTYPES
            and isinstance(value[1], list) and len(value[1]) <= wire.MAX_DIMS
            and all(type(n) is int and 0 <= n < (1 << 40) for n in value[1])):
        raise Refused(f"{where}: a spec is [dtype name, shape]")
    return value


def rank_field(fields: dict, name: str, world_size: int, optional: bool = False) -> int | None:
    value = fields.get(name)
    if value is None and optional:
        return None
    if type(value) is not int or not 0 <= value < world_size:
        raise Refused(f"{name}={str(value)[:20]} is not a rank of this world of {world_size}")
    return value


def parse(rank: int, request_id: int, message: dict, arrived: float) -> Request:
    """A decoded message as a ``Request`` whose fields have the types the operation needs."""
    op = message.get("op")
    if op not in OPS:
        raise Refused(f"asked for {str(op)[:40]!r}, which the relay does not carry ({', '.join(OPS)} it does)")
    tensors = message.get("tensors", [])
    if not isinstance(tensors, list) or not all(type(t) is torch.Tensor for t in tensors):
        raise Refused(f"{op}: 'tensors' must be a list of tensors")
    fields = {k: v for k, v in message.items() if k not in ("id", "op", "tensors")}
    if "output" in fields:
        fields["output"] = _spec(fields["output"], f"{op}: output")
    for name in ("outputs", "specs"):
        if name in fields:
            if not isinstance(fields[name], list):
                raise Refused(f"{op}: {name} must be a list of specs")
            fields[name] = [_spec(s, f"{op}: {name}") for s in fields[name]]
    if op in REDUCING:
        how = fields.get("reduce")
        if how not in REDUCE_OPS:
            raise Refused(f"{op}: reduce={str(how)[:40]!r}; the relay reduces with {', '.join(REDUCE_OPS)}")
        for t in tensors:
            if how == "avg" and not t.is_floating_point():
                raise Refused(f"{op}: an average of {t.dtype} tensors (floating point only)")
            if how in ("band", "bor", "bxor") and t.is_floating_point():
                raise Refused(f"{op}: a bitwise {how} of {t.dtype} tensors (integers and bool only)")
    if type(fields.get("tag", 0)) is not int:
        raise Refused(f"{op}: tag must be an int")
    if op == "mark" and not (isinstance(fields.get("label"), str) and len(fields["label"]) <= MARK_CHARS):
        raise Refused(f"a mark's label is a string of at most {MARK_CHARS} characters")
    return Request(rank, request_id, op, tensors, fields, arrived)


def signature(req: Request, world_size: int) -> tuple[tuple, str, int | None, list | None]:
    """(what must be equal on every rank, how to name the call, its root, the spec of what a rank
    contributes) of a collective; ``Refused`` when the request does not hold together on its own."""
    op, f, n, ts = req.op, req.fields, world_size, req.tensors
    specs = [spec(t) for t in ts]
    how = f.get("reduce")
    root = rank_field(f, "root", n) if op in ROOTED else None

    def named(*parts) -> str:
        return f"{op}({', '.join(str(p) for p in parts if p is not None)})"

    if op in ("all_gather", "all_gather_single", "reduce_scatter_single", "gather") and len(ts) != 1:
        raise Refused(f"{op} hands over one tensor")
    if op in ("all_reduce", "reduce") and not ts:
        raise Refused(f"{op} of no tensors")
    if op == "barrier":
        return (op,), named(), None, None
    if op == "all_reduce":
        return (op, how, specs), named(how, *map(shown, specs)), None, specs[0]
    if op == "reduce":
        return (op, how, root, specs), named(how, f"root {root}", *map(shown, specs)), root, specs[0]
    if op == "broadcast":
        declared = f.get("specs")
        if not declared:
            raise Refused("broadcast declares the specs of its tensors")
        if specs != (declared if req.rank == root else []):
            raise Refused("broadcast: the root hands over exactly the tensors it declares, the others none")
        return (op, root, declared), named(f"root {root}", *map(shown, declared)), root, declared[0]
    if op == "all_gather":
        outputs = f.get("outputs")
        if not isinstance(outputs, list) or len(outputs) != n:
            raise Refused(f"all_gather gathers into one tensor per rank ({n})")
        return (op, specs[0][0]), named(specs[0][0]), None, specs[0]
    if op == "all_gather_single":
        out = f.get("output")
        if out is None or out[0] != specs[0][0] or spec_bytes(out) != n * spec_bytes(specs[0]):
            raise Refused(f"all_gather_single of {shown(specs[0])} into {shown(out) if out else 'nothing'}: the "
                          f"output holds {n} inputs of its dtype")
        return (op, specs[0]), named(shown(specs[0])), None, specs[0]
    if op == "reduce_scatter":
        out = f.get("output")
        if len(ts) != n or out is None or out != specs[req.rank]:
            raise Refused(f"reduce_scatter hands over one tensor per rank ({n}) and receives into one shaped as "
                          "its own")
        return (op, how, specs), named(how, *map(shown, specs)), None, specs[0]
    if op == "reduce_scatter_single":
        out = f.get("output")
        if out is None or out[0] != specs[0][0] or n * spec_bytes(out) != spec_bytes(specs[0]):
            raise Refused(f"reduce_scatter_single of {shown(specs[0])} into {shown(out) if out else 'nothing'}: "
                          f"the input holds {n} outputs of its dtype")
        return (op, how, specs[0]), named(how, shown(specs[0])), None, specs[0]
    if op == "gather":
        if f.get("outputs", []) != ([specs[0]] * n if req.rank == root else []):
            raise Refused(f"gather: the root gathers into {n} tensors shaped as its input, the others into none")
        return (op, root, specs[0]), named(f"root {root}", shown(specs[0])), root, specs[0]
    if op == "scatter":
        out = f.get("output")
        if out is None or specs != ([out] * n if req.rank == root else []):
            raise Refused(f"scatter: the root hands over {n} tensors shaped as the output, the others none")
        return (op, root, out), named(f"root {root}", shown(out)), root, out
    raise Refused(f"{op} is not a collective")


def reduce_in_rank_order(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    """The ranks' tensors reduced in rank order."""
    out = tensors[0].clone()
    for t in tensors[1:]:
        if op in ("sum", "avg"):
            out.add_(t)
        elif op == "product":
            out.mul_(t)
        elif op == "min":
            torch.minimum(out, t, out=out)
        elif op == "max":
            torch.maximum(out, t, out=out)
        elif op == "band":
            out.bitwise_and_(t)
        elif op == "bor":
            out.bitwise_or_(t)
        else:
            out.bitwise_xor_(t)
    if op == "avg":
        out.div_(len(tensors))
    return out


def compute(op: str, parts: list[Request]) -> dict[int, list]:
    """Each rank's share of a collective's result, from every rank's part (``parts[r]`` is rank
    r's, their signatures equal): the tensors to copy into its outputs, in order."""
    n = len(parts)
    how = parts[0].fields.get("reduce")
    root = parts[0].fields.get("root")
    if op == "barrier":
        return {}
    if op in ("all_reduce", "reduce"):
        out = [reduce_in_rank_order([p.tensors[i] for p in parts], how) for i in range(len(parts[0].tensors))]
        return {q: out for q in range(n)} if op == "all_reduce" else {root: out}
    if op == "broadcast":
        return {q: parts[root].tensors for q in range(n) if q != root}
    if op == "all_gather":
        inputs = [p.tensors[0] for p in parts]
        handed = [spec(t) for t in inputs]
        for p in parts:
            if p.fields["outputs"] != handed:
                raise Mismatch(f"all_gather: rank {p.rank} gathers into {', '.join(map(shown, p.fields['outputs']))}; "
                               f"the ranks hand over {', '.join(map(shown, handed))}")
        return {q: inputs for q in range(n)}
    if op == "all_gather_single":
        flat = torch.cat([p.tensors[0].reshape(-1) for p in parts])
        return {q: [flat] for q in range(n)}
    if op == "reduce_scatter":
        return {q: [reduce_in_rank_order([p.tensors[q] for p in parts], how)] for q in range(n)}
    if op == "reduce_scatter_single":
        chunks = [p.tensors[0].reshape(-1).tensor_split(n) for p in parts]
        return {q: [reduce_in_rank_order([c[q] for c in chunks], how)] for q in range(n)}
    if op == "gather":
        return {root: [p.tensors[0] for p in parts]}
    return {q: [parts[root].tensors[q]] for q in range(n)}  # scatter


def record(req: Request, seq: int, world_size: int, root: int | None, contributed: list | None) -> dict:
    """A collective's log record, from its first part to arrive and its ``signature``'s root and
    spec (``Relay.records`` names the fields)."""
    dtype, shape = contributed if contributed is not None else (None, [])
    return {"kind": "collective", "op": req.op, "seq": seq, "ranks": list(range(world_size)),
            "src": root if ROOTED.get(req.op) == "src" else None, "dst": root if ROOTED.get(req.op) == "dst" else None,
            "tag": None, "reduce": req.fields.get("reduce"), "dtype": dtype, "shape": list(shape), "numel": req.numel,
            "sent_bytes": {}, "received_bytes": {}, "arrived_s": {}, "completed_s": None, "error": None}


def message_record(req: Request, seq: int, dst: int, tag: int) -> dict:
    """A point-to-point message's log record, made when its send arrives."""
    tensor = req.tensors[0]
    return {"kind": "p2p", "op": "send", "seq": seq, "ranks": [req.rank, dst], "src": req.rank, "dst": dst,
            "tag": tag, "reduce": None, "dtype": spec(tensor)[0], "shape": list(tensor.shape), "numel": tensor.numel(),
            "sent_bytes": {req.rank: req.nbytes}, "received_bytes": {}, "arrived_s": {req.rank: req.arrived},
            "completed_s": None, "error": None}



def mark_record(req: Request, seq: int) -> dict:
    """A mark's log record: the rank's label at the relay's clock (what the rank's code says)."""
    return {"kind": "mark", "op": "mark", "seq": seq, "ranks": [req.rank], "src": req.rank, "dst": None, "tag": None,
            "reduce": None, "dtype": None, "shape": [], "numel": 0, "sent_bytes": {req.rank: 0},
            "received_bytes": {req.rank: 0}, "arrived_s": {req.rank: req.arrived}, "completed_s": req.arrived,
            "error": None, "label": req.fields["label"]}
