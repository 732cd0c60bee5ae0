"""2:4 pruning and its check, random sparsity, and the CSR-against-dense sweep."""

import pytest
import torch

from fastdl_lab import device, sparse


def test_prune_2_4_keeps_the_two_largest_of_every_four():
    w = torch.tensor([[1.0, -5.0, 3.0, 0.5, 2.0, 2.5, -3.0, 0.0]])
    assert torch.equal(sparse.prune_2_4(w), torch.tensor([[0.0, -5.0, 3.0, 0.0, 0.0, 2.5, -3.0, 0.0]]))
    pruned = sparse.prune_2_4(torch.randn(16, 32))
    assert sparse.is_2_4(pruned) and (pruned != 0).sum() == 16 * 16
    assert not sparse.is_2_4(torch.ones(2, 8)) and not sparse.is_2_4(torch.zeros(2, 6))
    with pytest.raises(ValueError, match="multiple of 4"):
        sparse.prune_2_4(torch.randn(3, 6))


def test_random_sparse_has_about_the_density_asked():
    a = sparse.random_sparse(200, 200, 0.05)
    assert 0.04 < (a != 0).float().mean().item() < 0.06
    with pytest.raises(ValueError):
        sparse.random_sparse(2, 2, 1.5)


def test_the_sweep_checks_the_product_and_reports_each_density():
    rows = sparse.density_sweep(64, densities=(0.01, 0.5), reps=2)
    assert [r["density"] for r in rows] == [0.01, 0.5]
    assert rows[0]["nnz"] < rows[1]["nnz"] and all(r["sparse_s"] > 0 and r["dense_s"] > 0 for r in rows)
    assert rows[0]["speedup"] == pytest.approx(rows[0]["dense_s"] / rows[0]["sparse_s"])


def test_the_tensor_core_format_needs_a_gpu():
    if device.has_gpu():
        pytest.skip("a GPU is here")
    with pytest.raises(RuntimeError, match="needs a GPU"):
        sparse.semi_structured(sparse.prune_2_4(torch.randn(64, 64)))


@pytest.mark.gpu
def test_the_tensor_core_format_multiplies_as_the_dense_matrix_does():
    w = sparse.prune_2_4(torch.randn(128, 128, device="cuda")).half()
    x = torch.randn(128, 64, device="cuda").half()
    torch.testing.assert_close(torch.mm(sparse.semi_structured(w), x), w @ x, atol=1e-2, rtol=1e-2)
