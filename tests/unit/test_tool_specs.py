"""The one list of tool specs: schemas generated from the argument models (connector operations' from their
declarations), valid and self-contained on both faces, and the act vocabulary taken from vm.observe."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from wakeful.server.acting.connectors import OBJECT_ID_PATTERN, Registry, load_connectors
from wakeful.server.computers.pool import act_from_args, act_json
from wakeful.server.errors import BadRequest
from wakeful.server.tools.specs import Face, connector_spec, spec, tool_specs
from wakeful.vm.observe import ACT_KINDS

ROOT = Path(__file__).resolve().parents[2]

SHOP = """\
[connector]
name = "shop"
base_url = "https://shop.invalid"
credential = "shop_api"

[operations.get_item]
effect = "read"
method = "GET"
path = "/v1/items/{item}"
description = "Read one item"
params.item = { type = "object", kind = "item", in = "path" }
returns = [ { kind = "item", ref = "id", keep = ["price_cents", "currency"] } ]

[operations.find_purchases]
effect = "read"
method = "GET"
path = "/v1/purchases/{key}"
description = "Purchases made under an idempotency key"
params.key = { type = "string", in = "path" }

[operations.buy]
effect = "write"
method = "POST"
path = "/v1/items/{item}/buy"
description = "Buy an item"
risk = "ask"
idempotency_header = "Idempotency-Key"
params.item = { type = "object", kind = "item", in = "path", description = "The item to buy" }
params.note = { type = "string", in = "body", max_length = 20, required = false }
params.quantity = { type = "integer", in = "body", minimum = 1, maximum = 5 }
params.gift = { type = "boolean", in = "body", required = false }
params.colour = { type = "string", in = "query", enum = ["red", "blue"], required = false }
params.from = { type = "string", in = "query", pattern = "^[A-Z]{3}$", required = false }
amount = { from_object = "item", field = "price_cents", currency_field = "currency" }
reconcile = { operation = "find_purchases", by_idempotency_key = "key", done_when = { at = "buys[]", exists = true } }
"""

ONE_OF_EACH_ACT: dict[str, dict[str, Any]] = {
    "click": {"ref": "r1"}, "fill": {"ref": "r1", "text": "Ada"}, "press": {"key": "Enter", "observation": 3},
    "select": {"ref": "r1", "option": "EUR"}, "scroll": {"dy": 400, "observation": 3},
    "navigate": {"url": "https://example.test/", "observation": 3}, "new_tab": {"observation": 3},
    "switch_tab": {"tab_id": "t2", "observation": 3}, "close_tab": {"tab_id": "t2", "observation": 3},
    "desktop_click": {"x": 10, "y": 20, "observation": 3, "button": 3},
    "desktop_type": {"text": "hello", "observation": 3}, "desktop_key": {"keys": "ctrl+l", "observation": 3},
}


@pytest.fixture
def shop(tmp_path: Path) -> Registry:
    (tmp_path / "shop.toml").write_text(SHOP)
    return load_connectors(tmp_path)


@pytest.fixture
def shipped() -> Registry:
    return load_connectors(ROOT / "policies" / "connectors")


def test_a_connector_operations_schema_is_generated_from_its_declaration(shop: Registry) -> None:
    schema = connector_spec(shop.operation("shop__buy")).input_schema(Face.HARNESS)
    assert schema == {"type": "object", "additionalProperties": False, "required": ["item", "quantity"], "properties": {
        "item": {"type": "string", "pattern": OBJECT_ID_PATTERN,
                 "description": "The item to buy (an object ID of kind item returned by a read tool)"},
        "note": {"type": "string", "maxLength": 20},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 5},
        "gift": {"type": "boolean"},
        "colour": {"type": "string", "enum": ["red", "blue"]},
        "from": {"type": "string", "pattern": "^[A-Z]{3}$"},  # a Python keyword, and still the declared name
    }}
    assert connector_spec(shop.operation("shop__find_purchases")).input_schema(Face.HARNESS)["properties"] == {
        "key": {"type": "string", "minLength": 1}}  # a path segment is never empty


def test_a_connector_operations_model_accepts_what_its_schema_shows_by_the_declared_names(shop: Registry) -> None:
    buy = connector_spec(shop.operation("shop__buy"))
    checked = buy.validate(Face.MCP, {"task_id": "task_01x", "item": "obj_01ab", "quantity": 2, "from": "AMS"})
    assert checked.model_dump(by_alias=True, exclude_unset=True) == {
        "task_id": "task_01x", "item": "obj_01ab", "quantity": 2, "from": "AMS"}
    with pytest.raises(BadRequest) as refused:
        buy.validate(Face.HARNESS, {"item": "obj_01ab", "quantity": True, "price": 1})
    assert refused.value.code == "invalid_arguments"
    assert refused.value.message.startswith("shop__buy: quantity: Input should be a valid integer; price: Extra")


@pytest.mark.parametrize("face", list(Face))
def test_every_tools_schema_is_valid_and_self_contained_on_both_faces(shipped: Registry, face: Face) -> None:
    for tool in tool_specs(shipped, face, computers=True):
        schema = tool.input_schema(face)
        Draft202012Validator.check_schema(schema)
        text = json.dumps(schema)
        assert '"$ref"' not in text and '"$defs"' not in text, tool.name  # nothing to dangle when embedded
        assert schema["type"] == "object" and schema["additionalProperties"] is False, tool.name


def test_over_mcp_a_task_scoped_tool_takes_the_task_id_and_in_the_harness_the_wake_binds_it(shipped: Registry) -> None:
    mcp = {s.name: s.input_schema(Face.MCP) for s in tool_specs(shipped, Face.MCP, computers=True)}
    harness = {s.name: s.input_schema(Face.HARNESS) for s in tool_specs(shipped, Face.HARNESS, computers=True)}
    # ... except in triage, where no task is bound: attach_event names the task a delivery is given to.
    assert "task_id" not in json.dumps({name: s["properties"] for name, s in harness.items() if name != "attach_event"})
    assert harness["attach_event"]["required"] == ["event_id", "task_id", "reason"]
    assert [name for name, s in mcp.items() if "task_id" not in s.get("required", [])] == ["create_responsibility"]
    assert set(mcp) - set(harness) == {"create_responsibility", "steer_responsibility", "task_status"}
    assert set(harness) - set(mcp) == {"read_record", "stay_quiet", "confirm_pause", "attach_event", "start_helper"}


def test_the_act_argument_offers_exactly_the_act_kinds_of_vm_observe() -> None:
    act = spec("computer__act").input_schema(Face.HARNESS)["properties"]["act"]
    assert sorted(variant["properties"]["kind"]["const"] for variant in act["oneOf"]) == sorted(ACT_KINDS)
    assert sorted(ONE_OF_EACH_ACT) == sorted(ACT_KINDS)


@pytest.mark.parametrize(("kind", "fields"), ONE_OF_EACH_ACT.items())
def test_every_act_kind_validates_as_a_tool_argument_and_round_trips_through_its_record(
        kind: str, fields: dict[str, Any]) -> None:
    raw = {"kind": kind, **fields}
    checked: Any = spec("computer__act").validate(Face.HARNESS, {"act": raw})
    act = act_from_args(checked.act.model_dump())
    assert isinstance(act, ACT_KINDS[kind]) and act.kind == kind
    assert act_from_args(act_json(act)) == act


def test_an_act_field_that_belongs_to_another_kind_is_refused_with_its_path() -> None:
    with pytest.raises(BadRequest) as refused:
        spec("computer__act").validate(Face.HARNESS, {"act": {"kind": "desktop_key", "key": "F2", "observation": 1}})
    assert refused.value.code == "invalid_arguments"
    assert "act.desktop_key.keys: Field required" in refused.value.message
    assert "act.desktop_key.key: Extra inputs are not permitted" in refused.value.message


def test_the_claude_code_doc_names_every_tool_an_mcp_client_gets(shipped: Registry) -> None:
    doc = (ROOT / "docs" / "claude-code.md").read_text()
    table = doc[doc.index("## What the model gets"):]
    named = {s.name for s in tool_specs(shipped, Face.MCP, computers=True) if "__" not in s.name
             or s.name.startswith("computer__")}
    assert {name for name in named if f"`{name}`" not in table} == set()
    assert "`<connector>__<operation>`" in table
