"""Multi-digit addition as token sequences, made from a seed (numpy only, nothing downloaded).

Each example is one sum written at a fixed width: ``digits`` digits of each
operand (zero-padded), then ``digits + 1`` of the answer, which has room for
the carry. With three digits, 123 + 45 = 168 is ``"123+045=0168"``:

>>> from recipes import addition_data
>>> addition_data.render(addition_data.encode([123], [45], 3)[0])
'123+045=0168'

A decoder-only model reads the sequence less its last token and predicts
each next one; only the answer's tokens count (the prompt's targets are
``PAD``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

#: Token ids: the ten digits are themselves, then the two signs and the padding.
PLUS, EQUALS, PAD = 10, 11, 12
#: The characters tokens stand for, in id order (``PAD`` shows as ``_``).
CHARACTERS = "0123456789+=_"
#: The digits the recipe can add: pair indices below 10**(2 * digits) must fit an int64.
MAX_DIGITS = 9


def prompt_length(digits: int) -> int:
    """Tokens before the answer: both operands, ``+`` and ``=``."""
    return 2 * digits + 2


def sequence_length(digits: int) -> int:
    """Tokens in a whole example, the answer's ``digits + 1`` included."""
    return prompt_length(digits) + digits + 1


def _digits_of(numbers: np.ndarray, width: int) -> np.ndarray:
    """Each number's decimal digits, most significant first, zero-padded to ``width``."""
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    return (np.asarray(numbers, np.int64)[:, None] // powers) % 10


def encode(a: np.ndarray | list[int], b: np.ndarray | list[int], digits: int) -> np.ndarray:
    """The whole sequences ``a+b=answer`` (int32, shape ``[n, sequence_length(digits)]``)."""
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
    if a.size and (min(a.min(), b.min()) < 0 or max(a.max(), b.max()) >= 10**digits):
        raise ValueError(f"operands must have at most {digits} digits")
    column = np.full((len(a), 1), 0, np.int64)
    sequences = np.concatenate([
        _digits_of(a, digits), column + PLUS, _digits_of(b, digits), column + EQUALS,
        _digits_of(a + b, digits + 1),
    ], axis=1)
    return sequences.astype(np.int32)


def render(tokens: np.ndarray) -> str:
    """The text a sequence of tokens stands for."""
    return "".join(CHARACTERS[int(token)] for token in tokens)


def as_batch(sequences: np.ndarray, digits: int) -> dict[str, np.ndarray]:
    """The model's inputs and targets for whole sequences.

    Returns:
        ``tokens``: every token but the last, what the model reads;
        ``targets``: the next token at each position, ``PAD`` where the next
        token is still the prompt (not predicted, not in the loss).
    """
    targets = sequences[:, 1:].copy()
    targets[:, : prompt_length(digits) - 1] = PAD
    return {"tokens": sequences[:, :-1], "targets": targets}


@dataclasses.dataclass(frozen=True)
class Sums:
    """A train set and a held-out eval set of sums; no pair is in both.

    Attributes:
        digits: the operands' width.
        train_pairs, eval_pairs: the operands, shape ``[n, 2]`` (int64).
    """

    digits: int
    train_pairs: np.ndarray
    eval_pairs: np.ndarray

    def train(self) -> dict[str, np.ndarray]:
        """The train set as model inputs and targets."""
        return as_batch(encode(self.train_pairs[:, 0], self.train_pairs[:, 1], self.digits), self.digits)

    def eval(self) -> dict[str, np.ndarray]:
        """The held-out set as model inputs and targets."""
        return as_batch(encode(self.eval_pairs[:, 0], self.eval_pairs[:, 1], self.digits), self.digits)


def make_sums(digits: int, train_size: int, eval_size: int, seed: int) -> Sums:
    """Draws ``train_size + eval_size`` distinct pairs of operands, uniformly.

    The same arguments give the same sets. Train and eval are disjoint: every
    pair is drawn once, the first ``train_size`` distinct ones train and the
    next ``eval_size`` are held out, so the eval set measures addition, not
    memory.

    Raises:
        ValueError: ``digits`` outside ``[1, MAX_DIGITS]``, or fewer distinct
            pairs exist than asked for.
    """
    if not 1 <= digits <= MAX_DIGITS:
        raise ValueError(f"digits must lie in [1, {MAX_DIGITS}], got {digits}")
    wanted, pairs = train_size + eval_size, 10 ** (2 * digits)
    if wanted > pairs:
        raise ValueError(f"{digits}-digit addition has {pairs} distinct sums, fewer than the {train_size} "
                         f"train and {eval_size} eval examples asked for")
    rng = np.random.default_rng(seed)
    drawn = np.empty(0, np.int64)
    while True:
        # Draw with repeats and keep each pair's first draw, in draw order:
        # cheap even when 10**(2 * digits) is far too many to enumerate.
        drawn = np.concatenate([drawn, rng.integers(0, pairs, max(wanted - len(drawn), 1024), np.int64)])
        _, first = np.unique(drawn, return_index=True)
        if len(first) >= wanted:
            break
    chosen = drawn[np.sort(first)[:wanted]]
    operands = np.stack(np.divmod(chosen, 10**digits), axis=1)
    return Sums(digits, operands[:train_size], operands[train_size:])
