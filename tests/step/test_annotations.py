"""Models annotated the way Flax's own examples annotate them: a small lm1b-style
Transformer (Linen and NNX) trains alike on one device, on the default mesh
with no axis rules and on a ``data`` x ``model`` mesh with lm1b's rules, against
a hand-written optax loop; each parameter lands where Flax's own
``get_partition_spec`` + ``logical_to_mesh_sharding`` put it; an annotation
whose reading is ambiguous warns once naming the leaf; impossible ones are
refused, naming the leaf, before anything compiles."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flaxhooks

VOCAB, EMBED, HEADS, MLP, LENGTH, BATCH = 32, 16, 2, 32, 8, 16
HEAD = EMBED // HEADS

#: flax/examples/lm1b's logical axis rules (its ``logical_axis_rules`` config).
LM1B_RULES = (("batch", "data"), ("hidden", "model"), ("embed", None), ("vocab", "model"),
              ("mlp", "model"), ("heads", "model"), ("kv", None), ("joined_kv", "model"))


def _needs(count: int) -> list[jax.Device]:
    devices = jax.local_devices()
    if len(devices) < count:
        pytest.skip(f"needs {count} devices")
    return devices[:count]


def _mesh(shape: tuple[int, ...], names: tuple[str, ...] = ("data", "model")) -> Mesh:
    return Mesh(np.asarray(_needs(int(np.prod(shape)))).reshape(shape), names,
                axis_types=(AxisType.Auto,) * len(names))


_init = nn.initializers.xavier_uniform()
_zeros, _ones = nn.initializers.zeros_init(), nn.initializers.ones_init()


def _layer_norm() -> nn.LayerNorm:
    return nn.LayerNorm(scale_init=nn.with_logical_partitioning(_ones, ("embed",)),
                        bias_init=nn.with_logical_partitioning(_zeros, ("embed",)))


class TransformerLM(nn.Module):
    """One pre-LayerNorm decoder block between embeddings and logits, annotated
    as flax/examples/lm1b/models.py annotates its own."""

    attention_axes: tuple[str, ...] = ("embed", "kv")

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, EMBED, embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(1.0), ("vocab", "embed")))
        x = embed(tokens)
        y = nn.MultiHeadDotProductAttention(
            num_heads=HEADS, qkv_features=EMBED, use_bias=False, deterministic=True,
            kernel_init=nn.with_logical_partitioning(_init, self.attention_axes),
        )(_layer_norm()(x), mask=nn.make_causal_mask(tokens))
        x = x + y
        y = nn.Dense(MLP, kernel_init=nn.with_logical_partitioning(_init, ("embed", "mlp")),
                     bias_init=nn.with_logical_partitioning(_zeros, ("mlp",)))(_layer_norm()(x))
        y = nn.Dense(EMBED, kernel_init=nn.with_logical_partitioning(_init, ("mlp", "embed")),
                     bias_init=nn.with_logical_partitioning(_zeros, ("embed",)))(nn.gelu(y))
        x = _layer_norm()(x + y)
        return nn.Dense(VOCAB, kernel_init=nn.with_logical_partitioning(_init, ("embed", "vocab")),
                        bias_init=nn.with_logical_partitioning(_zeros, ("vocab",)))(x)


class NNXTransformerLM(nnx.Module):
    """The same block in NNX, annotated with ``nnx.with_partitioning``."""

    def __init__(self, rngs: nnx.Rngs):
        def norm():
            return nnx.LayerNorm(EMBED, scale_init=nnx.with_partitioning(_ones, ("embed",)),
                                 bias_init=nnx.with_partitioning(_zeros, ("embed",)), rngs=rngs)

        def linear(features_in, features_out, axes):
            return nnx.Linear(features_in, features_out, kernel_init=nnx.with_partitioning(_init, axes),
                              bias_init=nnx.with_partitioning(_zeros, axes[1:]), rngs=rngs)

        self.embed = nnx.Embed(VOCAB, EMBED, embedding_init=nnx.with_partitioning(
            nnx.initializers.normal(1.0), ("vocab", "embed")), rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            HEADS, EMBED, EMBED, use_bias=False, decode=False, deterministic=True,
            kernel_init=nnx.with_partitioning(_init, ("embed", "kv")), rngs=rngs)
        self.norms = nnx.List([norm() for _ in range(3)])
        self.hidden, self.out = linear(EMBED, MLP, ("embed", "mlp")), linear(MLP, EMBED, ("mlp", "embed"))
        self.logits = linear(EMBED, VOCAB, ("embed", "vocab"))

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.attention(self.norms[0](x), mask=nnx.make_causal_mask(tokens))
        x = x + self.out(nnx.gelu(self.hidden(self.norms[1](x))))
        return self.logits(self.norms[2](x))


def loss_fn(logits, batch):
    return optax.losses.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def _optimizer() -> optax.GradientTransformation:
    return optax.sgd(0.5, momentum=0.9)


def _batches(count: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (count, BATCH, LENGTH + 1)).astype(np.int32)
    return [{"image": t[:, :-1], "label": t[:, 1:]} for t in tokens]


def _by_hand(apply, params, batches):
    """The optax loop on one device: what every placement must compute."""
    tx = _optimizer()

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: loss_fn(apply(p, batch["image"]), batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    device = _needs(1)[0]
    params = jax.device_put(jax.tree.map(np.asarray, params), device)
    opt_state = tx.init(params)
    for batch in batches:
        params, opt_state = step(params, opt_state, jax.device_put(batch, device))
    return params


def _assert_close(got, want) -> None:
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))


def _flax_shardings(model: nn.Module, mesh: Mesh, rules) -> dict:
    """Where Flax itself puts each parameter (lm1b's train.py does the same)."""
    boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((BATCH, LENGTH), jnp.int32))
    return nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)["params"]


def _assert_placed_as(params, expected) -> None:
    flat = jax.tree_util.tree_leaves_with_path(expected, is_leaf=lambda x: isinstance(x, NamedSharding))
    assert len(flat) == len(jax.tree.leaves(params))
    for (path, want), got in zip(flat, jax.tree.leaves(params), strict=True):
        assert got.sharding.is_equivalent_to(want, got.ndim), (jax.tree_util.keystr(path), got.sharding, want)


@pytest.fixture(scope="module")
def linen_runs():
    """The lm1b-style model trained three ways from the same initial state,
    and any warnings the Trainer gave."""
    batches = _batches()
    model = TransformerLM()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Without the optimizer's norms (a smaller step to compile) but on the 4 x 2 mesh.
        one = flaxhooks.Trainer(model, _optimizer(), loss_fn, devices=_needs(1), optimizer_metrics=False)
        initial = jax.device_get(one.init(batches[0]))  # on the host: each fit places its own copy
        expected = _by_hand(lambda p, x: model.apply({"params": p}, x), initial.params, batches)
        runs = {"one device": one.fit(batches, epochs=1, state=initial)}
        _needs(8)
        default = flaxhooks.Trainer(model, _optimizer(), loss_fn, optimizer_metrics=False)  # no axis_rules
        runs["default mesh"] = default.fit(batches, epochs=1, state=initial)
        tensor = flaxhooks.Trainer(model, _optimizer(), loss_fn, mesh=_mesh((4, 2)), axis_rules=LM1B_RULES)
        runs["data=4,model=2"] = tensor.fit(batches, epochs=1, state=initial)
        # The three steps in one dispatch (a lax.scan over the mesh).
        dispatched = flaxhooks.Trainer(model, _optimizer(), loss_fn, mesh=_mesh((4, 2)),
                                       axis_rules=LM1B_RULES, steps_per_dispatch=3)
        runs["data=4,model=2, 3 steps a dispatch"] = dispatched.fit(batches, epochs=1, state=initial)
    return runs, expected, [w for w in caught if issubclass(w.category, UserWarning)]


def test_lm1b_linen_trains_the_same_on_one_device_the_default_mesh_and_a_data_model_mesh(linen_runs):
    runs, expected, caught = linen_runs
    for name, state in runs.items():
        assert int(state.step) == 3, name
        _assert_close(state.params, expected)
    assert [str(w.message) for w in caught] == []  # nothing lm1b's rules split is ambiguous


def test_on_the_default_mesh_every_unmapped_logical_name_stays_whole_as_in_flax(linen_runs):
    runs, _, _ = linen_runs
    params = runs["default mesh"].params
    _assert_placed_as(params, _flax_shardings(TransformerLM(), _mesh((8,), ("data",)), ()))
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(params))


def test_on_a_data_model_mesh_each_parameter_lies_where_flax_puts_it(linen_runs):
    runs, _, _ = linen_runs
    state = runs["data=4,model=2"]
    mesh = _mesh((4, 2))
    _assert_placed_as(state.params, _flax_shardings(TransformerLM(), mesh, LM1B_RULES))
    params = state.params
    hidden = params["Dense_0"]["kernel"]  # ("embed", "mlp"): its MLP units in halves over "model"
    assert {s.data.shape for s in hidden.addressable_shards} == {(EMBED, MLP // 2)}
    assert params["Embed_0"]["embedding"].sharding.spec == P("model", None)  # vocab over model
    key = params["MultiHeadDotProductAttention_0"]["key"]["kernel"]  # (16, 2, 8), names ("embed", "kv")
    assert key.shape == (EMBED, HEADS, HEAD) and key.sharding.is_fully_replicated
    out = params["MultiHeadDotProductAttention_0"]["out"]["kernel"]  # (2, 8, 16), the same two names
    assert out.shape == (HEADS, HEAD, EMBED) and out.sharding.is_fully_replicated
    # The optimizer's momentum follows its parameter.
    assert state.opt_state[0].trace["Dense_0"]["kernel"].sharding.is_equivalent_to(hidden.sharding, 2)


def test_a_shorter_annotation_that_splits_a_later_dimension_warns_once_naming_the_leaf():
    """("embed", "heads") on DenseGeneral's 3-D kernels, with heads over
    "model": JAX's reading splits the query's heads (meant) but the output's
    head width (the names were written for its flattened (heads x width, embed)
    kernel): the Trainer places both as JAX reads them, and says so once."""
    model = TransformerLM(attention_axes=("embed", "heads"))
    mesh = _mesh((4, 2))
    batch = _batches(1)[0]
    trainer = flaxhooks.Trainer(model, _optimizer(), loss_fn, mesh=mesh, axis_rules=LM1B_RULES)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = trainer.init(batch)
        trainer.init(batch)  # a second plan of the same Trainer: no repeat
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    attention = "params['MultiHeadDotProductAttention_0']"
    leaves = [f"{attention}['{name}']['kernel']" for name in ("query", "key", "value", "out")]
    assert sorted(m.split(" of shape")[0] for m in messages) == sorted(leaves)
    assert all("annotated with 2 axes ('embed', 'heads') for its 3 dimensions" in m for m in messages)
    out = next(m for m in messages if m.startswith(leaves[3]))
    assert "splits dimension 1 (size 8) as P(None, 'model', None)" in out
    _assert_placed_as(state.params, _flax_shardings(model, mesh, LM1B_RULES))  # as JAX reads it


class Annotated(nn.Module):
    """One Dense layer of ``features`` whose kernel is annotated with ``names``."""

    names: tuple
    features: int = 4
    logical: bool = True

    @nn.compact
    def __call__(self, x):
        annotate = nn.with_logical_partitioning if self.logical else nn.with_partitioning
        return nn.Dense(self.features, kernel_init=annotate(_init, self.names))(x.astype(jnp.float32))


def _classify(logits, batch):
    return optax.losses.softmax_cross_entropy_with_integer_labels(logits, batch["label"][:, 0]).mean()


@pytest.mark.parametrize("module, message", [
    (Annotated(("embed", "mlp", "heads")), r"params\['Dense_0'\]\['kernel'\] of shape \(8, 4\) is annotated "
                                           r"with 3 axes \('embed', 'mlp', 'heads'\), more than its 2"),
    (Annotated((None, "tensor"), logical=False),
     r"params\['Dense_0'\]\['kernel'\] of shape \(8, 4\) names axis 'tensor', which is neither a mesh axis"),
    (Annotated(("embed", "mlp"), features=3),
     r"params\['Dense_0'\]\['kernel'\] of shape \(8, 3\): dimension 1 of size 3 \('mlp' -> mesh 'model'\) "
     r"does not divide over 2 devices"),
    (Annotated(("mlp", "model")), r"params\['Dense_0'\]\['kernel'\] of shape \(8, 4\) splits two dimensions "
                                  r"over mesh axis 'model'"),  # "model" itself, and "mlp" by its rule
])
def test_an_impossible_annotation_is_refused_naming_the_leaf_before_compiling(module, message, compiles):
    rules = (("mlp", "model"), ("embed", None))
    trainer = flaxhooks.Trainer(module, _optimizer(), _classify, mesh=_mesh((4, 2)), axis_rules=rules)
    with pytest.raises(flaxhooks.ShardingError, match=message):
        trainer.fit(_batches(1), epochs=1)
    assert compiles == []


def test_an_nnx_lm1b_model_trains_as_on_one_device_placed_as_nnx_places_it():
    batches = _batches()
    mesh = _mesh((4, 2))
    with jax.set_mesh(mesh), nn.logical_axis_rules(LM1B_RULES):
        model = NNXTransformerLM(nnx.Rngs(0))
        expected_specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    graph, initial = nnx.split(model, nnx.Param)
    initial = jax.tree.map(np.asarray, initial)

    def apply(params, tokens):
        return nnx.merge(graph, params)(tokens)

    expected = _by_hand(apply, initial, batches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = flaxhooks.Trainer(model, _optimizer(), loss_fn, mesh=mesh, axis_rules=LM1B_RULES).fit(
            batches, epochs=1)
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []
    _assert_close(state.params, _pure(expected))
    specs = _pure(expected_specs)
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.params):
        want = NamedSharding(mesh, _lookup(specs, path))
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (jax.tree_util.keystr(path), leaf.sharding)
    hidden = state.params["hidden"]["kernel"]
    assert {s.data.shape for s in hidden.addressable_shards} == {(EMBED, MLP // 2)}
    assert state.params["attention"]["key"]["kernel"].sharding.is_fully_replicated


def _pure(state):
    """An nnx.State as nested dicts of its values, keyed by strings as the Trainer keys them."""
    def keyed(tree):
        return {str(k): keyed(v) for k, v in tree.items()} if isinstance(tree, dict) else tree

    return keyed(nnx.to_pure_dict(state))


def _lookup(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


@pytest.mark.parametrize("names, rules", [
    (("embed", "mlp"), LM1B_RULES),
    (("vocab", "embed"), (("vocab", "model"), ("embed", "model"))),  # "model" once per array: embed whole
    (("embed", "mlp"), (("mlp", "data"), ("embed", "data"), ("mlp", "model"))),  # rules in order
    (("embed", "mlp"), (("mlp", ("data", "model")),)),
    (("batch", None, "mlp"), (("batch", "data"), ("mlp", None))),
    (("heads", "kv"), ()),  # no rules: whole
])
def test_logical_names_are_read_as_flax_reads_them(names, rules):
    mesh = _mesh((4, 2))
    placement = flaxhooks.placement.Placement.of(mesh, None, "data", flaxhooks.Replicated(), rules)
    shape = (8,) * len(names)
    got = placement.mesh_spec(names, "x", shape)
    assert NamedSharding(mesh, got).is_equivalent_to(
        NamedSharding(mesh, nn.logical_to_mesh_axes(names, rules)), len(shape))


def test_mesh_axis_names_are_renamed_by_rules_else_must_be_the_meshs():
    from flaxhooks.placement import Annotation, Placement

    mesh = _mesh((4, 2))
    placement = Placement.of(mesh, None, "data", flaxhooks.Replicated(), (("mlp", "model"),))
    assert placement.mesh_spec(Annotation(("mlp", "data"), logical=False), "x", (8, 8)) == P("model", "data")
    own = Annotation(("hidden", None), logical=False, rules=(("hidden", "data"),))  # nnx sharding_rules
    assert placement.mesh_spec(own, "x", (8, 8)) == P("data", None)
    with pytest.raises(flaxhooks.ShardingError, match=r"x of shape \(8, 8\) names axis 'embed'"):
        placement.mesh_spec(Annotation(("embed", None), logical=False), "x", (8, 8))
    # The same name, logical: no rule maps it, so it stays whole.
    assert placement.mesh_spec(Annotation(("embed", None)), "x", (8, 8)) == P(None, None)


def test_only_a_shorter_annotation_splitting_a_later_dimension_is_ambiguous():
    mesh = _mesh((4, 2))
    placement = flaxhooks.placement.Placement.of(mesh, None, "data", flaxhooks.Replicated(), LM1B_RULES)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert placement.mesh_spec(("heads", "embed"), "first", (2, 8, 16)) == P("model", None, None)
        assert placement.mesh_spec(("embed", "kv"), "unsplit", (16, 2, 8)) == P(None, None, None)
        assert placement.mesh_spec(("embed", "heads", "kv"), "full", (16, 2, 8)) == P(None, "model", None)
        assert placement.mesh_spec(("embed", "heads"), "later", (16, 2, 8)) == P(None, "model", None)
        placement.mesh_spec(("embed", "heads"), "later", (16, 2, 8))  # once
    assert [str(w.message).split(" of shape")[0] for w in caught] == ["later"]
