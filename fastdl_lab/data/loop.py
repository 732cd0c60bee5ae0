"""A training loop that starves its device, beside the fixed one (lab 06 profiling + data).

The task: classify token sequences of long-tailed lengths with a bag-of-embeddings model. The
same model, optimizer state and batch order go through ``train_slow``, a loop written the way
many first loops are, and ``train_fast``, the same computation with the host kept out of the
device's way. Their losses agree to rounding, so the only difference a profiler or a
``SyncCounter`` can see is how the work is fed.

- ``TextClassifier``: embedding (``padding_idx=0``), mean over the real tokens, a small MLP.
- ``TextDataset`` / ``make_dataset`` / ``synthetic_seqs``: sequences, labels and test data.
- ``fresh_run``: one deterministic starting point (model and optimizer) for either loop.
- ``shuffle_sampler``: the batch order both loops share.
- ``train_slow`` (reference) and ``make_loader`` + ``train_fast`` (the fix).
- ``release_workers``: shut a loader's persistent worker pool down when a run ends.

``train_slow`` trains correctly, and six things in it are slow; lab 06 asks you to find them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler

from fastdl_lab.data.text import PAD as _PAD
from fastdl_lab.data.text import pad_collate, pad_to_max_collate

# Per-class loss weights, as a task with rarer classes would set them.
CLASS_WEIGHTS = [1.0, 2.0, 0.5, 1.5]


def planted_inefficiencies() -> dict[str, str]:
    """The six slow things in ``train_slow``, each named and explained: the answer to lab 06's hunt,
    kept out of the student copy of the package like every other solution."""
    ### BEGIN SOLUTION
    return {
        "single-process loading": "num_workers=0 and no pin_memory: collating and padding run on the training "
                                  "thread between steps, and every batch is copied from pageable memory, blocking",
        "padding to the dataset's longest": "every batch is padded to the longest sequence of the whole dataset, so "
                                            "most of the embedding and pooling work is on padding",
        "loss.item() every step": "reading the loss back makes the host wait for the device at every step, so the "
                                  "next step cannot be queued while this one runs",
        "accuracy on host copies every step": "sklearn's accuracy_score needs NumPy arrays: two copies to the host "
                                              "and a sync per step for a figure nobody reads that often",
        "class weights rebuilt every step": "a tensor made from the Python list and moved to the device each step: an "
                                            "upload (and, from pageable memory, a wait) for a constant",
        "per-sample loss loop": "a Python loop over the batch launches several small ops per sample, forward and "
                                "backward, where one weighted cross_entropy does the batch",
    }
    ### END SOLUTION


class TextClassifier(nn.Module):
    """Token ids ``[B, L]`` (``0`` = padding) -> class logits ``[B, classes]``.

    The embeddings of the real tokens are averaged (padding is masked out, so how far a batch is
    padded does not change the result beyond rounding), then a two-layer MLP. Weights come from
    ``seed`` alone, never from the global RNG.
    """

    def __init__(self, vocab: int = 4096, dim: int = 64, classes: int = 4, seed: int = 0):
        super().__init__()
        # Built on the meta device and filled below: default initialisation would draw from (and
        # advance) the caller's global RNG for values that are overwritten anyway.
        with torch.device("meta"):
            self.embed = nn.Embedding(vocab, dim, padding_idx=_PAD)
            self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, classes))
        self.to_empty(device="cpu")
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            nn.init.normal_(self.embed.weight, 0.0, 1.0, generator=gen)
            self.embed.weight[_PAD].zero_()
            for layer in (self.mlp[0], self.mlp[2]):
                bound = layer.in_features ** -0.5
                nn.init.uniform_(layer.weight, -bound, bound, generator=gen)
                nn.init.uniform_(layer.bias, -bound, bound, generator=gen)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = (tokens != _PAD).unsqueeze(-1).to(self.embed.weight.dtype)
        summed = (self.embed(tokens) * mask).sum(1)
        return self.mlp(summed / mask.sum(1).clamp_min(1.0))


class TextDataset(Dataset):
    """Items ``(tokens: LongTensor, label: int)``."""

    def __init__(self, seqs: list[torch.Tensor], labels: torch.Tensor):
        if len(seqs) != len(labels):
            raise ValueError(f"{len(seqs)} sequences but {len(labels)} labels")
        self.seqs = list(seqs)
        # Plain ints: reading a label tensor per item would be a value read on every fetch.
        self.labels = [int(y) for y in torch.as_tensor(labels).tolist()]

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.seqs[i], self.labels[i]


def make_dataset(seqs: list[torch.Tensor], classes: int = 4) -> TextDataset:
    """Label each sequence by the most common ``token % classes`` in it (ties: the smallest class).

    Deterministic, and learnable by this model: the mean embedding can carry the share of each
    residue class, and the MLP has to pick the largest. Near-ties make it noisy, as labels are.
    """
    labels = torch.stack([torch.bincount(s % classes, minlength=classes).argmax() for s in seqs])
    return TextDataset(seqs, labels)


def synthetic_seqs(n: int, *, vocab: int = 4096, seed: int = 0, min_len: int = 3,
                   max_len: int = 256) -> list[torch.Tensor]:
    """``n`` sequences of token ids in ``[1, vocab)`` with lognormal lengths (median about 25).

    The long tail is what makes padding policy matter: a few sequences near ``max_len`` decide
    how wide a batch padded to the dataset's longest is.
    """
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.exp(3.2 + 0.9 * torch.randn(n, generator=gen)).round().clamp(min_len, max_len).long()
    return [torch.randint(1, vocab, (int(length),), generator=gen) for length in lengths]


def fresh_run(seed: int, vocab: int = 4096,
              device: str | torch.device = "cpu") -> tuple[TextClassifier, torch.optim.Optimizer]:
    """The same model and optimizer for either loop.

    SGD with momentum keeps no state on the host. Adam's step counter is a CPU tensor read with
    ``.item()`` every step: harmless on a GPU, but on the CPU stand-in it would be a sync that
    both loops make and nobody can remove.
    """
    model = TextClassifier(vocab=vocab, seed=seed).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def shuffle_sampler(dataset: Dataset, seed: int) -> RandomSampler:
    """The shuffled order both loops use: any loader with this sampler and batch size sees the same batches.

    The order lives in the sampler's own generator. The DataLoader's ``generator`` would not do:
    every new iterator also draws a worker seed from it, and a persistent-worker loader makes only
    one iterator while a single-process one makes one per epoch, so their orders part after the
    first epoch.
    """
    return RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))


def _batches(loader: DataLoader):
    """Batches without end, epoch after epoch."""
    if len(loader) == 0:
        raise ValueError("the loader yields no batches")
    while True:
        yield from loader


def release_workers(loader: DataLoader) -> None:
    """Stop a loader's persistent worker processes now instead of whenever the loader is collected."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        loader._iterator = None
        if hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


def train_slow(model: nn.Module, optimizer: torch.optim.Optimizer, dataset: TextDataset, *, steps: int,
               batch_size: int, seed: int, device: str | torch.device = "cpu", log=None) -> list[float]:
    """Train for ``steps`` batches; the loss of each step. ``log(step, loss, accuracy)`` if given."""
    from sklearn.metrics import accuracy_score  # here, so that importing this module stays light

    longest = max(len(s) for s in dataset.seqs)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=shuffle_sampler(dataset, seed),
                        collate_fn=pad_to_max_collate(longest))
    model.train()
    losses = []
    batches = _batches(loader)
    for step in range(steps):
        tokens, _, labels = next(batches)
        tokens, labels = tokens.to(device), labels.to(device)
        weights = torch.tensor(CLASS_WEIGHTS).to(device)

        logits = model(tokens)
        total = sum(F.cross_entropy(logits[i:i + 1], labels[i:i + 1], weight=weights, reduction="sum")
                    for i in range(len(labels)))
        loss = total / weights[labels].sum()

        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        losses.append(loss.item())
        accuracy = accuracy_score(labels.cpu().numpy(), logits.argmax(1).cpu().numpy())
        if log is not None:
            log(step, losses[-1], accuracy)
    return losses


def make_loader(dataset: TextDataset, *, batch_size: int, seed: int, device: str | torch.device = "cpu") -> DataLoader:
    """The loader ``train_fast`` reads: batches in ``train_slow``'s order, prepared off the training thread."""
    ### BEGIN SOLUTION
    # Two workers collate ahead of the loop; each keeps four batches in flight, and the pool
    # survives from one epoch to the next. Each batch is padded only to its own longest sequence.
    return DataLoader(dataset, batch_size=batch_size, sampler=shuffle_sampler(dataset, seed), collate_fn=pad_collate,
                      num_workers=2, prefetch_factor=4, persistent_workers=True,
                      pin_memory=torch.device(device).type == "cuda")
    ### END SOLUTION


def train_fast(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader, *, steps: int,
               device: str | torch.device = "cpu") -> torch.Tensor:
    """``train_slow``'s computation with no sync and no per-step upload; the losses as one device tensor.

    The caller reads the losses after the loop, once. The loader's workers are stopped on return.
    """
    ### BEGIN SOLUTION
    weights = torch.tensor(CLASS_WEIGHTS, device=device)
    model.train()
    losses = []
    try:
        batches = _batches(loader)
        for _ in range(steps):
            tokens, _, labels = next(batches)
            # From pinned memory these copies are asynchronous: the host queues the step and moves on.
            tokens = tokens.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            loss = F.cross_entropy(model(tokens), labels, weight=weights)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
    finally:
        release_workers(loader)
    return torch.stack(losses)
    ### END SOLUTION


if __name__ == "__main__":
    from fastdl_lab.data.syncs import SyncCounter

    data = make_dataset(synthetic_seqs(512, seed=1))
    for label in ("slow", "fast"):
        model, optimizer = fresh_run(0)
        with SyncCounter() as counter:
            if label == "slow":
                result = train_slow(model, optimizer, data, steps=12, batch_size=32, seed=3)
            else:
                result = train_fast(model, optimizer, make_loader(data, batch_size=32, seed=3), steps=12)
        result = torch.as_tensor(result).tolist()
        print(f"{label}: losses {[round(x, 4) for x in result[:4]]} ...\n{counter.report(steps=12)}")
