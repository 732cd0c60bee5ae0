"""Lab 06 data: padding, length bucketing and sequence packing on stdlib docstring lengths."""

import numpy as np
import pytest
import torch

from fastdl_lab import checks
from fastdl_lab.data import text

MAX_LEN = 256
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def real_lengths():
    return np.minimum(text.docstring_lengths(), MAX_LEN)


# ---------------------------------------------------------------------------------------------
# Data


def test_tokenize_ids_are_crc32_of_each_word_and_mark():
    # By hand: crc32(b"Return") = 0xa0323a39 = 2687646265, and 2687646265 % 4095 = 3580, so id
    # 3581; "the" 1011183078 -> 634, "sum" 3367870285 -> 3056, "," 3772416878 -> 504,
    # "não" (utf-8) 829678806 -> 3142, "!" 2657877971 -> 1842.
    assert text.tokenize("Return the sum, não!") == [3581, 634, 3056, 504, 3142, 1842]
    # With vocab 7 the same crcs modulo 6, plus one: never 0, which is PAD.
    assert text.tokenize("Return the  sum,\nnão!", vocab=7) == [2, 1, 2, 3, 1, 6]
    assert text.tokenize(" \n\t") == []


def test_docstring_lengths_look_real(real_lengths):
    lengths = text.docstring_lengths()
    assert lengths.dtype == np.int64 and lengths.min() >= 1
    assert len(lengths) >= 2000
    # A long tail: a few docstrings run to hundreds of tokens, most are a line or two.
    assert lengths.max() >= 20 * np.median(lengths)
    assert (lengths > MAX_LEN).sum() >= 10
    expected = [n for n in (len(text.tokenize(t)) for t in text.docstring_texts()) if n]
    assert lengths.tolist() == expected


def test_corpus_is_seeded_and_truncated():
    a, b = text.corpus(40, seed=1, max_len=64), text.corpus(40, seed=1, max_len=64)
    c = text.corpus(40, seed=2, max_len=64)
    assert len(a) == 40 and all(s.dtype == torch.long and 1 <= len(s) <= 64 for s in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(len(x) == len(y) and torch.equal(x, y) for x, y in zip(a, c))
    assert max(len(s) for s in text.corpus(200, seed=1, max_len=64)) == 64
    with pytest.raises(ValueError, match="docstrings"):
        text.corpus(10**6, seed=0)


# ---------------------------------------------------------------------------------------------
# Padding


def test_padding_fraction_by_hand():
    # Batch [3, 1] pads to 3: 6 slots, 2 pads; batch [4, 1, 5] pads to 5: 15 slots, 5 pads.
    assert text.padding_fraction([[0, 1], [2, 3, 4]], [3, 1, 4, 1, 5]) == pytest.approx(7 / 21)
    assert text.padding_fraction([[0], [1, 3]], [3, 1, 4, 1, 5]) == 0.0


def test_random_batches_cover_every_index_once():
    batches = text.random_batches(103, 10, seed=4)
    assert [len(b) for b in batches] == [10] * 10 + [3]
    assert sorted(i for b in batches for i in b) == list(range(103))
    assert batches == text.random_batches(103, 10, seed=4) != text.random_batches(103, 10, seed=5)


def test_collates_pad_to_the_batch_or_to_the_dataset_maximum():
    items = [(torch.tensor([5, 6, 7]), 2), (torch.arange(1, 8), 0), (torch.tensor([9]), 5)]
    tokens, lengths, labels = text.pad_collate(items)
    assert tokens.shape == (3, 7) and tokens.dtype == lengths.dtype == labels.dtype == torch.long
    assert tokens[0].tolist() == [5, 6, 7, 0, 0, 0, 0] and tokens[2].tolist() == [9] + [text.PAD] * 6
    assert lengths.tolist() == [3, 7, 1] and labels.tolist() == [2, 0, 5]
    fixed, fixed_lengths, _ = text.pad_to_max_collate(11)(items)
    assert fixed.shape == (3, 11) and torch.equal(fixed[:, :7], tokens) and not fixed[:, 7:].any()
    assert torch.equal(fixed_lengths, lengths)
    with pytest.raises(ValueError):
        text.pad_to_max_collate(5)(items)


# ---------------------------------------------------------------------------------------------
# Bucketing


def _same_batch_share(before, after) -> float:
    """Share of ``after``'s batches that were also a batch, as a set of indices, in ``before``."""
    seen = {frozenset(b) for b in before}
    return sum(frozenset(b) in seen for b in after) / len(after)


def _epochs(sampler, epochs=(0, 1)):
    out = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


class SortOnceSampler(torch.utils.data.Sampler):
    """The tempting shortcut: sort everything once and only reshuffle the order of the batches."""

    def __init__(self, lengths, batch_size, seed=0):
        order = np.argsort(np.asarray(lengths), kind="stable")
        self.batches = [order[i:i + batch_size].tolist() for i in range(0, len(order), batch_size)]
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        for i in np.random.default_rng([self.seed, self.epoch]).permutation(len(self.batches)):
            yield self.batches[i]

    def __len__(self):
        return len(self.batches)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("drop_last, expected_len", [(False, 156), (True, 133)])
def test_bucket_sampler_invariants(seed, drop_last, expected_len):
    # 1001 items, buckets of 45 (not a multiple of 7): 22 full buckets of 6 full batches and a
    # short one each, then a last bucket of 11 items, one full batch and a short one.
    lengths = np.random.default_rng(seed).lognormal(3, 1, 1001).astype(np.int64) + 1
    sampler = text.BucketBatchSampler(lengths, 7, bucket_size=45, seed=seed, drop_last=drop_last)
    assert len(sampler) == expected_len
    epochs = _epochs(sampler)
    for batches in epochs:
        assert len(batches) == expected_len
        assert all(isinstance(i, int) for b in batches for i in b)
        assert all(1 <= len(b) <= 7 for b in batches)
        flat = [i for b in batches for i in b]
        assert len(set(flat)) == len(flat)
        if drop_last:
            assert all(len(b) == 7 for b in batches) and len(flat) == 133 * 7
        else:
            assert sorted(flat) == list(range(1001))
    assert _same_batch_share(*epochs) < 0.5
    assert _epochs(sampler, (1,))[0] == epochs[1]
    other = text.BucketBatchSampler(lengths, 7, bucket_size=45, seed=seed + 2, drop_last=drop_last)
    assert _epochs(other, (0,))[0] != epochs[0]


def test_bucketing_pads_far_less_than_random_batches(real_lengths):
    sampler = text.BucketBatchSampler(real_lengths, 32, seed=0)
    bucketed = [text.padding_fraction(batches, real_lengths) for batches in _epochs(sampler)]
    random = text.padding_fraction(text.random_batches(len(real_lengths), 32, seed=0), real_lengths)
    assert random > 0.7
    assert max(bucketed) < 0.1 and max(bucketed) < random / 8


def test_batches_come_in_a_shuffled_order(real_lengths):
    # Batch by batch in bucket order, the longest length would only fall at a bucket's end
    # (twice an epoch here); in a shuffled order it falls about as often as it rises.
    for batches in _epochs(text.BucketBatchSampler(real_lengths, 32, seed=0)):
        longest = np.array([real_lengths[b].max() for b in batches])
        assert (np.diff(longest) < 0).sum() >= len(batches) / 4


def test_sort_once_sampler_fails_the_reshuffle_property(real_lengths):
    ours = _same_batch_share(*_epochs(text.BucketBatchSampler(real_lengths, 32, seed=0)))
    once = _same_batch_share(*_epochs(SortOnceSampler(real_lengths, 32)))
    # Sorting once pads least of all, but every epoch offers the model the very same batches.
    assert once == 1.0
    assert ours < 0.05


def test_padding_report_orders_the_four_schemes(real_lengths):
    report = text.padding_report(text.docstring_lengths(), 32, seed=0, max_len=MAX_LEN)
    assert report["pad_to_max"] == pytest.approx(1 - real_lengths.sum() / (len(real_lengths) * MAX_LEN))
    assert report["random"] == text.padding_fraction(text.random_batches(len(real_lengths), 32, 0), real_lengths)
    assert report["pad_to_max"] > report["random"] > 0.7 > 0.1 > report["bucketed"] > report["packed"]
    assert report["packed"] < 0.01


# ---------------------------------------------------------------------------------------------
# Packing


def test_first_fit_decreasing_by_hand():
    # Longest first, each into the first row with room: 5 | 4 | 3 3, then the 2 joins the 4 and
    # the 1 the 5: three full rows. First fit in the given order needs four: 2 3 1 | 5 | 4 | 3.
    seqs = [torch.full((n,), 10 + i) for i, n in enumerate([2, 5, 3, 1, 4, 3])]
    packed = text.pack_sequences(seqs, 6)
    assert packed.seq_ids.tolist() == [[1, 1, 1, 1, 1, 3], [4, 4, 4, 4, 0, 0], [2, 2, 2, 5, 5, 5]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]
    assert packed.tokens.tolist() == [[11] * 5 + [13], [14] * 4 + [10] * 2, [12] * 3 + [15] * 3]


@pytest.mark.parametrize("max_len", [37, 64])
def test_packing_invariants(max_len):
    gen = torch.Generator().manual_seed(max_len)
    lengths = torch.randint(1, max_len + 1, (53,), generator=gen).tolist() + [max_len, 1]
    seqs = [torch.randint(1, text.VOCAB, (n,), generator=gen) for n in lengths]
    packed = text.pack_sequences(seqs, max_len)
    rows = packed.tokens.shape[0]
    for t in packed:
        assert t.shape == (rows, max_len) and t.dtype == torch.long
    for i, seq in enumerate(seqs):
        row, col = (packed.seq_ids == i).nonzero(as_tuple=True)
        # Whole, in one row, contiguous, positions restarting at 0.
        assert len(row) == len(seq) and (row == row[0]).all()
        assert torch.equal(col, torch.arange(col[0], col[0] + len(seq)))
        assert torch.equal(packed.tokens[row, col], seq)
        assert torch.equal(packed.position_ids[row, col], torch.arange(len(seq)))
    padding = packed.seq_ids < 0
    assert int((~padding).sum()) == sum(lengths)
    assert not packed.tokens[padding].any() and not packed.position_ids[padding].any()


def test_packing_refuses_a_sequence_longer_than_a_row():
    with pytest.raises(ValueError, match="sequence 2"):
        text.pack_sequences([torch.ones(3), torch.ones(8), torch.ones(9)], 8)


def test_block_diagonal_mask_by_hand():
    mask = text.block_diagonal_mask(torch.tensor([[0, 0, 1, 1, 1, -1], [2, 2, 2, 2, 2, 2]]))
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [0, 0, 1, 0, 0, 0],
                             [0, 0, 1, 1, 0, 0],
                             [0, 0, 1, 1, 1, 0],
                             [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert mask.dtype == torch.bool and mask.shape == (2, 6, 6)
    assert torch.equal(mask[0], expected)
    assert torch.equal(mask[1], torch.ones(6, 6, dtype=torch.bool).tril())


# ---------------------------------------------------------------------------------------------
# Losses: packing must change nothing a sequence sees


@pytest.fixture(scope="module")
def packed_case():
    seqs = text.corpus(48, seed=3) + [torch.tensor([7]), torch.tensor([7, 8])]
    model = text.TinyLM()
    packed = text.pack_sequences(seqs, MAX_LEN)
    return model, seqs, packed, text.sequence_losses(model, seqs)


def test_tiny_lm_weights_come_from_the_seed_alone():
    torch.manual_seed(123)
    a = text.TinyLM(seed=4).state_dict()
    torch.manual_seed(456)
    b, c = text.TinyLM(seed=4).state_dict(), text.TinyLM(seed=5).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tok.weight"], c["tok.weight"])


def test_tiny_lm_is_finite_on_rows_that_see_nothing():
    model = text.TinyLM(vocab=50, max_len=8)
    tokens = torch.zeros(2, 8, dtype=torch.long)
    mask = torch.zeros(2, 8, 8, dtype=torch.bool)
    mask[1] = torch.ones(8, 8, dtype=torch.bool).tril()
    logits = model(tokens, torch.zeros_like(tokens), mask)
    assert logits.shape == (2, 8, 50) and torch.isfinite(logits).all()


def test_packed_losses_equal_unpacked(packed_case):
    model, seqs, packed, truth = packed_case
    got = text.packed_sequence_losses(model, packed, text.block_diagonal_mask(packed.seq_ids))
    assert got.shape == truth.shape == (len(seqs),)
    checks.assert_close(got, truth, atol=TOLERANCE, rtol=0.0, name="packed losses")
    # Length 1: nothing to predict, loss 0 both ways; length 2: one real target.
    assert truth[-2] == got[-2] == 0.0 and truth[-1] > 0.0
    has_target = torch.tensor([len(s) >= 2 for s in seqs])
    assert (truth[has_target] > 1.0).all() and not truth[~has_target].any()


def test_packing_without_position_reset_is_caught(packed_case):
    model, seqs, packed, truth = packed_case
    positions = torch.arange(MAX_LEN).expand_as(packed.tokens)
    got = text.packed_sequence_losses(model, packed._replace(position_ids=positions),
                                      text.block_diagonal_mask(packed.seq_ids))
    assert float((got - truth).abs().max()) > 10_000 * TOLERANCE


def test_packing_with_a_plain_causal_mask_is_caught(packed_case):
    model, seqs, packed, truth = packed_case
    causal = torch.ones(MAX_LEN, MAX_LEN, dtype=torch.bool).tril() & (packed.seq_ids >= 0)[:, None, :]
    got = text.packed_sequence_losses(model, packed, causal)
    assert float((got - truth).abs().max()) > 10_000 * TOLERANCE


def test_threads_asking_for_the_corpus_together_scan_it_once_and_parse_safely():
    """Items of one submission are graded on threads: the stdlib scan happens once, and parses by
    other threads meanwhile (the engine's extraction) wait on the same lock (fastdl_lab/pyast.py)."""
    from concurrent.futures import ThreadPoolExecutor

    from autograder.engine import kernels

    text._scan_docstrings.cache_clear()
    cells = ["import triton\n@triton.jit\ndef k(x_ptr, BLOCK: tl.constexpr):\n    pass\n"] * 4
    with ThreadPoolExecutor(4) as pool:
        scans = [pool.submit(text.docstring_texts) for _ in range(2)]
        extracts = [pool.submit(kernels.extract, cells, ("k",)) for _ in range(20)]
        results = [f.result() for f in scans]
        assert all("def k(" in f.result() for f in extracts)
    assert results[0] == results[1] and len(results[0]) > 1000
    assert text._scan_docstrings.cache_info().misses == 1
