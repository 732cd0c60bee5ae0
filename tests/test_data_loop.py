import ast
import multiprocessing
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from autograder.strip import strip_solutions
from fastdl_lab.data import loop, text
from fastdl_lab.data.syncs import SyncCounter

STEPS, BATCH, SEED = 8, 16, 5


@pytest.fixture(scope="module")
def dataset():
    # 100 items in batches of 16: seven batches an epoch (the last short), so 8 steps cross into a
    # second epoch, where a persistent-worker loader could lose train_slow's order.
    return loop.make_dataset(loop.synthetic_seqs(100, seed=11))


@pytest.fixture(scope="module")
def runs(dataset):
    model, optimizer = loop.fresh_run(SEED)
    with SyncCounter("cpu") as slow:
        slow_losses = loop.train_slow(model, optimizer, dataset, steps=STEPS, batch_size=BATCH, seed=SEED)
    model, optimizer = loop.fresh_run(SEED)
    with SyncCounter("cpu") as fast:
        fast_losses = loop.train_fast(model, optimizer, loop.make_loader(dataset, batch_size=BATCH, seed=SEED),
                                      steps=STEPS)
    return slow, torch.tensor(slow_losses), fast, fast_losses


def test_losses_are_equal(runs):
    _, slow_losses, _, fast_losses = runs
    assert fast_losses.shape == (STEPS,) and fast_losses.dtype == torch.float32
    torch.testing.assert_close(fast_losses, slow_losses, rtol=1e-5, atol=0)


def test_the_slow_loop_syncs_and_uploads_every_step(runs):
    slow = runs[0]
    assert slow.syncs >= STEPS and slow.uploads >= STEPS
    assert slow.events["syncs", "aten._local_scalar_dense.default"] == STEPS  # loss.item()
    assert slow.events["syncs", "Tensor.numpy"] == 2 * STEPS  # accuracy on host copies
    # The class weights, the lengths and the labels are built from Python data every step.
    assert slow.events["uploads", "aten.lift_fresh.default"] == 3 * STEPS


def test_the_fixed_loop_neither_syncs_nor_uploads_per_step(runs):
    fast = runs[2]
    assert fast.intact and fast.syncs == 0
    # One upload in all: the class weights, made once before the loop.
    assert fast.uploads == 1 and fast.events["uploads", "aten.lift_fresh.default"] == 1


def test_the_fixed_loop_launches_far_fewer_ops(runs):
    slow, _, fast, _ = runs
    # Measured on torch 2.13 (CPU): 281 ops a step against 79 at batch 16 (525 against 79 at
    # 32); the per-sample loss loop grows with the batch, the fixed step does not.
    assert slow.ops / fast.ops > 2.5
    assert fast.ops / STEPS < 120


def test_workers_do_not_outlive_the_call(dataset):
    assert not multiprocessing.active_children()
    loader = loop.make_loader(dataset, batch_size=BATCH, seed=SEED)
    assert loader.num_workers >= 2 and loader.persistent_workers and loader.prefetch_factor >= 2
    assert not loader.pin_memory  # nothing to pin for on the CPU
    tokens, lengths, labels = next(iter(loader))
    assert tokens.shape[1] == int(lengths.max())  # padded to this batch's longest, no further
    assert len(multiprocessing.active_children()) == loader.num_workers

    class Fails(loop.TextClassifier):
        calls = 0

        def forward(self, tokens):
            Fails.calls += 1
            if Fails.calls == 2:
                raise RuntimeError("stop")
            return super().forward(tokens)

    model = Fails(seed=0)
    with pytest.raises(RuntimeError, match="stop"):
        loop.train_fast(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, steps=3)
    assert not multiprocessing.active_children()


def test_one_order_for_every_loader(dataset):
    def labels(loader, epochs=2):
        return [batch[2].tolist() for _ in range(epochs) for batch in loader]

    single = DataLoader(dataset, batch_size=BATCH, sampler=loop.shuffle_sampler(dataset, SEED),
                        collate_fn=text.pad_collate)
    workers = loop.make_loader(dataset, batch_size=BATCH, seed=SEED)
    try:
        assert labels(single) == labels(workers)
    finally:
        loop.release_workers(workers)
    assert not multiprocessing.active_children()


def test_padding_does_not_change_the_model():
    model = loop.TextClassifier(vocab=50, seed=3)
    seqs = [torch.tensor([4, 9, 2]), torch.tensor([7, 7, 1, 30, 12])]
    batch = [(s, 0) for s in seqs]
    tight, wide = text.pad_collate(batch)[0], text.pad_to_max_collate(40)(batch)[0]
    assert tight.shape == (2, 5) and wide.shape == (2, 40)
    torch.testing.assert_close(model(wide), model(tight), rtol=1e-6, atol=1e-7)
    assert not model.embed.weight[0].any()


def test_models_depend_on_the_seed_only():
    torch.manual_seed(1)
    a = loop.TextClassifier(seed=4)
    torch.manual_seed(2)
    b, c = loop.TextClassifier(seed=4), loop.TextClassifier(seed=5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embed.weight, c.embed.weight)


def test_labels_and_lengths():
    data = loop.make_dataset([torch.tensor([1, 5, 9, 2]), torch.tensor([1, 2]), torch.tensor([8, 4, 3])])
    assert data.labels == [1, 1, 0]  # most common token % 4; a tie goes to the smaller class
    assert data[2][1] == 0 and torch.equal(data[2][0], torch.tensor([8, 4, 3]))
    seqs = loop.synthetic_seqs(300, vocab=97, seed=2)
    lengths = torch.tensor([len(s) for s in seqs])
    assert 3 <= lengths.min() and lengths.max() <= 256 and lengths.float().median() < lengths.float().mean()
    assert all(int(s.min()) >= 1 and int(s.max()) < 97 for s in seqs)
    assert all(torch.equal(a, b) for a, b in zip(seqs, loop.synthetic_seqs(300, vocab=97, seed=2)))


def test_planted_inefficiencies_and_solution_regions():
    assert len(loop.planted_inefficiencies()) == 6
    assert "six things in it are slow" in loop.__doc__.strip().splitlines()[-1]
    root = Path(loop.__file__).parent
    # The answer key of the hunt is a solution too: the student copy only names where to look.
    for module, graded in [("loop.py", {"make_loader", "train_fast", "planted_inefficiencies"}), ("profile.py", set()),
                           ("syncs.py", set())]:
        source = (root / module).read_text()
        stubbed = {node.name for node in ast.walk(ast.parse(strip_solutions(source)))
                   if isinstance(node, ast.FunctionDef) and "NotImplementedError" in ast.unparse(node)}
        assert stubbed == graded, module
