"""A parameter server with synchronous, asynchronous, staleness-capped (a drop rule) and SSP SGD (lab 07).

Rank 0 is the server and owns the weights of a linear regression; ranks 1..K are workers, each
with its own shard of the data. A worker pulls the weights, computes the gradient of its shard's
loss at them, and pushes it back; the server applies gradients and counts versions (one per
update). Everything travels by point-to-point ``send``/``recv``; the server receives from
whichever worker speaks first (``recv`` without a source).

- **sync**: the server waits for one gradient from every worker, applies their average, and only
  then answers them all: every gradient is computed on the current weights (staleness 0), and
  every step waits for the slowest worker;
- **async**: the server applies each gradient the moment it arrives (Downpour-style). Nobody
  waits, but a slow worker's gradient was computed on weights that many updates have since
  replaced: its *staleness* is the server's version minus the version it was computed on;
- **bounded**: as async, but a gradient is applied only if the rule (``rule=``, by default
  ``bounded_staleness_rule_ref``) admits it; otherwise the worker is sent the current weights
  and recomputes. Every applied gradient is then at most ``tau`` versions old. This is a *drop*
  rule: nobody waits, the work of a refused gradient is lost, and a worker slow enough never to
  be within ``tau`` would never contribute;
- **ssp**: stale synchronous parallel (Ho et al., NIPS 2013), the bounded delay of Li et al.
  (OSDI 2014): every gradient is applied as it arrives, none is discarded, and a worker that runs
  ahead *waits*. Each worker has a clock, the number of its gradients applied; a worker may start
  iteration ``c`` only once every worker has finished iterations before ``c - tau`` (the start
  rule, ``start_rule=``, by default ``ssp_may_start_ref``), else the server holds its answer
  until the slowest catches up. ``tau = 0`` is bulk-synchronous (every worker waits for the
  slowest each iteration), a large ``tau`` is async. The bound is on clocks, not on versions: a
  gradient may still be up to about ``(tau + 1) * workers`` versions old.

``sync_steps`` (async, bounded and ssp) runs the first updates as sync rounds, then goes on in the
mode asked for: a synchronous start (the first epoch, say) while the weights move fastest, where
stale gradients do the most harm, then asynchrony.

The server records the staleness (in versions) of every applied gradient, the clock gap of each
(how many iterations its worker was ahead of the slowest when it started computing it) and the
loss after every update. Artificial per-worker delays (``worker_delays``, seconds of sleep before
each gradient) make asynchrony visible even on two cores, where the operating system would
otherwise decide who is slow.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from fastdl_lab import checks
from fastdl_lab.distributed.launch import run_world

MODES = ("sync", "async", "bounded", "ssp")
# Message heads: what a worker sends, and what the server answers.
PULL, PUSH = 0, 1
WEIGHTS, REJECTED, STOP = 0, 1, 2


def bounded_staleness_rule_ref(server_version: int, gradient_version: int, tau: int) -> bool:
    """May the server, now at ``server_version``, apply a gradient computed on ``gradient_version``?

    Yes when the gradient is at most ``tau`` versions old: staleness exactly ``tau`` is allowed,
    so ``tau = 0`` admits only gradients computed on the current weights.
    """
    ### BEGIN SOLUTION
    return server_version - gradient_version <= tau
    ### END SOLUTION


def ssp_may_start_ref(clocks: list[int], worker: int, tau: int) -> bool:
    """May ``worker`` (an index into ``clocks``) start its next iteration?

    ``clocks[i]`` is the number of worker i's gradients the server has applied, so the worker's
    next iteration is number ``clocks[worker]`` (from 0). It may start once every worker has
    finished the iterations before ``clocks[worker] - tau``: the slowest clock is at least that.
    ``tau = 0`` makes every worker wait until all have finished its previous iteration.
    """
    return clocks[worker] - min(clocks) <= tau


def make_linear_regression(seed: int, n: int, d: int, noise: float = 0.1):
    """X (n, d), y = X w* + noise, in float64: the server's problem."""
    x = checks.randn(n, d, seed=seed, dtype=torch.float64)
    w_true = checks.randn(d, seed=seed + 1, dtype=torch.float64)
    y = x @ w_true + checks.randn(n, seed=seed + 2, dtype=torch.float64, scale=noise)
    return x, y


def loss(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    """Half the mean squared error of the linear model w on (x, y)."""
    return 0.5 * float(((x @ w - y) ** 2).mean())


def gradient(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Gradient of ``loss`` with respect to w."""
    return x.T @ (x @ w - y) / x.shape[0]


def _worker_shard(x, y, worker: int, workers: int):
    rows = x.shape[0] // workers
    return x[worker * rows:(worker + 1) * rows], y[worker * rows:(worker + 1) * rows]


def _message(head: int, version: int, body: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.tensor([float(head), float(version)], dtype=torch.float64), body])


def _worker(rank: int, world_size: int, x, y, delay: float) -> dict:
    xs, ys = _worker_shard(x, y, rank - 1, world_size - 1)
    d = x.shape[1]
    reply = torch.empty(d + 2, dtype=torch.float64)
    dist.send(_message(PULL, 0, torch.zeros(d, dtype=torch.float64)), 0)
    dist.recv(reply, 0)
    pushes = rejected = 0
    while int(reply[0]) != STOP:
        version, w = int(reply[1]), reply[2:].clone()
        time.sleep(delay)
        dist.send(_message(PUSH, version, gradient(w, xs, ys)), 0)
        dist.recv(reply, 0)
        pushes += 1
        rejected += int(reply[0]) == REJECTED
    return {"pushes": pushes, "rejected": rejected}


def _server(world_size: int, mode: str, tau: int, steps: int, lr: float, rule: Callable, start_rule: Callable,
            sync_steps: int, x, y) -> dict:
    workers, d = world_size - 1, x.shape[1]
    w = torch.zeros(d, dtype=torch.float64)
    version = 0
    staleness: list[int] = []
    updates_by: list[int] = []
    losses: list[float] = []
    rejected = 0
    waiting: dict[int, tuple[int, torch.Tensor]] = {}
    stopped: set[int] = set()
    # SSP: each worker's clock (its gradients applied), the clock gap each started its current
    # iteration with, the gaps of the applied gradients, and the workers held back by the rule.
    clocks = [0] * workers
    started_gap: dict[int, int] = {}
    clock_gaps: list[int] = []
    held: set[int] = set()
    holds = 0
    deadlocked = False
    message = torch.empty(d + 2, dtype=torch.float64)
    start = time.perf_counter()

    def answer(dst: int, head: int) -> None:
        if head == STOP:
            stopped.add(dst)
        elif head == WEIGHTS:
            started_gap[dst] = clocks[dst - 1] - min(clocks)
        dist.send(_message(head, version, w), dst)

    def applied(src: int, gradient_version: int) -> None:
        staleness.append(version - gradient_version)
        clock_gaps.append(started_gap.get(src, 0))
        clocks[src - 1] += 1

    def stepped() -> None:
        nonlocal version
        version += 1
        losses.append(loss(w, x, y))

    while len(stopped) < workers:
        src = dist.recv(message)
        head, gradient_version, grad = int(message[0]), int(message[1]), message[2:].clone()
        if version >= steps:
            answer(src, STOP)
        elif head == PULL:
            answer(src, WEIGHTS)
        elif mode == "sync" or version < sync_steps:
            # Every worker computed on the current version: nobody is answered until the
            # slowest has pushed, so no gradient is ever stale.
            waiting[src] = (gradient_version, grad)
            if len(waiting) == workers:
                for dst, (v, _) in waiting.items():
                    applied(dst, v)
                updates_by.append(0)
                w -= lr * torch.stack([g for _, g in waiting.values()]).mean(0)
                stepped()
                for dst in sorted(waiting):
                    answer(dst, STOP if version >= steps else WEIGHTS)
                waiting.clear()
        elif mode == "bounded" and not rule(version, gradient_version, tau):
            rejected += 1
            answer(src, REJECTED)
        else:
            applied(src, gradient_version)
            updates_by.append(src)
            w -= lr * grad
            stepped()
            if version >= steps:
                answer(src, STOP)
                for dst in sorted(held):  # nothing more to wait for
                    answer(dst, STOP)
                held.clear()
            elif mode != "ssp":
                answer(src, WEIGHTS)
            else:
                # The worker that just finished, and any held one the slowest has now caught up
                # with, start their next iteration; the others wait.
                held.add(src)
                for dst in sorted(held):
                    if start_rule(list(clocks), dst - 1, tau):
                        held.discard(dst)
                        answer(dst, WEIGHTS)
                    elif dst == src:
                        holds += 1
                if len(held) == workers - len(stopped):
                    # Every worker still running is held: no gradient can come to move a clock.
                    deadlocked = True
                    for dst in sorted(held):
                        answer(dst, STOP)
                    held.clear()
    return {"weights": w, "staleness": staleness, "updates_by": updates_by, "rejected": rejected,
            "clock_gaps": clock_gaps, "holds": holds, "deadlocked": deadlocked, "losses": losses,
            "seconds": time.perf_counter() - start,
            "loss": loss(w, x, y), "initial_loss": loss(torch.zeros(d, dtype=torch.float64), x, y),
            "optimal_loss": loss(torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1), x, y)}


def run_ps(rank: int, world_size: int, mode: str, tau: int, steps: int, lr: float, seed: int,
           worker_delays=None, rule: Callable[[int, int, int], bool] = bounded_staleness_rule_ref,
           n: int = 240, d: int = 8, start_rule: Callable[[list[int], int, int], bool] = ssp_may_start_ref,
           sync_steps: int = 0) -> dict:
    """One rank of a parameter-server run: rank 0 serves, ranks 1.. are workers.

    ``steps`` is the number of updates the server applies (in sync mode each is the average of
    one gradient per worker); ``worker_delays[i]`` is worker i+1's sleep before each gradient;
    ``rule(server_version, gradient_version, tau) -> bool`` admits gradients in bounded mode;
    ``start_rule(clocks, worker, tau) -> bool`` lets a worker start its next iteration in ssp mode;
    ``sync_steps`` updates are sync rounds before the mode takes over.
    Rank 0 returns {"weights", "staleness" (versions, one entry per applied gradient),
    "clock_gaps" (per applied gradient: how many iterations its worker was ahead of the slowest
    when it started it), "updates_by" (which worker made each update; 0 for a sync round),
    "rejected" (gradients the bounded rule discarded), "holds" (times a worker that had just
    pushed was made to wait, ssp), "deadlocked" (ssp: every worker was held at once, and the run
    was stopped), "losses" (after each update), "seconds" (the server's wall time from the first
    message to the last), "loss", "initial_loss", "optimal_loss"}; a worker returns {"pushes",
    "rejected"}.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if world_size < 2:
        raise ValueError("a parameter server needs a server and at least one worker: world_size >= 2")
    if tau < 0:
        raise ValueError(f"tau must be at least 0, got {tau}")
    if not 0 <= sync_steps <= steps:
        raise ValueError(f"sync_steps must be between 0 and steps ({steps}), got {sync_steps}")
    delays = list(worker_delays or [0.0] * (world_size - 1))
    if len(delays) != world_size - 1:
        raise ValueError(f"worker_delays needs one delay per worker ({world_size - 1}), got {len(delays)}")
    x, y = make_linear_regression(seed, n, d)
    if rank == 0:
        return _server(world_size, mode, tau, steps, lr, rule, start_rule, sync_steps, x, y)
    return _worker(rank, world_size, x, y, delays[rank - 1])


def converged(result: dict, fraction: float = 0.05) -> bool:
    """Whether the server's loss closed all but ``fraction`` of the gap from start to optimum."""
    gap = result["initial_loss"] - result["optimal_loss"]
    return result["loss"] - result["optimal_loss"] <= fraction * gap


def check() -> None:
    """Sync is exact, async with a slow worker gets stale gradients, bounded never exceeds tau, SSP
    keeps every worker within tau iterations of the slowest and discards nothing."""
    sync = run_world(run_ps, 3, "sync", 0, 40, 0.3, 0)[0]
    assert set(sync["staleness"]) == {0} and converged(sync), sync
    delays = [0.001, 0.02]
    free = run_world(run_ps, 3, "async", 2, 60, 0.1, 0, worker_delays=delays)[0]
    bounded = run_world(run_ps, 3, "bounded", 2, 60, 0.1, 0, worker_delays=delays)[0]
    assert max(bounded["staleness"]) <= 2 and converged(bounded), bounded
    ssp = run_world(run_ps, 3, "ssp", 2, 60, 0.1, 0, worker_delays=delays)[0]
    assert max(ssp["clock_gaps"]) <= 2 and ssp["rejected"] == 0 and not ssp["deadlocked"] and converged(ssp), ssp
    print(f"ps: largest staleness async {max(free['staleness'])}, bounded (tau 2) {max(bounded['staleness'])} "
          f"with {bounded['rejected']} gradients rejected, ssp (tau 2) {max(ssp['staleness'])} versions and "
          f"{max(ssp['clock_gaps'])} iterations with none rejected and {ssp['holds']} waits; all converge")


if __name__ == "__main__":
    check()
