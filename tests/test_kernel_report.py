"""Every kernel, compiled for sm_80 and sm_90 at its launch configs: tensor cores, no spills, shared
memory within the SM's limit, and the committed kernels_sm*.csv rows are what it compiles to today."""

import csv
from pathlib import Path

import pytest
import triton

from fastdl_lab import kernel_report

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"

LISTING = """
        /*0100*/                   MOV R1, R2 ;
        /*0110*/              @!P5 BRA 0x0300 ;
        /*0120*/                   IADD3 R1, R1, 0x1, RZ ;
        /*0130*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0140*/               @P0 BRA 0x0120 ;
        /*0150*/                   NOP ;
        /*0160*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0170*/               @P1 BRA 0x0100 ;
        /*0180*/                   ISETP.GE.AND P2, PT, R2, R3, PT ;
        /*0190*/              @!P2 BRA 0x0180 ;
        /*01a0*/                   EXIT ;
        /*01b0*/                   BRA 0x1b0;
"""


def test_loop_instructions_counts_each_innermost_loop_body():
    # 0x120..0x140 is inner (3 instructions), 0x100..0x170 contains it and is left out,
    # 0x180..0x190 is a second innermost loop (2); the forward branch and the branch-to-self are not loops.
    assert kernel_report.loop_instructions(LISTING) == [3, 2]


def test_problems_name_spills_shared_memory_and_a_missed_tensor_core_path():
    launch = next(launch for launch in kernel_report.launches() if launch.kernel == "gemm")
    row = {"kernel": launch.kernel, "shape": launch.shape, "target": "sm_90", "spill_bytes": 64, "local_stack_bytes": 32,
           "shared_bytes": 240000, "shared_limit": kernel_report.SHARED_LIMIT[90], "tensor_core": "mma"}
    found = "\n".join(kernel_report.problems(row))
    assert "spills registers: 64 bytes spilled" in found
    assert "needs 240000 bytes of shared memory" in found
    assert "through wgmma, but compiles to mma" in found
    clean = {**row, "spill_bytes": 0, "local_stack_bytes": 0, "shared_bytes": 1024, "tensor_core": "wgmma"}
    assert kernel_report.problems(clean) == []


def _committed(capability: int) -> dict[tuple[str, str], dict]:
    with (RESULTS / f"kernels_sm{capability}.csv").open() as f:
        return {(r["kernel"], r["shape"]): r for r in csv.DictReader(f)}


@pytest.mark.parametrize("capability", kernel_report.TARGETS)
def test_every_kernel_compiles_without_spills_within_shared_memory_on_the_tensor_cores(capability):
    rows = kernel_report.rows(capability, log=lambda line: None)
    assert {row["kernel"].split(".")[0] for row in rows} >= {"gemm", "softmax", "layernorm", "attention",
                                                             "rowsum", "optim", "quant"}
    assert [p for row in rows for p in kernel_report.problems(row)] == []

    committed = _committed(capability)
    assert set(committed) == {(row["kernel"], row["shape"]) for row in rows}, \
        "benchmarks/results/kernels_sm*.csv lists other launches: rerun python benchmarks/kernels.py"
    for row in rows:
        old = committed[row["kernel"], row["shape"]]
        if old["triton"] != triton.__version__:
            continue  # another compiler's figures; the checks above still hold for this one
        for column in ("config", "registers", "spill_bytes", "shared_bytes", "tensor_core", "loop_instructions"):
            assert str(row[column]) == old[column], \
                f"{row['kernel']} ({row['shape']}) {column}: compiles to {row[column]}, the CSV says {old[column]}; " \
                "rerun python benchmarks/kernels.py"
