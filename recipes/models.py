"""The recipe's model and loss."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx


class CNN(nn.Module):
    """The CNN of Flax's MNIST example.

    It also sows its post-ReLU activations into ``intermediates`` (a no-op
    unless that collection is mutable), so ``ActivationStats`` shows the
    fraction of dead units per layer. ``dtype``: what the layers compute in
    (``jnp.bfloat16`` for mixed precision; the parameters stay float32).
    """

    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Conv(features=32, kernel_size=(3, 3), dtype=self.dtype)(x)
        x = self._relu(x, "Conv_0_relu")
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=64, kernel_size=(3, 3), dtype=self.dtype)(x)
        x = self._relu(x, "Conv_1_relu")
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(features=256, dtype=self.dtype)(x)
        x = self._relu(x, "Dense_0_relu")
        return nn.Dense(features=10, dtype=self.dtype)(x)

    def _relu(self, x: jax.Array, name: str) -> jax.Array:
        x = nn.relu(x)
        self.sow("intermediates", name, x)
        return x


class NNXCNN(nnx.Module):
    """The same CNN written with Flax NNX (same layers, same sown activations).

    ``flaxhooks.Trainer`` takes it as it takes the Linen one; when ``fit``
    ends the object holds the trained parameters.
    """

    def __init__(self, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        self.conv_0 = nnx.Conv(1, 32, kernel_size=(3, 3), dtype=dtype, rngs=rngs)
        self.conv_1 = nnx.Conv(32, 64, kernel_size=(3, 3), dtype=dtype, rngs=rngs)
        self.dense_0 = nnx.Linear(7 * 7 * 64, 256, dtype=dtype, rngs=rngs)
        self.dense_1 = nnx.Linear(256, 10, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self._relu(self.conv_0(x), "conv_0_relu")
        x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = self._relu(self.conv_1(x), "conv_1_relu")
        x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = self._relu(self.dense_0(x), "dense_0_relu")
        return self.dense_1(x)

    def _relu(self, x: jax.Array, name: str) -> jax.Array:
        x = nnx.relu(x)
        self.sow(nnx.Intermediate, name, x)  # read only under nnx.capture (the Trainer's)
        return x


def cross_entropy_loss(
    logits: jax.Array, batch: Mapping[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean softmax cross-entropy, with accuracy as a metric (in float32 from any logits)."""
    labels, logits = batch["label"], logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    loss = optax.losses.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}
