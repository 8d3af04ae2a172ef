"""One process of the multi-process test: ``python -m tests.multihost_worker ID COUNT PORT OUT``.

Each process exposes two CPU devices, joins the others over gloo on 127.0.0.1
and trains on its own share of every global batch.
"""

import sys

import jax


def main(process_id: int, processes: int, port: str, out: str) -> None:
    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=processes, process_id=process_id)

    import numpy as np

    import flaxhooks
    from tests.helpers import make_arrays, sgd_trainer

    loader = flaxhooks.ArrayLoader(make_arrays(64), batch_size=16 // processes, seed=1)
    trainer = sgd_trainer(callbacks=[flaxhooks.ConsoleLog(flaxhooks.Every(steps=4))])
    state = trainer.fit(loader, epochs=2)
    leaves = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.params))]
    # Each process evaluates its share (every 2nd example: 501 and 500, so
    # 6 and 5 batches); the result covers all 1001 exactly once.
    result = trainer.evaluate(make_arrays(1001, seed=5), batch_size=100)
    figures = [result.examples, result.metrics["loss"], result.metrics["accuracy"]]
    # One example: process 1's share is empty, and it still takes part.
    tiny = trainer.evaluate(make_arrays(1, seed=9), batch_size=100)
    figures.append(tiny.examples)
    # A bad label on process 1 only: both processes raise, neither waits forever.
    batch = make_arrays(8, seed=process_id)
    batch["label"][0] = 3 * process_id
    try:
        trainer.evaluate([batch])
        figures.append(0)
    except Exception as error:  # noqa: BLE001
        print(f"process {process_id} eval error: {type(error).__name__}: {error}", flush=True)
        figures.append(1)
    np.savez(out, *leaves, eval=np.array(figures))
    print(f"process {process_id}: {len(jax.local_devices())} local of {len(jax.devices())} devices, "
          f"step {int(state.step)}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
