"""Which accessibility nodes an observation shows: interactive ones always, named headings and text, bounded."""

from __future__ import annotations

from typing import Any

from wakeful.vm.accessibility import interesting_elements


def ax(node_id: str, role: str, name: str = "", *, children: tuple[str, ...] = (), backend: int | None = None,
       ignored: bool = False, value: str | None = None, props: dict[str, Any] | None = None) -> dict[str, Any]:
    node: dict[str, Any] = {"nodeId": node_id, "ignored": ignored, "role": {"type": "role", "value": role},
                            "name": {"type": "computedString", "value": name}, "childIds": list(children),
                            "properties": [{"name": k, "value": {"type": "booleanOrUndefined", "value": v}}
                                           for k, v in (props or {}).items()]}
    if backend is not None:
        node["backendDOMNodeId"] = backend
    if value is not None:
        node["value"] = {"type": "string", "value": value}
    return node


TREE = [
    ax("1", "RootWebArea", "Shop", children=("2", "3", "5", "7", "9", "10", "11"), backend=1),
    ax("2", "heading", "Cart", children=("2a",), backend=2, props={"level": 2}),
    ax("2a", "StaticText", "Cart", backend=20),
    ax("3", "button", "Pay   now", children=("3a",), backend=3, props={"focused": True, "disabled": False}),
    ax("3a", "StaticText", "Pay now", backend=30),
    ax("5", "textbox", "", backend=5, value="Ada", props={"required": True}),
    ax("7", "generic", "", children=("7a", "7b"), backend=7),
    ax("7a", "StaticText", "Total: 12 EUR", backend=70),
    ax("7b", "StaticText", "   ", backend=71),
    ax("9", "checkbox", "Gift", backend=9, props={"checked": "mixed"}),
    ax("10", "button", "Hidden", backend=10, ignored=True),
    ax("11", "link", "No DOM node"),
]


def test_interactive_nodes_named_headings_and_free_text_are_kept_in_document_order() -> None:
    elements, truncated = interesting_elements(TREE, limit=100, max_text=160)
    assert not truncated
    assert [(e.node, e.role, e.name) for e in elements] == [
        (2, "heading", "Cart"), (3, "button", "Pay now"), (5, "textbox", ""), (70, "StaticText", "Total: 12 EUR"),
        (9, "checkbox", "Gift")]


def test_states_values_and_levels_come_along() -> None:
    elements, _ = interesting_elements(TREE, limit=100, max_text=160)
    by_node = {e.node: e for e in elements}
    assert by_node[2].level == 2
    assert by_node[3].states == ("focused",)
    assert (by_node[5].value, by_node[5].states) == ("Ada", ("required",))
    assert by_node[9].states == ("checked=mixed",)


def test_the_snapshot_is_bounded_and_says_so() -> None:
    elements, truncated = interesting_elements(TREE, limit=2, max_text=160)
    assert truncated and [e.node for e in elements] == [2, 3]


def test_long_names_and_values_are_cut() -> None:
    tree = [ax("1", "textbox", "n" * 500, backend=1, value="v" * 500)]
    (element,), _ = interesting_elements(tree, limit=10, max_text=40)
    assert element.name == "n" * 40 and element.value == "v" * 40
