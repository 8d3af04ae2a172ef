"""What Diagnose writes to TensorBoard reaches the screen: every finding in
the Text tab (as TensorBoard's default reader keeps one entry per step, and
drops later steps when an earlier one comes after them), a reassuring entry
when nothing was found, and a counter only for the kinds that were found.
The real server reads them in tests/callbacks/test_diagnose_server.py."""

from __future__ import annotations

import types

import flax.linen as nn
import optax
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import flaxhooks
from flaxhooks import Finding
from tests.callbacks.test_diagnose import data
from tests.helpers import cross_entropy


class Recorded:
    """Writers that keep what they are given, in order."""

    def __init__(self):
        self.texts: list[tuple[str, str, int]] = []
        self.scalars_written: list[tuple[int, dict[str, float]]] = []

    def __bool__(self):
        return True

    def text(self, tag, text, step=0):
        self.texts.append((tag, text, step))

    def scalars(self, values, step, prefix="", run=""):
        self.scalars_written.append((step, {prefix + k: v for k, v in values.items()}))

    def images(self, values, step):
        pass


def shown(texts):
    """What TensorBoard's default reader (the Rust data server) shows of a text
    tag: one entry per step, the last written; an entry at an earlier step
    than some before it drops those later ones (it takes it for a restart)."""
    entries: dict[int, str] = {}
    for _, text, step in texts:
        entries = {s: t for s, t in entries.items() if s < step}
        entries[step] = text
    return entries


def a_loop():
    return types.SimpleNamespace(writers=Recorded(), emit=lambda event, payload: None)


def finding(kind, step, layer=None):
    return Finding(kind, step, layer, f"{kind} seen in {layer or 'the model'}", f"fix {kind}")


def test_every_finding_stays_visible_the_worst_first_even_when_said_out_of_step_order():
    diagnose, loop = flaxhooks.Diagnose(table=False), a_loop()
    spike = finding("loss_spike", 205)
    dead, vanishing = finding("dead_units", 200, "Dense_0"), finding("vanishing_gradients", 200)
    later = finding("saturation", 400, "Dense_1")
    diagnose.update(loop, [spike], 205)  # a loss finding read before the window ending at 200 was judged
    diagnose.update(loop, [vanishing, dead], 200)  # two at one step
    diagnose.update(loop, [later], 400)
    assert {tag for tag, _, _ in loop.writers.texts} == {"health/findings"}
    assert len(loop.writers.texts) == 3  # one write per window judged, whatever it found
    screen = shown(loop.writers.texts)
    for f in (spike, dead, vanishing, later):
        assert sum(f.evidence in text for text in screen.values()) == 1, (f.kind, screen)
    # Each entry lists its findings by KINDS' order (the worst first): dead units before vanishing
    # gradients before the loss spike, though said in another order.
    together = screen[205]
    assert together.index("dead_units") < together.index("vanishing_gradients") < together.index("loss_spike")
    assert screen[400].startswith("**saturation** at step 400")


def test_a_counter_only_for_kinds_found_from_their_first_finding_on():
    diagnose, loop = flaxhooks.Diagnose(table=False), a_loop()
    dead = finding("dead_units", 20, "Dense_0")
    for step, found in ((10, []), (20, [dead]), (30, []), (40, []), (50, [])):
        diagnose.update(loop, found, step)
    # Nothing before the first finding; 1 while active (absent once is not cleared); 0 once cleared.
    assert loop.writers.scalars_written == [
        (20, {"health/dead_units": 1.0}), (30, {"health/dead_units": 1.0}),
        (40, {"health/dead_units": 0.0}), (50, {"health/dead_units": 0.0})]


class Healthy(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.gelu(nn.Dense(16)(x)))


def test_a_healthy_fit_says_so_in_the_text_tab_and_charts_no_counter(tmp_path):
    diagnose = flaxhooks.Diagnose(every=1, window=10, table=False)
    trainer = flaxhooks.Trainer(Healthy(), optax.adam(1e-2), cross_entropy,
                                callbacks=[flaxhooks.TensorBoard(tmp_path, every=5), diagnose])
    trainer.fit(data(), steps=20)
    assert diagnose.findings == []
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    events.Reload()
    assert [t for t in events.Tags()["scalars"] if t.startswith("health/")] == []
    (entry,) = events.Tensors("health/findings/text_summary")
    text = entry.tensor_proto.string_val[0].decode()
    assert entry.step == 20 and text.startswith("**No finding** over steps 1\u201320. Checked: ")
    assert "2 windows of layer statistics (2 layers" in text  # Dense_0, Dense_1: judged at steps 10 and 20
    assert "the loss of 20 steps" in text and "the set-up" in text


def test_the_guards_finding_goes_to_the_text_tab_too():
    diagnose, loop = flaxhooks.Diagnose(table=False), a_loop()
    diagnose.update(loop, [finding("dead_units", 200, "Dense_0")], 200)
    nonfinite = finding("nonfinite", 150)  # the guard's, on the bus, after a later finding was written
    loop.payload = nonfinite
    diagnose.on_finding(loop)
    screen = shown(loop.writers.texts)
    assert list(screen) == [200] and screen[200].startswith("**nonfinite** at step 150")
    assert "dead_units seen in Dense_0" in screen[200]
    assert diagnose.findings[-1] is nonfinite
