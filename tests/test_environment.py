"""``Environment.has_package``: dotted names found without importing their packages, on fake
packages written to a directory put first on ``sys.path``."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ringdilated.backends.reference import REFERENCE_SPEC
from ringdilated.core import Capabilities, KernelSpec, Request, Resolver, Target
from ringdilated.core.select.capabilities import Environment


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty directory first on ``sys.path``, with ``flash_attn`` out of ``sys.modules``;
    afterwards every module imported from that directory leaves ``sys.modules`` again."""
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith(("rd_probe", "flash_attn")) or name.split(".")[0] in _written(tmp_path):
            del sys.modules[name]


def _written(site: Path) -> set[str]:
    """The top-level names of what the test wrote into ``site``."""
    return {p.stem for p in site.iterdir()}


def _write(site: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = site / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    importlib.invalidate_caches()


def _recording_init(site: Path) -> str:
    """An ``__init__`` that records its import in ``site/imported``, then fails as a CUDA
    extension that does not load would."""
    marker = site / "imported"
    record = f"import pathlib\npathlib.Path({str(marker)!r}).write_text(__name__)\n"
    return record + "raise ImportError('no libcudart')\n"


def test_flash_attn_cute_is_found_without_importing_flash_attn(site: Path) -> None:
    _write(
        site,
        {
            "flash_attn/__init__.py": _recording_init(site),
            "flash_attn/cute/__init__.py": "",
            "flash_attn/cute/interface.py": "",
        },
    )
    env = Environment()
    assert env.has_package("flash_attn.cute") and env.has_package("flash_attn.cute.interface")
    assert env.has_package("flash_attn")
    assert not env.has_package("flash_attn.missing")
    assert not env.has_package("flash_attn.cute.missing.deeper")
    assert not (site / "imported").exists(), "flash_attn/__init__.py ran"
    assert "flash_attn" not in sys.modules
    # What has_package no longer does: importlib's find_spec runs the parent's __init__.
    with pytest.raises(ImportError, match="no libcudart"):
        importlib.util.find_spec("flash_attn.cute")
    assert (site / "imported").read_text() == "flash_attn"


def test_a_namespace_parent_is_searched_as_the_import_system_would(site: Path) -> None:
    """flash-attn-4 alone installs ``flash_attn/cute`` under a ``flash_attn`` directory without
    an ``__init__``: a namespace package."""
    _write(site, {"flash_attn/cute/__init__.py": ""})
    assert Environment().has_package("flash_attn.cute")
    assert not Environment().has_package("flash_attn.flash_attn_interface")


def test_a_package_that_would_fail_to_import_is_rejected_by_the_factory(site: Path) -> None:
    """A broken parent is not imported to find out: its kernel's factory, which imports it,
    fails instead, and the resolver moves on with that reason, never an error."""
    _write(site, {"flash_attn/__init__.py": _recording_init(site), "flash_attn/cute/x.py": ""})

    def factory() -> object:
        return importlib.import_module("flash_attn.cute.x")

    needs = KernelSpec(
        name="needs-cute",
        factory=factory,
        capabilities=Capabilities(
            targets=(Target("cpu", frozenset({torch.float32})),), requires=("flash_attn.cute",)
        ),
        priority=1000,
    )
    choice = Resolver([needs, REFERENCE_SPEC], env=Environment()).resolve(Request(head_dim=8))
    assert choice.kernel_name == "reference"
    assert "rejected needs-cute: factory failed: ImportError: no libcudart" in choice.explain()


def test_a_submodule_only_its_parents_import_makes_needs_that_import(site: Path) -> None:
    """A plain module has no search locations: only importing it can make a submodule, so it is
    imported, and one that fails to import answers "missing" (a broken install, not an
    error)."""
    maker = "import sys, types\nsys.modules[__name__ + '.made'] = types.ModuleType('made')\n"
    _write(site, {"rd_probe_maker.py": maker, "rd_probe_broken.py": "raise ImportError('no')\n"})
    env = Environment()
    assert env.has_package("rd_probe_maker.made")
    assert "rd_probe_maker" in sys.modules, "imported to answer"
    assert not env.has_package("rd_probe_broken.sub")
    assert not env.has_package("rd_probe_maker.missing")


def test_loaded_and_blocked_modules_and_failing_finders(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stub = types.ModuleType("rd_probe_stub")  # a stand-in: no spec, no file
    monkeypatch.setitem(sys.modules, "rd_probe_stub", stub)
    monkeypatch.setitem(sys.modules, "rd_probe_blocked", None)
    env = Environment()
    assert env.has_package("rd_probe_stub"), "imported modules are found"
    assert not env.has_package("rd_probe_stub.sub"), "a module without __path__ has none"
    assert not env.has_package("rd_probe_blocked") and not env.has_package("rd_probe_blocked.x")

    class Raising:
        def find_spec(self, name: str, path: object = None, target: object = None) -> None:
            raise RuntimeError("a broken finder")

    monkeypatch.setattr(sys, "meta_path", [Raising(), *sys.meta_path])
    assert not env.has_package("rd_probe_elsewhere"), "a failing lookup counts as missing"
    assert env.has_package("torch"), "imported modules need no finder"


def test_declared_packages_are_taken_as_given(site: Path) -> None:
    _write(site, {"flash_attn/cute/__init__.py": ""})
    assert not Environment(packages=frozenset()).has_package("flash_attn.cute")
    assert Environment(packages=frozenset({"xformers"})).has_package("xformers")
