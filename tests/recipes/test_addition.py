"""The addition recipe: its data, its annotated Transformer, --mesh, a smoke run and a learning check."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import flaxhooks
from recipes import addition, addition_data
from recipes.transformer import AXIS_RULES, Transformer, answer_scores

ROOT = Path(__file__).resolve().parents[2]
ERROR = "python -m recipes.addition: error: "


def _run_recipe(*args, timeout=300, cwd=ROOT):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # from any directory
    return subprocess.run(
        [sys.executable, "-m", "recipes.addition", *args], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=timeout,
    )


def _sums_in(text: str) -> tuple[int, int, int]:
    """The operands and answer an example's text states, read back as Python ints."""
    prompt, answer = text.split("=")
    a, b = prompt.split("+")
    return int(a), int(b), int(answer)


# The data.


@pytest.mark.parametrize("digits", [1, 3, 5])
def test_every_example_states_a_true_sum_at_a_fixed_width(digits):
    sums = addition_data.make_sums(digits, train_size=60, eval_size=20, seed=digits)
    for pairs, batch in ((sums.train_pairs, sums.train()), (sums.eval_pairs, sums.eval())):
        sequences = np.concatenate([batch["tokens"], batch["targets"][:, -1:]], axis=1)
        assert sequences.shape == (len(pairs), addition_data.sequence_length(digits))
        for (a, b), sequence in zip(pairs, sequences, strict=True):
            text = addition_data.render(sequence)
            assert len(text.split("=")[1]) == digits + 1 and len(text.split("+")[0]) == digits
            assert _sums_in(text) == (a, b, int(a) + int(b))


def test_targets_are_the_next_tokens_of_the_answer_only():
    digits = 3
    batch = addition_data.as_batch(addition_data.encode([999, 5], [1, 7], digits), digits)
    assert addition_data.render(batch["tokens"][0]) == "999+001=100"
    # The model reads "...=" then each answer digit, and predicts the next; the prompt is not predicted.
    assert addition_data.render(batch["targets"][0]) == "_______1000"
    assert addition_data.render(batch["targets"][1]) == "_______0012"


def test_the_sets_are_the_same_from_the_same_seed_and_differ_from_another():
    first = addition_data.make_sums(3, 500, 100, seed=7)
    again = addition_data.make_sums(3, 500, 100, seed=7)
    other = addition_data.make_sums(3, 500, 100, seed=8)
    np.testing.assert_array_equal(first.train_pairs, again.train_pairs)
    np.testing.assert_array_equal(first.eval_pairs, again.eval_pairs)
    assert not np.array_equal(first.train_pairs, other.train_pairs)


@pytest.mark.parametrize("digits, train, held_out", [(1, 80, 20), (2, 5000, 1000), (4, 20000, 2000)])
def test_no_sum_is_in_both_sets_or_twice_in_one(digits, train, held_out):
    sums = addition_data.make_sums(digits, train, held_out, seed=0)
    train_pairs = {tuple(pair) for pair in sums.train_pairs.tolist()}
    eval_pairs = {tuple(pair) for pair in sums.eval_pairs.tolist()}
    assert len(train_pairs) == train and len(eval_pairs) == held_out
    assert not train_pairs & eval_pairs


def test_more_sums_than_exist_or_too_many_digits_are_refused():
    with pytest.raises(ValueError, match="1-digit addition has 100 distinct sums"):
        addition_data.make_sums(1, 90, 20, seed=0)
    with pytest.raises(ValueError, match=r"digits must lie in \[1, 9\], got 10"):
        addition_data.make_sums(10, 1, 1, seed=0)


# The model.


def _specs(tree):
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, PartitionSpec))


def _abstract_variables(model: Transformer, length: int):
    return jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((2, length), jnp.int32))


def test_every_parameter_names_a_logical_axis_per_dimension():
    model = Transformer(vocab_size=addition.VOCAB_SIZE, length=11, width=64, depth=2, heads=4)
    params = _abstract_variables(model, 11)["params"]
    boxed = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    # The embeddings, the final LayerNorm and logits, then each block's 16.
    assert len(boxed) == len(jax.tree.leaves(params)) == 2 + 4 + 2 * 16
    known = {name for name, _ in AXIS_RULES}
    for box in boxed:
        assert isinstance(box, nn.LogicallyPartitioned), type(box)
        assert len(box.names) == box.value.ndim and set(box.names) <= known, box
    specs = nn.get_partition_spec(params)
    for spec, value in zip(_specs(specs), jax.tree.leaves(nn.meta.unbox(params)), strict=True):
        assert len(spec) == value.ndim
    attention = specs["block_0"]["attention"]
    # Every head's projection at once, the heads the leading part of the joint axis.
    assert attention["query"]["kernel"] == PartitionSpec("embed", "heads")
    assert attention["out"]["kernel"] == PartitionSpec("heads", "embed")
    assert specs["block_1"]["mlp"]["down"]["kernel"] == PartitionSpec("mlp", "embed")


def test_the_default_model_splits_evenly_over_a_model_axis_of_two():
    config = addition.Config()
    model = Transformer(vocab_size=addition.VOCAB_SIZE, length=11, width=config.width, depth=config.depth,
                        heads=config.heads)
    params = _abstract_variables(model, 11)["params"]
    on_mesh = nn.logical_to_mesh(nn.get_partition_spec(params), AXIS_RULES)
    split = 0
    for spec, value in zip(_specs(on_mesh), jax.tree.leaves(nn.meta.unbox(params)), strict=True):
        for axis, size in zip(spec, value.shape, strict=True):
            if axis == "model":
                split += 1
                assert size % 2 == 0, (spec, value.shape)
    assert split > 0


def test_each_position_sees_only_the_tokens_before_it():
    model = Transformer(vocab_size=16, length=8, width=32, depth=2, heads=2)
    tokens = jnp.arange(8, dtype=jnp.int32)[None] % 10
    variables = model.init(jax.random.key(0), tokens)
    changed = tokens.at[0, 5].set(9 - tokens[0, 5])
    apply = jax.jit(model.apply)
    before, after = apply(variables, tokens), apply(variables, changed)
    np.testing.assert_allclose(before[0, :5], after[0, :5], atol=1e-6)
    assert not np.allclose(before[0, 5:], after[0, 5:])


def test_exact_match_needs_every_answer_token_and_ignores_the_prompt():
    pad = addition_data.PAD
    targets = np.array([[pad, pad, 1, 2], [pad, pad, 3, 4], [pad, pad, 5, 6]])
    predicted = np.array([[7, 7, 1, 2], [0, 0, 3, 0], [5, 5, 0, 0]])  # all right, half right, none right
    logits = jax.nn.one_hot(predicted, 16) * 10.0
    _, token_accuracy, exact = answer_scores(logits, jnp.asarray(targets), pad)
    answer = targets != pad
    right = (predicted == targets) & answer
    np.testing.assert_allclose(token_accuracy, right.sum(1) / answer.sum(1))
    every_one_right = [float(r.sum() == a.sum()) for r, a in zip(right, answer, strict=True)]
    np.testing.assert_array_equal(exact, every_one_right)


# --mesh.


def test_parse_mesh_gives_every_axis_in_order():
    assert addition.parse_mesh("data=4,model=2", 8) == {"data": 4, "model": 2}
    assert addition.parse_mesh(" model = 2 , data = 4 ", 8) == {"data": 4, "model": 2}
    assert addition.parse_mesh("data=8", 8) == {"data": 8, "model": 1}
    assert addition.parse_mesh("model=1", 1) == {"data": 1, "model": 1}


@pytest.mark.parametrize("text, devices, cause", [
    ("batch=8", 8, "unknown axis 'batch': the axes are data and model"),
    ("data=0,model=8", 8, "axis 'data' has size 0: sizes must be positive"),
    ("data=-2,model=-4", 8, "axis 'data' has size -2: sizes must be positive"),
    ("data=two", 2, "axis 'data' has size 'two', not a whole number"),
    ("data=4,data=2", 8, "axis 'data' is given twice"),
    ("data4", 4, "'data4' is not name=size (e.g. data=4,model=2)"),
    ("data=4,", 4, "'' is not name=size (e.g. data=4,model=2)"),
    ("data=4,model=4", 8, "the sizes multiply to 16, not to the device count, 8"),
    ("data=3", 8, "the sizes multiply to 3, not to the device count, 8"),
])
def test_parse_mesh_names_the_cause_of_a_refusal(text, devices, cause):
    with pytest.raises(addition.MeshError) as refused:
        addition.parse_mesh(text, devices)
    assert str(refused.value) == cause


def test_the_sharding_arguments_are_the_mesh_the_rule_and_the_rules_on_its_axes():
    config = addition.Config(mesh="data=4,model=2", fsdp=True)
    arguments = addition.sharding_arguments(config, addition.parse_mesh(config.mesh, 8))
    assert dict(arguments["mesh"].shape) == {"data": 4, "model": 2}
    assert arguments["mesh"].axis_types == (jax.sharding.AxisType.Auto,) * 2
    assert arguments["shard"] == flaxhooks.FSDP("data") and arguments["axis_rules"] == AXIS_RULES
    data_only = addition.sharding_arguments(dataclasses.replace(config, mesh=None, fsdp=False),
                                            {"data": 8})
    assert data_only["shard"] == flaxhooks.Replicated()
    # The rules to "model" keep those dimensions whole on a mesh without that axis.
    kept = {name: axis if axis == "data" else None for name, axis in AXIS_RULES}
    assert dict(data_only["axis_rules"]) == kept


def test_a_mesh_that_does_not_fit_the_devices_is_refused_in_one_line_and_makes_no_directory(tmp_path):
    result = _run_recipe("--mesh", "data=3,model=2", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"{ERROR}--mesh data=3,model=2: the sizes multiply to 6, not to the device count, 8"]
    assert not (tmp_path / "runs").exists()


# The command line.


@pytest.mark.parametrize("args, refusal", [
    (("--heads", "3"), "--heads 3 does not divide --width 128"),
    (("--heads", "2", "--width", "64", "--mesh", "data=2,model=4"),
     "--heads 2 does not split over the 4 devices of the mesh's model axis"),
    (("--digits", "1"), "--digits 1 makes 100 distinct sums, fewer than --train-examples 50000 and "
                        "--eval-examples 2000 together"),
])
def test_settings_that_cannot_run_are_refused_in_one_line(args, refusal):
    config, _ = addition.parse_config(args)
    with pytest.raises(addition.OptionError) as refused:
        addition.check_options(config, 8)
    assert addition.refusal(refused.value, "", config) == refusal


def test_help_lists_every_option_and_usage_errors_are_argparse_errors():
    result = _run_recipe("--help")
    assert result.returncode == 0, result.stderr
    for field in dataclasses.fields(addition.Config):
        assert "--" + field.name.replace("_", "-") in result.stdout
    assert "(default: 8)" in result.stdout and "(default: --no-fsdp)" in result.stdout
    refused = _run_recipe("--digits", "0")
    assert refused.returncode == 2 and refused.stderr.splitlines()[-1] == (
        f"{ERROR}argument --digits: must be at least 1, got 0")


def test_parse_config_reads_every_option():
    config, workdir = addition.parse_config(
        ["--digits", "4", "--mesh", "data=2,model=4", "--fsdp", "--cpu-devices", "8", "--workdir", "w"])
    assert (config.digits, config.mesh, config.fsdp, config.cpu_devices, workdir) == (
        4, "data=2,model=4", True, 8, "w")
    assert addition.parse_config([])[0] == addition.Config()


# Runs.

#: A tiny run: one epoch of 2-digit sums, a few steps, no Diagnose (its tests run it).
TINY = ("--digits", "2", "--train-examples", "512", "--eval-examples", "100", "--width", "32",
        "--batch-size", "128", "--epochs", "1", "--diagnose-every", "0")


@pytest.mark.slow
def test_a_tiny_run_finishes_and_says_its_held_out_metrics(tmp_path):
    """With a moving average of the weights, resumed from the checkpoint."""
    workdir = tmp_path / "run"
    result = _run_recipe(*TINY, "--ema", "0.9", "--workdir", str(workdir), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "8 CPU devices, mesh data=8,model=1; run directory:" in result.stdout, result.stdout
    final = [line for line in result.stdout.splitlines() if line.startswith("held-out exact match")]
    assert len(final) == 1 and final[0].endswith("(100 unseen 2-digit sums, step 4)"), result.stdout[-2000:]
    assert "the weights' moving average (--ema 0.9): held-out exact match" in result.stdout
    options = json.loads((workdir / "options.json").read_text())
    assert (options["digits"], options["ema"]) == (2, 0.9)
    resumed = _run_recipe("--workdir", str(workdir), "--resume", "--epochs", "2", timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step 4" in resumed.stdout + resumed.stderr
    assert "(100 unseen 2-digit sums, step 8)" in resumed.stdout
    assert "the weights' moving average (--ema 0.9)" in resumed.stdout  # its options, resumed


def test_it_learns_two_digit_addition(tmp_path):
    config = addition.Config(digits=2, train_examples=6000, eval_examples=1000, width=64, epochs=8,
                             batch_size=128, learning_rate=3e-3, log_every=1000)
    # (No wall-clock bound: on a shared 2-core host it measured the neighbours; timings live in benchmarks/.)
    results = addition.train_and_evaluate(config, tmp_path)
    assert results["examples"] == 1000
    assert results["exact_match"] > 0.9, results
    # A healthy Transformer: Diagnose (on by default) finds nothing over the whole run.
    assert (tmp_path / "diagnose" / "findings.md").read_text().endswith("No finding: nothing looked wrong.\n")
