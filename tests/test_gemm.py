"""Lab 01 gemm: the tiled Triton kernel against the reference, the launcher's checks, launch order."""

import pytest
import torch

from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl

from fastdl_lab import checks, gemm

DEV = "cuda" if device.has_gpu() else "cpu"

# Single block, exact block, ragged in every dimension over several blocks, and degenerate sizes
# (CPU default tiles are 64x64x32).
SHAPES = [(1, 1, 1), (37, 45, 50), (64, 64, 32), (130, 70, 100), (3, 129, 257)]


def _operands(m, n, k, dtype, seed=0):
    return (checks.randn(m, k, dtype=dtype, seed=seed, device=DEV),
            checks.randn(k, n, dtype=dtype, seed=seed + 1, device=DEV))


@pytest.mark.interpret
@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matmul_matches_reference(m, n, k, dtype):
    a, b = _operands(m, n, k, dtype)
    c = gemm.matmul(a, b)
    assert c.shape == (m, n) and c.dtype == dtype
    gemm.check_matmul(c, a, b, name=f"{m}x{n}x{k} {dtype}")


@pytest.mark.interpret
@pytest.mark.parametrize("m, n, k", [(33, 47, 48), (33, 47, 40), (16, 16, 16)])
def test_wrapped_edges_with_even_and_ragged_k(m, n, k):
    # 16x16x16 tiles: rows and columns past the last tile wrap round (the checked interpreter would
    # stop a load outside A or B); K = 48 and 16 run the unmasked EVEN_K loop, K = 40 the masked one.
    a, b = _operands(m, n, k, torch.float16, seed=5)
    gemm.check_matmul(gemm.matmul(a, b, block_m=16, block_n=16, block_k=16), a, b)


def test_gpu_path_autotunes_the_reference_over_the_arch_configs():
    for capability in (80, 90):
        tuned = gemm._autotuned(capability, torch.float16)
        assert tuned.keys == ["M", "N", "K"]
        assert [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages} for c in tuned.configs] == [
            {"BLOCK_M": c["block_m"], "BLOCK_N": c["block_n"], "BLOCK_K": c["block_k"], "GROUP_M": c["group_m"],
             "num_warps": c["num_warps"], "num_stages": c["num_stages"]} for c in gemm.autotune_configs(capability)]
        # EVEN_K follows the configuration the autotuner picked.
        even_k = tuned.fn.values["EVEN_K"]
        assert even_k({"K": 4096, "BLOCK_K": 64}) and not even_k({"K": 4000, "BLOCK_K": 64})


@pytest.mark.interpret
def test_strided_operands_and_small_tiles_with_ragged_last_group():
    # Transposed views exercise the stride arguments; 16x16 tiles make a 5x4 grid of tiles, so
    # GROUP_M=2 leaves a last group of one row.
    a = checks.randn(40, 70, seed=3, device=DEV).t()
    b = checks.randn(50, 40, seed=4, device=DEV).t()
    c = gemm.matmul(a, b, block_m=16, block_n=16, block_k=16, group_m=2)
    gemm.check_matmul(c, a, b)


@pytest.mark.interpret
def test_empty_inner_dimension_gives_zeros():
    a, b = _operands(5, 6, 0, torch.float32)
    assert torch.equal(gemm.matmul(a, b), torch.zeros(5, 6, device=DEV))


def test_reference_loops_and_numpy_agree():
    a, b = _operands(9, 7, 11, torch.float32)
    ref = gemm.matmul_ref(a, b)
    checks.assert_close(gemm.matmul_loops(a.cpu(), b.cpu()), ref.cpu())
    checks.assert_close(gemm.matmul_numpy(a, b), ref.cpu())
    assert gemm.matmul_ref(a.half(), b.half()).dtype == torch.float16
    with pytest.raises(ValueError, match="too large"):
        gemm.matmul_loops(torch.zeros(200, 200), torch.zeros(200, 200))


@pytest.mark.parametrize("a, b, message", [
    (torch.zeros(4), torch.zeros(4, 4), "2-D"),
    (torch.zeros(4, 5), torch.zeros(4, 5), "inner dimensions"),
    (torch.zeros(4, 4), torch.zeros(4, 4, dtype=torch.float16), "cast"),
    (torch.zeros(4, 4, dtype=torch.int32), torch.zeros(4, 4, dtype=torch.int32), "not supported"),
])
def test_validation_messages(a, b, message):
    with pytest.raises(ValueError, match=message):
        gemm.matmul(a.to(DEV), b.to(DEV))


def test_validation_of_types_and_blocks():
    with pytest.raises(TypeError):
        gemm.matmul([[1.0]], torch.zeros(1, 1))
    a, b = _operands(8, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        gemm.matmul(a, b, block_m=48)
    with pytest.raises(ValueError, match="power of two"):
        gemm.matmul(a, b, block_k=8)
    with pytest.raises(ValueError, match="group_m"):
        gemm.matmul(a, b, group_m=0)


def test_check_config_accepts_the_tunable_keys_only():
    assert gemm.check_config({"block_m": 64, "num_warps": 8, "num_stages": 2}) == {
        "block_m": 64, "num_warps": 8, "num_stages": 2}
    for bad, message in [({"warmup": True}, "unknown configuration key 'warmup'"), ({"num_warps": 3}, "num_warps"),
                         ({"num_stages": 0}, "num_stages"), ({"block_m": True}, "block_m"),
                         ({"block_k": 32.0}, "block_k"), ({"block_n": 512}, "block_n"), ([("block_m", 64)], "dict")]:
        with pytest.raises(ValueError, match=message):
            gemm.check_config(bad)


@pytest.mark.interpret
def test_launch_options_reach_the_kernel():
    a, b = _operands(70, 50, 40, torch.float32)
    gemm.check_matmul(gemm.matmul(a, b, block_m=32, block_n=32, block_k=16, num_warps=2, num_stages=2), a, b)
    with pytest.raises(ValueError, match="num_stages"):
        gemm.matmul(a, b, num_stages=9)


def test_the_compiler_reports_registers_and_shared_memory_per_program():
    four = gemm.resources(90, torch.float16, block_m=128, block_n=128, block_k=32, num_warps=4, num_stages=3)
    eight = gemm.resources(90, torch.float16, block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=3)
    shallow = gemm.resources(90, torch.float16, block_m=128, block_n=128, block_k=32, num_warps=4, num_stages=2)
    assert (four["threads"], eight["threads"]) == (128, 256)
    # The 128 x 128 fp32 accumulator alone is 128 registers per thread at 4 warps, 64 at 8.
    assert four["registers"] >= 128 and eight["registers"] < 0.7 * four["registers"]
    # One buffer of A and B tiles per pipeline stage: 16 KiB of fp16 each, plus a little of Triton's own.
    for used, stages in ((four, 3), (shallow, 2)):
        assert stages * 16 << 10 <= used["shared_bytes"] <= (stages * 16 + 2) << 10
    assert four["local_bytes"] == four["stack_bytes"] == 0


@pytest.mark.skipif(not device.interpreting(), reason="bf16 is only refused under the interpreter")
def test_bf16_refused_under_interpreter():
    a = torch.zeros(4, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        gemm.matmul(a, a)


@triton.jit
def _skips_last_tile(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # A plausible bug: the tile count is off by one, so the last program stores nothing.
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // num_pid_n, pid % num_pid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & ((k0 + offs_k)[None, :] < K), other=0.0)
        b = tl.load(b_ptr + (k0 + offs_k)[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=((k0 + offs_k)[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
    last = tl.cdiv(M, BLOCK_M) * num_pid_n - 1
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N) & (pid < last)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc, mask=mask)


@pytest.mark.interpret
@pytest.mark.skipif(device.has_gpu(), reason="outputs are poisoned on the CPU path only")
def test_unwritten_tile_is_caught():
    a, b = _operands(100, 90, 40, torch.float32)
    c = gemm.matmul(a, b, kernel=_skips_last_tile)
    assert c[:64].isfinite().all() and c[64:, 64:].isnan().all()
    with pytest.raises(checks.MismatchError, match="NaN in actual"):
        gemm.check_matmul(c, a, b)


GRIDS = [(1, 1, 1), (4, 3, 2), (5, 3, 2), (7, 9, 3), (3, 5, 8), (16, 16, 8)]


@pytest.mark.parametrize("num_pid_m, num_pid_n, group_m", GRIDS)
def test_grouped_order_is_a_bijection(num_pid_m, num_pid_n, group_m):
    total = num_pid_m * num_pid_n
    tiles = [gemm.grouped_pid_ref(p, num_pid_m, num_pid_n, group_m) for p in range(total)]
    assert sorted(tiles) == [(i, j) for i in range(num_pid_m) for j in range(num_pid_n)]


def test_grouped_order_walks_columns_inside_a_group():
    order = [gemm.grouped_pid_ref(p, 5, 3, 2) for p in range(15)]
    assert order[:6] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    # The fifth row of tiles is a group on its own.
    assert order[12:] == [(4, 0), (4, 1), (4, 2)]
    # A group of one row is the row-major order.
    assert all(gemm.grouped_pid_ref(p, 4, 6, 1) == gemm.row_major_pid(p, 4, 6) for p in range(24))
    with pytest.raises(ValueError):
        gemm.grouped_pid_ref(15, 5, 3, 2)


def test_grouped_order_touches_fewer_tiles():
    # 32x32 tiles of output, 128 programs in flight: row-major reads 4 rows of A and all 32
    # columns of B; grouping by 8 rows reads 8 rows and 16 columns.
    assert gemm.tiles_touched(gemm.row_major_pid, 32, 32, 128) == 4 + 32
    assert gemm.tiles_touched(gemm.grouped_pid_ref, 32, 32, 128, group_m=8) == 8 + 16
