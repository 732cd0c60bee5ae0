"""Graded items of lab 07 distributed: DDP wrappers, ring all-reduce, parameter server (a drop rule
and SSP), ZeRO-1, FSDP (fp32 and bf16) and a tensor-parallel MLP.

Every item is graded as worlds of ranks (``items.Worlds``, ``engine/worlds.py``): per world, one
sandboxed child per rank, nothing shared between them, each joined to the grader's relay before
the student's classes exist in it, each sent only its own part of the hidden inputs. Every
collective and message goes through the relay, in the grading process, which logs it. The checks
(``data_parallel.py``, ``ring_allreduce.py``, ``sharded.py``) judge values against references
computed here, what crossed against the relay's log (``traffic.py``), ZeRO-1's and FSDP's memory
against each rank child's cgroup peak on a large model, and count as self-reported, one point of
an item at most, what only the rank could count (``ranks.py``: the marks around its backward, the
optimizer state it watched, the storages it found alive). A world that deadlocks, mismatches or
loses a rank fails at the relay within the collective timeout, with the reason.
"""

from __future__ import annotations

import functools

from autograder.engine.items import Item, LabSpec, Worlds
from autograder.labs.lab07_distributed import ranks
from autograder.labs.lab07_distributed.data_parallel import (bucketed_check, case_sizes, ddp_check, ddp_rank_inputs,
                                                             ps_check, ps_inputs, ps_rank_inputs, ps_sizes, ssp_check,
                                                             ssp_inputs, training_cases, zero_check, zero_inputs,
                                                             zero_rank_inputs, zero_reference_worlds)
from autograder.labs.lab07_distributed.ring_allreduce import ring_check, ring_inputs, ring_rank_inputs, ring_sizes
from autograder.labs.lab07_distributed.sharded import (fsdp_cases, fsdp_check, fsdp_mixed_cases, fsdp_rank_inputs,
                                                       fsdp_reference_worlds, fsdp_sizes, tp_cases, tp_check,
                                                       tp_rank_inputs, tp_sizes)

# What a world may wait in one collective before it fails (the profile's ``rank_timeout_s`` for an
# item overrides it): what grading a world that deadlocks costs.
RANK_TIMEOUT_S = 20.0
# The largest message a rank may hand the relay: a memory world's largest tensor (a 512 x 512
# float32 weight, 1 MiB) fits with room.
MAX_MESSAGE_BYTES = 4 << 20

# The trusted code in a rank that the self-reported figures rest on: bound before the student's
# classes exist, verified unchanged after the drive. A second line behind the screen; what
# crossed between ranks needs none of it (the relay logged it).
INSTRUMENTS = ("autograder.engine.relay_backend.mark", "autograder.engine.relay_backend.RelayProcessGroup._request",
               "torch.distributed.barrier") + tuple(f"fastdl_lab.distributed.{name}" for name in (
    "ddp._data_parallel", "ddp._detached_state", "ddp._loss", "ddp.allreduce_gradients_ref", "watch._facts",
    "zero.watching_optimizers", "zero.StateWatch.observe", "zero.StateWatch.held", "ps.run_ps", "ps._server",
    "fsdp._sgd_step", "fsdp.functional_sgd", "fsdp.named_pieces", "fsdp.clean_name", "census.snapshot", "census.Snapshot.storages_now",
    "census.Snapshot.changed", "census.resident_bytes", "census.storage_bytes", "census._storage", "census._nbytes",
    "census.WireLog.before_gather", "census.WireLog.gathered_storages", "census.WireLog.summary")) + (
    "gc.get_objects", "gc.collect", "torch.Tensor.untyped_storage", "torch.UntypedStorage.nbytes",
    "torch.optim.optimizer.register_optimizer_step_post_hook", "torch.optim.AdamW", "torch.optim.SGD", "torch.save")


def _with_timeout(make_inputs):
    """Every item's inputs carry the collective timeout: the profile's ``rank_timeout_s`` for the
    item, or RANK_TIMEOUT_S."""
    def make(seed: int, params: dict) -> dict:
        return {**make_inputs(seed, params), "timeout_s": float(params.get("rank_timeout_s", RANK_TIMEOUT_S))}
    return make


# The names the graded functions and classes run with. Every item takes only its cell's functions
# and classes, screened (``engine/artefacts.py``). FSDP's units move parameters through the
# package's helpers (``fsdp.drop_parameters``, ``fsdp.place_views``, ``fsdp.register_sharded``), as
# graded code may not assign to attributes of other objects.
SCOPE = "import torch\nimport torch.distributed as dist\nfrom torch import nn\n"
FSDP_SCOPE = SCOPE + "from fastdl_lab.distributed import fsdp\n"


def _zero_reference(inputs: dict) -> dict:
    from fastdl_lab.distributed import zero

    return {"Zero1": zero.Zero1}


def _fsdp_reference(inputs: dict) -> dict:
    from fastdl_lab.distributed import fsdp

    return {"FSDPUnit": fsdp.FSDPUnit}


def _item(name, points, cell, make_inputs, drive, check, artefacts, worlds, kind="correctness", description="",
          scope=SCOPE, reference=None):
    # Host only: the ranks compute on the CPU (the relay carries CPU tensors), and the memory
    # figures are the host's. On a GPU profile too, rank children are then forked warm, not
    # started cold through bubblewrap, a few seconds each.
    return Item(name, points, (cell,), _with_timeout(make_inputs), drive, check, kind=kind, description=description,
                instruments=INSTRUMENTS, artefacts=artefacts, scope=scope, worlds=worlds, reference=reference,
                host_only=True)


def _worlds(sizes, rank_inputs, reference_worlds=None) -> Worlds:
    return Worlds(sizes, rank_inputs, timeout_s=RANK_TIMEOUT_S, max_message_bytes=MAX_MESSAGE_BYTES,
                  reference_worlds=reference_worlds)


LAB = LabSpec(
    name="07_distributed",
    preamble="from fastdl_lab import device\n",
    items=[
        _item("ddp_parity", 3, "ddp_code", training_cases, ranks.ddp_rank, functools.partial(ddp_check, points=3),
              ("DDP",), _worlds(case_sizes, ddp_rank_inputs("DDP")),
              description="DDP wrapper: rank 0's state broadcast, single-process parity, one all-reduce per "
                          "parameter and step on the relay, launched during backward (self-reported)"),
        _item("bucketed_ddp", 3, "bucketed_code", training_cases, ranks.ddp_rank,
              functools.partial(bucketed_check, points=3), ("BucketedDDP",),
              _worlds(case_sizes, ddp_rank_inputs("BucketedDDP")), kind="mechanism",
              description="bucketed DDP wrapper: parity from skewed starts, one all-reduce per bucket in bucket order "
                          "on the relay, launched during backward (self-reported)"),
        _item("ring_allreduce", 3, "ring_code", ring_inputs, ranks.ring_rank, ring_check, ("ring_allreduce",),
              _worlds(ring_sizes, ring_rank_inputs),
              description="ring all-reduce from send/recv: exact sums; bytes, chunks and neighbours on the relay; "
                          "ragged sizes, 2-4 ranks"),
        # One comparison, so one point; the runs around it check that the server honours it.
        _item("parameter_server", 1, "ps_code", ps_inputs, ranks.ps_rank, ps_check, ("bounded_staleness_rule",),
              _worlds(ps_sizes, ps_rank_inputs), kind="mechanism",
              description="drop rule: no gradient older than tau applied; convergence (the runs self-reported)"),
        _item("ssp", 1, "ssp_code", ssp_inputs, ranks.ssp_rank, ssp_check, ("ssp_may_start",),
              _worlds(ps_sizes, ps_rank_inputs), kind="mechanism",
              description="SSP: a worker starts only within tau iterations of the slowest; nothing discarded, no "
                          "deadlock, convergence (the runs self-reported)"),
        _item("zero1", 2, "zero_code", zero_inputs, ranks.zero_rank, functools.partial(zero_check, points=2),
              ("Zero1",), _worlds(case_sizes, zero_rank_inputs, zero_reference_worlds), reference=_zero_reference,
              description="ZeRO-1 around torch optimizers: bit-identical to AdamW and SGD, each parameter broadcast "
                          "from its owner on the relay, each rank's memory peak that of sharded state"),
        _item("fsdp", 3, "fsdp_code", fsdp_cases, ranks.fsdp_rank, fsdp_check, ("FSDPUnit",),
              _worlds(fsdp_sizes, fsdp_rank_inputs, fsdp_reference_worlds), kind="mechanism", scope=FSDP_SCOPE,
              reference=_fsdp_reference,
              description="FSDP: parity, gathers and reduce-scatters per unit on the relay, 1/N of the weights per "
                          "rank in its memory peak"),
        _item("fsdp_mixed", 2, "fsdp_code", fsdp_mixed_cases, ranks.fsdp_rank, fsdp_check, ("FSDPUnit",),
              _worlds(fsdp_sizes, fsdp_rank_inputs, fsdp_reference_worlds), kind="mechanism", scope=FSDP_SCOPE,
              reference=_fsdp_reference,
              description="FSDP in bf16 with fp32 master shards: parity within bf16's error, bf16 gathers on the "
                          "relay, 1/N per rank"),
        _item("tp_mlp", 3, "tp_code", tp_cases, ranks.tp_rank, tp_check,
              ("CopyToTensorParallel", "ReduceFromTensorParallel", "ColumnParallelLinear", "RowParallelLinear"),
              _worlds(tp_sizes, tp_rank_inputs), kind="mechanism",
              description="tensor-parallel MLP: column then row split, parity, one all-reduce per pass on the relay"),
    ],
)
