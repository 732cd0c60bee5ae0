"""Graded items of lab 06 data: a training loop with no host syncs and the same losses, a length
bucketing sampler judged on real lengths, and sequence packing judged by a model's losses.

Every item grades extracted code (``Item.artefacts``): the student's functions and classes run on
their own, screened, with only the names ``SCOPE`` imports, in a child whose every figure is data
the parent checks:

- the fixed loop's losses and final weights are compared here with the original loop's, run here;
  the batches of a second loader of ``make_loader``'s, over a probe of the dataset, are checked
  here (each padded to its own longest sequence), and its worker processes are counted from
  outside the child. The syncs, dispatched ops and uploads ``SyncCounter`` counts in the child are
  self-reported (a helper thread, a read no dispatcher sees, escapes them): one point of three,
  said so in the reason;
- the loop's speed is taken on the grader's clock, run by run, against the original loop in a
  reference child, each run from a seed the child receives with the call (GPU profiles);
- the sampler's batches travel to the parent, which holds the hidden lengths and computes the
  padding fraction and the batches' fill itself;
- the packed rows travel to the parent, which runs the model on them and compares each
  sequence's loss with the same sequence run alone.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from autograder.engine.items import Clocked, Item, LabSpec, Verdict
from autograder.labs._common import clocked_speed

SCOPE = ("import math\nimport numpy as np\nimport torch\nimport torch.nn.functional as F\n"
         "from torch.utils.data import DataLoader, Sampler\nfrom fastdl_lab.data.loop import shuffle_sampler\n"
         "from fastdl_lab.data.text import PAD, Packed, pad_collate\n")
# The ways to read a tensor's values that no dispatcher sees, and the switches that silence it.
LIBRARY = r"^(storage|untyped_storage|data_ptr|set_sync_debug_mode)$"
# The probe dataset a second loader of the student's make_loader serves (its items, its batch
# size), and how long the drive holds that loader's worker processes (the grader samples the
# child's processes every 50 ms).
PROBE_ITEMS, PROBE_BATCH = 12, 4
WORKERS_HELD_S = 0.15
# Trusted code calls these after the student's functions return; a rebound one would run student
# code outside the counter.
INSTRUMENTS = ("torch.Tensor.detach", "torch.Tensor.clone", "torch.Tensor.float", "torch.Tensor.cpu",
               "torch.utils.data.DataLoader.__iter__", "fastdl_lab.data.syncs.SyncCounter.__enter__",
               "fastdl_lab.data.syncs.SyncCounter.__exit__")


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _rng(seed: int, salt: int) -> np.random.Generator:
    return np.random.default_rng([seed % (1 << 31), salt])


# --- the fixed training loop ------------------------------------------------------------------


def loop_inputs(seed: int, params: dict) -> dict:
    from fastdl_lab.data import text

    max_len = int(params.get("max_len", 128))
    seqs = text.corpus(int(params.get("items", 384)), seed=seed % (1 << 31), max_len=max_len)
    # The probe a second loader of make_loader's is shown: the dataset's shortest sequences and its
    # longest, in batches of PROBE_BATCH. Batches of the training data nearly all hold a sequence
    # cut at max_len, so that padding to each batch's longest and padding to the dataset's look
    # alike there; here most batches have no long sequence, and tell them apart.
    by_length = sorted(seqs, key=len)
    return {"seqs": seqs, "probe": by_length[:PROBE_ITEMS - 1] + by_length[-1:],
            "seed": int(_rng(seed, 1).integers(1 << 30)), "steps": int(params.get("steps", 10)),
            "batch_size": int(params.get("batch_size", 32))}


def _dataset(inputs: dict):
    from fastdl_lab.data import loop

    return loop.make_dataset(list(inputs["seqs"]))


def _batch_tokens(batch) -> torch.Tensor:
    tokens = batch[0] if isinstance(batch, (tuple, list)) else batch
    if type(tokens) is not torch.Tensor or tokens.dim() != 2:
        raise TypeError("a batch of the loader must start with a 2-D tensor of token ids")
    return tokens


def loop_drive(ns: dict, inputs: dict, probe: bool = False) -> dict:
    """The fixed loop's run, with the figures SyncCounter counts around it; with ``probe``, also the
    batches of a second loader of make_loader's over ``inputs["probe"]``."""
    import time

    from torch.utils.data import DataLoader

    from fastdl_lab.data import loop
    from fastdl_lab.data.syncs import SyncCounter

    device, seed, steps = _device(), int(inputs["seed"]), int(inputs["steps"])
    dataset = _dataset(inputs)
    probe_data = loop.make_dataset(list(inputs["probe"])) if probe else None
    model, optimizer = loop.fresh_run(seed, device=device)
    weights = list(model.parameters())  # taken before any student code runs
    counter, loaders, passed = SyncCounter(), [], []
    with counter:
        loader = ns["make_loader"](dataset, batch_size=int(inputs["batch_size"]), seed=seed, device=device)
        loaders.append(loader)
        if type(loader) is not DataLoader:
            raise TypeError(f"make_loader must return a torch.utils.data.DataLoader, not {type(loader).__name__}")
        losses = ns["train_fast"](model, optimizer, loader, steps=steps, device=device)
        if probe:
            # Inside the counter: a collate in the training process is student code. The pass's
            # workers are held a moment: the grader counts the child's processes from outside, a
            # sample every 50 ms.
            loaders.append(ns["make_loader"](probe_data, batch_size=PROBE_BATCH, seed=seed, device=device))
            batches = iter(loaders[-1])
            passed = [next(batches) for _ in range(-(-len(inputs["probe"]) // PROBE_BATCH))]
            time.sleep(WORKERS_HELD_S)
            del batches
    for each in loaders:
        loop.release_workers(each)
    if type(losses) is not torch.Tensor:
        raise TypeError(f"train_fast must return a tensor of per-step losses, not {type(losses).__name__}")
    return {
        "losses": losses.detach().float().cpu().clone().reshape(-1),
        "weights": [p.data.detach().float().cpu().clone() for p in weights],
        "syncs": int(counter.syncs), "ops": int(counter.ops), "uploads": int(counter.uploads),
        "events": {":".join(map(str, k))[:80]: int(v) for k, v in list(counter.events.items())[:40]},
        "pinned": bool(loader.pin_memory), "device": device,
        "batches": [_batch_tokens(batch).detach().cpu().clone() for batch in passed],
    }


def syncs_drive(ns: dict, inputs: dict) -> dict:
    return loop_drive(ns, inputs, probe=True)


def _slow_run(inputs: dict, device: str):
    """The original loop, in the parent: its losses and final weights are the truth."""
    from fastdl_lab.data import loop

    seed = int(inputs["seed"])
    model, optimizer = loop.fresh_run(seed, device=device)
    losses = loop.train_slow(model, optimizer, _dataset(inputs), steps=int(inputs["steps"]),
                             batch_size=int(inputs["batch_size"]), seed=seed, device=device)
    return torch.tensor(losses, dtype=torch.float32), [p.detach().float().cpu() for p in model.parameters()]


def _reference_counts(inputs: dict) -> dict:
    """Ops and uploads of the course's own fixed loop on the same data: the yardstick per step."""
    from fastdl_lab.data import loop
    from fastdl_lab.data.syncs import SyncCounter

    seed = int(inputs["seed"])
    model, optimizer = loop.fresh_run(seed)
    loader = loop.make_loader(_dataset(inputs), batch_size=int(inputs["batch_size"]), seed=seed)
    counter = SyncCounter()
    with counter:
        loop.train_fast(model, optimizer, loader, steps=int(inputs["steps"]))
    return {"ops": counter.ops, "uploads": counter.uploads}


def _loop_outputs(outputs, inputs: dict) -> dict:
    if not isinstance(outputs, dict) or not {"losses", "weights", "syncs", "ops", "uploads"} <= set(outputs):
        raise AssertionError(f"the grading run returned {type(outputs).__name__}, not the loop's figures")
    steps = int(inputs["steps"])
    losses = outputs["losses"]
    if not isinstance(losses, torch.Tensor) or losses.numel() != steps:
        raise AssertionError(f"train_fast returned {getattr(losses, 'numel', lambda: '?')()} losses for {steps} steps")
    return outputs


def losses_check(inputs: dict, outputs, params: dict) -> Verdict:
    try:
        outputs = _loop_outputs(outputs, inputs)
    except AssertionError as exc:
        return Verdict.failed(str(exc))
    want_losses, want_weights = _slow_run(inputs, "cpu")
    got = outputs["losses"].float()
    rtol = float(params.get("rtol", 1e-4))
    if not torch.allclose(got, want_losses, rtol=rtol, atol=1e-6):
        step = int(torch.argmax((got - want_losses).abs()))
        return Verdict.failed(f"losses differ from the original loop's: step {step} gives {float(got[step]):.6f} "
                              f"instead of {float(want_losses[step]):.6f} (same data order, same start)")
    weights = outputs["weights"]
    if not isinstance(weights, list) or len(weights) != len(want_weights):
        return Verdict.failed("the model's weights did not come back")
    for i, (g, w) in enumerate(zip(weights, want_weights)):
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or not torch.allclose(g, w, rtol=1e-3, atol=1e-5):
            return Verdict.failed(f"the losses match, but weight tensor {i} of the model after training differs from "
                                  "the original loop's: was the model passed in the one that trained?")
    return Verdict.passed(f"the same {len(got)} losses as the original loop (rtol {rtol:g}) and the same final weights")


def _batches_problem(inputs: dict, batches, batch_size: int) -> str | None:
    """What is wrong with the probe loader's batches, judged here against the probe: each row one of
    its sequences, padded after its end, and no batch wider than its own longest sequence."""
    from fastdl_lab.data.text import PAD

    if not isinstance(batches, list) or len(batches) != -(-len(inputs["probe"]) // batch_size):
        return "the batches of a loader made by make_loader did not come back"
    known = {tuple(seq.tolist()) for seq in inputs["probe"]}
    for b, tokens in enumerate(batches):
        if type(tokens) is not torch.Tensor or tokens.dim() != 2 or not 0 < tokens.shape[0] <= batch_size \
                or tokens.dtype not in (torch.int64, torch.int32):
            return f"batch {b} is not a [rows <= {batch_size}, width] tensor of token ids"
        lengths = (tokens != PAD).sum(1)
        for row, length in zip(tokens.tolist(), lengths.tolist()):
            if tuple(row[:length]) not in known or any(row[length:]):
                return f"a row of batch {b} is not one of the dataset's sequences followed by padding"
        if tokens.shape[1] > int(lengths.max()):
            return (f"batch {b} is {tokens.shape[1]} tokens wide for a longest sequence of {int(lengths.max())}: "
                    "pad each batch to its own longest sequence (pad_collate), not to the dataset's")
    return None


def _self_reported_problems(inputs: dict, outputs: dict, params: dict) -> list[str]:
    """What SyncCounter, run in the student's process, says is still wrong with the step."""
    steps = int(inputs["steps"])
    syncs, ops, uploads = int(outputs["syncs"]), int(outputs["ops"]), int(outputs["uploads"])
    reference = _reference_counts(inputs)
    ops_bound = float(params.get("ops_ratio", 1.5)) * reference["ops"] + 10 * steps
    problems = []
    if syncs:
        events = ", ".join(f"{str(k).partition(':')[2]} x{v}" for k, v in sorted(outputs.get("events", {}).items())
                           if str(k).startswith("syncs:"))
        problems.append(f"{syncs} host syncs in {steps} steps ({events or 'see SyncCounter.report()'})")
    if uploads > reference["uploads"] + 2:
        problems.append(f"{uploads} uploads of host data in {steps} steps: is a constant built every step?")
    if ops > ops_bound:
        problems.append(f"{ops / steps:.0f} ops per step against {reference['ops'] / steps:.0f} for a vectorised "
                        "step: is there still a Python loop over the batch?")
    if outputs.get("device") == "cuda" and not outputs.get("pinned"):
        problems.append("the loader does not pin its batches (pin_memory) for the copy to the GPU")
    return problems


def syncs_check(inputs: dict, outputs, params: dict, observed) -> Verdict:
    """Three points: the loader's batches, checked here against the dataset (1); its worker
    processes, counted from outside the child and credited to a loader whose batches passed (1);
    the step's syncs, ops and uploads, counted by SyncCounter in the student's process, so
    self-reported (1)."""
    try:
        outputs = _loop_outputs(outputs, inputs)
    except AssertionError as exc:
        return Verdict.failed(str(exc))
    # Nothing is graded of a loop that does not train: one that returns the right numbers without
    # training the model it was given (or trains a copy in a worker) has nothing to count.
    trains = losses_check(inputs, outputs, params)
    if trains.fraction < 1:
        return Verdict.failed(f"the loop does not train as the original does, so nothing else is graded: "
                              f"{trains.reason}")
    steps = int(inputs["steps"])
    started = max(0, int(observed.processes) - 1)  # the runner itself is one of the child's processes
    padding = _batches_problem(inputs, outputs.get("batches"), PROBE_BATCH)
    counted = _self_reported_problems(inputs, outputs, params)
    details = {"processes_started": started, "syncs": outputs["syncs"], "ops_per_step": outputs["ops"] / steps,
               "uploads": outputs["uploads"], "batches": padding or "padded per batch"}
    earned, problems = 0.0, []
    if padding:
        problems.append(padding)
    else:
        earned += 1
        if started >= 1:
            earned += 1
        else:
            problems.append("the grader saw no process beside the training one: the loader decodes and pads in "
                            "the training process (num_workers=0)")
    seen = (f"seen by the grader: batches padded per batch and {started} processes beside the training one"
            if not problems else "; ".join(problems))
    counts = (f"{outputs['syncs']} syncs in {steps} steps, {outputs['ops'] / steps:.0f} ops per step, "
              f"{outputs['uploads']} uploads")
    if counted:
        told = "self-reported by SyncCounter in your process (1 point): " + "; ".join(counted)
    else:
        earned += 1
        told = f"self-reported by SyncCounter in your process (1 point): {counts}"
    if earned == 3:
        return Verdict.passed(f"{seen}; {told}", **details)
    return Verdict(earned / 3, f"{seen}; {told}", details)


# --- the fixed loop's speed, on the grader's clock (GPU profiles) ------------------------------


def loop_speed_call(seed: int, params: dict, i: int) -> dict:
    """The ``i``-th timed run's seed (the model's start and the batch order), drawn here and sent with
    the call: no run's losses can be known before it arrives."""
    return {"seed": int(np.random.default_rng([seed % (1 << 31), i]).integers(1 << 30))}


def _loop_run(train, inputs: dict):
    """``run(call) -> losses`` of one fresh training run per call, ``train(model, optimizer, dataset,
    seed, device) -> losses`` doing the loop."""
    from fastdl_lab.data import loop

    device, dataset = _device(), _dataset(inputs)

    def run(call: dict) -> torch.Tensor:
        seed = int(call["seed"])
        model, optimizer = loop.fresh_run(seed, device=device)
        losses = train(model, optimizer, dataset, seed, device)
        return torch.as_tensor(losses).detach().float().cpu().reshape(-1).clone()

    return run


def loop_speed_candidate(ns: dict, inputs: dict):
    from fastdl_lab.data import loop

    steps, batch_size = int(inputs["steps"]), int(inputs["batch_size"])

    def train(model, optimizer, dataset, seed, device):
        loader = ns["make_loader"](dataset, batch_size=batch_size, seed=seed, device=device)
        losses = ns["train_fast"](model, optimizer, loader, steps=steps, device=device)
        loop.release_workers(loader)
        return losses

    return _loop_run(train, inputs)


def loop_speed_baseline(_ns: dict, inputs: dict):
    from fastdl_lab.data import loop

    steps, batch_size = int(inputs["steps"]), int(inputs["batch_size"])

    def train(model, optimizer, dataset, seed, device):
        return loop.train_slow(model, optimizer, dataset, steps=steps, batch_size=batch_size, seed=seed, device=device)

    return _loop_run(train, inputs)


def loop_speed_check(inputs: dict, outputs, params: dict, observed) -> Verdict:
    rtol = float(params.get("rtol", 1e-3))

    def differs(got, want, _call: int) -> str | None:
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            return f"returned {got.numel() if isinstance(got, torch.Tensor) else 'no'} losses for {want.numel()} steps"
        if not torch.allclose(got.float(), want.float(), rtol=rtol, atol=1e-5):
            step = int(torch.argmax((got.float() - want.float()).abs()))
            return (f"gives the loss {float(got[step]):.5f} at step {step} where the original gives "
                    f"{float(want[step]):.5f}")
        return None

    return clocked_speed(observed, params, differs, "the fixed loop", "the original loop (train_slow)")


# --- the bucketing sampler ----------------------------------------------------------------------


def sampler_inputs(seed: int, params: dict) -> dict:
    from fastdl_lab.data import text

    lengths = text.docstring_lengths()
    rng = _rng(seed, 2)
    n = int(params.get("items", 2000))
    picked = rng.choice(len(lengths), size=min(n, len(lengths)), replace=False)
    return {"lengths": torch.as_tensor(np.minimum(lengths[picked], int(params.get("max_len", 256)))),
            "batch_size": int(params.get("batch_size", 32)), "seeds": [int(s) for s in rng.integers(1 << 30, size=2)],
            "epochs": int(params.get("epochs", 3))}


def sampler_drive(ns: dict, inputs: dict) -> list:
    from torch.utils.data import Sampler

    lengths = [int(v) for v in inputs["lengths"].tolist()]
    n, batch_size = len(lengths), int(inputs["batch_size"])
    runs = []
    for seed in inputs["seeds"]:
        sampler = ns["BucketBatchSampler"](lengths, batch_size, seed=int(seed))
        if not isinstance(sampler, Sampler):
            raise TypeError(f"BucketBatchSampler must be a torch.utils.data.Sampler, not {type(sampler).__name__}")
        epochs = []
        for epoch in range(int(inputs["epochs"])):
            sampler.set_epoch(epoch)
            batches, it = [], iter(sampler)
            # One batch per item at most: a sampler that never stops is cut off, and then fails.
            for batch in it:
                batches.append([int(i) for i in list(batch)[: batch_size + 1]])
                if len(batches) > n:
                    break
            epochs.append(batches)
        runs.append({"len": int(len(sampler)), "epochs": epochs})
    return runs


def _padding(batches: list[list[int]], lengths: np.ndarray) -> float:
    real = sum(int(lengths[b].sum()) for b in batches)
    total = sum(int(lengths[b].max()) * len(b) for b in batches)
    return 1.0 - real / total if total else 0.0


def _validate_epoch(batches, n: int, batch_size: int) -> str | None:
    if not isinstance(batches, list) or not batches:
        return "no batches"
    seen = np.zeros(n, dtype=np.int64)
    for b in batches:
        if not isinstance(b, list) or not b or len(b) > batch_size:
            return f"a batch of {len(b) if isinstance(b, list) else '?'} items (batch size {batch_size})"
        if not all(isinstance(i, int) and 0 <= i < n for i in b):
            return "an index outside the dataset"
        np.add.at(seen, np.asarray(b), 1)
    if (seen != 1).any():
        missing, twice = int((seen == 0).sum()), int((seen > 1).sum())
        return f"{missing} items never drawn and {twice} drawn more than once in an epoch"
    return None


def sampler_check(inputs: dict, outputs, params: dict) -> Verdict:
    lengths = inputs["lengths"].numpy()
    n, batch_size = len(lengths), int(inputs["batch_size"])
    if not isinstance(outputs, list) or len(outputs) != len(inputs["seeds"]):
        return Verdict.failed(f"expected {len(inputs['seeds'])} sampler runs, got {type(outputs).__name__}")
    fractions, repeats, ordered = [], [], []
    for r, run in enumerate(outputs):
        epochs = run.get("epochs") if isinstance(run, dict) else None
        if not isinstance(epochs, list) or len(epochs) != int(inputs["epochs"]):
            return Verdict.failed("the sampler's epochs did not come back")
        for e, batches in enumerate(epochs):
            problem = _validate_epoch(batches, n, batch_size)
            if problem:
                return Verdict.failed(f"epoch {e} (seed {r}): {problem}; every item must be drawn exactly once")
            if int(run.get("len", -1)) != len(batches):
                return Verdict.failed(f"len(sampler) is {run.get('len')} but epoch {e} had {len(batches)} batches")
            fractions.append(_padding(batches, lengths))
            # Longest item per batch against the batch's position: near +-1 when batches come in length order.
            tops = np.array([lengths[b].max() for b in batches], dtype=float)
            ordered.append(abs(float(np.corrcoef(np.arange(len(tops)), tops)[0, 1])) if tops.std() > 0 else 1.0)
            # The lower bound: batches of two would pass any padding bound. A bucket's last batch
            # may be short, so full batches are not required, a mean close to batch_size is.
            fill = n / (len(batches) * batch_size)
            if fill < float(params.get("min_fill", 0.9)):
                return Verdict.failed(f"epoch {e} (seed {r}) has {len(batches)} batches of {n / len(batches):.1f} "
                                      f"items on average for a batch size of {batch_size}: batches must be full "
                                      f"but for the last of each bucket (at least {params.get('min_fill', 0.9):.0%} "
                                      "full on average)")
        for a, b in zip(epochs, epochs[1:]):
            same = len({frozenset(x) for x in a} & {frozenset(x) for x in b})
            repeats.append(same / max(len(a), 1))
    random_padding = float(np.mean([_padding([list(map(int, c)) for c in np.array_split(
        _rng(0, e).permutation(n), math.ceil(n / batch_size))], lengths) for e in range(3)]))
    padding, bound = float(np.mean(fractions)), float(params.get("max_padding", 0.12))
    details = {"padding": padding, "random_batches_padding": random_padding, "repeated_batches": max(repeats),
               "order_correlation": max(ordered)}
    problems = []
    if padding > bound:
        problems.append(f"{padding:.1%} of the padded tokens are padding (random batches: {random_padding:.1%}; "
                        f"needs <= {bound:.0%}): are similar lengths batched together?")
    if max(repeats) > float(params.get("max_repeats", 0.5)) or max(ordered) > float(params.get("max_order", 0.5)):
        problems.append(f"batches are not reshuffled: {max(repeats):.0%} of one epoch's batches come back in the "
                        f"next, and batch order follows length (|r| = {max(ordered):.2f})")
    if not problems:
        return Verdict.passed(f"{padding:.1%} padding on {n} hidden real lengths (random batches: {random_padding:.1%}), "
                              f"reshuffled every epoch", **details)
    return Verdict(0.5 if len(problems) == 1 else 0.0, "; ".join(problems), details)


# --- sequence packing ---------------------------------------------------------------------------


def packing_inputs(seed: int, params: dict) -> dict:
    from fastdl_lab.data import text

    max_len = int(params.get("max_len", 96))
    seqs = text.corpus(int(params.get("sequences", 40)), seed=seed % (1 << 31), max_len=max_len)
    # The edges: a sequence that fills a row on its own, and one of a single token.
    seqs[0] = seqs[0].new_full((max_len,), 7) if len(seqs[0]) < max_len else seqs[0]
    seqs[1] = seqs[1][:1]
    return {"seqs": seqs, "max_len": max_len, "model_seed": int(_rng(seed, 3).integers(1 << 30))}


def packing_drive(ns: dict, inputs: dict) -> dict:
    packed = ns["pack_sequences"](list(inputs["seqs"]), int(inputs["max_len"]))
    tokens, position_ids, seq_ids = tuple(packed)[:3]
    mask = ns["block_diagonal_mask"](seq_ids)
    for name, value in (("tokens", tokens), ("position_ids", position_ids), ("seq_ids", seq_ids), ("mask", mask)):
        if type(value) is not torch.Tensor:
            raise TypeError(f"{name} must be a tensor, not {type(value).__name__}")
    return {"tokens": tokens.detach().cpu().clone(), "position_ids": position_ids.detach().cpu().clone(),
            "seq_ids": seq_ids.detach().cpu().clone(), "mask": mask.detach().cpu().clone()}


def _layout_problem(seqs, max_len: int, tokens, position_ids, seq_ids) -> str | None:
    from fastdl_lab.data.text import PAD

    if not all(isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape == tokens.shape for t in (position_ids, seq_ids)) \
            or tokens.dim() != 2 or tokens.shape[1] != max_len:
        return f"tokens, position_ids and seq_ids must all be [rows, {max_len}]"
    if ((seq_ids < -1) | (seq_ids >= len(seqs))).any():
        return "seq_ids outside -1 (padding) and the sequence indices"
    if (tokens[seq_ids == -1] != PAD).any():
        return "a slot marked as padding holds a token"
    for i, seq in enumerate(seqs):
        rows, cols = torch.nonzero(seq_ids == i, as_tuple=True)
        if len(cols) != len(seq):
            return f"sequence {i} has {len(seq)} tokens but {len(cols)} slots"
        if len(set(rows.tolist())) != 1 or (cols.diff() != 1).any():
            return f"sequence {i} is split or scattered: a sequence must sit whole in one row"
        if not torch.equal(tokens[rows[0], cols], seq):
            return f"sequence {i}'s tokens are not its own"
    return None


def packing_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab.data import text

    seqs, max_len = list(inputs["seqs"]), int(inputs["max_len"])
    if not isinstance(outputs, dict) or not all(isinstance(outputs.get(k), torch.Tensor)
                                                for k in ("tokens", "position_ids", "seq_ids", "mask")):
        return Verdict.failed("pack_sequences and block_diagonal_mask did not return tensors")
    tokens, position_ids, seq_ids, mask = (outputs[k].long() if k != "mask" else outputs[k]
                                           for k in ("tokens", "position_ids", "seq_ids", "mask"))
    problem = _layout_problem(seqs, max_len, tokens, position_ids, seq_ids)
    if problem:
        return Verdict.failed(problem)
    best = len(text.pack_sequences(seqs, max_len).tokens)
    rows, slack = tokens.shape[0], float(params.get("row_slack", 0.15))
    details = {"rows": rows, "first_fit_decreasing_rows": best}
    if rows > math.ceil(best * (1 + slack)):
        return Verdict(0.5, f"{rows} rows where first-fit decreasing needs {best}: the packing wastes slots", details)
    rows_n, length = tokens.shape
    if mask.dtype != torch.bool or mask.shape != (rows_n, length, length):
        return Verdict(0.3, f"the mask must be a bool tensor [{rows_n}, {length}, {length}]", details)
    model = text.TinyLM(max_len=max(max_len, 256), seed=int(inputs["model_seed"]))
    with torch.no_grad():
        alone = text.sequence_losses(model, seqs)
        packed = text.packed_sequence_losses(model, text.Packed(tokens, position_ids, seq_ids), mask)
    close = torch.isclose(packed, alone, rtol=1e-4, atol=1e-5)
    details.update(worst=float((packed - alone).abs().max()))
    if close.all():
        return Verdict.passed(f"{len(seqs)} hidden sequences in {rows} rows, each with the loss it has alone", **details)
    i = int(torch.argmax((packed - alone).abs()))
    pos = position_ids[seq_ids == i]
    hint = (f"its position ids run {int(pos[0])}..{int(pos[-1])}, not 0..{len(seqs[i]) - 1}"
            if int(pos[0]) != 0 else "does it attend to tokens of other sequences in its row?")
    return Verdict(0.3, f"{int((~close).sum())} of {len(seqs)} sequences have a different loss packed than alone; "
                        f"sequence {i}: {float(packed[i]):.5f} instead of {float(alone[i]):.5f} ({hint})", details)


LAB = LabSpec(
    name="06_data",
    preamble="from fastdl_lab import device\n",
    items=[
        Item("loop_syncs", 3, ("loop_code",), loop_inputs, syncs_drive, syncs_check, kind="mechanism",
             artefacts=("make_loader", "train_fast"), scope=SCOPE, library=LIBRARY, instruments=INSTRUMENTS,
             description="the fixed loop: batches padded per batch and worker processes, seen by the grader; no host "
                         "syncs, no per-step uploads and a vectorised step, self-reported (1 point)"),
        Item("loop_losses", 2, ("loop_code",), loop_inputs, loop_drive, losses_check,
             artefacts=("make_loader", "train_fast"), scope=SCOPE, library=LIBRARY, instruments=INSTRUMENTS,
             description="the fixed loop trains exactly as the original one: same losses, same final weights"),
        Item("loop_speed", 2, ("loop_code",), loop_inputs, kind="speed", check=loop_speed_check,
             artefacts=("make_loader", "train_fast"), scope=SCOPE, library=LIBRARY, reference=lambda inputs: {},
             clocked=Clocked(loop_speed_call, loop_speed_candidate, loop_speed_baseline, warmup=1, reps=5),
             description="the fixed loop against the original one, run by run on the grader's clock (GPU profiles)"),
        Item("bucket_sampler", 3, ("sampler_code",), sampler_inputs, sampler_drive, sampler_check, kind="mechanism",
             artefacts=("BucketBatchSampler",), scope=SCOPE, library=LIBRARY,
             description="a length-bucketing batch sampler: padding on hidden real lengths, full batches, "
                         "reshuffled every epoch"),
        Item("packing", 3, ("packing_code",), packing_inputs, packing_drive, packing_check,
             artefacts=("pack_sequences", "block_diagonal_mask"), scope=SCOPE, library=LIBRARY,
             withheld=("model_seed",),
             description="packed sequences give each sequence the loss it has alone: no cross-talk"),
    ],
)
