"""Summary: tabulate at fit start, parameters only, once, process 0, TensorBoard, no compilation."""

from __future__ import annotations

import io
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import rich.box
from flax import jax_utils
from rich.console import Console
from rich.text import Text

import flaxhooks
from flaxhooks import Summary, TensorBoard
from flaxhooks.contract import HookBus
from tests.helpers import BatchNormNet, make_batches, sgd_trainer

TAG = Summary.tag

FEATURES = 9
PER_DEVICE = 16


class Perturbed(nn.Module):
    """Dense(9→4) → perturb → Dense(4→2): 40 + 10 = 50 parameters, and one
    perturbation of shape [batch, 4] that plain tabulate counts as 64 more."""

    @nn.compact
    def __call__(self, x, train: bool):
        h = self.perturb("hidden", nn.Dense(4)(x))
        return nn.Dense(2)(nn.relu(h))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(6)(x)))


class Nested(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(Block()(x))


def loss_fn(outputs, batch):
    return optax.losses.softmax_cross_entropy_with_integer_labels(outputs, batch["label"]).mean()


def batches(count: int, batch_size: int, classes: int = 2, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "image": rng.normal(size=(batch_size, FEATURES)).astype(np.float32),
            "label": rng.integers(0, classes, batch_size).astype(np.int32),
        }
        for _ in range(count)
    ]


def perturbed_trainer(devices, callbacks=()) -> flaxhooks.Trainer:
    return flaxhooks.Trainer(Perturbed(), optax.sgd(0.1), loss_fn, callbacks=callbacks, devices=devices)


def captured(width: int = 120) -> Console:
    return Console(file=io.StringIO(), width=width)


def loop_of(trainer: flaxhooks.Trainer, state: flaxhooks.TrainState) -> flaxhooks.Loop:
    """What a handler sees at fit start, for a Trainer given its first batch (``init``)."""
    return flaxhooks.Loop(state=jax_utils.replicate(state, trainer.devices), model=trainer.model,
                          spec=trainer.batch_spec)


def output(console: Console) -> str:
    file = console.file
    assert isinstance(file, io.StringIO)
    return file.getvalue()


def total(table: str) -> int:
    match = re.search(r"Total Parameters: ([\d,]+)", Text.from_ansi(table).plain)
    assert match, table
    return int(match.group(1).replace(",", ""))


def test_totals_count_parameters_not_perturbations(devices):
    plain = nn.tabulate(Perturbed(), jax.random.key(0))(jnp.zeros((PER_DEVICE, FEATURES)), train=False)
    assert total(plain) == 114  # the perturbation [16, 4] counted as parameters

    console = captured()
    summary = Summary(console=console)
    trainer = perturbed_trainer(devices, [summary])
    trainer.fit(batches(2, PER_DEVICE * len(devices)), epochs=1)

    assert summary.parameters == 50
    assert sum(x.size for x in jax.tree.leaves(trainer.state.params)) == 50
    assert summary.table is not None and total(summary.table) == 50
    assert "perturbations" not in summary.table
    printed = output(console)
    assert "Total Parameters: 50" in printed
    assert "\x1b[" not in printed  # not a terminal: plain text
    # Inputs are one device's share of the batch, called in inference mode, and the table says so.
    assert f"float32[{PER_DEVICE},{FEATURES}]" in summary.table
    assert "train: False" in summary.table
    note = (f"Shapes per device: {PER_DEVICE} of the global batch of {PER_DEVICE * len(devices)}, split over "
            f"{len(devices)} devices.")
    if len(devices) > 1:
        # Then where the state lies: replicated (data parallel), so each device holds it whole.
        state_bytes = sum(x.nbytes for x in jax.tree.leaves(trainer.state))
        placed = f"State replicated on each of the {len(devices)} devices: {state_bytes} B each."
        assert summary.table.endswith(f"\n{note}\n{placed}")
        assert printed.rstrip().endswith(f"{note}\n{placed}")
    else:
        assert "Shapes per device" not in printed  # one device: the shapes are the batch's


def test_carried_state_is_shown_but_parameters_are_params_only():
    console = captured(160)
    summary = Summary(console=console)
    trainer = sgd_trainer(BatchNormNet(), callbacks=[summary], devices=jax.local_devices()[:1])
    trainer.fit(make_batches(1), steps=1)
    assert summary.table is not None and "batch_stats" in summary.table
    assert summary.parameters == sum(x.size for x in jax.tree.leaves(trainer.state.params))


def test_printed_once_across_two_fits():
    console = captured()
    summary = Summary(console=console)
    trainer = perturbed_trainer(jax.local_devices()[:1], [summary])
    data = batches(2, PER_DEVICE)
    trainer.fit(data, epochs=1)
    table = summary.table
    trainer.fit(data, epochs=2)
    assert output(console).count("Perturbed Summary") == 1
    assert output(console).count("Total Parameters") == 1
    assert summary.table is table


def test_tabulate_options_pass_through():
    trainer = flaxhooks.Trainer(Nested(), optax.sgd(0.1), loss_fn, devices=jax.local_devices()[:1])
    loop = loop_of(trainer, trainer.init(batches(1, PER_DEVICE, classes=3)[0]))

    full = Text.from_ansi(Summary().render(loop)).plain
    shallow = Text.from_ansi(Summary(depth=1).render(loop)).plain
    assert "Block_0/Dense_0" in full
    assert "Block_0" in shallow and "Block_0/Dense_0" not in shallow
    assert total(full) == total(shallow) == (9 * 6 + 6) + (6 * 4 + 4) + (4 * 3 + 3)

    assert "flops" not in full
    flops = Text.from_ansi(Summary(compute_flops=True, compute_vjp_flops=True).render(loop)).plain
    assert "flops" in flops and "vjp_flops" in flops

    narrow = Summary(console_kwargs={"width": 70}).render(loop)
    assert max(len(line) for line in Text.from_ansi(narrow).plain.splitlines()) <= 70
    plain = Summary(console_kwargs={"force_terminal": False, "width": 200}).render(loop)
    assert "\x1b[" not in plain

    ascii_box = Text.from_ansi(Summary(table_kwargs={"box": rich.box.ASCII}).render(loop)).plain
    assert "┏" in full and "┏" not in ascii_box and "+---" in ascii_box
    wide = Summary(console_kwargs={"width": 200}).render(loop)
    right = Summary(column_kwargs={"justify": "right"}, console_kwargs={"width": 200}).render(loop)
    assert Text.from_ansi(right).plain != Text.from_ansi(wide).plain


def test_process_zero_only(monkeypatch):
    assert Summary.process_zero_only
    console = captured()
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    summary = Summary(console=console)
    assert HookBus([summary]).callbacks == ()
    perturbed_trainer(jax.local_devices()[:1], [summary]).fit(batches(1, PER_DEVICE), steps=1)
    assert summary.table is None and output(console) == ""


class FakeWriter(flaxhooks.writers.Writer):
    """A writer (flaxhooks.writers.Writer) that keeps the texts."""

    def __init__(self):
        self.texts: list[tuple[str, str, int]] = []

    def text(self, tag: str, text: str, step: int = 0) -> None:
        self.texts.append((tag, text, step))

    def scalars(self, values, step, prefix=""):
        pass

    def histograms(self, values, step):
        pass

    def images(self, values, step):
        pass

    def sync_point(self):
        import threading

        done = threading.Event()
        done.set()
        return done


class Writes(flaxhooks.Callback):
    """A writer callback (flaxhooks.writers.WriterCallback), registered after the Summary."""

    def __init__(self, writer):
        self.writer = writer

    def open_writer(self, loop):
        return self.writer

    def close_writer(self, loop):
        pass


def test_table_is_written_once_to_the_fits_writers():
    writer = FakeWriter()
    summary = Summary(console=captured())
    trainer = perturbed_trainer(jax.local_devices()[:1], [summary, Writes(writer)])
    trainer.fit(batches(2, PER_DEVICE), epochs=1)
    trainer.fit(batches(2, PER_DEVICE), epochs=2)
    assert summary.table is not None
    assert writer.texts == [(TAG, f"```\n{summary.table.rstrip()}\n```", 0)]


def test_no_writer_no_tensorboard_text():
    summary = Summary(console=captured())
    perturbed_trainer(jax.local_devices()[:1], [summary]).fit(batches(1, PER_DEVICE), steps=1)
    assert summary.table is not None


def test_table_goes_to_tensorboard_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    summary = Summary(console=captured())
    trainer = perturbed_trainer(jax.local_devices()[:1], [summary, TensorBoard(tmp_path)])
    trainer.fit(batches(2, PER_DEVICE), epochs=1)  # flushed at fit end

    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    events.Reload()
    tag = f"{TAG}/text_summary"
    assert tag in events.Tags()["tensors"]
    assert events.SummaryMetadata(tag).plugin_data.plugin_name == "text"
    written = events.Tensors(tag)
    assert len(written) == 1 and written[0].step == 0
    text = written[0].tensor_proto.string_val[0].decode()
    assert summary.table is not None
    assert text == f"```\n{summary.table.rstrip()}\n```"
    assert "Total Parameters: 50" in text and "\x1b[" not in text


@pytest.mark.parametrize("flops", [False, True])
def test_costs_no_compilation_unless_flops_are_asked(compiles, flops):
    trainer = perturbed_trainer(jax.local_devices()[:1])
    state = trainer.init(batches(1, PER_DEVICE)[0])
    loop = loop_of(trainer, state)
    summary = Summary(compute_flops=flops, console=captured())
    compiles.clear()
    summary.on_fit_start(loop)
    if not flops:
        assert compiles == []
    assert summary.parameters == 50
    assert summary.table is not None and ("flops" in summary.table) == flops


def nested_trainer(summary: Summary) -> flaxhooks.Trainer:
    return flaxhooks.Trainer(Nested(), optax.sgd(0.1), loss_fn, devices=jax.local_devices()[:1],
                             callbacks=[summary])


def table_rows(printed: str) -> list[str]:
    """The lines of the table's box (title and caption left out)."""
    return [line for line in printed.splitlines() if line and line[0] in "┏┃┡│├└"]


@pytest.mark.parametrize("given", [True, False], ids=["console", "console_kwargs"])
def test_off_a_terminal_a_wide_table_is_printed_whole_at_its_natural_width(given):
    file = io.StringIO()
    console = Console(file=file)  # not a terminal: rich assumes 80 columns
    assert not console.is_terminal and console.width == 80
    summary = Summary(console=console) if given else Summary(console_kwargs={"file": file})
    trainer = nested_trainer(summary)
    trainer.fit(batches(1, PER_DEVICE, classes=3), steps=1)

    rows = table_rows(file.getvalue())
    assert "\x1b[" not in file.getvalue()
    assert len({len(row) for row in rows}) == 1  # every row whole: none squeezed or wrapped
    assert len(rows[0]) > 80
    assert all(row[-1] in "┓┃┩│┤┘" for row in rows)
    # The natural width: what a width of its own gives it.
    loop = loop_of(trainer, trainer.init(batches(1, PER_DEVICE, classes=3)[0]))
    natural = Text.from_ansi(Summary(console_kwargs={"width": 500}).render(loop)).plain
    assert table_rows(natural) == rows


def test_on_a_terminal_the_table_fits_its_width():
    console = Console(file=io.StringIO(), force_terminal=True, width=80)
    summary = Summary(console=console)
    nested_trainer(summary).fit(batches(1, PER_DEVICE, classes=3), steps=1)
    rows = table_rows(Text.from_ansi(output(console)).plain)
    assert rows and max(len(row) for row in rows) <= 80
    assert "Total Parameters" in Text.from_ansi(output(console)).plain
