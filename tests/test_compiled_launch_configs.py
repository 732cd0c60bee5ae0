"""What the launchers launch on an A100 and an H100 compiles well: tensor cores for the matrix
products, no register spills, shared memory within the SM. No GPU needed: every kernel is compiled
for sm_80 / sm_90 at the configuration its module's ``default_config`` gives that GPU, the very
function its launcher calls. Each kernel at its main launch shapes, every GEMM autotune
configuration included, is checked by tests/test_kernel_report.py; here are the other types and
sizes, and the proof that launchers take their configuration from ``default_config``."""

import pytest
import torch

from fastdl_lab import checks, gemm, kernel_report, layernorm, optim, rowsum, softmax, triton_aot

SHARED_LIMIT = kernel_report.SHARED_LIMIT
CAPABILITIES = [80, 90]


def _fits(kernel, capability: int) -> dict:
    used = triton_aot.resources(kernel)
    assert used["local_bytes"] == used["stack_bytes"] == 0, f"registers spill: {used}"
    assert used["shared_bytes"] <= SHARED_LIMIT[capability], used
    return used


def _tensor_cores(kernel, capability: int) -> None:
    summary = triton_aot.ptx_summary(kernel.asm["ptx"])
    assert summary[kernel_report.dot_path(capability)] > 0, summary


@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize("dtype, even_k", [(torch.float16, False), (torch.float32, True), (torch.bfloat16, True)])
def test_gemm_default_config_other_types_and_ragged_k(capability, dtype, even_k):
    kernel = gemm.compiled(capability, dtype, even_k=even_k)
    assert kernel.metadata.num_warps == gemm.default_config(dtype, capability)["num_warps"]
    _tensor_cores(kernel, capability)
    _fits(kernel, capability)


def test_gemm_default_is_the_first_autotune_config():
    for capability in (75, 80, 86, 90, 100):
        for dtype in (torch.float16, torch.float32):
            configs = gemm.autotune_configs(capability, dtype)
            assert 3 <= len(configs) <= 6 and gemm.default_config(dtype, capability) == configs[0]
            assert all(gemm.check_config(c) == c for c in configs)
    # The interpreter keeps its one configuration.
    assert gemm.default_config(torch.float16, None)["block_m"] == 64
    with pytest.raises(ValueError, match="capability"):
        gemm.autotune_configs("90")


@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize("dtype, n_cols", [(torch.float16, 8192), (torch.bfloat16, 8192), (torch.float32, 4096),
                                           (torch.float16, 1000)])
def test_softmax_launch_configs_compile_without_spills(capability, dtype, n_cols):
    kernel = softmax.compiled(capability, dtype, n_cols)
    config = softmax.default_config(n_cols, dtype, capability)
    assert kernel.metadata.num_warps == config["num_warps"]
    assert f"reqntid {32 * config['num_warps']}" in kernel.asm["ptx"]
    _fits(kernel, capability)


@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize("which", ["fwd", "bwd_dx", "bwd_dwdb"])
@pytest.mark.parametrize("n_cols", [1024, 8192])
def test_layernorm_launch_configs_compile_without_spills(capability, which, n_cols):
    kernel = layernorm.compiled(capability, torch.float16, n_cols, 4096, which=which)
    config = layernorm.default_config(n_cols, 4096, capability)
    warps = config["sum_num_warps" if which == "bwd_dwdb" else "num_warps"]
    assert kernel.metadata.num_warps == warps and kernel.metadata.num_stages == config["num_stages"]
    _fits(kernel, capability)


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_elementwise_and_reduction_launch_configs_compile_without_spills(capability):
    _fits(rowsum.compiled(capability, torch.float16), capability)
    _fits(optim.compiled(capability, torch.bfloat16, True), capability)


class _Recorder:
    """Stands in for a kernel (with the reference's parameters) and records the launch it gets."""

    def __init__(self, reference):
        self.fn = reference.fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.grid, self.kwargs = grid, kwargs
        return launch


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_launchers_use_default_config_for_the_gpu_they_run_on(monkeypatch, capability):
    # The launchers ask device.capability; pretending it is an A100 or an H100 shows what they would
    # launch there, which must be what the compiled-artefact checks above compile.
    monkeypatch.setattr(gemm.device, "capability", lambda t=None: capability)
    a = checks.randn(300, 200, dtype=torch.float16)
    record = _Recorder(gemm._matmul_kernel)
    gemm.matmul(a, a.t(), kernel=record)
    config = gemm.default_config(torch.float16, capability)
    assert record.kwargs == {"BLOCK_M": config["block_m"], "BLOCK_N": config["block_n"],
                             "BLOCK_K": config["block_k"], "GROUP_M": config["group_m"],
                             "EVEN_K": 200 % config["block_k"] == 0, "num_warps": config["num_warps"],
                             "num_stages": config["num_stages"]}

    record = _Recorder(softmax._softmax_kernel)
    softmax.softmax(checks.randn(3, 8000, dtype=torch.float16), kernel=record)
    assert record.kwargs == {"BLOCK_N": 8192, "num_warps": softmax.default_config(8000, torch.float16, capability)[
        "num_warps"]}
