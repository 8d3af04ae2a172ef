"""The recipe's model, loss and held-out evaluation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


class CNN(nn.Module):
    """The CNN of Flax's MNIST example."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Conv(features=32, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=64, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(features=256)(x)
        x = nn.relu(x)
        return nn.Dense(features=10)(x)


def cross_entropy_loss(
    logits: jax.Array, batch: Mapping[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean softmax cross-entropy, with accuracy as a metric."""
    labels = batch["label"]
    loss = optax.losses.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


def evaluate(model: nn.Module, variables: Mapping[str, Any], images: np.ndarray, labels: np.ndarray,
             batch_size: int = 1000) -> dict[str, float]:
    """Loss and accuracy over every example, summed on the host in float64."""
    @jax.jit
    def sums(x, y):
        logits = model.apply(variables, x)
        losses = optax.losses.softmax_cross_entropy_with_integer_labels(logits, y)
        return losses.sum(), jnp.sum(jnp.argmax(logits, -1) == y)

    loss = correct = 0.0
    for start in range(0, len(labels), batch_size):
        batch_loss, batch_correct = sums(images[start:start + batch_size], labels[start:start + batch_size])
        loss += float(batch_loss)
        correct += float(batch_correct)
    return {"accuracy": correct / len(labels), "loss": loss / len(labels), "examples": len(labels)}
