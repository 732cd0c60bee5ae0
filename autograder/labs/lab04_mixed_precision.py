"""Graded items of lab 04 mixed precision: bytes per parameter, a dynamic loss scaler, an AMP
training step, a one-launch fused AdamW kernel and the optimizer around it.

Every item here grades extracted code: the student's classes and functions are screened and run
on their own (``Item.artefacts``), the kernel on its own (``Item.kernels``). No other code of the
notebook runs in the grading child, so what the drivers count (launches, dispatched ops, skipped
steps) is counted by trusted code the submission cannot reach.
"""

from __future__ import annotations

import random

import torch
from torch import nn

from autograder.engine.items import Item, LabSpec, Verdict
from autograder.labs._common import failure_text, on_device, per_case, require_tensor, triton_kernel
from fastdl_lab import checks

# Bound before any student code runs (see lab01_gemm).
from fastdl_lab.optim import fused_adamw as _fused_adamw

SCOPE = (
    "import math\nimport torch\nimport torch.nn.functional as F\nfrom torch import nn\n"
    "import triton\nimport triton.language as tl\nfrom fastdl_lab.optim import multi_tensor_table\n"
)
KERNEL = "fused_adamw_kernel"
# torch.amp, GradScaler, the package's DynamicLossScaler, Adam and AdamW in any of their homes.
LIBRARY = r"^amp$|scaler|adam"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.05}


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed % (1 << 63))


# --- bytes per parameter ----------------------------------------------------------------------

STORAGE = ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")
MOMENTS = ("fp32", "bf16", "fp16", "int8")
OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw")
COMPONENTS = ("params", "grads", "master", "optimizer", "total")


def bytes_inputs(seed: int, params: dict) -> dict:
    rng = random.Random(seed)
    recipes = []
    for _ in range(int(params.get("recipes", 16))):
        recipe = {"param": rng.choice(STORAGE), "grad": rng.choice(STORAGE),
                  "master": rng.choice([None, "fp32", "fp32", "bf16"]), "optimizer": rng.choice(OPTIMIZERS),
                  "moments": rng.choice(MOMENTS)}
        if recipe["moments"] == "int8":
            recipe["block"] = rng.choice([64, 256, 2048])
        recipes.append(recipe)
    return {"recipes": recipes}


def bytes_drive(ns: dict, inputs: dict) -> list:
    answers = []
    for recipe in inputs["recipes"]:
        got = ns["bytes_per_param"](dict(recipe))
        answers.append([float(got[key]) for key in COMPONENTS])
    return answers


def bytes_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab.amp import bytes_per_param_ref

    recipes = inputs["recipes"]
    if not isinstance(outputs, list) or len(outputs) != len(recipes):
        return Verdict.failed(f"expected {len(recipes)} answers, got {type(outputs).__name__}")
    right, first = 0, None
    for recipe, got in zip(recipes, outputs):
        want = bytes_per_param_ref(recipe)
        wrong = [f"{key} {float(g):g} (expected {want[key]:g})" for key, g in zip(COMPONENTS, got, strict=True)
                 if abs(float(g) - want[key]) > 1e-9 * max(1.0, want[key])]
        right += not wrong
        if wrong and first is None:
            first = f"for {recipe}: " + ", ".join(wrong)
    if first is None:
        return Verdict.passed(f"bytes per parameter right for all {len(recipes)} hidden recipes")
    return Verdict(right / len(recipes), f"{right}/{len(recipes)} hidden recipes right; first wrong {first}")


# --- dynamic loss scaler ----------------------------------------------------------------------


def _tiny_model(gen: torch.Generator, dims: tuple[int, int, int]) -> dict:
    d_in, d_hidden, d_out = dims
    return {"w1": torch.randn(d_hidden, d_in, generator=gen) * 0.3, "b1": torch.zeros(d_hidden),
            "w2": torch.randn(d_out, d_hidden, generator=gen) * 0.3}


def _build(state: dict) -> nn.Module:
    w1, b1, w2 = state["w1"], state["b1"], state["w2"]
    model = nn.Sequential(nn.Linear(w1.shape[1], w1.shape[0]), nn.Tanh(), nn.Linear(w2.shape[1], w2.shape[0], bias=False))
    with torch.no_grad():
        model[0].weight.copy_(w1)
        model[0].bias.copy_(b1)
        model[2].weight.copy_(w2)
    return model.to("cuda" if torch.cuda.is_available() else "cpu")


class _Overflow:
    """Makes chosen steps' gradients non-finite from inside backward, as an overflow would."""

    def __init__(self, model: nn.Module, script: dict[int, str]):
        self.step, self.script = 0, script
        model[0].weight.register_hook(self._hook)

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        bad = self.script.get(self.step)
        if bad is None:
            return grad
        grad = grad.clone()
        grad.view(-1)[self.step % grad.numel()] = float(bad)
        return grad


def scaler_inputs(seed: int, params: dict) -> dict:
    rng, gen = random.Random(seed), _generator(seed)
    runs = []
    for clip in (None, 0.5):
        steps = int(params.get("steps", 14))
        script = {}
        for s in range(steps):
            if rng.random() < 0.3:
                script[s] = rng.choice(["inf", "-inf", "nan"])
        script.setdefault(rng.randrange(steps), "inf")
        runs.append({
            "model": _tiny_model(gen, (6, 12, 3)), "x": torch.randn(steps, 8, 6, generator=gen),
            "y": torch.randn(steps, 8, 3, generator=gen), "script": sorted(script.items()), "clip": clip,
            "init_scale": 2.0 ** rng.randint(4, 16), "growth_factor": rng.choice([2.0, 4.0]),
            "backoff_factor": rng.choice([0.5, 0.25]), "growth_interval": rng.randint(2, 4)})
    return {"runs": runs}


def _scripted_run(run: dict, scaler) -> dict:
    model = _build(run["model"])
    overflow = _Overflow(model, dict(run["script"]))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    stepped, scales = [], []
    real_step = opt.step

    def counted_step(*args, **kwargs):
        stepped[-1] = True
        return real_step(*args, **kwargs)

    opt.step = counted_step
    for s, (x, y) in enumerate(zip(run["x"], run["y"])):
        overflow.step = s
        stepped.append(False)
        loss = ((model(on_device(x)) - on_device(y)) ** 2).mean()
        scaler.scale(loss).backward()
        if run["clip"] is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), run["clip"])
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(float(scaler.get_scale()))
    return {"scales": scales, "stepped": stepped, "params": [p.detach().cpu() for p in model.parameters()]}


def _scaler_args(run: dict) -> dict:
    return {k: run[k] for k in ("init_scale", "growth_factor", "backoff_factor", "growth_interval")}


def scaler_drive(ns: dict, inputs: dict) -> list:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return [_scripted_run(run, ns["DynamicLossScaler"](device=device, **_scaler_args(run))) for run in inputs["runs"]]


def scaler_check(inputs: dict, outputs, params: dict) -> Verdict:
    runs = inputs["runs"]
    if not isinstance(outputs, list) or len(outputs) != len(runs):
        return Verdict.failed(f"expected {len(runs)} runs, got {type(outputs).__name__}")
    labels = [f"run {i + 1} ({'clipping' if r['clip'] else 'no clipping'}, overflows at steps "
              f"{[s for s, _ in r['script']]})" for i, r in enumerate(runs)]

    def check_one(i: int) -> None:
        want = _scripted_run(runs[i], torch.amp.GradScaler("cpu", **_scaler_args(runs[i])))
        got = outputs[i]
        for s, (g, w) in enumerate(zip(got["scales"], want["scales"], strict=True)):
            if float(g) != w:
                raise AssertionError(f"{labels[i]}: scale after step {s} is {float(g):g}, GradScaler has {w:g} "
                                     f"(scales so far {want['scales'][:s + 1]})")
        skipped = [s for s, done in enumerate(got["stepped"]) if not done]
        expected = [s for s, done in enumerate(want["stepped"]) if not done]
        if skipped != expected:
            raise AssertionError(f"{labels[i]}: optimizer steps skipped at {skipped}, GradScaler skips {expected}")
        for g, w in zip(got["params"], want["params"], strict=True):
            require_tensor(g, "a parameter")
            checks.assert_close(g, w, name=f"{labels[i]}: parameters after the run", atol=1e-6, rtol=1e-5)

    return per_case(labels, check_one)


# --- AMP training step ------------------------------------------------------------------------


class _AutocastProbe(nn.Module):
    """Records the dtype the first layer computed in: bf16 only under autocast."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model, self.dtypes = model, []

    def forward(self, x):
        h = self.model[0](x)
        self.dtypes.append(str(h.dtype).replace("torch.", ""))
        return self.model[2](self.model[1](h))


def step_inputs(seed: int, params: dict) -> dict:
    run = scaler_inputs(seed, {"steps": int(params.get("steps", 8))})["runs"][1]
    return {**run, "clip": float(params.get("max_norm", 0.25)), "init_scale": 2.0 ** 12, "growth_interval": 2}


def _train(run: dict, step_fn) -> dict:
    model = _build(run["model"])
    overflow = _Overflow(model, dict(run["script"]))
    probe = _AutocastProbe(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda" if torch.cuda.is_available() else "cpu", **_scaler_args(run))
    losses = []
    for s, (x, y) in enumerate(zip(run["x"], run["y"])):
        overflow.step = s
        loss = step_fn(probe, opt, scaler, on_device(x), on_device(y), nn.functional.mse_loss, run["clip"])
        losses.append(float(loss))
    return {"losses": losses, "dtypes": probe.dtypes, "scale": float(scaler.get_scale()),
            "params": [p.detach().cpu() for p in model.parameters()]}


def step_drive(ns: dict, inputs: dict) -> dict:
    student = ns["train_step"]
    return _train(inputs, lambda *args: student(*args, dtype=torch.bfloat16))


def step_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab.amp import train_step_amp

    want = _train(inputs, lambda m, o, s, x, y, f, clip: train_step_amp(m, o, s, x, y, f, dtype=torch.bfloat16,
                                                                         max_norm=clip))
    if set(outputs["dtypes"]) != {"bfloat16"}:
        return Verdict.failed(f"the forward ran in {sorted(set(outputs['dtypes']))}, not bfloat16: "
                              "is it under torch.autocast?")
    if float(outputs["scale"]) != want["scale"]:
        return Verdict.failed(f"the scale ended at {float(outputs['scale']):g}, expected {want['scale']:g}: "
                              "does the step call scaler.update() once per step?")
    try:
        for got, ref in zip(outputs["params"], want["params"], strict=True):
            require_tensor(got, "a parameter")
            checks.assert_close(got, ref, atol=1e-3, rtol=1e-2,
                                name=f"parameters after {len(want['losses'])} clipped AMP steps (clipping must see "
                                     "unscaled gradients)")
        checks.assert_close(torch.tensor([float(v) for v in outputs["losses"]]), torch.tensor(want["losses"]),
                            name="the returned losses", atol=1e-3, rtol=1e-2)
    except AssertionError as exc:
        return Verdict.failed(failure_text(exc))
    return Verdict.passed(f"{len(want['losses'])} bf16 autocast steps with overflows and clipping match the reference")


# --- fused AdamW kernel -----------------------------------------------------------------------


def _tensors(gen: torch.Generator, shapes) -> list[torch.Tensor]:
    return [torch.randn(*shape, generator=gen) for shape in shapes]


def adamw_inputs(seed: int, params: dict) -> dict:
    gen, rng = _generator(seed), random.Random(seed)
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


def _ulp(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


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
            tol = 2e-5 if dtype == torch.float32 else _ulp(dtype)
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
    gen, rng = _generator(seed), random.Random(seed)
    steps = int(params.get("steps", 3))
    cases = []
    for count in params.get("tensor_counts", [8, 64]):
        shapes = [[rng.randint(1, 40)] if rng.random() < 0.5 else [rng.randint(1, 9), rng.randint(1, 9)]
                  for _ in range(count)]
        cases.append({"init": _tensors(gen, shapes), "grads": [_tensors(gen, shapes) for _ in range(steps)]})
    return {"cases": cases, **HYPER}


def optimizer_drive(ns: dict, inputs: dict) -> list:
    kernel = triton_kernel(ns, KERNEL)
    state = {"launches": 0, "ops": 0, "launching": False}
    ns[KERNEL] = _LaunchCounter(kernel, state)
    results = []
    for case in inputs["cases"]:
        params = [on_device(t.clone()).requires_grad_() for t in case["init"]]
        opt = ns["FusedAdamW"](params, lr=inputs["lr"], betas=(inputs["beta1"], inputs["beta2"]), eps=inputs["eps"],
                               weight_decay=inputs["weight_decay"])
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"FusedAdamW must be a torch.optim.Optimizer, not {type(opt).__name__}")
        per_step = []
        for grads in case["grads"]:
            for p, g in zip(params, grads):
                p.grad = on_device(g.clone())
            state.update(launches=0, ops=0)
            with _op_counter(state):
                opt.step()
            per_step.append([state["launches"], state["ops"]])
        results.append({"params": [p.detach().cpu() for p in params], "per_step": per_step})
    return results


def optimizer_check(inputs: dict, outputs, params: dict) -> Verdict:
    cases = inputs["cases"]
    if not isinstance(outputs, list) or len(outputs) != len(cases):
        return Verdict.failed(f"expected {len(cases)} runs, got {type(outputs).__name__}")
    counts = [len(c["init"]) for c in cases]
    try:
        for case, got in zip(cases, outputs):
            want = _torch_adamw(inputs, case["init"], case["grads"])
            for j, (g, w) in enumerate(zip(got["params"], want, strict=True)):
                require_tensor(g, f"tensor {j}")
                checks.assert_close(g, w, name=f"{len(want)} tensors, tensor {j} after {len(case['grads'])} steps",
                                    atol=2e-5, rtol=1e-4)
    except AssertionError as exc:
        return Verdict.failed(failure_text(exc))
    launches = [[int(step[0]) for step in got["per_step"]] for got in outputs]
    ops = [[int(step[1]) for step in got["per_step"]] for got in outputs]
    details = {"tensors": counts, "launches_per_step": launches, "ops_per_step": ops}
    if any(n != 1 for run in launches for n in run):
        return Verdict(0.5, f"values match torch.optim.AdamW, but kernel launches per step were {launches} for "
                            f"{counts} tensors: a fused step launches once", details)
    # The first step may create state tensor by tensor; later steps must not touch tensors one by one.
    grows = max(ops[-1][1:]) - max(ops[0][1:])
    if grows > int(params.get("op_slack", 6)):
        return Verdict(0.5, f"one launch per step, but the step also ran {max(ops[-1][1:])} torch ops for "
                            f"{counts[-1]} tensors against {max(ops[0][1:])} for {counts[0]}: work that grows "
                            "with the number of tensors is not fused", details)
    return Verdict.passed(f"matches torch.optim.AdamW with one launch per step for {counts} tensors "
                          f"({max(ops[-1][1:])} other torch ops per step)", **details)


# --- speed ------------------------------------------------------------------------------------


def speed_inputs(seed: int, params: dict) -> dict:
    gen = _generator(seed)
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


LAB = LabSpec(
    name="04_mixed_precision",
    preamble="from fastdl_lab import device\n",
    items=[
        Item("bytes_per_param", 2, ("memory_code",), bytes_inputs, bytes_drive, bytes_check,
             artefacts=("bytes_per_param",), scope=SCOPE, library=LIBRARY,
             description="bytes per parameter of params, grads, master weights and optimizer state"),
        Item("loss_scaler", 3, ("scaler_code",), scaler_inputs, scaler_drive, scaler_check, kind="mechanism",
             artefacts=("DynamicLossScaler",), scope=SCOPE, library=LIBRARY,
             description="a dynamic loss scaler, step for step against torch.amp.GradScaler on scripted overflows"),
        Item("amp_train_step", 2, ("train_step_code",), step_inputs, step_drive, step_check,
             artefacts=("train_step",), scope=SCOPE, library=LIBRARY,
             description="bf16 autocast step: scale, unscale before clipping, step, update"),
        Item("fused_adamw", 4, ("adamw_kernel_code",), adamw_inputs, adamw_drive, adamw_check, kernels=(KERNEL,),
             description="the one-launch AdamW kernel against torch.optim.AdamW: fp32, bf16/fp16 with fp32 masters"),
        Item("fused_adamw_launches", 2, ("adamw_kernel_code", "adamw_optimizer_code"), optimizer_inputs,
             optimizer_drive, optimizer_check, kind="mechanism", kernels=(KERNEL,), artefacts=("FusedAdamW",),
             scope=SCOPE, library=LIBRARY, description="the optimizer class: one kernel launch per step, however many tensors"),
        Item("fused_adamw_speed", 2, ("adamw_kernel_code",), speed_inputs, kind="speed", check=speed_check,
             timed=speed_timed, baseline=speed_baseline, kernels=(KERNEL,),
             description="fused step vs torch foreach AdamW (GPU profiles)"),
    ],
)
