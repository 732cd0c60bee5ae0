"""Graded items of lab 10, the capstone: the student's transformer block, a short training run
of a model made of it, the step's memory predicted from the sizes, and (GPU profiles) the step's
time against the package's block on the same kernels.

The block and the memory formula are extracted artefacts (``Item.artefacts``): only the class
``Block`` and the function ``predict_memory`` leave the notebook, screened, and run with the names
``SCOPE`` binds. Every figure a verdict rests on is the grader's own:

- ``capstone_block``: the block's output and every gradient, on hidden sizes, against the
  package's block with the same weights, computed here;
- ``capstone_training``: the child trains and returns its weights; the grader trains the
  reference itself on the same batches and judges the loss *it* computes with the returned
  weights on a held-out batch (a forged loss curve buys nothing);
- ``capstone_memory``: the student's function only answers; the four parts are measured here on
  the reference model (``fastdl_lab.capstone.accounting.measure``), in the grading process,
  which runs no student code;
- ``capstone_step_speed``: a step of a model of the student's blocks against the same model of the
  package's, both on torch's kernels, timed on the grader's clock, call by call (``Clocked``).
"""

from __future__ import annotations

import random

import torch

from autograder.engine.items import Clocked, Item, LabSpec, Verdict
from autograder.labs._common import clocked_speed, per_case, require_tensor
from fastdl_lab import checks

# What the extracted Block and predict_memory may use: the package's LayerNorm module (a holder of
# weight and bias that calls the function it is given) and the config class, nothing of the model.
SCOPE = (
    "import math\nimport torch\nimport torch.nn.functional as F\nfrom torch import nn\n"
    "from fastdl_lab.capstone.model import GPTConfig, LayerNorm\n"
)
# The package's block and model, torch's transformer layers, and the lab's answers by name.
LIBRARY = r"capstone|transformer|multihead|multi_head|accounting|predict_memory_ref|memory_split"

SIZES = ("vocab_size", "seq_len", "d_model", "n_head", "n_layer")


def _config(sizes: dict):
    from fastdl_lab.capstone.model import GPTConfig

    return GPTConfig(**{k: int(sizes[k]) for k in SIZES})


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed % (1 << 63))


# --- the block ------------------------------------------------------------------------------------


def _away_from_init(name: str, shape, gen: torch.Generator) -> torch.Tensor:
    """Weights far from their initial values: LayerNorms at 1 and 0 and zero biases would hide a
    term that is swapped or missing."""
    if len(shape) > 1:
        return torch.randn(shape, generator=gen) * 0.3
    centre = 1.0 if name.startswith("ln") and name.endswith("weight") else 0.0
    return torch.randn(shape, generator=gen) * 0.5 + centre


def block_inputs(seed: int, params: dict) -> dict:
    """Per case: sizes, the block's weights (drawn here, by name), an input and an output gradient."""
    from fastdl_lab.capstone import model as capstone_model

    gen, cases = _generator(seed), []
    for d_model, n_head, tokens, batch in params.get("cases", [[48, 3, 37, 2], [64, 4, 50, 3], [32, 1, 19, 1]]):
        sizes = {"vocab_size": 256, "seq_len": tokens, "d_model": d_model, "n_head": n_head, "n_layer": 1}
        block = capstone_model.Block(_config(sizes), capstone_model.LAYER_NORMS["torch"],
                                     capstone_model.ATTENTIONS["torch"])
        state = {name: _away_from_init(name, p.shape, gen) for name, p in block.named_parameters()}
        cases.append({"sizes": sizes, "batch": batch, "state": state,
                      "x": torch.randn(batch, tokens, d_model, generator=gen),
                      "dy": torch.randn(batch, tokens, d_model, generator=gen)})
    return {"cases": cases}


def _labels(inputs: dict) -> list[str]:
    return [f"d_model={c['sizes']['d_model']} heads={c['sizes']['n_head']} tokens={c['sizes']['seq_len']} "
            f"batch={c['batch']}" for c in inputs["cases"]]


def _run_block(block_class, case: dict) -> dict:
    from fastdl_lab.capstone import model as capstone_model

    block = block_class(_config(case["sizes"]), capstone_model.LAYER_NORMS["torch"], capstone_model.ATTENTIONS["torch"])
    block.load_state_dict(case["state"], strict=True)
    x = case["x"].clone().requires_grad_()
    y = block(x)
    y.backward(case["dy"])
    return {"y": y.detach(), "dx": x.grad, "grads": {name: p.grad for name, p in block.named_parameters()}}


def block_drive(ns: dict, inputs: dict) -> list:
    return [_run_block(ns["Block"], case) for case in inputs["cases"]]


def _leaks_the_future(case: dict, y: torch.Tensor) -> bool:
    """Whether ``y`` is what the block gives without the causal mask (the mistake worth naming)."""
    from fastdl_lab.capstone import model as capstone_model

    def full(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    block = capstone_model.Block(_config(case["sizes"]), capstone_model.LAYER_NORMS["torch"], full)
    block.load_state_dict(case["state"])
    with torch.no_grad():
        return bool(torch.allclose(block(case["x"]), y, atol=1e-4, rtol=1e-4))


def block_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab.capstone import model as capstone_model

    cases, labels = inputs["cases"], _labels(inputs)
    if not isinstance(outputs, list) or len(outputs) != len(cases):
        return Verdict.failed(f"expected {len(cases)} results, got {type(outputs).__name__}")

    def check_one(i: int) -> None:
        got, case = outputs[i], cases[i]
        if not isinstance(got, dict) or not isinstance(got.get("grads"), dict):
            raise AssertionError(f"expected y, dx and grads, got {type(got).__name__}")
        want = _run_block(capstone_model.Block, case)
        require_tensor(got.get("y"), "the block's output")
        comparable = got["y"].shape == want["y"].shape and got["y"].dtype == want["y"].dtype
        if comparable and not torch.allclose(got["y"], want["y"], atol=1e-4, rtol=1e-4) \
                and _leaks_the_future(case, got["y"]):
            raise AssertionError("the output is the block's without the causal mask: each position sees later tokens")
        checks.assert_close(got["y"], want["y"], name="output", atol=1e-4, rtol=1e-4)
        require_tensor(got.get("dx"), "dx (is the input on the autograd graph?)")
        checks.assert_close(got["dx"], want["dx"], name="dx", atol=1e-4, rtol=1e-4)
        for name, grad in want["grads"].items():
            require_tensor(got["grads"].get(name), f"the gradient of {name}")
            checks.assert_close(got["grads"][name], grad, name=f"d{name}", atol=1e-4, rtol=1e-4)

    return per_case(labels, check_one)


# --- a short training run -------------------------------------------------------------------------


def training_inputs(seed: int, params: dict) -> dict:
    """Sizes, the initial weights (drawn here), the batches of every step and a held-out batch."""
    from fastdl_lab.capstone import data, model as capstone_model

    sizes = {"vocab_size": 256, **{k: int(v) for k, v in params.get("sizes", {"seq_len": 48, "d_model": 64,
                                                                           "n_head": 4, "n_layer": 2}).items()}}
    config = _config(sizes)
    steps, batch = int(params.get("steps", 20)), int(params.get("batch", 8))
    state = capstone_model.build(config, seed=seed % (1 << 31)).state_dict()
    batches = list(data.batches("train", steps, batch, config.seq_len, seed=seed % (1 << 31)))
    held_out = next(data.batches("val", 1, 2 * batch, config.seq_len, seed=(seed + 1) % (1 << 31)))
    return {"sizes": sizes, "state": state, "lr": float(params.get("lr", 3e-3)),
            "x": torch.stack([x for x, _ in batches]), "y": torch.stack([y for _, y in batches]),
            "held_x": held_out[0], "held_y": held_out[1], "band": float(params.get("band", 0.005))}


def _train(block_class, inputs: dict) -> dict:
    from fastdl_lab.capstone import model as capstone_model, step

    gpt = capstone_model.build(_config(inputs["sizes"]), block=block_class)
    gpt.load_state_dict(inputs["state"], strict=True)
    optimizer = step.make_optimizer(gpt, lr=inputs["lr"])
    for x, y in zip(inputs["x"], inputs["y"]):
        step._step(gpt, optimizer, x, y)
    return {name: p.detach() for name, p in gpt.state_dict().items()}


def training_drive(ns: dict, inputs: dict) -> dict:
    return _train(ns["Block"], inputs)


def _held_out_loss(inputs: dict, state: dict) -> float:
    from fastdl_lab.capstone import model as capstone_model

    gpt = capstone_model.build(_config(inputs["sizes"]))
    gpt.load_state_dict(state, strict=True)
    with torch.no_grad():
        return gpt(inputs["held_x"], inputs["held_y"])[1].item()


def training_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab.capstone import model as capstone_model

    steps = len(inputs["x"])
    if not isinstance(outputs, dict):
        return Verdict.failed(f"expected the trained weights by name, got {type(outputs).__name__}")
    want_names = capstone_model.build(_config(inputs["sizes"])).state_dict()
    state = {}
    for name, ref in want_names.items():
        got = outputs.get(name)
        if not isinstance(got, torch.Tensor) or got.shape != ref.shape or not got.is_floating_point():
            return Verdict.failed(f"the trained weights lack {name} {tuple(ref.shape)} (got {type(got).__name__})")
        state[name] = got.float()
    try:
        mine = _held_out_loss(inputs, state)
    except RuntimeError as exc:  # a tensor the model cannot hold
        return Verdict.failed(f"the returned weights do not load: {str(exc)[:200]}")
    start = _held_out_loss(inputs, inputs["state"])
    trained = _train(capstone_model.Block, inputs)
    reference = _held_out_loss(inputs, trained)
    # How far the run went elsewhere: the distance from the reference's weights as a share of the
    # reference's whole update (0 for the same computation up to rounding; a block that differs
    # anywhere steers every step after the first away).
    moved = sum((trained[k].float() - inputs["state"][k].float()).pow(2).sum() for k in trained).sqrt()
    apart = sum((state[k] - trained[k].float()).pow(2).sum() for k in trained).sqrt()
    drift = (apart / moved).item() if moved > 0 else float("inf")
    band, max_drift = inputs["band"], float(params.get("max_drift", 0.05))
    where = (f"held-out loss after {steps} AdamW steps {mine:.4f}, the reference's {reference:.4f} "
             f"(from {start:.4f} at the start); your weights differ from the reference run's by "
             f"{drift:.1%} of its update")
    if not abs(mine - reference) <= band * reference:
        return Verdict.failed(f"{where}: the loss is outside the band of {band:.1%}", loss=mine, reference=reference,
                              drift=drift)
    if not drift <= max_drift:
        return Verdict.failed(f"{where}: more than {max_drift:.0%}, so the run trained another model", loss=mine,
                              reference=reference, drift=drift)
    return Verdict.passed(f"{where}: within {band:.1%} and {max_drift:.0%}", loss=mine, reference=reference,
                          drift=drift)


# --- the step's memory ----------------------------------------------------------------------------


def memory_inputs(seed: int, params: dict) -> dict:
    rng = random.Random(seed)
    cases = []
    for _ in range(int(params.get("cases", 6))):
        n_head = rng.choice([1, 2, 4])
        sizes = {"vocab_size": rng.choice([256, 300, 384, 512]), "seq_len": rng.randrange(16, 97),
                 "d_model": n_head * rng.choice([8, 16, 24]), "n_head": n_head, "n_layer": rng.randint(1, 3)}
        cases.append({"sizes": sizes, "batch": rng.randint(1, 4), "attention": rng.choice(["torch", "math"]),
                      "recompute_blocks": rng.choice([0, 0, 1, sizes["n_layer"]])})
    return {"cases": cases}


def memory_drive(ns: dict, inputs: dict) -> list:
    answers = []
    for case in inputs["cases"]:
        got = ns["predict_memory"](_config(case["sizes"]), case["batch"], case["attention"], case["recompute_blocks"])
        answers.append({part: float(got[part]) for part in ("weights", "grads", "optimizer", "activations")})
    return answers


def _case_label(case: dict) -> str:
    s = case["sizes"]
    return (f"V={s['vocab_size']} T={s['seq_len']} d={s['d_model']} heads={s['n_head']} layers={s['n_layer']} "
            f"batch={case['batch']} attention={case['attention']} recomputed={case['recompute_blocks']}")


def memory_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab.capstone import accounting

    cases = inputs["cases"]
    if not isinstance(outputs, list) or len(outputs) != len(cases):
        return Verdict.failed(f"expected {len(cases)} answers, got {type(outputs).__name__}")
    # Exact for the parts lab 04 counts; the activations within a few percent: the small terms
    # (token ids, statistics, the loss's scalar) are worth getting, not worth a mark.
    exact, slack = 1e-3, float(params.get("activation_tolerance", 0.03))

    def check_one(i: int) -> None:
        case = cases[i]
        measured = accounting.measure(_config(case["sizes"]), case["batch"], attention=case["attention"],
                                      recompute_blocks=case["recompute_blocks"])
        answer = outputs[i] if isinstance(outputs[i], dict) else {}
        errors = accounting.relative_errors(answer, measured)
        wrong = [f"{part} {str(answer.get(part, 'missing'))[:40]} (measured {measured[part]}, off by "
                 f"{errors[part]:.1%})"
                 for part in accounting.PARTS if errors[part] > (slack if part == "activations" else exact)]
        if wrong:
            raise AssertionError(", ".join(wrong))

    return per_case([_case_label(c) for c in cases], check_one)


# --- the step's time on a GPU ---------------------------------------------------------------------


def speed_inputs(seed: int, params: dict) -> dict:
    sizes = {"vocab_size": 50304, **{k: int(v) for k, v in params.get("sizes", {"seq_len": 1024, "d_model": 768,
                                                                             "n_head": 12, "n_layer": 4}).items()}}
    return {"sizes": sizes, "batch": int(params.get("batch", 8)), "seed": seed % (1 << 31)}


def speed_call(seed: int, params: dict, i: int) -> dict:
    """The ``i``-th timed step's batch, drawn here: no call's loss is known before it arrives."""
    inputs = speed_inputs(seed, params)
    gen = _generator(seed * 1000 + i)
    shape = (inputs["batch"], inputs["sizes"]["seq_len"])
    return {"x": torch.randint(0, inputs["sizes"]["vocab_size"], shape, generator=gen),
            "y": torch.randint(0, inputs["sizes"]["vocab_size"], shape, generator=gen)}


def _stepper(block_class, inputs: dict):
    """``run(call) -> loss``: one training step of the item's model of ``block_class`` blocks (the
    package's where None), on torch's LayerNorm and attention: what is timed is the block's own
    work, its splits, copies and projections, around the same kernels. bf16 autocast on a GPU
    that has it, fp16 on one that has not (a T4); fp32 on a CPU (a test's profile)."""
    from fastdl_lab.capstone import model as capstone_model, step

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    gpt = capstone_model.build(_config(inputs["sizes"]), seed=inputs["seed"], device=device, block=block_class)
    gpt.autocast_dtype = (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16) if cuda else None
    optimizer = step.make_optimizer(gpt)

    def run(call: dict):
        return step._step(gpt, optimizer, call["x"].to(device), call["y"].to(device)).float().cpu()

    return run


def speed_candidate(ns: dict, inputs: dict):
    return _stepper(ns["Block"], inputs)


def speed_baseline(_ns: dict, inputs: dict):
    return _stepper(None, inputs)


def speed_check(inputs: dict, outputs, params: dict, observed) -> Verdict:
    def differs(got, want, _call: int) -> str | None:
        if not isinstance(got, torch.Tensor) or got.numel() != 1 or not torch.isfinite(got).all():
            return f"returned {type(got).__name__}, not the step's loss"
        # The same weights and batches: the losses differ only by rounding (bf16 on a GPU).
        if abs(got.item() - want.item()) > 0.05 * abs(want.item()):
            return f"a loss of {got.item():.4f} where the package's block gives {want.item():.4f}"
        return None

    return clocked_speed(observed, params, differs, "a training step of a model of your blocks",
                         "the same step of the package's blocks, both on torch's LayerNorm and attention")


LAB = LabSpec(
    name="10_capstone",
    preamble="from fastdl_lab import device\n",
    items=[
        Item("capstone_block", 3, ("block_code",), block_inputs, block_drive, block_check,
             artefacts=("Block",), scope=SCOPE, library=LIBRARY,
             description="the pre-norm block: output and every gradient on hidden sizes against the package's"),
        Item("capstone_training", 2, ("block_code",), training_inputs, training_drive, training_check,
             artefacts=("Block",), scope=SCOPE, library=LIBRARY, withheld=("held_x", "held_y", "band"),
             description="a model of your blocks trained on hidden batches: the grader's held-out loss with your "
                         "weights within a band of the reference run's"),
        Item("capstone_memory", 3, ("memory_code",), memory_inputs, memory_drive, memory_check,
             artefacts=("predict_memory",), scope=SCOPE, library=LIBRARY,
             description="weights, gradients, AdamW state and saved activations predicted from the sizes, against "
                         "the grader's measurement on hidden configurations"),
        Item("capstone_step_speed", 2, ("block_code",), speed_inputs, kind="speed", check=speed_check,
             artefacts=("Block",), scope=SCOPE, library=LIBRARY,
             reference=lambda inputs: {},
             clocked=Clocked(speed_call, speed_candidate, speed_baseline, warmup=2, reps=10),
             description="a bf16 training step of a model of your blocks against the package's block, both on "
                         "torch's kernels, call by call on the grader's clock (GPU profiles)"),
    ],
)
