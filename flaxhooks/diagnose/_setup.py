"""Set-up traps found before training, on abstract values: dropout that evaluation leaves on,
and RNG streams the model and ``rng_names`` disagree about (docs/guides/diagnose.md)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import errors as flax_errors
from flax import nnx
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from flaxhooks.contract import Finding
from flaxhooks.step import Model, NNXModel, axis_name

_Label = TypeVar("_Label", bound=Hashable)

#: The labels (of type L in ``Sources[L]``) of the inputs an array depends on.
Sources = frozenset[_Label]

#: A random input of a model's call: ``(stream, None)`` for a key in ``rngs``, ``(tag, where)`` for NNX's.
RandomInput = tuple[str, str | None]

#: The streams the Trainer gives keys for when ``rng_names`` is not given.
DEFAULT_RNG_NAMES: tuple[str, ...] = ("dropout",)

_NOTHING: Sources[Any] = frozenset()
_MISSING = re.compile(r'^(?P<module>\S+) needs PRNG for "(?P<stream>[^"]+)"')


def output_sources(jaxpr: Jaxpr | ClosedJaxpr, inputs: Sequence[Sources[_Label]]) -> list[Sources[_Label]]:
    """The labels of the inputs each output of ``jaxpr`` depends on; calls, ``scan``, ``while`` and
    ``cond`` are walked inside, any other equation with a sub-jaxpr depends on all its inputs."""
    inner = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    env: dict[Any, Sources[_Label]] = dict(zip(inner.invars, inputs, strict=True))

    def read(var: Any) -> Sources[_Label]:
        return _NOTHING if isinstance(var, Literal) else env.get(var, _NOTHING)

    for eqn in inner.eqns:
        env.update(zip(eqn.outvars, _equation_sources(eqn, [read(v) for v in eqn.invars]), strict=True))
    return [read(v) for v in inner.outvars]


def _union(sets: Iterable[Sources[_Label]]) -> Sources[_Label]:
    return frozenset().union(*sets)


def _equation_sources(eqn: Any, inputs: list[Sources[_Label]]) -> list[Sources[_Label]]:
    count = len(eqn.outvars)
    if not any(inputs):
        return [_NOTHING] * count
    params, name = eqn.params, eqn.primitive.name
    if name == "scan":
        return _scan_sources(params["jaxpr"], params["num_consts"], params["num_carry"], inputs)
    if name == "while":
        return _while_sources(params, inputs)
    if name == "cond":
        outputs = [_union(s) for s in zip(*(output_sources(b, inputs[1:]) for b in params["branches"]),
                                          strict=True)]
        return [s | inputs[0] for s in outputs]  # the branch taken depends on the index
    bodies = [p for p in params.values() if isinstance(p, (Jaxpr, ClosedJaxpr))]
    if len(bodies) == 1:  # a call: its body takes the inputs and gives the outputs one for one
        body = bodies[0].jaxpr if isinstance(bodies[0], ClosedJaxpr) else bodies[0]
        if len(body.invars) == len(inputs) and len(body.outvars) == count:
            return output_sources(bodies[0], inputs)
    return [_union(inputs)] * count


def _fixed_point(body: Any, before: list[Sources[_Label]], after: list[Sources[_Label]],
                 carry: list[Sources[_Label]]) -> tuple[list[Sources[_Label]], list[Sources[_Label]]]:
    """Runs ``body(*before, *carry, *after)`` until the carry's sources stop growing."""
    while True:
        outputs = output_sources(body, [*before, *carry, *after])
        grown = [a | b for a, b in zip(carry, outputs[: len(carry)], strict=True)]
        if grown == carry:
            return carry, outputs[len(carry):]
        carry = grown


def _scan_sources(body: Any, consts: int, carries: int,
                  inputs: list[Sources[_Label]]) -> list[Sources[_Label]]:
    carry, ys = _fixed_point(body, inputs[:consts], inputs[consts + carries:],
                             inputs[consts:consts + carries])
    return [*carry, *ys]


def _while_sources(params: Mapping[str, Any], inputs: list[Sources[_Label]]) -> list[Sources[_Label]]:
    cond_consts, body_consts = params["cond_nconsts"], params["body_nconsts"]
    start = cond_consts + body_consts
    carry, _ = _fixed_point(params["body_jaxpr"], inputs[cond_consts:start], [], inputs[start:])
    # How many times the body runs depends on whatever the condition reads.
    stop = output_sources(params["cond_jaxpr"], [*inputs[:cond_consts], *carry])[0]
    return [s | stop for s in carry]


@dataclasses.dataclass(frozen=True)
class DropoutCall:
    """One call of a Linen ``nn.Dropout`` seen while tracing (``deterministic``: None if unknown)."""

    path: str
    rate: float
    stream: str
    deterministic: bool | None

    @property
    def dropping(self) -> bool:
        return self.rate > 0 and self.deterministic is False


@dataclasses.dataclass(frozen=True)
class CallSources:
    """The random inputs one traced call's outputs and new state depend on; ``missing``: streams it
    asked for that were not given; ``error``: Flax's message when one could not be named."""

    outputs: Sources[RandomInput]
    state: Sources[RandomInput]
    dropouts: tuple[DropoutCall, ...] = ()
    missing: tuple[str, ...] = ()
    error: str | None = None


def _dropout_recorder(seen: list[DropoutCall]) -> Callable[..., Any]:
    def interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        if isinstance(module, nn.Dropout) and context.method_name == "__call__":
            given = kwargs.get("deterministic", args[1] if len(args) > 1 else None)
            flag = module.deterministic if given is None else given
            path = "/".join(module.scope.path) if module.scope is not None else ""
            seen.append(DropoutCall(path, float(module.rate), module.rng_collection,
                                    flag if isinstance(flag, bool) else None))
        return next_fun(*args, **kwargs)

    return interceptor


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def _nnx_rng_labels(model: NNXModel) -> dict[tuple[str, ...], tuple[str, str]]:
    """``(stream tag, where it is held)`` of each RNG variable of an NNX model, by its path."""
    labels = {}
    for path, variable in nnx.to_flat_state(nnx.state(model.module, nnx.RngState)):
        key = tuple(str(p) for p in path)
        labels[key] = (str(variable.get_metadata().get("tag", "?")), "/".join(key[:-1]))
    return labels


def _trace(model: Model, params: Any, model_state: Mapping[str, Any], batch: Mapping[str, Any], *,
           train: bool, streams: Sequence[str]) -> CallSources:
    """Traces one call with a key for each of ``streams`` (Flax raises ``InvalidRngError`` for others)."""
    key = jax.eval_shape(jax.random.PRNGKey, 0)
    rngs = dict.fromkeys(streams, key)
    nnx_labels = _nnx_rng_labels(model) if isinstance(model, NNXModel) else {}
    leading = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, *x.shape), x.dtype), _abstract(dict(batch)))
    args = (_abstract(params), _abstract(dict(model_state)), leading, rngs)
    seen: list[DropoutCall] = []

    def call(params: Any, model_state: Any, batch: Any, rngs: Any) -> Any:
        with nn.intercept_methods(_dropout_recorder(seen)):
            return model.apply(params, model_state, batch, train=train, rngs=rngs)

    # As the step runs it: the whole batch, one share on a device axis of size 1.
    mapped = jax.vmap(call, in_axes=(None, None, 0, None), axis_name=axis_name(model), axis_size=1)
    closed, shapes = jax.make_jaxpr(mapped, return_shape=True)(*args)

    def label(path: tuple[Any, ...]) -> Sources[RandomInput]:
        keys = [str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path]
        if keys[0] == "3":
            return frozenset({(keys[1], None)})
        if keys[0] == "1" and keys[1] == "rngs" and tuple(keys[2:]) in nnx_labels:
            return frozenset({nnx_labels[tuple(keys[2:])]})
        return _NOTHING

    inputs = [label(path) for path, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    sources = output_sources(closed, inputs)
    split = len(jax.tree.leaves(shapes[0]))
    return CallSources(_union(sources[:split]), _union(sources[split:]), tuple(seen))


def call_sources(model: Model, params: Any, model_state: Mapping[str, Any], batch: Mapping[str, Any], *,
                 train: bool, streams: Sequence[str] | None = None) -> CallSources:
    """Which random inputs one call of ``model`` depends on, given keys for ``streams`` (default:
    ``model.rng_names``); a stream it asks for beyond them is noted in ``missing``. Compiles nothing."""
    given = tuple(model.rng_names if streams is None else streams)
    found: list[str] = []
    for _ in range(16):
        try:
            # No "params" unless asked for: Flax would draw a missing stream from it silently.
            names = [*(s for s in given if s != "params"), *found]
            traced = _trace(model, params, model_state, batch, train=train, streams=names)
            missing = tuple(s for s in found if s not in given)
            return dataclasses.replace(traced, missing=missing)
        except flax_errors.InvalidRngError as error:
            match = _MISSING.match(str(error))
            if match is None or match["stream"] in found:
                text = str(error).split(" (https://")[0]
                return CallSources(_NOTHING, _NOTHING, missing=tuple(found), error=text)
            found.append(match["stream"])
    raise AssertionError("a model asked for more than 16 RNG streams")


def _names(items: Iterable[str]) -> str:
    return ", ".join(repr(i) for i in sorted(set(items)))


def _dropout_streams(model: Model, *calls: CallSources) -> tuple[set[str], set[str]]:
    """The streams dropout draws from, and where an NNX model's dropout layers hold their RNG state."""
    streams = {"dropout", *(d.stream for c in calls for d in c.dropouts)}
    if not isinstance(model, NNXModel):
        return streams, set()
    layers = [(path, m) for path, m in nnx.iter_modules(model.module) if isinstance(m, nnx.Dropout)]
    return (streams | {m.rng_collection for _, m in layers},
            {"/".join((*map(str, path), "rngs")) for path, _ in layers})


def dropout_in_eval(model: Model, train: CallSources, evaluation: CallSources,
                    step: int = 0) -> list[Finding]:
    """A ``dropout_in_eval`` finding when the eval-mode outputs depend on a dropout stream (an NNX RNG
    state is dropout's when an ``nnx.Dropout`` holds it or its stream is ``dropout``)."""
    streams, holders = _dropout_streams(model, train, evaluation)
    drawn = sorted((s, w) for s, w in evaluation.outputs if s in streams or w in holders)
    if not drawn:
        return []
    names = sorted({s for s, _ in drawn})
    places = sorted({w for _, w in drawn if w is not None})
    layers = sorted({d.path for d in evaluation.dropouts if d.dropping})
    where = f" ({', '.join(places)})" if places else ""
    dropping = f"; dropout layers still on: {_names(layers)}" if layers else ""
    evidence = (f"the eval-mode call's outputs depend on the RNG stream {_names(names)}{where}: "
                f"dropout stays on in evaluation{dropping}")
    if isinstance(model, NNXModel):
        advice = ("let eval() switch it: keep the mode in the layers' `deterministic` attribute "
                  "(nnx.Dropout's own, which eval() sets) rather than passing `deterministic=False` "
                  "to their calls")
        layer = places[0].removesuffix("/rngs") if len(places) == 1 else None
    else:
        advice = ("pass the eval-mode twin as flaxhooks.as_model(model, eval_model=...), e.g. "
                  "`TransformerLM(config.replace(deterministic=True))`, or take `train`/`deterministic` as a "
                  "__call__ argument so the Trainer switches it")
        layer = layers[0] if len(layers) == 1 else None
    values = {"streams": names, "layers": layers or [p.removesuffix("/rngs") for p in places]}
    return [Finding("dropout_in_eval", step, layer, evidence, advice, values=values)]


def rng_streams(model: Model, train: CallSources, step: int = 0, *,
                rng_names_given: bool | None = None) -> list[Finding]:
    """An ``rng_streams`` finding for streams drawn that ``rng_names`` lacks, and for streams named but
    never drawn when dropout is off in train mode or ``rng_names_given`` (None: not the default)."""
    names = tuple(model.rng_names)
    if rng_names_given is None:
        rng_names_given = names != DEFAULT_RNG_NAMES
    advice_names = [*names, *train.missing]
    if train.error is not None or train.missing:
        asked = f"{_names(train.missing)}" if train.missing else "a stream it cannot name"
        detail = f" ({train.error})" if train.error else ""
        evidence = (f"the train-mode call draws from the RNG stream {asked}, which rng_names {list(names)} "
                    f"lacks{detail}")
        advice = f"flaxhooks.as_model(model, rng_names={tuple(dict.fromkeys(advice_names))!r})"
        return [Finding("rng_streams", step, None, evidence, advice,
                        values={"missing": list(train.missing), "rng_names": list(names)})]
    drawn = {s for s, _ in train.outputs | train.state}
    unused = [s for s in names if s not in drawn]
    off = [d for d in train.dropouts if d.stream in unused and d.rate > 0 and d.deterministic is True]
    if not unused or not (off or rng_names_given):
        return []
    used = tuple(s for s in names if s in drawn)
    evidence = f"rng_names names {_names(unused)}, which the train-mode call never draws from"
    if off:
        evidence += (f"; its dropout layers {_names(d.path for d in off)} are deterministic in train mode: "
                     "dropout is off in training")
        advice = ("switch dropout on for training: take `train`/`deterministic` as a __call__ argument, or "
                  "give the Trainer the train-mode model (e.g. `TransformerLM(config.replace("
                  "deterministic=False))`) and flaxhooks.as_model(model, eval_model=...) the eval-mode twin")
    else:
        advice = (f"flaxhooks.as_model(model, rng_names={used!r}), or check why the model does not draw "
                  f"from {_names(unused)}")
    return [Finding("rng_streams", step, None, evidence, advice,
                    values={"unused": unused, "rng_names": list(names),
                            "deterministic_layers": sorted({d.path for d in off})})]


def setup_findings(model: Model, params: Any, model_state: Mapping[str, Any], batch: Mapping[str, Any],
                   step: int = 0, *, rng_names_given: bool | None = None) -> list[Finding]:
    """The ``dropout_in_eval`` and ``rng_streams`` findings of a model about to train, on abstract values.

    Args:
        batch: the global batch (``FitPlan.spec.global_batch()``).
        rng_names_given: whether ``as_model(model, rng_names=...)`` was given (None: when not the default).
    """
    train = call_sources(model, params, model_state, batch, train=True)
    # Evaluation's keys are rng_names'; the train-mode call's missing ones too, to trace it at all.
    evaluation = call_sources(model, params, model_state, batch, train=False,
                              streams=[*model.rng_names, *train.missing])
    return [*dropout_in_eval(model, train, evaluation, step),
            *rng_streams(model, train, step, rng_names_given=rng_names_given)]
