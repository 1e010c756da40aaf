"""No class in the protocol core holds more than ``MAX_ATTRIBUTES`` attributes.

A machine-checked target (as tests/test_layers.py checks the layer table): the sessions
are split by concern (kvtransport.core.sender, .receiver and the parts they are made of),
and this test keeps them split. It parses every module of kvtransport/core and counts, per
class, the distinct instance attributes its methods assign (``self.x = ...``, augmented
and tuple targets included, anywhere in the class's own methods); properties are not
attributes (a property's setter counts what it assigns).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "kvtransport" / "core"
MAX_ATTRIBUTES = 25


def _own_nodes(cls: ast.ClassDef) -> list[ast.AST]:
    """The nodes of ``cls``'s own body (a nested class's are its own)."""
    out: list[ast.AST] = []
    stack: list[ast.AST] = list(cls.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.ClassDef):
            continue
        out.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return out


def instance_attributes(cls: ast.ClassDef) -> set[str]:
    """The names ``cls``'s methods assign on ``self``."""
    return {
        node.attr
        for node in _own_nodes(cls)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


def core_classes() -> dict[str, set[str]]:
    """``module:Class`` -> its instance attributes, for every class in kvtransport/core."""
    out = {}
    for path in sorted(CORE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out[f"{path.relative_to(ROOT)}:{node.name}"] = instance_attributes(node)
    return out


def test_no_core_class_holds_more_than_the_target() -> None:
    over = {
        name: len(attrs) for name, attrs in core_classes().items() if len(attrs) > MAX_ATTRIBUTES
    }
    assert not over, f"classes over {MAX_ATTRIBUTES} attributes (split them by concern): {over}"


def test_the_sessions_are_found_and_counted() -> None:
    """The count sees the sessions (a renamed module would pass the target vacuously)."""
    classes = core_classes()
    assert 5 <= len(classes["kvtransport/core/sender.py:SenderSession"]) <= MAX_ATTRIBUTES
    assert 5 <= len(classes["kvtransport/core/receiver.py:ReceiverSession"]) <= MAX_ATTRIBUTES


def test_the_count_sees_every_kind_of_assignment() -> None:
    source = """
class C:
    def __init__(self):
        self.a = 1
        self.b, (self.c, self.d) = 2, (3, 4)
        self.e += 1
        self.a = 5  # counted once
        other.f = 6  # not self

    @property
    def p(self):
        return self.a

    @p.setter
    def p(self, v):
        self.g = v

    def m(self):
        for self.h in range(2):
            pass

    class Inner:  # its own class
        def __init__(self):
            self.z = 0
"""
    cls = ast.parse(source).body[0]
    assert isinstance(cls, ast.ClassDef)
    assert instance_attributes(cls) == {"a", "b", "c", "d", "e", "g", "h"}
