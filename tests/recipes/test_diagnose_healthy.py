"""Healthy models give no finding over whole runs: a false alarm is a bug.

The recipe's CNN (Linen, in the default run of ``test_recipe.py``) and the
addition Transformer (``test_addition.py``) are checked where they already
run; here: an LSTM, and the CNN in NNX.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import optax
import pytest

import flaxhooks
from recipes import addition_data, mnist
from recipes.transformer import batch_loss


class LSTM(nn.Module):
    """A one-layer LSTM language model over the addition recipe's tokens."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(16, 64)(tokens)
        x = nn.RNN(nn.OptimizedLSTMCell(128))(x)
        return nn.Dense(16)(x)


@pytest.mark.slow
def test_an_lstm_gives_no_finding_over_a_whole_run():
    sums = addition_data.make_sums(3, 20_000, 100, 0)
    diagnose = flaxhooks.Diagnose(every=2, window=100, table=False)
    loss = functools.partial(batch_loss, pad=addition_data.PAD)
    trainer = flaxhooks.Trainer(flaxhooks.as_model(LSTM(), input_keys=("tokens",)), optax.adam(2e-3), loss,
                                label_key=None, callbacks=[diagnose])
    trainer.fit(flaxhooks.ArrayLoader(sums.train(), 256, seed=0), epochs=4)  # 312 steps
    assert int(trainer.state.step) == 312
    assert diagnose.findings == []
    assert sorted(diagnose.pictures()) == ["dead_units", "gradient_rms", "update_ratio"]


@pytest.mark.slow
def test_the_nnx_cnn_gives_no_finding(tmp_path):
    config = mnist.Config(api="nnx", epochs=6, download=False, stats_every=0, log_every=1000)  # 186 steps
    mnist.train_and_evaluate(config, tmp_path)
    assert (tmp_path / "diagnose" / "findings.md").read_text().endswith("No finding: nothing looked wrong.\n")
