"""The compiled simulator's source transform (pddnet/sim/compile_shape.py): each dataclass
gets an ``__init__`` written out that behaves as the one ``@dataclass`` generates, and
classes it cannot or need not shape are left alone. Each case runs the source twice, as
written and as shaped, and compares."""

import dataclasses
import inspect
import sys
import textwrap
import types

import pytest

from pddnet.sim.compile_shape import shape_source
from pddnet.sim.compiled import COMPILED_MODULES, source_root

SOURCE = textwrap.dedent(
    '''
    from __future__ import annotations

    from dataclasses import KW_ONLY, InitVar, dataclass, field
    from typing import ClassVar


    @dataclass(frozen=True)
    class Frozen:
        a: int
        b: str = "b"  # a default
        c: list[int] = field(default_factory=list)
        d: float = field(default=1.5, compare=True)
        hidden: dict[str, int] = field(default_factory=dict, init=False)
        LIMIT: ClassVar[int] = 9  # not a field


    @dataclass
    class Plain:
        """Not frozen: plain assignments; __post_init__ still runs."""

        a: int
        _: KW_ONLY
        k: int = 3
        tags: set[str] = field(default_factory=lambda: {"x"})
        count: int = field(default=0, init=False)

        def __post_init__(self) -> None:
            self.count = self.a + self.k


    @dataclass(frozen=True, kw_only=True)
    class AllKeywords:
        x: int
        y: int = 2


    @dataclass(frozen=True)
    class MixedKeywords:
        x: int
        y: int = field(default=5, kw_only=True)
        z: int = 7


    @dataclass(frozen=True)
    class Own:
        a: int

        def __init__(self, a: int) -> None:
            object.__setattr__(self, "a", a * 2)


    @dataclass(frozen=True)
    class Derived(Frozen):
        e: int = 0


    @dataclass
    class WithInitVar:
        a: int
        scale: InitVar[int] = 1


    class NotADataclass:
        a: int = 1
    '''
)


def _load(source: str, name: str) -> dict:
    """Runs ``source`` as module ``name`` (dataclasses look their module up by name)."""
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module.__dict__


@pytest.fixture(scope="module")
def both() -> tuple[dict, dict, str]:
    shaped = shape_source(SOURCE)
    return _load(SOURCE, "example_plain"), _load(shaped, "example_shaped"), shaped


def _same_signature(plain: type, shaped: type) -> None:
    want = inspect.signature(plain.__init__).parameters
    got = inspect.signature(shaped.__init__).parameters
    assert list(got) == list(want)
    for name, p in want.items():
        assert got[name].kind == p.kind, name
        if repr(p.default) == "<factory>":  # dataclasses' marker; written out: None
            assert got[name].default is None, name
        else:
            assert got[name].default == p.default, name


def test_which_classes_are_shaped(both):
    *_, shaped = both
    names = ["Frozen", "Plain", "AllKeywords", "MixedKeywords", "Own", "Derived", "WithInitVar"]
    generated = {n for n in names + ["NotADataclass"] if "compile_shape" in _src(shaped, n)}
    assert generated == {"Frozen", "Plain", "AllKeywords", "MixedKeywords"}
    assert shape_source(shaped) == shaped  # a shaped class has its __init__: shaped once only


def _src(text: str, cls_name: str) -> str:
    """The text of class ``cls_name`` in ``text`` (up to the next top-level statement)."""
    start = text.index(f"class {cls_name}")
    end = text.find("\n@", start)
    return text[start : end if end >= 0 else len(text)]


def test_classes_it_leaves_alone_keep_their_text(both):
    *_, shaped = both
    for name in ("Own", "Derived", "WithInitVar", "NotADataclass"):
        assert _src(shaped, name) == _src(SOURCE, name), name


def test_a_frozen_dataclass_constructs_as_the_generated_init_does(both):
    plain, shaped, text = both
    P, S = plain["Frozen"], shaped["Frozen"]
    assert 'object.__setattr__(self, "a", a)' in _src(text, "Frozen")
    _same_signature(P, S)
    for args, kwargs in [((1,), {}), ((1, "z", [4], 2.5), {}), ((2,), {"d": 0.5, "c": [1]})]:
        p, s = P(*args, **kwargs), S(*args, **kwargs)
        assert dataclasses.asdict(s) == dataclasses.asdict(p)
        assert s.hidden == {}
    one, two = S(1), S(1)
    assert one.c == [] and one.c is not two.c  # default_factory: a fresh list each time
    assert one.hidden is not two.hidden
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.a = 5
    with pytest.raises(TypeError):
        S()  # a field without a default is required
    assert S.LIMIT == 9 and "LIMIT" not in inspect.signature(S).parameters


def test_a_plain_dataclass_gets_assignments_and_its_post_init(both):
    plain, shaped, text = both
    P, S = plain["Plain"], shaped["Plain"]
    assert "self.a = a" in _src(text, "Plain")
    _same_signature(P, S)
    for kwargs in [{}, {"k": 10}, {"tags": {"y"}}]:
        p, s = P(4, **kwargs), S(4, **kwargs)
        assert dataclasses.asdict(s) == dataclasses.asdict(p)
    assert S(4).count == 7  # set by __post_init__, after the fields
    assert S(1).tags == {"x"} and S(1).tags is not S(1).tags
    with pytest.raises(TypeError):
        S(4, 10)  # k is keyword-only (after KW_ONLY)


@pytest.mark.parametrize("name", ["AllKeywords", "MixedKeywords"])
def test_positional_and_keyword_only_fields_keep_their_kind(both, name):
    plain, shaped, _ = both
    P, S = plain[name], shaped[name]
    _same_signature(P, S)
    same = dataclasses.astuple  # (two classes: compare the values)
    assert same(S(x=1)) == same(P(x=1))
    assert same(S(x=1, y=9)) == same(P(x=1, y=9))
    if name == "AllKeywords":
        with pytest.raises(TypeError):
            S(1)
    else:
        assert same(S(1, 8)) == same(P(1, 8))  # z stays positional; y is keyword-only
        with pytest.raises(TypeError):
            S(1, 8, 9)


def test_left_alone_classes_behave_as_written(both):
    _, shaped, _ = both
    assert shaped["Own"](3).a == 6
    assert shaped["Derived"](1, e=2).e == 2
    assert shaped["WithInitVar"](2, 3).a == 2


@pytest.mark.parametrize("module", COMPILED_MODULES)
def test_every_compiled_module_shapes_to_valid_source_that_writes_out_its_dataclasses(module):
    path = source_root().joinpath(*module.split(".")).with_suffix(".py")
    text = path.read_text()
    shaped = shape_source(text)
    compile(shaped, str(path), "exec")
    assert "written out: mypyc" not in text  # the hand-written form is gone from the sources
    for line in text.splitlines():  # nothing of the original is lost or moved before it
        assert line in shaped
