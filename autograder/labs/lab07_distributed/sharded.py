"""Lab 07's sharded items: FSDP (fp32, and bf16 with fp32 master shards) and the tensor-parallel MLP.

Parity is judged against single-process references computed here. The collectives are read from
the relay's log, step by step and pass by pass: for FSDP two all-gathers of every unit's flat
vector, in the compute dtype, and one reduce-scatter per unit and step; for tensor parallelism one
all-reduce of the activations in forward and one in backward, nothing else. A tensor-parallel rank
is sent only its own shards of the weights, so the unsplit MLP exists nowhere in it.

FSDP's memory is judged twice. Physically, where the profile asks for a memory world: a model
large enough that full weights kept by a rank show in its cgroup's memory peak, compared with the
course's FSDP on the same world. And in the rank (self-reported): the bytes of its parameters, their
state and every tensor left after training (``census``), and how many units' gathered weights were
still allocated when another was gathered.
"""

from __future__ import annotations

import functools
import json
import random

import torch
from torch import nn

from autograder.engine.items import Verdict
from autograder.labs._common import per_case
from autograder.labs.lab07_distributed import traffic
from autograder.labs.lab07_distributed.data_parallel import (memory_data, memory_spec, peak_problem, sums_problem)
from autograder.labs.lab07_distributed.ranks import WEIGHTS, memory_blocks
from fastdl_lab import checks
from fastdl_lab.distributed import ddp, fsdp, tensor_parallel

# --- FSDP (ZeRO-3) -------------------------------------------------------------------------------


def fsdp_cases(seed: int, params: dict) -> dict:
    """One hidden case per world: MLPs of units, except the last world's, a token model (an
    embedding fed integer ids, its matrix tied to a projection in the same unit): what an FSDP
    that casts every input, or that loses the parameters' names or ties, gets wrong."""
    rng = random.Random(seed)
    cases = []
    low, high = params.get("min_width", 12), params.get("max_width", 36)
    for i, world in enumerate(params["worlds"]):
        case = {"seed": rng.randint(0, 10_000), "n": world * rng.randint(3, 6), "steps": int(params.get("steps", 3)),
                "lr": rng.choice([0.05, 0.1, 0.2]), "world": world}
        if i == len(params["worlds"]) - 1:
            # Twice the MLPs' widths: the memory checks' fixed slack (1 KiB) must stay small next to the shards.
            case.update(vocab=rng.randint(2 * low, 2 * high), width=rng.randint(low, high),
                        hidden=rng.randint(low, high), out=rng.randint(2, 6), tokens=rng.randint(3, 8))
        else:
            case["dims"] = [rng.randint(low, high) for _ in range(int(params.get("units", 4)) + 1)]
        cases.append(case)
    found = {"cases": cases, "dtype": ""}
    if "memory" in params:
        found["memory"] = memory_spec(params["memory"])
    return found


def fsdp_mixed_cases(seed: int, params: dict) -> dict:
    return {**fsdp_cases(seed, params), "dtype": "bfloat16"}


def fsdp_sizes(inputs: dict) -> list[int]:
    return [c["world"] for c in inputs["cases"]] + ([inputs["memory"]["world"]] if "memory" in inputs else [])


def fsdp_reference_worlds(inputs: dict) -> list[int]:
    return [len(inputs["cases"])] if "memory" in inputs else []


def _model_fn(case: dict):
    if "vocab" in case:
        return functools.partial(fsdp.unit_lm, case["seed"], case["vocab"], case["width"], case["hidden"], case["out"])
    return functools.partial(fsdp.unit_mlp, case["seed"], case["dims"])


def _data(case: dict):
    if "vocab" in case:
        return fsdp.make_token_data(case["seed"], case["n"], case["tokens"], case["vocab"], case["out"])
    return ddp.make_regression(case["seed"], case["n"], case["dims"][0], case["dims"][-1])


def fsdp_rank_inputs(inputs: dict, world: int, rank: int) -> dict:
    if world == len(inputs["cases"]):
        spec = inputs["memory"]
        x, y = ddp._shard(memory_data(spec), rank, spec["world"])
        return {"memory": spec, "x": x.clone(), "y": y.clone(), "steps": spec["steps"], "lr": spec["lr"],
                "dtype": inputs["dtype"]}
    c = inputs["cases"][world]
    x, y = ddp._shard(_data(c), rank, c["world"])
    model = {k: c[k] for k in ("dims", "vocab", "width", "hidden", "out") if k in c}
    return {"seed": c["seed"], **model, "x": x.clone(), "y": y.clone(), "steps": c["steps"], "lr": c["lr"],
            "dtype": inputs["dtype"]}


def _compute_dtype(inputs: dict):
    return getattr(torch, inputs["dtype"]) if inputs["dtype"] else None


def fsdp_label(case: dict) -> str:
    if "vocab" in case:
        return (f"{case['world']} ranks, token ids into a tied embedding of {case['vocab']} x {case['width']}, "
                f"hidden {case['hidden']}, out {case['out']}")
    return f"{case['world']} ranks, widths {case['dims']}"


def collectives_problem(records: list[dict], shards: list[int], world_size: int, steps: int,
                        dtype: torch.dtype | None) -> str | None:
    """Each step's traffic as the relay carried it: every unit's flat vector (``shards[u]``
    elements per rank) all-gathered twice, in the compute dtype, and its gradient reduce-scattered
    once; nothing else, and nothing after the last step."""
    problem = traffic.barrier_problem(records, steps + 1)
    if problem:
        return problem
    phases = traffic.phases(records)
    wanted = str(dtype or torch.float32).removeprefix("torch.")
    units = len(shards)
    for step in range(steps):
        ops = phases[step + 1]
        others = [r for r in ops if r["op"] not in traffic.DATA_GATHERS + traffic.DATA_REDUCE_SCATTERS]
        if others:
            return (f"step {step}: {traffic.shown_ops(others)}; fully sharded training moves weights with "
                    "all-gathers and gradients with reduce-scatters, nothing else")
        gathers = [r for r in ops if r["op"] in traffic.DATA_GATHERS]
        scatters = [r for r in ops if r["op"] in traffic.DATA_REDUCE_SCATTERS]
        if len(gathers) != 2 * units or len(scatters) != units:
            return (f"step {step}: {len(gathers)} all-gathers and {len(scatters)} reduce-scatters of {units} units; "
                    f"expected {2 * units} (before each unit's forward and again before its backward) and {units}")
        if sorted(int(r["numel"]) for r in gathers) != sorted(2 * shards):
            return (f"step {step}: all-gathers of {sorted(int(r['numel']) for r in gathers)} elements per rank; each "
                    f"unit's shard ({sorted(shards)}) is gathered twice")
        if any(r["dtype"] != wanted for r in gathers):
            return (f"step {step}: all-gathers in {sorted({r['dtype'] for r in gathers})}, not the compute dtype "
                    f"{wanted}")
        if sorted(int(r["numel"]) // world_size for r in scatters) != sorted(shards):
            return f"step {step}: the reduce-scatters do not hand each rank its unit's shard"
    if phases[-1]:
        return f"{traffic.shown_ops(phases[-1])} after the last step"
    return None


def live_problems(results: list[dict], shards: list[int], element: int, world_size: int) -> list[str]:
    """Ranks that still held more than two other units' gathered weights when they gathered one,
    as they counted it themselves."""
    largest_two = element * world_size * sum(sorted(shards)[-2:])
    return [f"rank {rank}: {r['wire']['max_live_buffers']} units' gathered weights ({r['wire']['max_live_bytes']} B) "
            "were still allocated when another was gathered: free each unit's full weights after its forward and "
            "after its backward" for rank, r in enumerate(results)
            if r["wire"]["max_live_buffers"] > 2 or r["wire"]["max_live_bytes"] > largest_two]


@functools.lru_cache(maxsize=8)
def _memory_reference_sums(spec_json: str) -> tuple[list[list[float]], tuple[int, ...]]:
    """The memory world trained in one process: per unit, sum and sum of squares of its weights;
    and each unit's elements."""
    spec = json.loads(spec_json)
    model = fsdp.train_reference(lambda: nn.Sequential(*memory_blocks(spec)), memory_data(spec), spec["steps"],
                                 spec["lr"])
    sums = []
    for block in model:
        flat = torch.cat([p.detach().double().reshape(-1) for p in block.parameters()])
        sums.append([float(flat.sum()), float(flat.square().sum())])
    return sums, tuple(sum(p.numel() for p in block.parameters()) for block in model)


def fsdp_memory_problem(spec: dict, per_rank: list, world: dict, reference: dict) -> str | None:
    """The memory world's weights (its shards' sums, put together) and every rank's peak against
    the course's FSDP on the same world: within half of the full model's fp32 bytes."""
    want, numels = _memory_reference_sums(json.dumps(spec, sort_keys=True))
    try:
        got = [[sum(r["sums"][u][k] for r in per_rank) for k in (0, 1)] for u in range(len(want))]
    except (KeyError, IndexError, TypeError):
        return "the memory world's ranks returned no shards of the model's units"
    problem = sums_problem(got, want, "the memory world")
    if problem:
        return problem
    # A rank that kept every unit's gathered weights after its step would hold the whole model
    # more than the sharded reference, whose peak holds none of them: half of that is allowed.
    slack = [4 * sum(numels) // 2] * spec["world"]
    return peak_problem(world, reference, slack, "full weights kept after the units had computed")


def fsdp_check(inputs: dict, outputs, params: dict, observed) -> Verdict:
    """A third for parity, a third for the collectives the relay carried, a third for the memory:
    the memory world's peaks (physical) and what each rank counted it kept (self-reported), half
    each where there is a memory world, the self-reported count alone where there is none."""
    cases, dtype = inputs["cases"], _compute_dtype(inputs)
    references = [fsdp.train_reference(_model_fn(c), _data(c), c["steps"], c["lr"]) for c in cases]
    expected_out = str(dtype or torch.float32)

    def check_one(i: int) -> None:
        c = cases[i]
        lowp = (fsdp.train_reference(_model_fn(c), _data(c), c["steps"], c["lr"], compute_dtype=dtype,
                                     world_size=c["world"]) if dtype else None)
        fsdp.check_parity(outputs[i], references[i], name="FSDPUnit", lowp_reference=lowp)
        for rank, result in enumerate(outputs[i]):
            if result["output_dtype"] != expected_out:
                raise checks.MismatchError(f"rank {rank}: the model's output is {result['output_dtype']}, expected "
                                           f"{expected_out}")

    parity = per_case([fsdp_label(c) for c in cases], check_one)
    if parity.fraction < 1:
        return Verdict(parity.fraction / 3, parity.reason)
    element = torch.tensor([], dtype=dtype or torch.float32).element_size()
    wire, reported, physical = [], [], []
    worlds = list(zip(cases, outputs, references, observed.worlds, strict=False))
    for c, results, reference, world in worlds:
        shards = [shard for _, shard in fsdp.unit_sizes(reference, c["world"])]
        problem = collectives_problem(world["records"], shards, c["world"], c["steps"], dtype)
        if problem:
            wire.append(f"{fsdp_label(c)}: {problem}")
        reported += [f"{fsdp_label(c)}: {p}" for p in fsdp.memory_problems(results, reference)]
        reported += [f"{fsdp_label(c)}: {p}" for p in live_problems(results, shards, element, c["world"])]
    if "memory" in inputs:
        spec = inputs["memory"]
        memory_world = observed.worlds[len(cases)]
        _, numels = _memory_reference_sums(json.dumps(spec, sort_keys=True))
        shards = [-(-n // spec["world"]) for n in numels]
        problem = collectives_problem(memory_world["records"], shards, spec["world"], spec["steps"], dtype)
        if problem:
            wire.append(f"the memory world: {problem}")
        problem = fsdp_memory_problem(spec, outputs[len(cases)], memory_world,
                                      observed.reference["worlds"][len(cases)])
        if problem:
            physical.append(problem)
    memory_lost = (bool(physical) + bool(reported)) / 2 if "memory" in inputs else float(bool(reported))
    lost = (bool(wire) + memory_lost) / 3
    held = outputs[0][0]["memory"]["param_bytes"]
    full = 4 * sum(p.numel() for p in references[0].parameters())
    if not lost:
        worlds_text = f"{len(cases)} hidden world{'s' * (len(cases) != 1)}"
        peak = "; every rank's memory peak within the sharded reference's" if "memory" in inputs else ""
        return Verdict.passed(f"parity on {worlds_text}; the relay saw two all-gathers and one reduce-scatter per "
                              f"unit and step{peak}; each rank keeps its 1/N shard ({held} B of {full} B in the first, "
                              "self-reported)")
    parts = []
    if wire:
        parts.append(f"{wire[0]} (the relay's log)")
    if physical:
        parts.append(physical[0])
    if reported:
        parts.append(f"{reported[0]} (self-reported: counted in the rank)")
    return Verdict(1 - lost, f"weights correct, but {'; '.join(parts)}")


# --- tensor parallel -----------------------------------------------------------------------------


def tp_cases(seed: int, params: dict) -> dict:
    rng = random.Random(seed)
    return {"cases": [{"seed": rng.randint(0, 10_000), "tokens": rng.randint(3, 9), "d_model": rng.randint(6, 16),
                       "d_hidden": world * rng.randint(3, 8) + rng.randint(1, world - 1), "world": world}
                      for world in params["worlds"]]}


def tp_sizes(inputs: dict) -> list[int]:
    return [c["world"] for c in inputs["cases"]]


def tp_rank_inputs(inputs: dict, world: int, rank: int) -> dict:
    """This rank's shards of the weights and the whole input: the unsplit MLP is never sent."""
    c = inputs["cases"][world]
    shard = tensor_parallel.shard_mlp(tensor_parallel.make_mlp(c["seed"], c["d_model"], c["d_hidden"]), rank,
                                      c["world"])
    x, dy = tensor_parallel._inputs(c["seed"], c["tokens"], c["d_model"])
    return {**{k: shard[k] for k in WEIGHTS}, "x": x, "dy": dy}


def tp_label(case: dict) -> str:
    return f"{case['world']} ranks, d_model {case['d_model']}, d_hidden {case['d_hidden']}"


def allreduce_problem(records: list[dict], tokens: int, d_model: int) -> str | None:
    """One all-reduce of the activations (tokens x d_model) in forward, one in backward, nothing else."""
    problem = traffic.barrier_problem(records, 3)
    if problem:
        return problem
    construct, forward, backward, after = traffic.phases(records)
    for name, ops in (("construction", construct), ("after backward", after)):
        if ops:
            return f"{traffic.shown_ops(ops)} in {name}"
    for name, ops in (("forward", forward), ("backward", backward)):
        shapes = [(r["op"], int(r["numel"])) for r in ops]
        if shapes != [("all_reduce", tokens * d_model)]:
            return (f"{traffic.shown_ops(ops)} in {name}; the column- then row-parallel MLP needs exactly one "
                    f"all-reduce of the {tokens} x {d_model} activations in each pass")
    return None


def tp_check(inputs: dict, outputs, params: dict, observed) -> Verdict:
    """Half for the output and gradients of the unsplit MLP, half for what the relay carried."""
    cases = inputs["cases"]

    def check_one(i: int) -> None:
        c = cases[i]
        tensor_parallel.check_tp(outputs[i], c["seed"], c["tokens"], c["d_model"], c["d_hidden"])

    parity = per_case([tp_label(c) for c in cases], check_one)
    if parity.fraction < 1:
        return Verdict(parity.fraction / 2, parity.reason)
    problems = [f"{tp_label(c)}: {p}" for c, world in zip(cases, observed.worlds, strict=True)
                if (p := allreduce_problem(world["records"], c["tokens"], c["d_model"]))]
    if problems:
        return Verdict(0.5, f"output and gradients correct, but {problems[0]} (the relay's log)")
    return Verdict.passed(f"output and gradients equal the unsplit MLP on {len(cases)} hidden "
                          f"world{'s' * (len(cases) != 1)}; the relay saw one all-reduce in forward and one in "
                          "backward")
