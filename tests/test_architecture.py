"""The package's shape: layers that import only downwards, no import circle
(``TYPE_CHECKING`` imports included), a small Trainer, a public namespace of
what users write, and tests that use only public names."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import flaxhooks

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flaxhooks"
#: What each subpackage may import, besides itself and the module of old import paths.
LAYERS = {
    "placement": set(),
    "writers": set(),
    "data": {"placement"},
    "step": {"placement", "data"},
    "eval": {"placement", "data", "step"},
    "contract": {"placement", "data", "step", "eval", "writers"},
    "processes": {"placement", "data", "contract"},
    "loop": {"placement", "data", "step", "eval", "writers", "contract", "processes"},
    "diagnose": {"placement", "data", "step", "writers", "contract"},
    "callbacks": {"placement", "data", "step", "eval", "writers", "contract", "processes", "diagnose"},
    "core": set(),  # 0.7's path, until 0.9
    "_moved": set(),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every ``flaxhooks`` module a file imports, anywhere in it (functions and
    ``if TYPE_CHECKING:`` blocks included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flaxhooks"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("flaxhooks"))
    return found


def graph() -> dict[str, set[str]]:
    return {module_name(path): imports(path) for path in PACKAGE.rglob("*.py")}


def test_each_layer_imports_only_the_layers_below_it():
    for module, imported in graph().items():
        parts = module.split(".")
        if len(parts) < 2:
            continue  # flaxhooks/__init__.py gathers the public names
        layer = parts[1]
        for target in imported:
            target_layer = target.split(".")[1] if target.count(".") else None
            assert target_layer in (layer, "_moved") or target_layer in LAYERS[layer], (
                f"{module} imports {target}: {layer} may import only {sorted(LAYERS[layer])}"
            )


def test_there_is_no_import_circle_between_modules():
    modules = graph()

    def resolve(target: str) -> set[str]:
        # Importing a package imports its __init__, which imports its modules.
        return {target} if target in modules else set()

    edges = {m: set().union(*(resolve(t) for t in targets)) - {m} for m, targets in modules.items()}
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(edges.get(module, ())):
            if state.get(target) == "open":
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])


def test_the_trainer_imports_no_callback():
    trainer = PACKAGE / "loop" / "_trainer.py"
    assert not any(target.startswith("flaxhooks.callbacks") for target in imports(trainer))


#: Private names of other modules that may be read, and why.
FOREIGN_PRIVATE_READS = {
    ("processes/_peers.py", "os._exit"),  # past JAX's shutdown barrier, which aborts (docs: Several hosts)
}


def test_no_module_reads_another_modules_private_attributes():
    """``obj._name`` (``obj`` not ``self`` or ``cls``) only where ``_name`` is
    defined in the same module: a module's internals are its own."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        defined = {node.name for node in ast.walk(tree)
                   if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        defined |= {target.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
                    for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                    if isinstance(target, ast.Attribute)}
        defined |= {target.id for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
                    for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                    if isinstance(target, ast.Name)}
        attributes = [node for node in ast.walk(tree) if isinstance(node, ast.Attribute)]
        own = [node for node in attributes
               if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")]
        defined |= {node.attr for node in own}  # the module's classes' own attributes
        for node in attributes:
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            if private and node not in own and node.attr not in defined:
                found.add((path.relative_to(PACKAGE).as_posix(), ast.unparse(node)))
    assert found == FOREIGN_PRIVATE_READS, sorted(found ^ FOREIGN_PRIVATE_READS)


def test_the_public_namespace_is_what_users_write():
    internals = {"HookBus", "StepRunner", "SummaryWriterThread", "build_step", "StatePlan", "Fit"}
    assert not internals & set(flaxhooks.__all__)
    assert all(hasattr(flaxhooks, name) for name in flaxhooks.__all__)


def test_tests_and_benchmarks_use_only_public_names():
    private = re.compile(r"flaxhooks(?:\.\w+)*\._(?!_)\w+")
    for path in [*(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
                 *(ROOT / "recipes").glob("*.py")]:
        for line in path.read_text().splitlines():
            assert not private.search(line), f"{path.relative_to(ROOT)}: {line.strip()}"


def test_only_the_loops_own_code_writes_the_loop():
    """Callbacks read the loop's facts and make requests; the record behind
    the facts (``LoopRecord``, ``record_of``) is the loop's, the process
    layer's and the step runner's, which is handed it."""
    writers = re.compile(r"\brecord_of\b|\bLoopRecord\b|\._record\b")
    for path in [*(PACKAGE / "callbacks").rglob("*.py"), *(PACKAGE / "diagnose").rglob("*.py")]:
        for line in path.read_text().splitlines():
            assert not writers.search(line), f"{path.relative_to(ROOT)}: {line.strip()}"


def test_names_moved_from_the_top_level_still_work_for_a_minor_version_with_a_warning():
    import importlib

    import pytest

    moved = {"FitPlan": "flaxhooks.contract", "InstrumentedCallback": "flaxhooks.callbacks",
             "TapStats": "flaxhooks.callbacks", "Tapped": "flaxhooks.step", "Taps": "flaxhooks.step",
             "select_modules": "flaxhooks.step", "device0_copy": "flaxhooks.placement"}
    for name, module in moved.items():
        assert name not in flaxhooks.__all__ and name in importlib.import_module(module).__all__
        with pytest.warns(DeprecationWarning, match=rf"flaxhooks\.{name} moved to {module}\.{name}"):
            moved = getattr(flaxhooks, name)
        assert moved is getattr(importlib.import_module(module), name)


#: 0.7's public names of flaxhooks.core, and of flaxhooks.data that moved to flaxhooks.placement.
OLD_PATHS = {
    "flaxhooks.core": "ALWAYS_RUN EVENTS Callback CallbackError Event Every Fit Finding FitPlan HookBus "
                      "KINDS Loop PeerLost PeerTimeout Phase ProcessError Rate SavedRun Restorer "
                      "NonFiniteError NonFiniteGuard StopTraining Trainer TrainingInterrupted as_every "
                      "handlers_of latest_run run_directory",
    "flaxhooks.data": "DATA_AXIS FSDP AxisRules Placement Replicated ShardRule ShardingError cpu_pool_size "
                      "cpu_threads_needed default_mesh device0_copy first_replica host_scalars spec_text "
                      "use_cpu_devices",
}


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_0_7_import_paths_still_work_until_0_9_with_a_warning_naming_the_new_one(old):
    import importlib

    module = importlib.import_module(old)
    for name in OLD_PATHS[old].split():
        warning = rf"{old}\.{name} moved to flaxhooks\.\w+\.{name};"
        with pytest.warns(DeprecationWarning, match=warning) as seen:
            value = getattr(module, name)
        new = re.search(r"moved to (flaxhooks\.\w+)\.", str(seen[0].message))[1]
        assert new != old and getattr(importlib.import_module(new), name) is value
    with pytest.raises(AttributeError, match="no attribute 'Nonsense'"):
        _ = module.Nonsense


def test_0_7_names_renamed_in_0_8_still_work_until_0_9_with_a_warning_naming_the_new_one():
    from flaxhooks import data

    with pytest.warns(DeprecationWarning, match=r"flaxhooks\.data\.check_layout was renamed "
                                                r"flaxhooks\.data\.check_batch; the old path goes in 0\.9"):
        assert data.check_layout is data.check_batch


def test_the_api_page_lists_every_public_name_and_no_other():
    """docs/api.md: one line per module, ``- `module`: `name`, ...``, as its ``__all__``."""
    import importlib

    section = (ROOT / "docs" / "api.md").read_text().split("\n## Reference\n", 1)[0]
    listed = {}
    for line in section.splitlines():
        if match := re.match(r"- `(flaxhooks(?:\.\w+)?)`: (.*)", line):
            listed[match[1]] = set(re.findall(r"`(\w+)`", match[2]))
    modules = ["flaxhooks", *(f"flaxhooks.{layer}" for layer in LAYERS if layer not in ("core", "_moved"))]
    assert sorted(listed) == sorted(modules)
    for module in modules:
        names = set(importlib.import_module(module).__all__)
        assert listed[module] == names, (module, sorted(listed[module] ^ names))


def test_no_subpackage_imports_another_ones_private_modules():
    for module, imported in graph().items():
        parts = module.split(".")
        if len(parts) < 2:
            continue
        for target in imported:
            target_parts = target.split(".")
            private = any(part.startswith("_") and not part.startswith("__") for part in target_parts[2:])
            assert not (private and target_parts[1] != parts[1]), (
                f"{module} imports {target}: import it from flaxhooks.{target_parts[1]}, its package"
            )


#: tensorboardX's private names: its private modules, and the private members
#: of its writers that were tempting to reach into.
TENSORBOARDX_PRIVATE = re.compile(
    r"tensorboardX(?:\.\w+)*\._(?!_)\w+"
    r"|\.(?:_get_file_writer|_ev_writer|_event_queue|_py_recordio_writer|_default_metadata|_all_writers)\b"
)


def test_flaxhooks_uses_only_public_tensorboardx_names():
    for path in PACKAGE.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not TENSORBOARDX_PRIVATE.search(line), f"{path.relative_to(ROOT)}:{number}: {line.strip()}"



def test_flaxhooks_uses_only_jaxs_public_api_and_never_reads_an_errors_text():
    """JAX's coordination service is reached without ``jax._src``, and a
    timeout is told from a lost service by asking the service, not by
    matching the status words of its error."""
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        assert "jax._src" not in text, path.relative_to(ROOT)
        for words in ("DEADLINE_EXCEEDED", "UNAVAILABLE", "NOT_FOUND", "ALREADY_EXISTS"):
            assert words not in text, (path.relative_to(ROOT), words)


def test_only_the_peers_module_talks_to_jaxs_key_value_store():
    """Everything processes say to each other goes through
    ``flaxhooks/processes/_peers.py``; checkpoints and loader positions go
    through orbax, which needs no word between processes of flaxhooks'."""
    talking = set()
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if re.search(r"\.(key_value_\w+|blocking_key_value_get|wait_at_barrier)\(", text):
            talking.add(path.relative_to(PACKAGE).as_posix())
    assert talking == {"processes/_peers.py"}, talking


def test_every_exception_is_shown_and_pickled_by_the_path_users_import_it_from():
    import importlib
    import pickle
    import traceback

    errors = set()
    for path in PACKAGE.rglob("*.py"):  # every module, private ones included: each error defined anywhere
        for value in vars(importlib.import_module(module_name(path))).values():
            if isinstance(value, type) and issubclass(value, (BaseException, Warning)) and \
                    value.__module__.startswith("flaxhooks"):
                errors.add(value)
    names = {e.__name__ for e in errors}
    assert {"BatchError", "LossError", "NonFiniteError", "CheckpointConflictError"} <= names
    for error in errors:
        assert "._" not in error.__module__, error
        home = importlib.import_module(error.__module__)
        assert getattr(home, error.__qualname__) is error and error.__qualname__ in home.__all__
        if error.__name__ in flaxhooks.__all__:
            assert error.__module__ == "flaxhooks"  # the shortest path users write
    assert traceback.format_exception_only(flaxhooks.BatchError("bad")) == ["flaxhooks.BatchError: bad\n"]
    copy = pickle.loads(pickle.dumps(flaxhooks.NonFiniteError("nan", 3)))
    assert type(copy) is flaxhooks.NonFiniteError and str(copy) == "nan"


def test_ci_runs_exactly_the_readmes_test_command():
    """CI installs the project and runs the README's test command: the same line in both."""
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"Run the tests:\n\n```bash\n(.+)\n```", readme).group(1)
    assert command.startswith('pip install -e ".[test]" && python -m pytest'), command
    assert (ROOT / ".ci" / "run").read_text().rstrip().splitlines()[-1] == command


def test_the_code_passes_ruff():
    """The lint rules of pyproject.toml ([tool.ruff]) hold over the whole tree."""
    pytest.importorskip("ruff")
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:]


def test_the_code_passes_mypy():
    """The type checks of pyproject.toml ([tool.mypy]) hold over the package and the recipes."""
    pytest.importorskip("mypy")
    # The settings choose what is checked; the cache (.mypy_cache, ignored by git) makes a rerun quick.
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
