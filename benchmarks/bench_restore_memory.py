"""Benchmark: each process's peak host memory while it restores a checkpoint.

What is measured
    ``--processes`` JAX processes (gloo on 127.0.0.1, ``--cpu-devices`` CPU
    devices each) train an MLP of ``--layers`` ``Dense(--width)`` layers with
    SGD momentum, FSDP over every process's devices (``FSDP("data")``), for
    one step and save it (``Checkpoint``). New processes then restore it onto
    the same mesh: ``restore_latest()`` and ``train_state`` onto the planned
    shardings, as ``fit(..., resume=True)`` does. A thread samples the
    process's resident memory every 2 ms during the restore; the growth over
    the resident memory before it is compared with the bound: this process's
    share of the state (on CPU devices its shards live in host memory) plus
    the largest leaf. Above the bound is reported as FAIL, but the script
    exits 0: it is a measurement. The restore runs twice: with glibc's
    allocator as it comes, and with a fixed mmap threshold
    (``MALLOC_MMAP_THRESHOLD_``), under which freed read buffers go back to
    the system at once instead of being kept for reuse.

How to run
    python -m benchmarks.bench_restore_memory [--width 4096] [--layers 3]
        [--processes 2] [--cpu-devices 2]

    The last line of output is one JSON object with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=4096, help="units per layer (default 4096)")
    parser.add_argument("--layers", type=int, default=3, help="Dense layers (default 3)")
    parser.add_argument("--processes", type=int, default=2, help="JAX processes (default 2)")
    parser.add_argument("--cpu-devices", type=int, default=2, help="CPU devices per process (default 2)")
    parser.add_argument("--role", nargs=4, metavar=("PHASE", "INDEX", "PORT", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.width, args.layers, args.processes, args.cpu_devices) < 1:
        parser.error("--width, --layers, --processes and --cpu-devices must be positive")
    return args


def resident_bytes() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One process of one phase: ``save`` (train a step, save it) or ``restore``."""
    phase, index, port, directory = args.role
    import flaxhooks

    flaxhooks.use_cpu_devices(args.cpu_devices, across_processes=True)
    import flax.linen as nn
    import jax
    import numpy as np
    import optax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", args.processes, int(index))

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(args.layers):
                x = nn.relu(nn.Dense(args.width)(x))
            return nn.Dense(10)(x)

    def loss_fn(logits, batch):
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    checkpoint = flaxhooks.Checkpoint(directory, every=1)
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    trainer = flaxhooks.Trainer(MLP(), optax.sgd(0.01, momentum=0.9), loss_fn, mesh=mesh,
                                shard=flaxhooks.FSDP("data", min_size=1024), callbacks=[checkpoint])
    per_process = 2 * args.cpu_devices
    rng = np.random.default_rng(int(index))
    data = {"image": rng.normal(size=(4 * per_process, args.width)).astype(np.float32),
            "label": rng.integers(0, 10, 4 * per_process).astype(np.int32)}
    loader = flaxhooks.ArrayLoader(data, batch_size=per_process, seed=0)
    if phase == "save":
        trainer.fit(loader, steps=1)
        return {}
    plan = trainer._plan({k: v[:per_process] for k, v in data.items()}, None)
    # The checkpoint found and its metadata read (which loads tensorstore) first:
    # the growth measured is the reading of the arrays.
    restored = checkpoint.restore_latest()
    sizes = [x.size * x.dtype.itemsize for x in jax.tree.leaves(plan.abstract)]
    before = peak = resident_bytes()
    sampling = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not sampling.is_set():
            peak = max(peak, resident_bytes())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    from flaxhooks.step import placed

    # Placed as the Trainer places a restored state (arrays already there are kept).
    state = placed(restored.train_state(plan.abstract), plan.shardings)
    jax.block_until_ready(state)
    sampling.set()
    sampler.join()
    peak = max(peak, resident_bytes())
    share = sum(shard.data.size * shard.data.dtype.itemsize
                for x in jax.tree.leaves(state) for shard in x.addressable_shards)
    return {"process": int(index), "state_bytes": sum(sizes), "share_bytes": share,
            "largest_leaf_bytes": max(sizes), "growth_bytes": peak - before}


#: glibc's allocator with a fixed mmap threshold: a large block freed goes
#: back to the system at once, where by default glibc raises the threshold
#: after the first such free and keeps later blocks for reuse.
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def run_phase(args: argparse.Namespace, phase: str, directory: str,
              extra_env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, **(extra_env or {})}
    procs = [subprocess.Popen(
        ["timeout", "-s", "KILL", "600", sys.executable, "-m", "benchmarks.bench_restore_memory",
         "--width", str(args.width), "--layers", str(args.layers), "--processes", str(args.processes),
         "--cpu-devices", str(args.cpu_devices), "--role", phase, str(i), str(port), directory],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(args.processes)]
    results = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"a {phase} process failed ({proc.returncode}): {err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.role is not None:
        print(json.dumps(worker(args)), flush=True)
        return {}
    directory = tempfile.mkdtemp(prefix="bench-restore-")
    run_phase(args, "save", directory)
    mb = 2**20
    print(f"restore: {args.processes} processes x {args.cpu_devices} CPU devices, FSDP over all, "
          f"{args.layers} x Dense({args.width}) with SGD momentum")
    result: dict[str, Any] = {"benchmark": "restore_memory"}
    for allocator, extra_env in (("glibc's default", None),
                                 ("MALLOC_MMAP_THRESHOLD_=1048576", FIXED_MMAP_THRESHOLD)):
        processes = run_phase(args, "restore", directory, extra_env)
        print(f"allocator: {allocator}")
        for p in processes:
            p["bound_bytes"] = p["share_bytes"] + p["largest_leaf_bytes"]
            print(f"  process {p['process']}: state {p['state_bytes'] / mb:.0f} MB, its share "
                  f"{p['share_bytes'] / mb:.0f} MB, largest leaf {p['largest_leaf_bytes'] / mb:.0f} MB: "
                  f"peak host memory grew {p['growth_bytes'] / mb:.0f} MB during the restore (bound "
                  f"{p['bound_bytes'] / mb:.0f} MB)")
        within = all(p["growth_bytes"] <= p["bound_bytes"] for p in processes)
        print(f"  every process within its share + the largest leaf: {'PASS' if within else 'FAIL'}")
        key = "default_allocator" if extra_env is None else "fixed_mmap_threshold"
        result[key] = {"processes": processes, "within_bound": within}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
