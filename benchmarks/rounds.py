"""Segments timed side by side: whole segments end to end, in rounds that rotate which goes first."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping


def alternate(runs: Mapping[str, Callable[[], object]], rounds: int, steps: int,
              unit: str = "steps/s") -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Times each of ``runs`` (each runs ``steps`` steps and blocks) once a round for ``rounds``
    rounds, the first of each round rotated; prints each round. Returns each run's steps per
    second and cores busy (process CPU time over wall time) by round."""
    names = list(runs)
    rates: dict[str, list[float]] = {name: [] for name in names}
    busy: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        for name in names[index % len(names):] + names[:index % len(names)]:
            start, cpu = time.perf_counter(), time.process_time()
            runs[name]()
            wall = time.perf_counter() - start
            rates[name].append(steps / wall)
            busy[name].append((time.process_time() - cpu) / wall)
        print(f"round {index + 1}: " + "  ".join(f"{n} {rates[n][-1]:.1f}" for n in names) + f" {unit}",
              flush=True)
    return rates, busy
