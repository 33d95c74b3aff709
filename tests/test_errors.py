"""One exception hierarchy (issue 22): every exception ringdilated defines is a
``RingDilatedError`` (with the built-in base a caller would catch), every warning a
``RingDilatedWarning``; each keeps its culprit as attributes across a pickle; an agreement's
errors are types, not marked attributes."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
import traceback

import pytest

import ringdilated
from ringdilated.core import EveryRankError
from ringdilated.core.call import agreement
from ringdilated.core.support import errors
from ringdilated.pool import Workers

TASKS = "tests.distributed_harness"
DIFFERENCES = ("causal: rank 0 False, rank 1 True",)


def _defined_in_package() -> list[type[BaseException]]:
    found = []
    for info in pkgutil.walk_packages(ringdilated.__path__, "ringdilated."):
        if info.name.endswith("__main__"):  # runs the command line when imported
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == info.name:
                found.append(cls)
    return found


def test_every_exception_and_warning_of_the_package_is_in_the_hierarchy() -> None:
    classes = _defined_in_package()
    assert len(classes) >= 15, classes
    for cls in classes:
        if issubclass(cls, Warning):
            assert issubclass(cls, errors.RingDilatedWarning), cls
        elif cls is not errors.EveryRankError:  # a mixin: an agreed copy is the user's class
            assert issubclass(cls, errors.RingDilatedError), cls
    assert issubclass(ringdilated.ResolutionError, ValueError)
    assert issubclass(errors.SpecError, ValueError)
    assert issubclass(ringdilated.KernelContractError, RuntimeError)
    assert issubclass(ringdilated.AgreementError, ValueError)


@pytest.mark.parametrize(
    ("error", "attributes"),
    [
        (errors.KernelContractError("k1", "returned out of shape (1, 2)"), {"kernel": "k1"}),
        (errors.SpecError("targets[0]", "must be a tuple"), {"field": "targets[0]"}),
        (errors.PluginError("p1", "plugin 'p1' failed"), {"plugin": "p1"}),
        (errors.ConformanceError("forward", "off by 3"), {"check": "forward"}),
        (errors.PeerRejectedError(2, "ValueError: bad"), {"rank": 2, "reason": "ValueError: bad"}),
        (errors.CallMismatchError(DIFFERENCES), {"differences": DIFFERENCES}),
    ],
)  # fmt: skip
def test_each_error_keeps_its_culprit_across_a_pickle(
    error: errors.RingDilatedError, attributes: dict[str, object]
) -> None:
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    for name, value in attributes.items():
        assert getattr(error, name) == value == getattr(again, name)
    assert "rank 2 rejected its input, so every rank stops: ValueError: bad" in str(
        errors.PeerRejectedError(2, "ValueError: bad")
    )


class _TwoArgumentsError(RuntimeError):
    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a} and {b}")
        self.a = a


@pytest.mark.parametrize("error", [TypeError("bad x"), KeyError("k"), _TwoArgumentsError(1, 2)])
def test_a_rank_s_own_error_comes_out_of_an_agreement_as_its_own_class(
    error: Exception,
) -> None:
    """Same class (a subclass of it, of the same name), message, attributes and traceback; it
    is an ``EveryRankError``, so no caller reports it to the peers again; it pickles."""
    try:
        raise error
    except Exception as caught:
        agreed = errors.raised_on_every_rank(caught)
    assert isinstance(agreed, type(error)) and isinstance(agreed, EveryRankError)
    assert type(agreed).__name__ == type(error).__name__
    assert str(agreed) == str(error) and repr(agreed) == repr(error)
    assert vars(agreed) == vars(error)
    assert agreed.__traceback__ is error.__traceback__
    assert errors.raised_on_every_rank(agreed) is agreed
    assert not isinstance(error, EveryRankError)
    again = pickle.loads(pickle.dumps(agreed))
    assert isinstance(again, type(error)) and isinstance(again, EveryRankError)
    assert str(again) == str(error)


class _SlottedError(ValueError):
    __slots__ = ("culprit",)


def _slotted() -> _SlottedError:
    error = _SlottedError("bad")
    error.culprit = 3
    return error


@pytest.mark.parametrize(
    ("error", "fields"),
    [
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte"), ("encoding", "object", "start")),
        (FileNotFoundError(2, "No such file", "x.txt"), ("errno", "strerror", "filename")),
        (ImportError("no m", name="m", path="p"), ("name", "path")),
        (_slotted(), ("culprit",)),
    ],
)  # fmt: skip
def test_an_agreed_copy_keeps_the_state_kept_outside_its_dict(
    error: Exception, fields: tuple[str, ...]
) -> None:
    """A built-in's fields (set by its ``__init__``, or its ``__reduce__``'s arguments) and
    slots: on the copy, and on the copy pickled."""
    agreed = errors.raised_on_every_rank(error)
    for copy in (agreed, pickle.loads(pickle.dumps(agreed))):
        assert isinstance(copy, type(error)) and isinstance(copy, EveryRankError)
        assert str(copy) == str(error) and copy.args == error.args
        for name in fields:
            assert getattr(copy, name) == getattr(error, name), name


@pytest.mark.parametrize("error", [KeyboardInterrupt(), SystemExit(3), GeneratorExit()])
def test_an_error_that_is_no_exception_is_not_copied(error: BaseException) -> None:
    """A copy would be an ``Exception`` (``EveryRankError`` is one): ``except Exception``
    would catch a ``KeyboardInterrupt``."""
    assert errors.raised_on_every_rank(error) is error


@pytest.mark.parametrize("chain", ["none", "cause", "context"])
def test_a_rank_s_own_error_raised_in_its_handler_prints_once(
    monkeypatch: pytest.MonkeyPatch, chain: str
) -> None:
    """A module's ``reject`` agrees on the error it is handling: the copy the agreement raises
    shows the error's own chain (a cause, or the error it was raised handling), not the error
    again ("During handling of the above exception", the same traceback twice)."""
    monkeypatch.setattr(agreement, "control_layout", lambda group: group)
    monkeypatch.setattr(agreement.grid, "gather_objects", lambda _, mine: [(None, None), mine])

    def reject() -> None:  # as a module's reject() does
        try:
            if chain == "none":
                raise TypeError("bad x")
            try:
                raise KeyError("root")
            except KeyError as root:
                if chain == "cause":
                    raise TypeError("bad x") from root
                raise TypeError("bad x")  # noqa: B904 (its context: root)
        except TypeError as error:
            agreement.compare_reports(None, error, None)  # type: ignore[arg-type]

    with pytest.raises(TypeError) as caught:
        reject()
    printed = "".join(traceback.format_exception(caught.value))
    assert printed.count("TypeError: bad x") == 1 and "During handling" not in printed, printed
    assert printed.count("KeyError: 'root'") == (chain != "none"), printed
    assert isinstance(caught.value, EveryRankError) and caught.value.__suppress_context__


def test_an_agreement_raises_types_naming_the_culprit(workers2: Workers) -> None:
    """Rank 1's own error stays its ``ValueError`` (now an ``EveryRankError``); rank 0 gets a
    ``PeerRejectedError`` with ``rank == 1``; a mismatch is a ``CallMismatchError`` with its
    differences, on both ranks."""
    results = workers2.results(f"{TASKS}:agreement_error_types", {})
    own, peer = results[1]["bad_input"], results[0]["bad_input"]
    assert own["name"] == "ValueError" and own["every_rank"] and not own["peer"], own
    assert own["message"] == "k and v head_dim must equal q's 8, got 4"
    assert own["pickled"] == ("ValueError", own["message"], True)
    assert peer["name"] == "PeerRejectedError" and peer["peer"] and peer["rank"] == 1, peer
    assert peer["value_error"] and peer["every_rank"] and peer["pickled"][0] == "PeerRejectedError"
    for result in results:
        mismatch = result["mismatch"]
        assert mismatch["name"] == "CallMismatchError" and mismatch["every_rank"], mismatch
        assert mismatch["differences"] == ("causal: rank 0 False, rank 1 True",), mismatch
