"""Lab 04 items on number formats and loss scaling: bytes per parameter, the dynamic loss scaler
step for step against torch.amp.GradScaler, and the AMP training step."""

from __future__ import annotations

import random

import torch
from torch import nn

from autograder.engine.items import Verdict
from autograder.labs._common import failure_text, on_device, per_case, require_tensor
from autograder.labs.lab04_mixed_precision.shared import generator
from fastdl_lab import checks

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
    rng, gen = random.Random(seed), generator(seed)
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
    # Fired by the optimizer itself after each step it really takes, whatever the scaler.
    opt.register_step_post_hook(lambda *_: stepped.__setitem__(-1, True))
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
        # A bf16 forward leaves its rounding in the loss: honest steps return the reference's losses to
        # the bit, an fp32 forward's differ by 7e-4 or more of the loss (25 seeds), parameters far
        # less. So this, a value the grader recomputes, is what says the forward ran under autocast;
        # the dtype the probe saw in the child says so only for the reason above.
        checks.assert_close(torch.tensor([float(v) for v in outputs["losses"]]), torch.tensor(want["losses"]),
                            name="the returned losses (a bf16 forward's, under torch.autocast)", atol=1e-5,
                            rtol=float(params.get("loss_rtol", 2e-4)))
    except AssertionError as exc:
        return Verdict.failed(failure_text(exc))
    return Verdict.passed(f"{len(want['losses'])} bf16 autocast steps with overflows and clipping match the reference")
