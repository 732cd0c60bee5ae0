"""Lab 01's tensor-core shape rules: multiples per dtype, rounding, and a padded vocabulary that
computes the same embeddings, logits, loss and gradients as the original."""

import pytest
import torch
from torch import nn

from fastdl_lab import shapes


def test_multiples_follow_the_byte_rule():
    assert shapes.multiple_for(torch.float16) == shapes.multiple_for(torch.bfloat16) == 8
    assert shapes.multiple_for(torch.float16, best=True) == 64
    assert (shapes.multiple_for(torch.float32), shapes.multiple_for(torch.float32, best=True)) == (4, 32)
    assert (shapes.multiple_for(torch.int8), shapes.multiple_for(torch.int8, best=True)) == (16, 128)
    with pytest.raises(ValueError, match="no tensor-core rule"):
        shapes.multiple_for(torch.bool)


def test_round_up_and_alignment():
    assert [shapes.round_up(n, 64) for n in (0, 1, 64, 65, 50257)] == [0, 64, 64, 128, 50304]
    report = shapes.aligned(4096, 50257, 4095)
    assert report["M"] == {"16 B": True, "128 B": True}
    assert report["N"] == {"16 B": False, "128 B": False}
    assert report["K"] == {"16 B": False, "128 B": False}
    assert shapes.aligned(8, 72, 64)["N"] == {"16 B": True, "128 B": False}
    with pytest.raises(ValueError):
        shapes.round_up(5, 0)


@pytest.mark.parametrize("vocab, bias", [(1000, True), (1024, False), (77, True)])
def test_a_padded_vocabulary_computes_the_same(vocab, bias):
    torch.manual_seed(vocab)
    emb, head = nn.Embedding(vocab, 32), nn.Linear(32, vocab, bias=bias)
    pemb, phead = shapes.pad_embedding(emb), shapes.pad_lm_head(head)
    assert pemb.num_embeddings % 64 == 0 and phead.proj.out_features % 64 == 0
    assert pemb.num_embeddings - vocab < 64
    tokens = torch.randint(0, vocab, (4, 9))
    targets = torch.randint(0, vocab, (4, 9))
    torch.testing.assert_close(pemb(tokens), emb(tokens))
    logits, plogits = head(emb(tokens)), phead(pemb(tokens))
    assert plogits.shape == logits.shape == (4, 9, vocab)
    torch.testing.assert_close(plogits, logits)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    ploss = nn.functional.cross_entropy(plogits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(ploss, loss)
    loss.backward()
    ploss.backward()
    torch.testing.assert_close(phead.proj.weight.grad[:vocab], head.weight.grad)
    assert not phead.proj.weight.grad[vocab:].any()  # sliced-off logits send nothing back
    torch.testing.assert_close(pemb.weight.grad[:vocab], emb.weight.grad)


def test_k_operands_are_row_major():
    a, b = shapes.k_alignment_operands(4095, m=8, n=4)
    assert a.shape == (8, 4095) and b.shape == (4095, 4) and a.is_contiguous() and b.is_contiguous()
