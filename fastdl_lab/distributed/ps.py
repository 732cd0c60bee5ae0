"""A parameter server with synchronous, asynchronous and staleness-capped (drop rule) SGD (lab 07).

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
  and recomputes. Every applied gradient is then at most ``tau`` versions old. This is a drop
  rule: nobody waits and a refused gradient's work is lost. Bounded delay (Li et al., OSDI 2014)
  and stale synchronous parallel (Ho et al., NIPS 2013) keep the same bound by making a fast
  worker wait for the slow ones instead, and apply every gradient.

The server records the staleness of every applied gradient. Artificial per-worker delays
(``worker_delays``, seconds of sleep before each gradient) make asynchrony visible even on two
cores, where the operating system would otherwise decide who is slow.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from fastdl_lab import checks
from fastdl_lab.distributed.launch import run_world

MODES = ("sync", "async", "bounded")
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


def _server(world_size: int, mode: str, tau: int, steps: int, lr: float, rule: Callable, x, y) -> dict:
    workers, d = world_size - 1, x.shape[1]
    w = torch.zeros(d, dtype=torch.float64)
    version = 0
    staleness: list[int] = []
    updates_by: list[int] = []
    rejected = 0
    waiting: dict[int, tuple[int, torch.Tensor]] = {}
    stopped: set[int] = set()
    message = torch.empty(d + 2, dtype=torch.float64)
    start = time.perf_counter()

    def answer(dst: int, head: int) -> None:
        if head == STOP:
            stopped.add(dst)
        dist.send(_message(head, version, w), dst)

    while len(stopped) < workers:
        src = dist.recv(message)
        head, gradient_version, grad = int(message[0]), int(message[1]), message[2:].clone()
        if version >= steps:
            answer(src, STOP)
        elif head == PULL:
            answer(src, WEIGHTS)
        elif mode == "sync":
            # Every worker computed on the current version: nobody is answered until the
            # slowest has pushed, so no gradient is ever stale.
            waiting[src] = (gradient_version, grad)
            if len(waiting) == workers:
                staleness += [version - v for v, _ in waiting.values()]
                updates_by.append(0)
                w -= lr * torch.stack([g for _, g in waiting.values()]).mean(0)
                version += 1
                for dst in sorted(waiting):
                    answer(dst, STOP if version >= steps else WEIGHTS)
                waiting.clear()
        elif mode == "bounded" and not rule(version, gradient_version, tau):
            rejected += 1
            answer(src, REJECTED)
        else:
            staleness.append(version - gradient_version)
            updates_by.append(src)
            w -= lr * grad
            version += 1
            answer(src, STOP if version >= steps else WEIGHTS)
    return {"weights": w, "staleness": staleness, "updates_by": updates_by, "rejected": rejected,
            "seconds": time.perf_counter() - start,
            "loss": loss(w, x, y), "initial_loss": loss(torch.zeros(d, dtype=torch.float64), x, y),
            "optimal_loss": loss(torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1), x, y)}


def run_ps(rank: int, world_size: int, mode: str, tau: int, steps: int, lr: float, seed: int,
           worker_delays=None, rule: Callable[[int, int, int], bool] = bounded_staleness_rule_ref,
           n: int = 240, d: int = 8) -> dict:
    """One rank of a parameter-server run: rank 0 serves, ranks 1.. are workers.

    ``steps`` is the number of updates the server applies (in sync mode each is the average of
    one gradient per worker); ``worker_delays[i]`` is worker i+1's sleep before each gradient;
    ``rule(server_version, gradient_version, tau) -> bool`` admits gradients in bounded mode.
    Rank 0 returns {"weights", "staleness" (one entry per applied gradient), "updates_by" (which
    worker made each update; 0 for a sync round), "rejected", "seconds" (the server's wall time
    from the first message to the last), "loss", "initial_loss", "optimal_loss"}; a worker returns
    {"pushes", "rejected"}.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if world_size < 2:
        raise ValueError("a parameter server needs a server and at least one worker: world_size >= 2")
    delays = list(worker_delays or [0.0] * (world_size - 1))
    if len(delays) != world_size - 1:
        raise ValueError(f"worker_delays needs one delay per worker ({world_size - 1}), got {len(delays)}")
    x, y = make_linear_regression(seed, n, d)
    if rank == 0:
        return _server(world_size, mode, tau, steps, lr, rule, x, y)
    return _worker(rank, world_size, x, y, delays[rank - 1])


def converged(result: dict, fraction: float = 0.05) -> bool:
    """Whether the server's loss closed all but ``fraction`` of the gap from start to optimum."""
    gap = result["initial_loss"] - result["optimal_loss"]
    return result["loss"] - result["optimal_loss"] <= fraction * gap


def check() -> None:
    """Sync is exact, async with a slow worker gets stale gradients, bounded never exceeds tau."""
    sync = run_world(run_ps, 3, "sync", 0, 40, 0.3, 0)[0]
    assert set(sync["staleness"]) == {0} and converged(sync), sync
    delays = [0.001, 0.02]
    free = run_world(run_ps, 3, "async", 2, 60, 0.1, 0, worker_delays=delays)[0]
    bounded = run_world(run_ps, 3, "bounded", 2, 60, 0.1, 0, worker_delays=delays)[0]
    assert max(bounded["staleness"]) <= 2 and converged(bounded), bounded
    print(f"ps: largest staleness async {max(free['staleness'])}, bounded (tau 2) {max(bounded['staleness'])} "
          f"with {bounded['rejected']} gradients rejected; all converge")


if __name__ == "__main__":
    check()
