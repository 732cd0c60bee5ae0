"""Lab 07's data-parallel items: the DDP wrappers, the parameter server and ZeRO-1.

Inputs are drawn here from the secret seed, and each rank is sent only its own part: its slice of
the batch and the weights it starts from (which differ per rank: a wrapper must broadcast rank 0's).
Parity is judged against references computed here. What crossed between the ranks (each step's
all-reduces, ZeRO's broadcasts from each parameter's owner) is read from the relay's log
(``traffic.py``); a memory world's peak comes from each rank child's cgroup. What only a rank can
count (the marks around its backward, the server's staleness, the optimizer state it holds) is
self-reported: it can cost at most ``SELF_REPORTED`` points of an item.
"""

from __future__ import annotations

import functools
import json
import random
from collections import Counter

import torch

from autograder.engine.items import Verdict
from autograder.labs._common import per_case
from autograder.labs.lab07_distributed import traffic
from autograder.labs.lab07_distributed.ranks import memory_blocks
from fastdl_lab import checks
from fastdl_lab.distributed import ddp, ps, watch, zero

# The most points of an item that a figure counted inside a rank can cost.
SELF_REPORTED = 1.0


def self_reported_fraction(points: float) -> float:
    """What is left of an item whose self-reported figure alone is wrong."""
    return max(0.0, 1 - SELF_REPORTED / points)


def _model_fn(case: dict, rank: int | None = None):
    """Every hidden model starts differently on every rank (weights and a buffer): a wrapper that
    forgets to broadcast rank 0's state trains replicas that disagree. ``rank=0``: rank 0's model."""
    return functools.partial(ddp.rank_skewed_mlp, case["seed"], case["d_in"], case["d_hidden"], case["d_out"],
                             rank=rank)


def _data(case: dict):
    return ddp.make_regression(case["seed"], case["n"], case["d_in"], case["d_out"])


def training_cases(seed: int, params: dict) -> dict:
    rng = random.Random(seed)
    cases = []
    for world, extra in params["worlds"]:
        d_in, d_hidden, d_out = rng.randint(5, 12), rng.randint(8, 20), rng.randint(2, 4)
        cases.append({"seed": rng.randint(0, 10_000), "d_in": d_in, "d_hidden": d_hidden, "d_out": d_out,
                      "n": world * rng.randint(6, 12), "steps": int(params.get("steps", 4)),
                      "lr": rng.choice([0.05, 0.1, 0.2]), "world": world, "extra": extra})
    return {"cases": cases}


def case_sizes(inputs: dict) -> list[int]:
    return [c["world"] for c in inputs["cases"]] + ([inputs["memory"]["world"]] if "memory" in inputs else [])


def label(case: dict) -> str:
    extra = f", bucket_bytes={case['extra']}" if case["extra"] else ""
    return f"{case['world']} ranks{extra}"


def _shard(data, rank: int, world: int):
    x, y = ddp._shard(data, rank, world)
    return x.clone(), y.clone()


# --- DDP wrappers: per parameter, then bucketed ----------------------------------------------


def ddp_rank_inputs(class_name: str):
    def make(inputs: dict, world: int, rank: int) -> dict:
        c = inputs["cases"][world]
        x, y = _shard(_data(c), rank, c["world"])
        case = {k: c[k] for k in ("d_in", "d_hidden", "d_out", "steps", "lr", "extra")}
        return {"class_name": class_name, "case": case, "state": ddp._detached_state(_model_fn(c, rank=rank)()),
                "x": x, "y": y}
    return make


def _shown(sizes: list[int]) -> str:
    return f"{sizes[:8]}{'...' if len(sizes) > 8 else ''}"


def layout_problem(records: list[dict], expected: list[int], steps: int, ordered: bool) -> str | None:
    """What is wrong with the all-reduces the relay carried, step by step, if anything: one per
    expected unit (``expected`` elements each, in this order if ``ordered``) and nothing else."""
    problem = traffic.barrier_problem(records, steps + 1)
    if problem:
        return problem
    phases = traffic.phases(records)
    for step in range(steps):
        ops = phases[step + 1]
        others = [r for r in ops if r["op"] != "all_reduce"]
        if others:
            return f"step {step}: {traffic.shown_ops(others)} beside the all-reduces"
        sizes = [int(r["numel"]) for r in ops]
        if (sizes if ordered else sorted(sizes)) != (expected if ordered else sorted(expected)):
            return f"step {step}: all-reduces of {_shown(sizes)} elements; expected {_shown(expected)}"
    if phases[-1]:
        return f"{traffic.shown_ops(phases[-1])} after the last step's synchronisation"
    return None


def late_problem(records: list[dict], world_size: int, steps: int) -> str | None:
    """All-reduces a rank's own marks place outside its step's backward (self-reported)."""
    phases = traffic.phases(records)
    for rank in range(world_size):
        marks = traffic.marks(records, rank)
        for step in range(steps):
            began, ended = marks.get(f"backward {step}"), marks.get(f"finish {step}")
            calls = phases[step + 1]
            if began is None or ended is None:
                return f"rank {rank}, step {step}: the rank's marks around its backward are missing"
            late = [r for r in calls if not began <= r["arrived_s"].get(rank, -1.0) <= ended]
            if late:
                return (f"rank {rank}, step {step}: {len(late)} of {len(calls)} all-reduces reached the relay "
                        "after the rank's backward had ended (no overlap: launch them from the gradient hooks)")
    return None


def _wrapper_verdict(inputs: dict, outputs, observed, expected_units, ordered: bool, what: str,
                     points: float) -> Verdict:
    """Parity from skewed starts first (per case), then what the relay carried, then the overlap
    the ranks' own marks show."""
    cases = inputs["cases"]

    def check_one(i: int) -> None:
        c, trials = cases[i], outputs[i]
        reference = ddp.train_reference(_model_fn(c, rank=0), _data(c), c["steps"], c["lr"])
        watch.check_trials(trials, _model_fn(c, rank=0), reference, name=f"{label(c)}:")

    parity = per_case([label(c) for c in cases], check_one)
    if parity.fraction < 1:
        return parity
    for c, world in zip(cases, observed.worlds, strict=True):
        problem = layout_problem(world["records"], expected_units(c), c["steps"], ordered)
        if problem is not None:
            return Verdict(0.5, f"replicas correct from skewed starts, but {label(c)}: {problem} (the relay's log)")
    for c, world in zip(cases, observed.worlds, strict=True):
        problem = late_problem(world["records"], c["world"], c["steps"])
        if problem is not None:
            return Verdict(self_reported_fraction(points),
                           f"replicas correct and the relay saw {what}, but {label(c)}: {problem} "
                           "(self-reported: the rank's own marks)")
    return Verdict.passed(f"parity on {len(cases)} hidden worlds whose ranks start apart; the relay saw {what}; "
                          "all launched during backward (self-reported by the ranks' marks)")


def ddp_check(inputs: dict, outputs, params: dict, observed, points: float = 3) -> Verdict:
    def per_parameter(c: dict) -> list[int]:
        return [p.numel() for p in _model_fn(c, rank=0)().parameters()]

    return _wrapper_verdict(inputs, outputs, observed, per_parameter, False, "one all-reduce per parameter and step",
                            points)


def bucketed_check(inputs: dict, outputs, params: dict, observed, points: float = 3) -> Verdict:
    def buckets(c: dict) -> list[int]:
        return ddp.bucket_sizes(_model_fn(c, rank=0)(), c["extra"])

    return _wrapper_verdict(inputs, outputs, observed, buckets, True,
                            "one all-reduce per bucket and step, in bucket order", points)


# --- parameter server ------------------------------------------------------------------------


def ps_inputs(seed: int, params: dict) -> dict:
    rng = random.Random(seed)
    probes = []
    for _ in range(40):
        tau = rng.randint(0, 8)
        server = rng.randint(0, 200)
        probes.append((server, max(0, server - rng.randint(0, tau + 2)), tau))
    runs = [dict(run, seed=rng.randint(0, 1000)) for run in params["runs"]]
    return {"probes": probes, "runs": runs}


def ps_groups(inputs: dict) -> list[list[int]]:
    """The runs each world holds, one after another: runs of the same size share a world (a world
    costs its ranks' start, more than a short run)."""
    groups: dict[int, list[int]] = {}
    for i, run in enumerate(inputs["runs"]):
        groups.setdefault(run["world"], []).append(i)
    return list(groups.values())


def ps_sizes(inputs: dict) -> list[int]:
    return [inputs["runs"][group[0]]["world"] for group in ps_groups(inputs)]


def ps_rank_inputs(inputs: dict, world: int, rank: int) -> dict:
    # The rule's answers come from one rank: the others need not see the probes.
    return {"runs": [inputs["runs"][i] for i in ps_groups(inputs)[world]],
            "probes": inputs["probes"] if (world, rank) == (0, 0) else []}


def _served_runs(inputs: dict, outputs, observed) -> tuple[list[tuple[dict, dict]], str | None]:
    """Each run with what its server's rank returned, once the relay (trusted) has seen only point
    to point messages and one barrier after each run; else the problem."""
    runs = []
    for group, per_rank, world in zip(ps_groups(inputs), outputs, observed.worlds, strict=True):
        if any(r["op"] != "barrier" for r in traffic.collectives(world["records"])):
            return [], "the relay saw a collective in a parameter server's run, which is point to point"
        problem = traffic.barrier_problem(world["records"], len(group))
        if problem:
            return [], problem
        runs += [(inputs["runs"][i], per_rank[0]["results"][j]) for j, i in enumerate(group)]
    return runs, None


def _answers_problem(inputs: dict, outputs, reference, shown) -> str | None:
    """The rule's answers to the hidden probes, against the course's rule (judged here)."""
    answers = outputs[0][0]["answers"]
    if len(answers) != len(inputs["probes"]):
        return "the rule was not answered for every hidden case"
    for probe, answer in zip(inputs["probes"], answers, strict=True):
        if bool(answer) != reference(*probe):
            return f"{shown(*probe)} returned {bool(answer)}"
    return None


def ps_check(inputs: dict, outputs, params: dict, observed) -> Verdict:
    """The rule's answers (values) decide; the servers' records of what they applied are counted in
    the server's rank (self-reported) and can only take the point away."""
    problem = _answers_problem(inputs, outputs, ps.bounded_staleness_rule_ref,
                               lambda server, gradient, tau: f"bounded_staleness_rule(server_version={server}, "
                                                             f"gradient_version={gradient}, tau={tau})")
    if problem:
        return Verdict.failed(problem)
    runs, problem = _served_runs(inputs, outputs, observed)
    if problem:
        return Verdict.failed(problem)
    for run, server in runs:
        worst = max(server["staleness"], default=0)
        if worst > run["tau"]:
            return Verdict.failed(f"a gradient {worst} versions old was applied with tau={run['tau']} (self-reported "
                                  "by the server's rank)")
        if not ps.converged(server):
            return Verdict(0.5, f"staleness bounded, but the loss {server['loss']:.4f} did not approach the optimum "
                                f"{server['optimal_loss']:.4f} (tau={run['tau']}; self-reported by the server's rank)")
    return Verdict.passed(f"rule correct on {len(inputs['probes'])} hidden cases; {len(inputs['runs'])} servers never "
                          "exceeded tau and converged (self-reported by the server's rank)")


# --- stale synchronous parallel -----------------------------------------------------------------


def ssp_inputs(seed: int, params: dict) -> dict:
    """Clocks of 2 to 5 workers, most within a few iterations of the slowest, so that the cases sit
    around the bound: exactly tau ahead, one more, the slowest itself."""
    rng = random.Random(seed)
    probes = []
    for _ in range(40):
        tau, workers = rng.randint(0, 4), rng.randint(2, 5)
        slowest = rng.randint(0, 60)
        clocks = [slowest + rng.randint(0, tau + 2) for _ in range(workers)]
        clocks[rng.randrange(workers)] = slowest
        probes.append((clocks, rng.randrange(workers), tau))
    runs = [dict(run, seed=rng.randint(0, 1000)) for run in params["runs"]]
    return {"probes": probes, "runs": runs}


def ssp_check(inputs: dict, outputs, params: dict, observed) -> Verdict:
    """As ``ps_check``: the start rule's answers decide; what the servers recorded (each gradient's
    clock gap, the gradients discarded, a deadlock, the loss) is self-reported by the server's rank
    and can only take the point away."""
    problem = _answers_problem(inputs, outputs, ps.ssp_may_start_ref,
                               lambda clocks, worker, tau: f"ssp_may_start(clocks={clocks}, worker={worker}, tau={tau})")
    if problem:
        return Verdict.failed(problem)
    runs, problem = _served_runs(inputs, outputs, observed)
    if problem:
        return Verdict.failed(problem)
    for run, server in runs:
        tau = run["tau"]
        if server["deadlocked"]:
            return Verdict.failed(f"every worker was held at once with tau={tau}: the rule let nobody start "
                                  "(self-reported by the server's rank)")
        worst = max(server["clock_gaps"], default=0)
        if worst > tau:
            return Verdict.failed(f"a worker started an iteration {worst} ahead of the slowest with tau={tau} "
                                  "(self-reported by the server's rank)")
        if server["rejected"]:
            return Verdict.failed(f"{server['rejected']} gradients were discarded; SSP applies every gradient "
                                  "(self-reported by the server's rank)")
        if not ps.converged(server):
            return Verdict(0.5, f"clock gaps bounded, but the loss {server['loss']:.4f} did not approach the optimum "
                                f"{server['optimal_loss']:.4f} (tau={tau}; self-reported by the server's rank)")
    return Verdict.passed(f"start rule correct on {len(inputs['probes'])} hidden cases; {len(inputs['runs'])} SSP "
                          "servers kept every worker within tau iterations of the slowest, discarded nothing and "
                          "converged (self-reported by the server's rank)")


# --- ZeRO-1 ----------------------------------------------------------------------------------


def zero_inputs(seed: int, params: dict) -> dict:
    """Per world, AdamW with weight decay and SGD with momentum, hyperparameters from the seed;
    with ``params["memory"]`` a last world trains a model large enough for its ranks' memory peaks
    to show unsharded optimizer state."""
    cases = training_cases(seed, params)["cases"]
    rng = random.Random(seed + 1)
    for c in cases:
        c["runs"] = [["AdamW", {"lr": rng.choice([0.01, 0.02, 0.05]), "weight_decay": rng.choice([0.01, 0.05, 0.1]),
                                "betas": rng.choice([(0.9, 0.999), (0.8, 0.99)])}],
                     ["SGD", {"lr": rng.choice([0.05, 0.1]), "momentum": rng.choice([0.8, 0.9]),
                              "nesterov": rng.random() < 0.5, "weight_decay": rng.choice([0.0, 0.01])}]]
    found = {"cases": cases}
    if "memory" in params:
        found["memory"] = memory_spec(params["memory"])
    return found


def memory_spec(raw: dict) -> dict:
    """A memory world's sizes, from the profile alone (its reference run serves every student)."""
    return {"world": int(raw.get("world", 2)), "width": int(raw["width"]), "layers": int(raw.get("layers", 4)),
            "rows": int(raw.get("rows", 4)), "steps": int(raw.get("steps", 2)), "seed": int(raw.get("seed", 7)),
            "lr": float(raw.get("lr", 0.01)), "optimizer": "AdamW", "defaults": {"lr": float(raw.get("lr", 0.01))}}


def memory_data(spec: dict):
    return ddp.make_regression(spec["seed"], spec["world"] * spec["rows"], spec["width"], spec["width"])


def zero_rank_inputs(inputs: dict, world: int, rank: int) -> dict:
    if world == len(inputs["cases"]):
        spec = inputs["memory"]
        x, y = _shard(memory_data(spec), rank, spec["world"])
        return {"memory": spec, "x": x, "y": y}
    c = inputs["cases"][world]
    x, y = _shard(_data(c), rank, c["world"])
    case = {k: c[k] for k in ("d_in", "d_hidden", "d_out", "steps", "runs")}
    return {"case": case, "state": ddp._detached_state(_zero_model_fn(c)()), "x": x, "y": y}


def zero_reference_worlds(inputs: dict) -> list[int]:
    return [len(inputs["cases"])] if "memory" in inputs else []


def _zero_model_fn(case: dict):
    return functools.partial(ddp.small_mlp, case["seed"], case["d_in"], case["d_hidden"], case["d_out"])


def broadcast_problem(phase: list[dict], numels: list[int], world_size: int) -> str | None:
    """A ``step()``'s traffic: one broadcast of every parameter from its owner under the
    largest-first partition (``zero.owners_ref``), and nothing else."""
    owners = zero.owners_ref(numels, world_size)
    expected = Counter(zip(numels, owners))
    others = [r for r in phase if r["op"] != "broadcast"]
    if others:
        return f"step() made {traffic.shown_ops(others)}; it broadcasts each parameter from its owner, nothing else"
    got = Counter((int(r["numel"]), r["src"]) for r in phase)
    if got != expected:
        missing = sorted((expected - got).elements())[:3]
        return (f"step() broadcast {len(phase)} tensors, not one per parameter from its owner (missing "
                f"(elements, owner) {missing})")
    return None


def _zero_values(per_rank: list, j: int, case: dict, opt_name: str, defaults: dict, name: str) -> None:
    """Every rank's weights are bit for bit the unsharded optimizer's on rank 0's averaged gradients."""
    results = [r[j] for r in per_rank]
    model = _zero_model_fn(case)()
    params = list(model.parameters())
    start = ddp._detached_state(model)
    zero._check_grads(results[0], params, case["steps"], name)
    reference = zero.replay_reference(_zero_model_fn(case), results[0]["grads"], zero.optimizer_class(opt_name),
                                      defaults)
    zero.check_states(results, reference["state"], start, name, opt_name)


def _zero_runs(inputs: dict) -> list[tuple[int, int, str, dict]]:
    return [(i, j, name, defaults) for i, c in enumerate(inputs["cases"])
            for j, (name, defaults) in enumerate(c["runs"])]


def zero_check(inputs: dict, outputs, params: dict, observed, points: float = 2) -> Verdict:
    """Per world and optimizer: bit-identical weights and, in the relay's log, each parameter
    broadcast from its owner at every ``step()``. Then the memory world: every rank's cgroup peak
    within half the unsharded state of the course's ZeRO-1 on the same world. Last, the state each
    optimizer held as watched inside the rank (self-reported)."""
    cases, runs = inputs["cases"], _zero_runs(inputs)

    def check_one(k: int) -> None:
        i, j, opt_name, defaults = runs[k]
        c = cases[i]
        name = f"Zero1 ({opt_name}, {c['world']} ranks)"
        _zero_values(outputs[i], j, c, opt_name, defaults, name)
        records = observed.worlds[i]["records"]
        per_run = 1 + 2 * c["steps"]
        problem = traffic.barrier_problem(records, per_run * len(c["runs"]))
        phases = traffic.phases(records)
        numels = [p.numel() for p in _zero_model_fn(c)().parameters()]
        for step in range(c["steps"]):
            problem = problem or broadcast_problem(phases[j * per_run + 2 + 2 * step], numels, c["world"])
        if problem:
            raise checks.MismatchError(f"{name}: {problem} (the relay's log)")

    verdict = per_case([f"{name}, {cases[i]['world']} ranks" for i, _, name, _ in runs], check_one)
    if verdict.fraction < 1:
        return verdict
    if "memory" in inputs:
        problem = zero_memory_problem(inputs["memory"], outputs[-1], observed.worlds[-1], observed.reference,
                                      len(cases))
        if problem:
            return Verdict.failed(problem)
    for k, (i, j, opt_name, defaults) in enumerate(runs):
        c = cases[i]
        try:
            zero.check_zero([r[j] for r in outputs[i]], _zero_model_fn(c), opt_name, defaults, c["steps"],
                            name=f"Zero1, {c['world']} ranks")
        except AssertionError as exc:
            return Verdict(self_reported_fraction(points),
                           f"weights bit-identical and every parameter broadcast from its owner, but "
                           f"{str(exc)[:300]} (self-reported: the optimizer state as the rank watched it)")
    memory = " and each rank's memory peak within the sharded reference's" if "memory" in inputs else ""
    return Verdict.passed(f"bit-identical to AdamW and SGD on {len(runs)} hidden runs; the relay saw each parameter "
                          f"broadcast from its owner{memory}; each parameter's state on one rank (self-reported)")


@functools.lru_cache(maxsize=8)
def _memory_reference_sums(spec_json: str) -> list[list[float]]:
    """The memory world's weights after full-batch AdamW in this process: per parameter, sum and
    sum of squares (as the ranks return them)."""
    spec = json.loads(spec_json)
    model = torch.nn.Sequential(*memory_blocks(spec))
    x, y = memory_data(spec)
    opt = torch.optim.AdamW(model.parameters(), **spec["defaults"])
    for _ in range(spec["steps"]):
        opt.zero_grad(set_to_none=True)
        ddp._loss(model, x, y).backward()
        opt.step()
    return [[float(p.detach().double().sum()), float(p.detach().double().square().sum())] for p in model.parameters()]


def sums_problem(got, want: list[list[float]], what: str) -> str | None:
    """Whether a memory world's weights (per tensor: sum, sum of squares) are the reference's."""
    if not isinstance(got, list) or len(got) != len(want):
        return f"{what}: returned no weights of the model's shape"
    for k, ((s, sq), (s_ref, sq_ref)) in enumerate(zip(got, want)):
        scale = max(sq_ref, 1e-12) ** 0.5
        if abs(sq - sq_ref) > 1e-4 * sq_ref + 1e-9 or abs(s - s_ref) > 1e-4 * scale + 1e-9:
            return f"{what}: tensor {k}'s weights are not those of the optimizer after its steps"
    return None


def peak_problem(world: dict, reference: dict, slack: list[int], what: str) -> str | None:
    """A rank whose cgroup memory peak exceeds the reference rank's by more than its ``slack``."""
    mine, theirs = traffic.peaks(world), traffic.peaks(reference)
    sources = {r.get("peak_source") for r in world["ranks"] + reference["ranks"]}
    source = "its cgroup's peak" if sources == {"cgroup"} else "its sampled resident memory"
    for rank, (got, base, room) in enumerate(zip(mine, theirs, slack, strict=True)):
        if got > base + room:
            return (f"rank {rank}'s memory peak is {(got - base) / 2**20:.1f} MiB above the sharded reference's on the "
                    f"same model ({what}; measured outside the rank: {source})")
    return None


def zero_memory_problem(spec: dict, per_rank: list, world: dict, reference: dict, index: int) -> str | None:
    want = _memory_reference_sums(json.dumps(spec, sort_keys=True))
    for rank, result in enumerate(per_rank):
        problem = sums_problem(result.get("sums") if isinstance(result, dict) else None, want,
                               f"the memory world, rank {rank}")
        if problem:
            return problem
    numels = [spec["width"] ** 2, spec["width"]] * spec["layers"]
    owners = zero.owners_ref(numels, spec["world"])
    # AdamW keeps two moments of four bytes per element: a rank that kept them for every parameter
    # would hold 8 bytes per element it does not own beyond its share. Half of that is allowed.
    slack = [4 * sum(n for n, owner in zip(numels, owners) if owner != rank) for rank in range(spec["world"])]
    return peak_problem(world, reference["worlds"][index], slack, "AdamW's state kept for parameters other ranks own")
