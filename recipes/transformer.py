"""A small decoder-only Transformer whose every parameter names its logical axes.

Each parameter is created with ``nn.with_logical_partitioning`` and each
activation that a sharded run should keep laid out is constrained with
``nn.with_logical_constraint``; :data:`AXIS_RULES` maps the logical names to
the axes of a ``("data", "model")`` mesh. On a mesh whose ``model`` axis has
size 1 the annotations split nothing: the same model trains data-parallel.

Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from recipes.transformer import Transformer
    >>> model = Transformer(vocab_size=16, length=11, width=32, depth=1, heads=2)
    >>> shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((2, 11), jnp.int32))
    >>> spec = nn.get_partition_spec(shapes)["params"]["embed"]["embedding"]
    >>> spec == jax.sharding.PartitionSpec("vocab", "embed")
    True
"""

from __future__ import annotations

from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from flaxhooks.diagnose import record_attention

#: Logical axis name to mesh axis: batches split over ``data``; the vocabulary,
#: the heads and the MLP's hidden units over ``model`` (tensor parallelism);
#: the rest replicated.
AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "data"),
    ("vocab", "model"),
    ("embed", None),
    ("heads", "model"),
    ("kv", None),
    ("mlp", "model"),
    ("length", None),
)

_dense_init = nn.initializers.xavier_uniform()
_zeros = nn.initializers.zeros_init()
_ones = nn.initializers.ones_init()


def _layer_norm(name: str) -> nn.LayerNorm:
    return nn.LayerNorm(
        name=name,
        scale_init=nn.with_logical_partitioning(_ones, ("embed",)),
        bias_init=nn.with_logical_partitioning(_zeros, ("embed",)),
    )


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees itself and those before it."""

    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        width = x.shape[-1]
        if width % self.heads:
            raise ValueError(f"the width {width} does not divide into {self.heads} heads")
        head_width = width // self.heads

        # Plain Dense layers over every head at once, each kernel with one
        # name per dimension: flax's DenseGeneral would annotate its flattened
        # 2-D kernel, and the two names then cover only the leading dimensions
        # of the 3-D one. The heads are the leading part of the joint axis.
        def projection(name: str) -> jax.Array:
            joint = nn.Dense(
                width, name=name,
                kernel_init=nn.with_logical_partitioning(_dense_init, ("embed", "heads")),
                bias_init=nn.with_logical_partitioning(_zeros, ("heads",)),
            )(x)
            return joint.reshape(*joint.shape[:-1], self.heads, head_width)

        names = ("batch", "length", "heads", "kv")
        query, key, value = (
            nn.with_logical_constraint(projection(name), names) for name in ("query", "key", "value")
        )
        causal = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.bool_))
        # nn.dot_product_attention's computation, written out so that Diagnose sees
        # the pre-softmax logits (record_attention does nothing outside its steps).
        logits = jnp.einsum("...qhd,...khd->...hqk", query / jnp.sqrt(head_width).astype(query.dtype), key)
        record_attention(self, logits, causal)
        weights = jax.nn.softmax(jnp.where(causal, logits, jnp.finfo(logits.dtype).min))
        attended = jnp.einsum("...hqk,...khd->...qhd", weights, value)
        attended = nn.with_logical_constraint(attended, names)
        out = nn.Dense(
            width, name="out",
            kernel_init=nn.with_logical_partitioning(_dense_init, ("heads", "embed")),
            bias_init=nn.with_logical_partitioning(_zeros, ("embed",)),
        )(attended.reshape(*attended.shape[:-2], width))
        return nn.with_logical_constraint(out, ("batch", "length", "embed"))


class MLP(nn.Module):
    """Two dense layers with a GELU between, ``hidden`` units wide."""

    hidden: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        width = x.shape[-1]
        h = nn.Dense(
            self.hidden, name="up",
            kernel_init=nn.with_logical_partitioning(_dense_init, ("embed", "mlp")),
            bias_init=nn.with_logical_partitioning(_zeros, ("mlp",)),
        )(x)
        h = nn.with_logical_constraint(nn.gelu(h), ("batch", "length", "mlp"))
        out = nn.Dense(
            width, name="down",
            kernel_init=nn.with_logical_partitioning(_dense_init, ("mlp", "embed")),
            bias_init=nn.with_logical_partitioning(_zeros, ("embed",)),
        )(h)
        return nn.with_logical_constraint(out, ("batch", "length", "embed"))


class Block(nn.Module):
    """Pre-LayerNorm residual block: attention, then the MLP."""

    heads: int
    mlp_ratio: int = 4

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + CausalSelfAttention(self.heads, name="attention")(_layer_norm("attention_norm")(x))
        return x + MLP(self.mlp_ratio * x.shape[-1], name="mlp")(_layer_norm("mlp_norm")(x))


class Transformer(nn.Module):
    """Token and learned position embeddings, ``depth`` blocks, a final LayerNorm and logits.

    Attributes:
        vocab_size: how many token ids there are (the logits' last axis).
        length: the longest sequence (positions learned).
        width: the embedding's width.
        depth: how many blocks.
        heads: attention heads per block (dividing ``width``).
    """

    vocab_size: int
    length: int
    width: int = 128
    depth: int = 2
    heads: int = 4

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(
            self.vocab_size, self.width, name="embed",
            embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")),
        )
        positions = self.param(
            "positions", nn.with_logical_partitioning(nn.initializers.normal(0.02), ("length", "embed")),
            (self.length, self.width),
        )
        # Module.param returns what the initializer does, boxed, in flax's annotation; unboxed at run time.
        x = embed(tokens) + positions[None, : tokens.shape[1]]  # type: ignore[index]
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        for index in range(self.depth):
            x = Block(self.heads, name=f"block_{index}")(x)
        x = _layer_norm("final_norm")(x)
        logits = nn.Dense(
            self.vocab_size, name="logits",
            kernel_init=nn.with_logical_partitioning(_dense_init, ("embed", "vocab")),
            bias_init=nn.with_logical_partitioning(_zeros, ("vocab",)),
        )(x)
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


def answer_scores(
    logits: jax.Array, targets: jax.Array, pad: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-example loss, token accuracy and exact match over the answer's tokens.

    Positions whose target is ``pad`` (the prompt) are left out of all three.

    Returns:
        Each example's mean cross-entropy over its answer tokens, the fraction
        of them predicted right, and 1.0 when every one is right (else 0.0).
        The model reads the true answer before each position, but greedy
        decoding would then produce the whole answer exactly when every
        token is right here, so this exact match is greedy decoding's.
    """
    counted = (targets != pad).astype(jnp.float32)
    answer_tokens = jnp.maximum(counted.sum(-1), 1.0)
    losses = optax.losses.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    right = (jnp.argmax(logits, -1) == targets).astype(jnp.float32) * counted
    token_accuracy = right.sum(-1) / answer_tokens
    exact = (right.sum(-1) == counted.sum(-1)).astype(jnp.float32)
    return (losses * counted).sum(-1) / answer_tokens, token_accuracy, exact


def example_loss(
    logits: jax.Array, batch: Mapping[str, jax.Array], pad: int
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """For evaluation: each example's loss, and its token accuracy and exact match as metric inputs."""
    losses, token_accuracy, exact = answer_scores(logits, batch["targets"], pad)
    return losses, {"token_accuracy": token_accuracy, "exact_match": exact}


def batch_loss(
    logits: jax.Array, batch: Mapping[str, jax.Array], pad: int
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """For training: the batch's mean loss, with mean token accuracy and exact match as metrics."""
    losses, metrics = example_loss(logits, batch, pad)
    return losses.mean(), {name: values.mean() for name, values in metrics.items()}
