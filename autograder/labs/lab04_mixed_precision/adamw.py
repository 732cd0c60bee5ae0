"""Lab 04 items on the fused optimizer: the one-launch AdamW kernel, the optimizer class around it,
and its speed on GPU profiles.

The optimizer class is judged on two things. Its parameters after several steps, on many tensors
and on parameter groups with their own hyper-parameters, against ``torch.optim.AdamW`` replayed by
the parent: one point, on values the parent recomputes. Its kernel launches and torch ops per
step, counted in the child by a stand-in for the kernel and a dispatch mode: figures of the
student's own process, so self-reported, one point, given only with right values."""

from __future__ import annotations

import random

import torch

from autograder.engine.items import Verdict
from autograder.labs._common import failure_text, on_device, per_case, require_tensor, triton_kernel
from autograder.labs.lab04_mixed_precision.shared import generator
from fastdl_lab import checks

# Bound before any student cell runs (see lab01_gemm).
from fastdl_lab.optim import fused_adamw as _fused_adamw

KERNEL = "fused_adamw_kernel"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.05}

# --- fused AdamW kernel -----------------------------------------------------------------------


def _tensors(gen: torch.Generator, shapes) -> list[torch.Tensor]:
    return [torch.randn(*shape, generator=gen) for shape in shapes]


def adamw_inputs(seed: int, params: dict) -> dict:
    gen, rng = generator(seed), random.Random(seed)
    steps = int(params.get("steps", 6))
    groups = []
    for dtype, master, shapes in params.get("groups", [
            ["float32", False, [[1], [37], [5, 7], [300], [3, 4, 5], [1030]]],
            ["bfloat16", True, [[17], [64, 3], [513]]],
            ["float16", True, [[9, 9], [260]]]]):
        shapes = [[max(1, d + rng.randint(-2, 2)) for d in s] for s in shapes]
        groups.append({"dtype": dtype, "master": master, "init": _tensors(gen, shapes),
                       "grads": [_tensors(gen, shapes) for _ in range(steps)]})
    return {"groups": groups, "block": int(params.get("block", 256)), **HYPER}


def _run_fused(inputs: dict, group: dict, kernel) -> dict:
    dtype = DTYPES[group["dtype"]]
    masters = [on_device(t.clone()) for t in group["init"]] if group["master"] else None
    params = [on_device(t.to(dtype)) for t in group["init"]]
    m = [torch.zeros_like(t, dtype=torch.float32) for t in params]
    v = [torch.zeros_like(t, dtype=torch.float32) for t in params]
    for step, grads in enumerate(group["grads"], 1):
        _fused_adamw(params, [on_device(g.to(dtype)) for g in grads], m, v, step, masters=masters, kernel=kernel,
                     block=inputs["block"], **{k: inputs[k] for k in HYPER})
    return {"params": [p.cpu() for p in params], "masters": None if masters is None else [t.cpu() for t in masters]}


def adamw_drive(ns: dict, inputs: dict) -> list:
    kernel = triton_kernel(ns, KERNEL)
    return [_run_fused(inputs, group, kernel) for group in inputs["groups"]]


def _torch_adamw(inputs: dict, init: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """torch.optim.AdamW on fp32 copies: what the fp32 master weights must follow."""
    params = [t.clone().requires_grad_() for t in init]
    opt = torch.optim.AdamW(params, lr=inputs["lr"], betas=(inputs["beta1"], inputs["beta2"]), eps=inputs["eps"],
                            weight_decay=inputs["weight_decay"], foreach=False)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def adamw_check(inputs: dict, outputs, params: dict) -> Verdict:
    groups = inputs["groups"]
    if not isinstance(outputs, list) or len(outputs) != len(groups):
        return Verdict.failed(f"expected {len(groups)} parameter groups, got {type(outputs).__name__}")
    labels = [f"{g['dtype']} params{' + fp32 master' if g['master'] else ''} "
              f"{[tuple(t.shape) for t in g['init']]}" for g in groups]

    def check_one(i: int) -> None:
        group, got = groups[i], outputs[i]
        dtype = DTYPES[group["dtype"]]
        grads = [[g.to(dtype).float() for g in step] for step in group["grads"]]
        want = _torch_adamw(inputs, group["init"], grads)
        n = len(grads)
        for j, ref in enumerate(want):
            name = f"{labels[i]}: tensor {j} after {n} steps"
            if group["master"]:
                require_tensor(got["masters"][j], f"{name} (master)")
                checks.assert_close(got["masters"][j], ref, name=f"{name} (fp32 master)", atol=2e-5, rtol=1e-4)
            require_tensor(got["params"][j], name)
            if got["params"][j].dtype != dtype:
                raise AssertionError(f"{name}: the parameter became {got['params'][j].dtype}")
            # A 16-bit parameter is its master rounded once: within one unit in the last place
            # (the CPU interpreter truncates to bf16 where a GPU rounds to nearest).
            tol = 2e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
            checks.assert_close(got["params"][j].float(), ref.to(dtype).float(), name=name, atol=tol, rtol=tol)

    return per_case(labels, check_one)


# --- the optimizer around the kernel: one launch per step ---------------------------------------


class _LaunchCounter:
    """Stands in for the student's kernel in the namespace their optimizer runs in."""

    __slots__ = ("_kernel", "_state")

    def __init__(self, kernel, state: dict):
        self._kernel, self._state = kernel, state

    def __getitem__(self, grid):
        launch = self._kernel[grid]

        def counted(*args, **kwargs):
            self._state["launches"] += 1
            self._state["launching"] = True
            try:
                return launch(*args, **kwargs)
            finally:
                self._state["launching"] = False

        return counted


def _op_counter(state: dict):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class OpCounter(TorchDispatchMode):
        # Ops inside a launch belong to Triton's launcher (or the interpreter), not the step; ops on
        # scalars only (a step count kept as a tensor, as torch's own optimizers do) are bookkeeping.
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if not state["launching"] and any(isinstance(t, torch.Tensor) and t.numel() > 1
                                              for t in tree_leaves((args, kwargs, out))):
                state["ops"] += 1
            return out

    return OpCounter()


def optimizer_inputs(seed: int, params: dict) -> dict:
    gen, rng = generator(seed), random.Random(seed)
    steps = int(params.get("steps", 3))

    def shapes_of(count: int) -> list:
        return [[rng.randint(1, 40)] if rng.random() < 0.5 else [rng.randint(1, 9), rng.randint(1, 9)]
                for _ in range(count)]

    cases = []
    # One parameter group: the launch count's cases.
    for count in params.get("tensor_counts", [8, 64]):
        shapes = shapes_of(count)
        cases.append({"init": _tensors(gen, shapes), "grads": [_tensors(gen, shapes) for _ in range(steps)],
                      "groups": [list(range(count))], "group_hyper": [{}], "frozen": []})
    # Two groups with their own learning rate and weight decay, and tensors that never get a
    # gradient (torch's optimizers leave them, and their state, alone).
    count = int(params.get("group_tensors", 24))
    shapes, order = shapes_of(count), list(range(count))
    rng.shuffle(order)
    cases.append({"init": _tensors(gen, shapes), "grads": [_tensors(gen, shapes) for _ in range(steps)],
                  "groups": [sorted(order[: count // 2]), sorted(order[count // 2:])],
                  "group_hyper": [{}, {"lr": HYPER["lr"] * 0.5, "weight_decay": 0.0}],
                  "frozen": sorted(rng.sample(range(count), 3))})
    return {"cases": cases, **HYPER}


def _param_groups(case: dict, params: list) -> list[dict]:
    return [{"params": [params[i] for i in group], **hyper}
            for group, hyper in zip(case["groups"], case["group_hyper"])]


def _set_grads(case: dict, params: list, grads: list) -> None:
    frozen = set(case["frozen"])
    for i, (p, g) in enumerate(zip(params, grads)):
        if i not in frozen:
            p.grad = on_device(g.clone())


def optimizer_drive(ns: dict, inputs: dict) -> list:
    kernel = triton_kernel(ns, KERNEL)
    state = {"launches": 0, "ops": 0, "launching": False}
    ns[KERNEL] = _LaunchCounter(kernel, state)
    results = []
    for case in inputs["cases"]:
        params = [on_device(t.clone()).requires_grad_() for t in case["init"]]
        opt = ns["FusedAdamW"](_param_groups(case, params), lr=inputs["lr"], betas=(inputs["beta1"], inputs["beta2"]),
                               eps=inputs["eps"], weight_decay=inputs["weight_decay"])
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"FusedAdamW must be a torch.optim.Optimizer, not {type(opt).__name__}")
        per_step = []
        for grads in case["grads"]:
            _set_grads(case, params, grads)
            state.update(launches=0, ops=0)
            with _op_counter(state):
                opt.step()
            per_step.append([state["launches"], state["ops"]])
        results.append({"params": [p.detach().cpu() for p in params], "per_step": per_step})
    return results


def _torch_adamw_case(inputs: dict, case: dict) -> list[torch.Tensor]:
    """torch.optim.AdamW on the case's groups, with its frozen tensors never given a gradient."""
    params = [t.clone().requires_grad_() for t in case["init"]]
    opt = torch.optim.AdamW(_param_groups(case, params), lr=inputs["lr"], betas=(inputs["beta1"], inputs["beta2"]),
                            eps=inputs["eps"], weight_decay=inputs["weight_decay"], foreach=False)
    frozen = set(case["frozen"])
    for step_grads in case["grads"]:
        for i, (p, g) in enumerate(zip(params, step_grads)):
            if i not in frozen:
                p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def _case_label(case: dict) -> str:
    tensors = len(case["init"])
    if len(case["groups"]) == 1:
        return f"{tensors} tensors"
    return f"{tensors} tensors in {len(case['groups'])} groups, {len(case['frozen'])} without gradients"


def optimizer_check(inputs: dict, outputs, params: dict) -> Verdict:
    cases = inputs["cases"]
    if not isinstance(outputs, list) or len(outputs) != len(cases):
        return Verdict.failed(f"expected {len(cases)} runs, got {type(outputs).__name__}")
    steps = len(cases[0]["grads"])
    try:
        for case, got in zip(cases, outputs):
            want = _torch_adamw_case(inputs, case)
            for j, (g, w) in enumerate(zip(got["params"], want, strict=True)):
                require_tensor(g, f"tensor {j}")
                checks.assert_close(g, w, name=f"{_case_label(case)}, tensor {j} after {steps} steps",
                                    atol=2e-5, rtol=1e-4)
    except AssertionError as exc:
        return Verdict.failed(failure_text(exc))
    grouped = [c for c in cases if len(c["groups"]) > 1]
    values = (f"after {steps} steps on {', '.join(str(len(c['init'])) for c in cases)} tensors"
              + "".join(f" ({len(c['groups'])} groups, {len(c['frozen'])} without gradients)" for c in grouped[:1])
              + " the values are torch.optim.AdamW's (checked by the grader)")
    # The launch count's cases: one group each. These figures are counted in the student's own
    # process, so they carry the item's second point only, and the reason says so first.
    single = [i for i, case in enumerate(cases) if len(case["groups"]) == 1]
    counts = [len(cases[i]["init"]) for i in single]
    launches = [[int(step[0]) for step in outputs[i]["per_step"]] for i in single]
    ops = [[int(step[1]) for step in outputs[i]["per_step"]] for i in single]
    details = {"tensors": counts, "launches_per_step": launches, "ops_per_step": ops}
    told = "self-reported (counted in your process):"
    if any(n != 1 for run in launches for n in run):
        return Verdict(0.5, f"{values}; {told} launches per step {launches} for {counts} tensors, where a fused step "
                            "launches once", details)
    # The first step may create state tensor by tensor; later steps must not touch tensors one by one.
    grows = max(ops[-1][1:]) - max(ops[0][1:])
    if grows > int(params.get("op_slack", 6)):
        return Verdict(0.5, f"{values}; {told} one launch per step, but {max(ops[-1][1:])} torch ops for {counts[-1]} "
                            f"tensors against {max(ops[0][1:])} for {counts[0]}: per-tensor work is not fused", details)
    return Verdict.passed(f"{values}; {told} one launch per step for {counts} tensors, {max(ops[-1][1:])} other "
                          "torch ops per step", **details)


# --- speed ------------------------------------------------------------------------------------


def speed_inputs(seed: int, params: dict) -> dict:
    gen = generator(seed)
    shapes = params.get("shapes", [[256, 256]] * 4 + [[256]] * 8)
    return {"init": _tensors(gen, shapes), "grads": _tensors(gen, shapes), **HYPER}


def _speed_run(inputs: dict, step_fn):
    params = [on_device(t.clone()) for t in inputs["init"]]
    grads = [on_device(g) for g in inputs["grads"]]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    calls = [0]

    def one_step():
        calls[0] += 1
        step_fn(params, grads, m, v, calls[0])
        return {"params": params, "calls": calls[0]}

    return one_step


def speed_timed(ns: dict, inputs: dict):
    kernel = triton_kernel(ns, KERNEL)
    hyper = {k: inputs[k] for k in HYPER}
    return _speed_run(inputs, lambda p, g, m, v, step: _fused_adamw(p, g, m, v, step, kernel=kernel, **hyper))


def speed_baseline(_ns: dict, inputs: dict):
    from fastdl_lab.optim import adamw_foreach

    hyper = {k: inputs[k] for k in HYPER}
    return _speed_run(inputs, lambda p, g, m, v, step: adamw_foreach(p, g, m, v, step, **hyper))


def speed_check(inputs: dict, outputs, params: dict) -> Verdict:
    calls = int(outputs["calls"])
    if not 0 < calls <= 10_000:
        return Verdict.failed(f"the timed step reports {calls} calls")
    want = _torch_adamw(inputs, inputs["init"], [inputs["grads"]] * calls)
    try:
        for j, (got, ref) in enumerate(zip(outputs["params"], want, strict=True)):
            require_tensor(got, f"tensor {j}")
            checks.assert_close(got.cpu(), ref, name=f"tensor {j} after {calls} timed steps", atol=1e-4, rtol=1e-3)
    except AssertionError as exc:
        return Verdict.failed(failure_text(exc))
    return Verdict.passed(f"{calls} timed steps match torch.optim.AdamW")
