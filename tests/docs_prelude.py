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
