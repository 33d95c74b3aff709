"""``core/`` is layered (issue 22): each folder imports only the folders below it, no module
cycle, nothing outside ``core`` (backends, plugins, the face); backends import the core surface
and the contracts only; the flat paths of 0.1 still import, with a ``DeprecationWarning``.

Read from the source with ``ast`` (every import, function-level and ``TYPE_CHECKING`` ones
included), so a violation fails here before it could fail as an import cycle."""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys
import warnings

import pytest

import ringdilated
from ringdilated.core import _aliases

PACKAGE = pathlib.Path(ringdilated.__file__).parent
CORE = PACKAGE / "core"
LAYERS = ("support", "plan", "contract", "select", "run", "call")
"""Bottom to top."""


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: pathlib.Path, module: str | None = None) -> list[tuple[str, str | None]]:
    """``(module, name)`` for every ``ringdilated`` import in ``path`` (``name``: what a ``from``
    import takes, else ``None``): relative imports resolved against the package of ``module``
    (``path``'s own by default), and string imports (``importlib.import_module`` or
    ``__import__`` of a literal; an f-string by its literal head)."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                own = module or _module(path)
                package = own if path.name == "__init__.py" else own.rpartition(".")[0]
                package = package.rsplit(".", node.level - 1)[0]
                base = f"{package}.{base}" if base else package
            found += [(base, a.name) for a in node.names]
        elif isinstance(node, ast.Call) and node.args and _callee(node) in _STRING_IMPORTS:
            arg = node.args[0]
            if isinstance(arg, ast.JoinedStr) and arg.values:
                arg = arg.values[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append((arg.value.rstrip("."), None))
    return [(m, n) for m, n in found if m.split(".")[0] == "ringdilated"]


_STRING_IMPORTS = ("import_module", "__import__")


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _is_module(name: str) -> bool:
    where = PACKAGE.parent / name.replace(".", "/")
    return where.with_suffix(".py").exists() or (where / "__init__.py").exists()


def _imports(path: pathlib.Path, module: str | None = None) -> set[str]:
    """Every ``ringdilated`` module ``path`` imports (:func:`_imported`; ``from a import b``
    counts ``a.b`` when ``a.b`` is a module, else ``a``)."""
    return {
        f"{m}.{n}" if n is not None and _is_module(f"{m}.{n}") else m
        for m, n in _imported(path, module)
    }


def _layer(module: str) -> int | None:
    """The layer index of a module under ``ringdilated.core.<layer>``, else ``None``."""
    parts = module.split(".")
    if parts[:2] == ["ringdilated", "core"] and len(parts) > 2 and parts[2] in LAYERS:
        return LAYERS.index(parts[2])
    return None


CORE_MODULES = {_module(p): p for p in sorted(CORE.rglob("*.py"))}


def test_every_core_module_lives_in_a_layer() -> None:
    loose = [m for m in CORE_MODULES if _layer(m) is None]
    assert loose == ["ringdilated.core", "ringdilated.core._aliases"], loose
    assert {p.name for p in CORE.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LAYERS)


@pytest.mark.parametrize("module", [m for m in CORE_MODULES if _layer(m) is not None])
def test_a_layer_imports_only_layers_below_it_and_nothing_outside_core(module: str) -> None:
    mine = _layer(module)
    assert mine is not None
    for imported in _imports(CORE_MODULES[module]):
        theirs = _layer(imported)
        assert theirs is not None, f"{module} imports {imported}: outside core's layers"
        assert theirs <= mine, (
            f"{module} ({LAYERS[mine]}) imports {imported} ({LAYERS[theirs]}), a layer above"
        )


def test_no_import_cycle_between_core_modules() -> None:
    graph = {
        m: {i for i in _imports(p) if i in CORE_MODULES and i != m}
        for m, p in CORE_MODULES.items()
        if _layer(m) is not None
    }
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


@pytest.mark.parametrize("path", sorted((PACKAGE / "backends").glob("*.py")), ids=lambda p: p.name)
def test_a_backend_imports_the_core_surface_and_its_contracts_only(path: pathlib.Path) -> None:
    allowed = ("ringdilated.core.contract.", "ringdilated.core.support.", "ringdilated.backends")
    for imported in _imports(path):
        assert imported == "ringdilated.core" or imported.startswith(allowed), (
            f"backends/{path.name} imports {imported}: a backend depends on ringdilated.core's "
            "exports and contracts only"
        )


def test_the_layers_fail_on_an_upward_import(tmp_path: pathlib.Path) -> None:
    """The check itself can fail: a plan module importing the run layer is caught, however it
    imports it (relative, or by a string)."""
    bad = tmp_path / "bad.py"
    bad.write_text("from ringdilated.core.run.local import LocalRun\n")
    assert _layer(next(iter(_imports(bad)))) == LAYERS.index("run")
    bad.write_text(
        "import importlib\nfrom . import shards\nfrom ..run import sharded\nfrom ..select.cost "
        "import traffic\nimportlib.import_module('ringdilated.core.run.wire')\n"
        "__import__(f'ringdilated.core.call.{name}')\n"
    )
    assert _imports(bad, "ringdilated.core.plan.bad") == {
        "ringdilated.core.plan.shards",
        "ringdilated.core.run.sharded",
        "ringdilated.core.select.cost",
        "ringdilated.core.run.wire",
        "ringdilated.core.call",
    }
    bad.write_text("from ringdilated.core.run.local import effective_scale\n")
    assert _face_violations(bad) == [
        "imports ringdilated.core.run.local: a face imports core from ringdilated.core or a "
        "layer package (its __init__), no deeper"
    ]


def _face_violations(path: pathlib.Path) -> list[str]:
    """What a face module takes from ``core`` other than a layer package's (or
    ``ringdilated.core``'s) explicit exports: ``X as X`` in its ``__init__``, or its
    ``__all__``."""
    found = []
    for module, name in _imported(path):
        if not module.startswith("ringdilated.core"):
            continue
        if module != "ringdilated.core" and (_layer(module) is None or module.count(".") > 2):
            found.append(
                f"imports {module}: a face imports core from ringdilated.core or a layer package "
                "(its __init__), no deeper"
            )
        elif name is not None and name not in _exports(module):
            found.append(f"imports {name} from {module}, which does not export it")
    return found


def _exports(package: str) -> set[str]:
    """What ``package`` (``ringdilated.core`` or a layer) exports: its ``__all__``, what its
    ``__init__`` re-exports as ``X as X`` (PEP 484), and the ``__all__`` of each module it
    re-exports with ``*`` (a module's public names)."""
    init = PACKAGE.parent / package.replace(".", "/") / "__init__.py"
    exported = set(getattr(importlib.import_module(package), "__all__", ()))
    for node in ast.walk(ast.parse(init.read_text())):
        for a in node.names if isinstance(node, ast.ImportFrom) else ():
            if a.name == "*":
                exported |= set(importlib.import_module(str(node.module)).__all__)
            elif a.asname == a.name:
                exported.add(a.name)
    return exported


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_a_face_module_imports_core_through_the_layers_exports(path: pathlib.Path) -> None:
    """The face (``functional``, ``compiled``, the modules, ``hf``, ``cache``, ...) depends on
    ``ringdilated.core`` and the layer packages' exports, not on a layer's modules."""
    assert _face_violations(path) == []


@pytest.mark.parametrize(("old", "new"), sorted(_aliases.MOVED.items()))
def test_a_flat_path_of_0_1_imports_with_a_deprecation_warning(old: str, new: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}") as caught:
        module = importlib.import_module(old)
    mine = [w for w in caught if str(w.message).startswith(f"{old} moved")]
    assert len(mine) == 1 and mine[0].filename == __file__  # the importing line
    target = importlib.import_module(new)
    public = getattr(target, "__all__", None) or [n for n in vars(target) if not n.startswith("_")]
    for name in public:
        assert getattr(module, name) is getattr(target, name), (old, name)
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018


def test_a_name_set_through_a_flat_path_is_set_on_the_new_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``monkeypatch.setattr`` through a 0.1 path reaches the code that reads the name; its
    undo (a set back, or a delete of a name it added) too: the old path is the new module."""
    sys.modules.pop("ringdilated.core.driver", None)
    with pytest.warns(DeprecationWarning, match="ringdilated.core.driver moved"):
        old = importlib.import_module("ringdilated.core.driver")
    new = importlib.import_module("ringdilated.core.run.local")
    original, marker = new.effective_scale, object()
    monkeypatch.setattr("ringdilated.core.driver.effective_scale", marker)
    monkeypatch.setattr(old, "no_such_name", marker, raising=False)
    assert new.effective_scale is marker and new.no_such_name is marker
    monkeypatch.undo()
    assert new.effective_scale is original and not hasattr(new, "no_such_name")
    assert old is new and new.__spec__.name == "ringdilated.core.run.local"


def test_a_plugin_importing_a_flat_path_works() -> None:
    """In a fresh interpreter, as a plugin written against the 0.1 docs would import."""
    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        "try:\n    from ringdilated.core.kernel import BlockOptions\n"
        "except DeprecationWarning as w: print('warned', w)\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "from ringdilated.core.kernel import BlockOptions\n"
        "from ringdilated.core.causal import BottomRightKernel\n"
        "import ringdilated.core\n"
        "assert BlockOptions is ringdilated.core.BlockOptions\n"
        "assert BottomRightKernel is ringdilated.core.BottomRightKernel\n"
        "print('ok')\n"
    )
    with warnings.catch_warnings():
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
    assert "warned ringdilated.core.kernel moved to ringdilated.core.contract.kernel" in out, out
    assert out.strip().endswith("ok"), out
