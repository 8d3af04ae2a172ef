"""The recipe's model and loss."""

from __future__ import annotations

from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
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
