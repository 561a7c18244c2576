"""Which nodes of a page's accessibility tree (CDP `Accessibility.getFullAXTree`) the model is shown.

Pure: it reads the tree CDP returns, as plain dicts, and imports no browser driver.
"""

from __future__ import annotations

from typing import Any

from wakeful.vm.observe import Element

__all__ = ["INTERACTIVE_ROLES", "NAMED_ROLES", "interesting_elements"]

INTERACTIVE_ROLES = frozenset({
    "button", "link", "textbox", "searchbox", "combobox", "listbox", "option", "checkbox", "radio", "switch",
    "slider", "spinbutton", "menuitem", "menuitemcheckbox", "menuitemradio", "tab", "treeitem",
})
NAMED_ROLES = frozenset({"heading", "img", "image", "alert", "alertdialog", "dialog", "status", "StaticText"})
"""Shown only when they have a name; StaticText only outside interactive elements and headings (whose own name
already carries the text)."""
_STATES = ("focused", "disabled", "checked", "pressed", "expanded", "selected", "required", "readonly", "invalid")


def _value(prop: Any) -> Any:
    return prop.get("value") if isinstance(prop, dict) else None


def _states(node: dict[str, Any]) -> tuple[str, ...]:
    found = []
    props = {p["name"]: _value(p.get("value")) for p in node.get("properties", [])}
    for name in _STATES:
        value = props.get(name)
        if value in (True, "true"):
            found.append(name)
        elif value == "mixed":
            found.append(f"{name}=mixed")
    return tuple(found)


def interesting_elements(nodes: list[dict[str, Any]], *, limit: int,
                         max_text: int) -> tuple[tuple[Element, ...], bool]:
    """Pick the nodes worth showing from a CDP AX tree, in document order: interactive ones, and named
    headings, images, alerts and text. Bounded to `limit` elements; names and values to `max_text` characters."""
    by_id = {n["nodeId"]: n for n in nodes}
    child_ids = {c for n in nodes for c in n.get("childIds", [])}
    roots = [n for n in nodes if n["nodeId"] not in child_ids]
    found: list[Element] = []
    stack: list[tuple[dict[str, Any], bool]] = [(n, False) for n in reversed(roots)]
    while stack:
        node, inside_named = stack.pop()
        role = str(_value(node.get("role")) or "")
        name = " ".join(str(_value(node.get("name")) or "").split())
        keep = False
        if not node.get("ignored") and node.get("backendDOMNodeId") is not None:
            if role in INTERACTIVE_ROLES:
                keep = True
            elif role in NAMED_ROLES and name:
                keep = role != "StaticText" or not inside_named
        if keep:
            if len(found) == limit:
                return tuple(found), True
            value = _value(node.get("value"))
            level = next((_value(p.get("value")) for p in node.get("properties", []) if p["name"] == "level"), None)
            found.append(Element(node=int(node["backendDOMNodeId"]), role=role, name=name[:max_text],
                                 value=None if value in (None, "") else str(value)[:max_text],
                                 states=_states(node), level=int(level) if level is not None else None))
        covers = inside_named or (keep and role != "StaticText")
        children = [by_id[c] for c in node.get("childIds", []) if c in by_id]
        stack.extend((child, covers) for child in reversed(children))
    return tuple(found), False
