"""What a graded item is, and how a lab's items are found.

A lab's items live in ``autograder/labs/lab<NN>_<topic>.py`` as a ``LAB = LabSpec(...)``. Each item
names the student's solution cells it needs and three functions with a strict split of trust:

- ``make_inputs(seed, params)`` runs in the trusted parent and draws hidden inputs; the keys the
  item names in ``withheld`` (labels, expected values, the seed they came from) never leave it;
- ``drive(ns, inputs)`` runs in the sandboxed child, where ``ns`` holds what the student's cells
  defined (for a kernel item, only their ``@triton.jit`` functions and constants: ``kernels``
  names the ones it needs); it calls the student's code and returns data (``autograder.wire``).
  Once student code is loaded, the child is the student's: ``drive`` is a convenience for honest
  code, and nothing it reports is believed;
- ``check(inputs, outputs, params[, observed])`` runs in the parent, computes the reference itself
  and returns a ``Verdict``. It must treat ``outputs`` as hostile: anything can come back. A check
  that takes ``observed`` also gets what the grader measured from outside the child
  (``Observed``: the cgroup's memory peak, its own clock's timings, its services' logs, a
  reference child's figures), the only figures a mechanism verdict may rest on whole. A figure
  only the child can count is self-reported: at most one point of an item, and its reason says so.

An item that grades native code the student wrote as text (lab 09's C++) names it in ``built``:
the grader has it compiled in a sandboxed child that loads nothing it made, judges the built bytes
itself, and hands what it approved to the student's child as files (``Built``).

An item graded as *worlds of ranks* (lab 07) names them in ``worlds`` (``Worlds``): the grader
starts, per world, a relay in its own process and one sandboxed child per rank, joined to the
relay's socket alone; ``drive`` then runs in every rank child and ``check`` receives every rank's
outputs with the relay's log of the world (``Observed.worlds``).

Speed items of kernels add ``timed(ns, inputs)`` and ``baseline(ns, inputs)`` to a kernel item:
the child, where no student Python exists, times the two A/B interleaved with ``fastdl_lab.timing``.
A speed item of student Python is ``clocked`` (``Clocked``): the grader's own clock times it, call
by call; the engine refuses any other speed item (``grade.ConfigurationError``).
A Python item whose figure is measured in the student's process names its ``instruments``
(dotted names, bound before the cells run and verified unchanged after them). An item that
grades Python classes or functions on their own names them in ``artefacts``: only those
definitions (screened, ``artefacts.py``) reach the child, run in the names its trusted ``scope``
imports; ``drive`` finds them, and any ``kernels``, in ``ns``.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Verdict:
    fraction: float  # 0..1 of the item's points
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def passed(cls, reason: str = "correct", **details: Any) -> "Verdict":
        return cls(1.0, reason, details)

    @classmethod
    def failed(cls, reason: str, **details: Any) -> "Verdict":
        return cls(0.0, reason, details)


@dataclass
class Observed:
    """What the grader measured about one child from outside it, for ``check(..., observed)``."""

    peak_bytes: int = 0  # the child's memory peak (all its processes and tmpfs files)
    peak_source: str = "sampled"  # "cgroup": the kernel's count; "sampled": the watchdog's samples
    wall_s: float = 0.0
    processes: int = 0  # the most processes of the child's own at once (its runner and what it started)
    services: dict[str, Any] = field(default_factory=dict)  # each service's record of the child's calls
    timings: dict[str, Any] = field(default_factory=dict)  # a clocked item's samples and outputs per call
    reference: dict[str, Any] = field(default_factory=dict)  # the reference child's figures (peak_bytes, ...)
    # An item graded as worlds (``Item.worlds``): per world, in order, {"size": ranks, "records": the
    # relay's log (``relay.Relay.records``), "ranks": [{"peak_bytes", "peak_source", "wall_s",
    # "processes"} of each rank's child]}.
    worlds: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Clocked:
    """A speed figure taken by the grader's clock, for Python the child runs (``Item.clocked``).

    The student's child and a reference child (``Item.reference``: the course's implementation, no
    student code) each hold the item's ``inputs``; the grader then calls them alternately, once per
    repetition, handing each call ``call_inputs(seed, params, i)``, made in the grader and unseen by
    the child until then, and times every call from its request to its result on its own clock. The
    child not being timed is frozen (its cgroup, or SIGSTOP where there is no freezer), so nothing
    it left running competes with the other. ``check`` finds the samples and both sides' outputs of
    every call in ``observed.timings``. The keys of a call's inputs named in ``withheld`` (the
    labels a call's outputs are judged on) stay in the grader: ``observed.timings["withheld"]``
    holds them, call by call, beside the outputs.
    """

    call_inputs: Callable[[int, dict, int], dict]
    candidate: Callable[[dict, dict], Callable[[dict], Any]]  # (ns, inputs) -> run(call_inputs) -> outputs
    baseline: Callable[[dict, dict], Callable[[dict], Any]]  # the same in the reference child
    warmup: int = 1
    reps: int = 5
    withheld: tuple[str, ...] = ()


@dataclass
class Worlds:
    """An item graded as worlds of ranks, each rank a sandboxed child of its own (``Item.worlds``).

    ``sizes(inputs)`` gives the ranks of each world the item asks for, in order. For every rank the
    grader makes that rank's inputs, ``rank_inputs(inputs, world, rank)`` (what the rank may know:
    its own shard, its own tensor), and adds ``world``, ``rank``, ``world_size`` and ``timeout_s``
    (the item's inputs' ``timeout_s``, else ``timeout_s`` here). Each rank runs in a sandboxed child
    of its own, which the item's worlds share (child k is rank k of each world larger than k, one
    world after another). The child joins each world through that world's socket in its folder
    (``relay_backend.init_relay_world``), its first before any student code exists, and runs the
    item's ``drive(ns, rank_inputs)`` there. The relay in the grading process carries and logs
    every collective and message (``relay.py``): the check reads what crossed from that log, never
    from a rank's count. ``reference_worlds(inputs)`` names the worlds that the course's own
    implementation (``Item.reference``) also runs, once per grading process and parameters, for
    the figures a check compares a rank's with (its memory peak); those have children of their own.
    """

    sizes: Callable[[dict], list[int]]
    rank_inputs: Callable[[dict, int, int], dict]
    timeout_s: float = 20.0
    # What the relay of one world holds at most: a message (refused before it is read), bytes
    # handed over and not yet delivered (eight messages), records and receives waiting. The
    # grading process holds them, for every world at once.
    max_message_bytes: int = 4 << 20
    max_operations: int = 10_000
    reference_worlds: Callable[[dict], list[int]] | None = None


class BuildRefused(Exception):
    """What a build made will not be handed to the student's child; the message says why."""


@dataclass
class Built:
    """Native code built from a string constant of the student's cells, judged, then loaded where
    the student's code runs (``Item.built``).

    The grader takes the constant ``constant`` from the cells without executing them and hands it
    to a sandboxed *build child* (trusted code, the student copy of the package, the item's
    ``build_s`` added to its time), which runs ``build(source, params)``: it compiles, loads
    nothing it made, and returns data (the built files as bytes, and whatever the screen needs). A
    build that raises is the item's ``error`` verdict, with the message. The grader then calls
    ``screen(source, built, params)``, which must read those bytes as hostile (bounded readers
    only, ``engine/elf.py``) and returns the files for the student's child, ``{name: bytes}``, or
    raises ``BuildRefused`` (a ``rejected`` verdict). The student's child finds them read-only in
    ``/job/in/built``, each path in ``ns`` under its name; no Python of the student's runs there.
    """

    constant: str
    build: Callable[[str, dict], Any]
    screen: Callable[[str, Any, dict], dict[str, bytes]]


@dataclass
class Item:
    name: str  # equals the grade_id of the item's test cell in the notebook
    points: float
    cells: tuple[str, ...]  # grade_ids of the solution cells the item executes
    make_inputs: Callable[[int, dict], dict]
    drive: Callable[[dict, dict], Any] | None = None
    check: Callable[[dict, Any, dict], Verdict] | None = None
    kind: str = "correctness"  # correctness | mechanism | speed
    timed: Callable[[dict, dict], Callable[[], Any]] | None = None
    baseline: Callable[[dict], Callable[[], Any]] | None = None
    description: str = ""
    kernels: tuple[str, ...] = ()
    instruments: tuple[str, ...] = ()
    artefacts: tuple[str, ...] = ()
    scope: str = ""  # trusted imports that give ``artefacts`` the names they may use
    library: str = ""  # attribute names (a pattern) that reach the library's version of the technique
    # Seconds added to the profile's wall limit (twice as many CPU seconds) of the child that
    # compiles the student's source (``built``'s build child; the child itself for an item without one).
    build_s: float = 0.0
    built: Built | None = None
    # The item builds C++ with fastdl_lab.custom.sources: its (build) child is shown the parts
    # every build shares (fastdl_lab.custom.pch), made here once per machine: a build then
    # compiles the student's source alone, in about a quarter of the time.
    torch_headers: bool = False
    # Keys of ``make_inputs``'s dict that stay in the parent (the check sees them; the child never).
    withheld: tuple[str, ...] = ()
    # The course's own implementation under the names ``drive`` finds the student's:
    # ``reference(inputs) -> ns``, run in a trusted child (the full package, no student code). An
    # item with ``reference_run`` runs it once per grading process and profile parameters (again
    # after a run that failed), through the item's own ``drive`` on inputs of the same sizes, for the
    # figures its check compares the student's with (``observed.reference``: its memory peak, ...).
    reference: Callable[[dict], dict] | None = None
    reference_run: bool = False
    clocked: Clocked | None = None
    # Services the grader runs for the child (``services(inputs, params) -> {name: handler}``):
    # a device it simulates, a relay. The child calls them over its channel; each handler's owner
    # keeps its own record, which ``observed.services`` hands the check.
    services: Callable[[dict, dict], dict[str, Any]] | None = None
    # Run on the CPU even on a GPU profile: a figure the kernel's cgroup measures (host memory).
    host_only: bool = False
    # Graded as worlds of ranks, one sandboxed child per rank behind the grader's relay (``Worlds``).
    worlds: Worlds | None = None

    @property
    def is_speed(self) -> bool:
        return self.kind == "speed"

    @property
    def runs_alone(self) -> bool:
        """Timed: nothing else of the submission may share the machine while it runs."""
        return self.is_speed or self.clocked is not None


@dataclass
class LabSpec:
    name: str  # e.g. "01_gemm": the nbgrader assignment and notebook name
    items: list[Item]
    preamble: str = ""  # trusted imports executed in the child before the student's cells

    def item(self, name: str) -> Item:
        for it in self.items:
            if it.name == name:
                return it
        raise KeyError(f"lab {self.name} has no item {name!r}")


def _module_name(lab: str) -> str:
    return "lab" + lab


def all_labs() -> dict[str, LabSpec]:
    import autograder.labs as pkg

    labs = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("lab"):
            spec = importlib.import_module(f"autograder.labs.{info.name}").LAB
            labs[spec.name] = spec
    return dict(sorted(labs.items()))


def lab_spec(full_name: str) -> LabSpec:
    """The lab of that exact name ("01_gemm"), importing its module alone: every lab module imports
    the parts of the package its items use, and a grading child, which needs one lab, would pay
    for all of them on each start."""
    spec = importlib.import_module(f"autograder.labs.{_module_name(full_name)}").LAB
    if spec.name != full_name:
        raise ValueError(f"autograder/labs/{_module_name(full_name)} defines lab {spec.name!r}, not {full_name!r}")
    return spec


def load_lab(name: str) -> LabSpec:
    """Find a lab by full name ("01_gemm"), number ("01", "1") or topic ("gemm")."""
    labs = all_labs()
    if name in labs:
        return labs[name]
    for full, spec in labs.items():
        number, _, topic = full.partition("_")
        if name in (number, topic) or (name.isdigit() and int(name) == int(number)):
            return spec
    raise SystemExit(f"unknown lab {name!r}; known labs: {', '.join(labs)}")
