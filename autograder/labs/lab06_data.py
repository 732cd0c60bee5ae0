"""Graded items of lab 06 data: a training loop with no host syncs and the same losses, a length
bucketing sampler judged on real lengths, and sequence packing judged by a model's losses.

Every item grades extracted code (``Item.artefacts``): the student's functions and classes run on
their own, screened, with only the names ``SCOPE`` imports. What the figures rest on is taken
where no student code can reach it:

- syncs, dispatched ops and uploads of the fixed loop are counted by ``SyncCounter``, entered by
  trusted code around the student's calls (the screen keeps graded code from reaching the
  dispatcher's private mode stack, from rebinding library attributes, and from starting threads);
  the final weights come back too, so a loop that trained a copy elsewhere (a loader worker) fails;
- the sampler's batches travel to the parent, which holds the hidden lengths and computes the
  padding fraction itself;
- the packed rows travel to the parent, which runs the model on them and compares each
  sequence's loss with the same sequence run alone.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from autograder.engine.items import Item, LabSpec, Verdict

SCOPE = ("import math\nimport numpy as np\nimport torch\nimport torch.nn.functional as F\n"
         "from torch.utils.data import DataLoader, Sampler\nfrom fastdl_lab.data.loop import shuffle_sampler\n"
         "from fastdl_lab.data.text import PAD, Packed, pad_collate\n")
# The ways to read a tensor's values that no dispatcher sees, and the switches that silence it.
LIBRARY = r"^(storage|untyped_storage|data_ptr|set_sync_debug_mode)$"
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
    return {"seqs": text.corpus(int(params.get("items", 384)), seed=seed % (1 << 31), max_len=max_len),
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


def loop_drive(ns: dict, inputs: dict) -> dict:
    from torch.utils.data import DataLoader

    from fastdl_lab.data import loop
    from fastdl_lab.data.syncs import SyncCounter
    from fastdl_lab.data.text import PAD

    device, seed, steps = _device(), int(inputs["seed"]), int(inputs["steps"])
    dataset = _dataset(inputs)
    model, optimizer = loop.fresh_run(seed, device=device)
    weights = list(model.parameters())  # taken before any student code runs
    counter = SyncCounter()
    with counter:
        loader = ns["make_loader"](dataset, batch_size=int(inputs["batch_size"]), seed=seed, device=device)
        if type(loader) is not DataLoader:
            raise TypeError(f"make_loader must return a torch.utils.data.DataLoader, not {type(loader).__name__}")
        losses = ns["train_fast"](model, optimizer, loader, steps=steps, device=device)
        # A fresh pass for the padding the collate leaves (inside the counter: a collate in the
        # training process is student code). The figures are taken after the counter stops.
        batches = iter(loader)
        widths = [_batch_tokens(next(batches)) for _ in range(min(steps, 3))]
        del batches
    loop.release_workers(loader)
    if type(losses) is not torch.Tensor:
        raise TypeError(f"train_fast must return a tensor of per-step losses, not {type(losses).__name__}")
    # Columns no sequence of the batch reaches: padding beyond the batch's own longest sequence.
    padding = [float((tokens == PAD).all(0).float().mean()) for tokens in widths]
    return {
        "losses": losses.detach().float().cpu().clone().reshape(-1),
        "weights": [p.data.detach().float().cpu().clone() for p in weights],
        "syncs": int(counter.syncs), "ops": int(counter.ops), "uploads": int(counter.uploads),
        "events": {":".join(map(str, k))[:80]: int(v) for k, v in list(counter.events.items())[:40]},
        "loader": {"num_workers": int(loader.num_workers), "pin_memory": bool(loader.pin_memory),
                   "persistent_workers": bool(loader.persistent_workers)},
        "padding": padding, "device": device,
    }


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


def syncs_check(inputs: dict, outputs, params: dict) -> Verdict:
    try:
        outputs = _loop_outputs(outputs, inputs)
    except AssertionError as exc:
        return Verdict.failed(str(exc))
    # Counts mean something only for a loop that trains: one that returns the right numbers without
    # training the model it was given (or trains a copy in a worker) has nothing to count.
    trains = losses_check(inputs, outputs, params)
    if trains.fraction < 1:
        return Verdict.failed(f"the loop does not train as the original does, so its counts are not graded: "
                              f"{trains.reason}")
    steps = int(inputs["steps"])
    syncs, ops, uploads = int(outputs["syncs"]), int(outputs["ops"]), int(outputs["uploads"])
    reference = _reference_counts(inputs)
    ops_bound = float(params.get("ops_ratio", 1.5)) * reference["ops"] + 10 * steps
    loader = outputs.get("loader", {})
    padding = [float(p) for p in outputs.get("padding", [])]
    details = {"syncs": syncs, "ops_per_step": ops / steps, "uploads": uploads,
               "reference_ops_per_step": reference["ops"] / steps, "loader": loader, "padding": padding}
    problems = []
    if syncs:
        events = ", ".join(f"{k.partition(':')[2]} x{v}" for k, v in sorted(outputs.get("events", {}).items())
                           if k.startswith("syncs:"))
        problems.append(f"{syncs} host syncs in {steps} steps ({events or 'see SyncCounter.report()'})")
    if uploads > reference["uploads"] + 2:
        problems.append(f"{uploads} uploads of host data in {steps} steps: is a constant built every step?")
    if ops > ops_bound:
        problems.append(f"{ops / steps:.0f} ops per step against {reference['ops'] / steps:.0f} for a vectorised "
                        "step: is there still a Python loop over the batch?")
    if int(loader.get("num_workers", 0)) < 1:
        problems.append("the loader decodes and pads in the training process (num_workers=0)")
    if outputs.get("device") == "cuda" and not loader.get("pin_memory"):
        problems.append("the loader does not pin its batches (pin_memory) for the copy to the GPU")
    if padding and max(padding) > 0:
        problems.append(f"{max(padding):.0%} of a batch's columns hold no token of any of its sequences: pad each "
                        "batch to its own longest sequence")
    if not problems:
        return Verdict.passed(f"0 syncs in {steps} steps, {ops / steps:.0f} ops per step, {uploads} uploads, "
                              f"{loader.get('num_workers')} loader workers", **details)
    fraction = max(0.0, 1.0 - 0.5 * len(problems)) if not syncs else 0.0
    return Verdict(fraction, "; ".join(problems), details)


def speed_timed(ns: dict, inputs: dict):
    from fastdl_lab.data import loop

    device, seed, steps = _device(), int(inputs["seed"]), int(inputs["steps"])
    dataset = _dataset(inputs)

    def run():
        model, optimizer = loop.fresh_run(seed, device=device)
        loader = ns["make_loader"](dataset, batch_size=int(inputs["batch_size"]), seed=seed, device=device)
        losses = ns["train_fast"](model, optimizer, loader, steps=steps, device=device)
        loop.release_workers(loader)
        return {"losses": losses.detach().float().cpu().reshape(-1)}

    return run


def speed_baseline(ns: dict, inputs: dict):
    from fastdl_lab.data import loop

    device, seed = _device(), int(inputs["seed"])
    dataset = _dataset(inputs)

    def run():
        model, optimizer = loop.fresh_run(seed, device=device)
        loop.train_slow(model, optimizer, dataset, steps=int(inputs["steps"]), batch_size=int(inputs["batch_size"]),
                        seed=seed, device=device)

    return run


def speed_check(inputs: dict, outputs, params: dict) -> Verdict:
    losses = outputs.get("losses") if isinstance(outputs, dict) else None
    want, _ = _slow_run(inputs, "cpu")
    if not isinstance(losses, torch.Tensor) or losses.shape != want.shape or \
            not torch.allclose(losses.float(), want, rtol=float(params.get("rtol", 1e-3)), atol=1e-5):
        return Verdict.failed("the timed loop's losses differ from the original loop's")
    return Verdict.passed("same losses as the original loop")


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
        Item("loop_syncs", 3, ("loop_code",), loop_inputs, loop_drive, syncs_check, kind="mechanism",
             artefacts=("make_loader", "train_fast"), scope=SCOPE, library=LIBRARY, instruments=INSTRUMENTS,
             description="the fixed loop: no host syncs, no per-step uploads, a vectorised step, loader workers"),
        Item("loop_losses", 2, ("loop_code",), loop_inputs, loop_drive, losses_check,
             artefacts=("make_loader", "train_fast"), scope=SCOPE, library=LIBRARY, instruments=INSTRUMENTS,
             description="the fixed loop trains exactly as the original one: same losses, same final weights"),
        Item("loop_speed", 2, ("loop_code",), loop_inputs, kind="speed", check=speed_check, timed=speed_timed,
             baseline=speed_baseline, artefacts=("make_loader", "train_fast"), scope=SCOPE, library=LIBRARY,
             description="the fixed loop against the original one, timed A/B (GPU profiles)"),
        Item("bucket_sampler", 3, ("sampler_code",), sampler_inputs, sampler_drive, sampler_check, kind="mechanism",
             artefacts=("BucketBatchSampler",), scope=SCOPE, library=LIBRARY,
             description="a length-bucketing batch sampler: padding on hidden real lengths, reshuffled every epoch"),
        Item("packing", 3, ("packing_code",), packing_inputs, packing_drive, packing_check,
             artefacts=("pack_sequences", "block_diagonal_mask"), scope=SCOPE, library=LIBRARY,
             description="packed sequences give each sequence the loss it has alone: no cross-talk"),
    ],
)
