"""What the documentation's examples assume: small stand-ins for the model,
data and Trainer a reader brings, so every example in README.md and docs/
runs as written (``tests/test_docs.py``).

Each page's examples run in order in one namespace made by :func:`names`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import numpy as np
import optax

import flaxhooks


class MyModel(nn.Module):
    """A small CNN on 28x28x1 images, with the logical axis names the mesh
    page's rules use (``embed``, ``mlp``)."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Conv(4, (3, 3))(x))
        x = x.reshape(x.shape[0], -1)
        x = nn.Dense(16, kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("embed", "mlp")))(x)
        return nn.Dense(10)(nn.relu(x))


def loss_fn(logits, batch):
    loss = optax.losses.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["label"]).mean()}


def offline_trackers(directory: Any) -> dict[str, str]:
    """Environment variables that keep W&B offline, silent and out of ``$HOME`` (its settings, cache
    and logs in ``directory``), and MLflow from reporting its use."""
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
            "WANDB_DIR": str(directory), "WANDB_CONFIG_DIR": f"{directory}/wandb-config",
            "WANDB_CACHE_DIR": f"{directory}/wandb-cache", "WANDB_DATA_DIR": f"{directory}/wandb-data",
            "WANDB_ARTIFACT_DIR": f"{directory}/wandb-artifacts", "WANDB_ERROR_REPORTING": "false",
            "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true", "WANDB_X_DISABLE_STATS": "true",
            "WANDB_X_DISABLE_MACHINE_INFO": "true", "MLFLOW_DISABLE_TELEMETRY": "true"}


def names() -> dict[str, Any]:
    """A fresh namespace: the names the examples use without defining them."""
    rng = np.random.default_rng(0)
    images = rng.normal(size=(256, 28, 28, 1)).astype(np.float32)
    labels = rng.integers(0, 10, size=256).astype(np.int32)
    test_images, test_labels = images[:64], labels[:64]
    model = MyModel()
    optimizer = optax.sgd(0.1, momentum=0.9)
    return {
        "flaxhooks": flaxhooks, "optax": optax, "np": np,
        "MyModel": MyModel, "model": model, "loss_fn": loss_fn,
        "opt": optimizer, "optimizer": optimizer,
        "images": images, "labels": labels, "test_images": test_images, "test_labels": test_labels,
        "test": {"image": test_images, "label": test_labels},
        "loader": flaxhooks.ArrayLoader({"image": images, "label": labels}, batch_size=64),
        "trainer": flaxhooks.Trainer(model, optimizer, loss_fn),
        # grain's example: a source of record indices, decoded into examples
        "source": list(range(256)),
        "decode": lambda i: {"image": images[i], "label": labels[i]},
        "per_process_batch": 64,
    }
