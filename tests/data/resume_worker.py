"""One training process of a kill-and-resume test, on one kind of data.

``python -m tests.data.resume_worker KIND MODE OUT INDEX COUNT PORT``:
``MODE`` is ``whole`` (train 3 epochs), ``killed`` (SIGKILL itself at step
8, once the checkpoint of step 6 is complete) or ``resumed`` (``fit(...,
resume=True)``). Each step's batch (this process's share) is logged as a
fingerprint to ``OUT/<MODE>-p<INDEX>.json``, and the final parameters to
``OUT/<MODE>-params.npz``. With ``COUNT`` > 1 the processes form one JAX run
(gloo on 127.0.0.1, ``PORT``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

EXAMPLES, GLOBAL_BATCH, EPOCHS, SAVE_EVERY, KILL_AT = 40, 8, 3, 3, 8


class Records:
    """A random-access source of examples (grain's DataLoader names it by its repr)."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays["label"])

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {key: value[index] for key, value in self.arrays.items()}

    def __repr__(self) -> str:
        return f"Records({len(self)})"


class TorchStyleLoader:
    """What a PyTorch ``DataLoader`` with a numpy collate gives: re-iterable,
    a length, dicts of arrays, the same seeded order each time."""

    def __init__(self, arrays: dict[str, np.ndarray], batch_size: int, seed: int, share: slice):
        self.arrays, self.batch_size, self.seed, self.share = arrays, batch_size, seed, share

    def __len__(self) -> int:
        return len(self.arrays["label"][self.share]) // self.batch_size

    def __iter__(self):
        order = np.random.default_rng(self.seed).permutation(len(self.arrays["label"]))[self.share]
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            index = order[start:start + self.batch_size]
            yield {key: value[index] for key, value in self.arrays.items()}


def make_data(kind: str, arrays: dict[str, np.ndarray], index: int, count: int):
    import grain

    batch = GLOBAL_BATCH // count
    if kind == "array":
        import flaxhooks

        return flaxhooks.ArrayLoader(arrays, batch, seed=3)
    if kind == "torch":
        return TorchStyleLoader(arrays, batch, seed=3, share=slice(index, None, count))
    records = Records(arrays)
    if kind == "grain_loader":
        sampler = grain.samplers.IndexSampler(
            len(records), shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True),
            shuffle=True, seed=3, num_epochs=1)
        # Workers are checked on one process; on two, what is checked is each
        # process's own sampler share and state, the same with or without them
        # (and each epoch's start spawns them anew: most of a two-process run).
        workers = 2 if count == 1 else 0
        return grain.DataLoader(data_source=records, sampler=sampler, worker_count=workers,
                                operations=[grain.transforms.Batch(batch, drop_remainder=True)])
    if kind == "grain_unsharded":  # every process the same batches: a mistake flaxhooks points out
        return grain.MapDataset.source(records).seed(3).shuffle().batch(batch, drop_remainder=True)
    mine = grain.MapDataset.source(records).seed(3).shuffle()[index::count]
    if kind == "grain_map":
        return mine.batch(batch, drop_remainder=True)
    if kind == "grain_iter":
        return mine.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)).batch(
            batch, drop_remainder=True)
    raise ValueError(kind)


def main() -> None:
    kind, mode, out, index, count, port = sys.argv[1:]
    index, count = int(index), int(count)
    import jax

    import flaxhooks

    flaxhooks.use_cpu_devices(2, across_processes=count > 1)
    if count > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=count, process_id=index)
    import flax.linen as nn
    import optax

    from tests.helpers import cross_entropy, make_arrays

    checkpoint = flaxhooks.Checkpoint(os.path.join(out, "ckpt"), every=SAVE_EVERY)
    taken: dict[int, str] = {}

    class Log(flaxhooks.Callback):
        def on_step_end(self, loop):
            local = {key: np.concatenate([np.asarray(s.data) for s in value.addressable_shards])
                     for key, value in loop.batch.items()}
            taken[loop.step] = flaxhooks.data.fingerprint(local)
            if mode == "killed" and loop.step == KILL_AT:
                checkpoint.wait()
                while SAVE_EVERY * (KILL_AT // SAVE_EVERY) not in checkpoint.saved_steps():
                    time.sleep(0.05)  # process 0 commits it; every process dies after
                _write(out, mode, index, taken)
                if count > 1:
                    # Every process past orbax's last barrier of the save, then
                    # the one hosting JAX's coordination service dies last: a
                    # process that outlives it is aborted by JAX (SIGABRT).
                    from jax.experimental import multihost_utils

                    multihost_utils.sync_global_devices("resume_worker: before the kill")
                    if index == 0:
                        time.sleep(1.0)
                os.kill(os.getpid(), signal.SIGKILL)

    model = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(3)])
    trainer = flaxhooks.Trainer(model, optax.adam(1e-2), cross_entropy, callbacks=[checkpoint, Log()])
    data = make_data(kind, make_arrays(EXAMPLES, seed=5), index, count)
    state = trainer.fit(data, epochs=EPOCHS, resume=mode == "resumed")
    _write(out, mode, index, taken)
    if index == 0:
        leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(state.params)]
        np.savez(os.path.join(out, f"{mode}-params.npz"), *leaves)
    print("DONE", flush=True)


def _write(out: str, mode: str, index: int, taken: dict[int, str]) -> None:
    with open(os.path.join(out, f"{mode}-p{index}.json"), "w") as file:
        json.dump(taken, file)


if __name__ == "__main__":
    main()
