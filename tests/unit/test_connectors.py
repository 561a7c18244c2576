"""Connector declarations: the shipped files load, every broken declaration is reported at its file and line, and
requests, arguments, extracted objects and reconcile checks follow the declaration exactly."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from wakeful.server.acting.connectors import (
    ConnectorError,
    ConnectorProblem,
    ExtractedObject,
    Operation,
    Registry,
    build_request,
    extract_objects,
    load_connectors,
    reconcile_arguments,
    reconcile_done,
    validate_arguments,
)
from wakeful.server.errors import BadRequest, NotFound

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "policies" / "connectors"
TABLE_STYLE = (Path(__file__).parent / "connector_fixtures" / "table_style.toml").read_text()

SHOP = """\
[connector]
name = "shop"
description = "A test shop"
base_url = "https://shop.invalid"
credential = "shop_api"

[operations.list_items]
effect = "read"
method = "GET"
path = "/v1/items"
description = "List items"
returns = [ { kind = "item", at = "items[]", ref = "id", keep = ["price_cents", "currency", "state"] } ]

[operations.get_item]
effect = "read"
method = "GET"
path = "/v1/items/{item}"
description = "Read one item"
params.item = { type = "object", kind = "item", in = "path" }
returns = [ { kind = "item", ref = "id", keep = ["price_cents", "currency", "state"] } ]

[operations.find_purchases]
effect = "read"
method = "GET"
path = "/v1/purchases"
description = "Purchases made under an idempotency key"
internal = true
params.key = { type = "string", in = "query" }

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
params.code = { type = "string", in = "query", pattern = "^[A-Z]{3}$", required = false }
amount = { from_object = "item", field = "price_cents", currency_field = "currency" }
reconcile = { operation = "find_purchases", by_idempotency_key = "key", done_when = { at = "buys[]", exists = true } }
"""


def edit(old: str, new: str, text: str = SHOP) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def line_of(text: str, fragment: str) -> int:
    [number] = [n for n, line in enumerate(text.splitlines(), 1) if fragment in line]
    return number


def problems_of(directory: Path, **files: str) -> list[ConnectorProblem]:
    for name, text in files.items():
        (directory / f"{name}.toml").write_text(text)
    with pytest.raises(ConnectorError) as info:
        load_connectors(directory)
    assert info.value.code == "invalid_connector"
    assert str(info.value.message) == "\n".join(str(p) for p in info.value.problems)
    return list(info.value.problems)


def only_problem(directory: Path, text: str) -> ConnectorProblem:
    [problem] = problems_of(directory, shop=text)
    assert problem.file == str(directory / "shop.toml")
    return problem


@pytest.fixture
def shop(tmp_path: Path) -> Registry:
    (tmp_path / "shop.toml").write_text(SHOP)
    return load_connectors(tmp_path)


@pytest.fixture
def shipped() -> Registry:
    return load_connectors(SHIPPED, base_urls={"merchant": "http://127.0.0.1:8001/", "hotel": "http://127.0.0.1:8003"})


# --- the shipped declarations ---------------------------------------------------------------------------------


def test_the_shipped_declarations_load_with_one_tool_per_operation_except_internal_reads(shipped: Registry) -> None:
    assert sorted(shipped.connectors) == ["airline", "hotel", "mail", "merchant"]
    assert sorted(op.tool_name for op in shipped.tools()) == [
        "airline__get_booking", "airline__order_flight", "airline__read_booking", "airline__search_flights",
        "hotel__book_quote", "hotel__get_quote", "hotel__quote_stay", "mail__read_thread", "mail__reply",
        "merchant__cancel_renewal", "merchant__get_subscription", "merchant__list_subscriptions",
    ]
    assert {op.name for op in shipped.operations() if op.internal} == {
        "find_cancellations", "find_orders", "find_bookings", "find_sent"}


def test_base_urls_given_at_load_time_override_the_files(shipped: Registry) -> None:
    assert shipped.connectors["merchant"].base_url == "http://127.0.0.1:8001"
    assert shipped.operation("hotel__book_quote").base_url == "http://127.0.0.1:8003"
    assert shipped.connectors["airline"].base_url == "https://airline.invalid"
    assert shipped.connectors["merchant"].credential == "merchant_api"


def test_every_shipped_write_asks_has_an_idempotency_header_and_reconciles_through_a_read(shipped: Registry) -> None:
    writes = {op.tool_name: op for op in shipped.operations() if op.effect == "write"}
    assert sorted(writes) == ["airline__order_flight", "hotel__book_quote", "mail__reply", "merchant__cancel_renewal"]
    for op in writes.values():
        assert op.risk == "ask" and op.idempotency_header == "Idempotency-Key"
        assert shipped.reconciler(op).effect == "read"
    assert [name for name, op in writes.items() if op.amount is None] == ["mail__reply"]  # a mail spends nothing


def test_a_mail_reply_goes_to_its_threads_sender_and_the_model_names_no_recipient(shipped: Registry) -> None:
    reply = shipped.operation("mail__reply")
    assert set(reply.params) == {"thread", "body"}  # no to, no cc: "CC the itinerary to ..." has nowhere to go
    request = build_request(reply, args={"thread": "obj_1", "body": "any news?"}, resolved={"thread": "thr-1"},
                            idempotency_key="k1")
    assert (request.method, httpx.URL(request.url).path, request.body) == (
        "POST", "/v1/threads/thr-1/replies", b'{"body":"any news?"}')


def test_the_hotel_quote_is_a_read_sent_as_post(shipped: Registry) -> None:
    quote = shipped.operation("hotel__quote_stay")
    assert (quote.effect, quote.method, quote.risk) == ("read", "POST", None)
    request = build_request(quote, args={"hotel": "H-100", "nights": 2}, resolved={}, idempotency_key=None)
    assert request.body == b'{"hotel":"H-100","nights":2}'


def test_shipped_reads_extract_the_objects_of_the_simulators_responses(shipped: Registry) -> None:
    subscriptions = {"subscriptions": [
        {"id": "sub_1", "plan": "pro", "status": "active", "renewal": "on", "price_cents": 1200, "currency": "EUR",
         "period_end": "2025-01-31", "card_last4": "4242"}]}
    [sub] = extract_objects(shipped.operation("merchant__list_subscriptions"), subscriptions)
    assert sub == ExtractedObject(kind="subscription", ref="sub_1", snapshot={
        "plan": "pro", "status": "active", "renewal": "on", "price_cents": 1200, "currency": "EUR",
        "period_end": "2025-01-31"})
    booking = {"pnr": "PNR123", "flight": "AB100", "date": "2025-03-01", "from": "AMS", "to": "LIS",
               "status": "cancelled", "ticket": {"number": "074-1"}}
    [b] = extract_objects(shipped.operation("airline__get_booking"), booking)
    assert (b.kind, b.ref, b.snapshot) == ("booking", "PNR123", {k: v for k, v in booking.items() if k != "pnr"})
    flights = {"flights": [{"flight": "WK200", "price_cents": 9900, "currency": "EUR"}, {"flight": "WK300"}]}
    assert [f.ref for f in extract_objects(shipped.operation("airline__search_flights"), flights)] == ["WK200", "WK300"]
    quote = {"quote_id": "q_1", "hotel": "H-100", "nights": 2, "price_cents": 30000, "currency": "EUR",
             "expires_at": "2025-03-01T12:00:00Z"}
    [q] = extract_objects(shipped.operation("hotel__quote_stay"), quote)
    assert (q.kind, q.ref, q.snapshot["price_cents"]) == ("quote", "q_1", 30000)


def test_an_unknown_tool_is_not_found(shipped: Registry) -> None:
    for name in ("merchant__refund", "bank__pay", "merchant", "merchant.cancel_renewal"):
        with pytest.raises(NotFound) as info:
            shipped.operation(name)
        assert info.value.code == "unknown_tool"


# --- every problem at its file and line ------------------------------------------------------------------------


def test_a_bad_method_reads_file_line_key_and_the_allowed_values(tmp_path: Path) -> None:
    text = edit('method = "POST"', 'method = "FETCH"')
    problem = only_problem(tmp_path, text)
    assert str(problem) == (f"{tmp_path / 'shop.toml'}:{line_of(text, 'FETCH')}: "
                            "operations.buy.method: must be one of GET, POST, PUT, PATCH, DELETE")


def test_a_bad_effect_is_reported_at_its_line(tmp_path: Path) -> None:
    text = edit('effect = "write"', 'effect = "change"')
    problem = only_problem(tmp_path, text)
    assert (problem.line, problem.message) == (line_of(text, '"change"'),
                                               "operations.buy.effect: must be one of read, write")


def test_a_missing_method_is_reported_at_its_operations_header(tmp_path: Path) -> None:
    text = edit('[operations.get_item]\neffect = "read"\nmethod = "GET"\n', '[operations.get_item]\neffect = "read"\n')
    problem = only_problem(tmp_path, text)
    assert (problem.line, problem.message) == (line_of(text, "[operations.get_item]"),
                                               "operations.get_item.method: is required")


def test_an_unknown_placeholder_is_reported_at_the_path_and_the_orphaned_path_param_at_its_own_line(
        tmp_path: Path) -> None:
    text = edit('path = "/v1/items/{item}/buy"', 'path = "/v1/items/{itme}/buy"')
    first, second = problems_of(tmp_path, shop=text)
    assert (first.line, first.message) == (
        line_of(text, "{itme}"), 'operations.buy.path: placeholder {itme} has no parameter with in = "path"')
    assert (second.line, second.message) == (
        line_of(text, "The item to buy"), 'operations.buy.params.item.in: is "path" but the path has no {item}')


def test_a_path_param_missing_from_the_template_is_reported_at_the_param(tmp_path: Path) -> None:
    text = edit("params.gift =", 'params.size = { type = "string", in = "path" }\nparams.gift =')
    problem = only_problem(tmp_path, text)
    assert (problem.line, problem.message) == (line_of(text, "params.size"),
                                               'operations.buy.params.size.in: is "path" but the path has no {size}')


def test_an_object_param_without_a_kind_is_reported_at_the_param(tmp_path: Path) -> None:
    text = edit('type = "object", kind = "item", in = "path", description', 'type = "object", in = "path", description')
    problem = only_problem(tmp_path, text)
    assert (problem.line, problem.message) == (line_of(text, "The item to buy"),
                                               "operations.buy.params.item.kind: is required")


def test_an_unknown_param_type_is_reported_at_the_param(tmp_path: Path) -> None:
    text = edit('params.gift = { type = "boolean"', 'params.gift = { type = "bool"')
    problem = only_problem(tmp_path, text)
    assert (problem.line, problem.message) == (
        line_of(text, "params.gift"),
        "operations.buy.params.gift.type: must be one of object, string, integer, boolean")


def test_reconcile_through_a_missing_operation_is_reported_at_the_reconcile_line(tmp_path: Path) -> None:
    text = edit('operation = "find_purchases"', 'operation = "find_purchase"')
    problem = only_problem(tmp_path, text)
    assert problem.line == line_of(text, "reconcile =")
    assert problem.message == ("operations.buy.reconcile.operation: must name a read of this connector to reconcile "
                               "with; find_purchase: there is no such operation in this connector")


def test_reconcile_through_a_write_is_refused(tmp_path: Path) -> None:
    text = edit('operation = "find_purchases", by_idempotency_key = "key",', 'operation = "buy",')
    problem = only_problem(tmp_path, text)
    assert problem.line == line_of(text, "reconcile =")
    assert problem.message.endswith("buy: it is a write")


def test_a_read_declaring_risk_is_refused_at_the_risk_line(tmp_path: Path) -> None:
    text = edit('description = "Read one item"', 'description = "Read one item"\nrisk = "auto"')
    problem = only_problem(tmp_path, text)
    assert (problem.line, problem.message) == (
        line_of(text, 'risk = "auto"'), "operations.get_item.risk: only writes declare risk: reads are never risky")


@pytest.mark.parametrize(("key", "line"), [
    ("idempotency_header", 'idempotency_header = "X-Request-Id"'),
    ("amount", 'amount = { currency_field = "currency", field = "price_cents", from_object = "item" }'),
    ("reconcile", 'reconcile = { operation = "list_items", done_when = { exists = true } }'),
])
def test_a_read_declaring_write_only_keys_is_refused(tmp_path: Path, key: str, line: str) -> None:
    text = edit('description = "Read one item"', f'description = "Read one item"\n{line}')
    problems = problems_of(tmp_path, shop=text)
    assert (problems[0].line, problems[0].message) == (
        line_of(text, line), f"operations.get_item.{key}: only writes declare {key}")


def test_a_write_without_risk_or_reconcile_is_refused(tmp_path: Path) -> None:
    text = edit('risk = "ask"\n', "").split("amount =")[0]
    problems = problems_of(tmp_path, shop=text)
    assert [(p.line, p.message.split(":")[0]) for p in problems] == [
        (line_of(text, "[operations.buy]"), "operations.buy.risk"),
        (line_of(text, "[operations.buy]"), "operations.buy.reconcile"),
    ]


@pytest.mark.parametrize(("old", "new", "fragment", "key"), [
    ('credential = "shop_api"', 'credential = "shop_api"\napi_key = "sk_live_123"', "api_key", "connector.api_key"),
    ('params.gift = { type = "boolean"', 'params.token = { type = "boolean"', "params.token",
     "operations.buy.params.token"),
    ('keep = ["price_cents", "currency", "state"] } ]\n\n[operations.get_item]',
     'keep = ["price_cents", "access_token"] } ]\n\n[operations.get_item]', "access_token",
     "operations.list_items.returns[0].keep[1]"),
    ('params.gift = { type = "boolean", in = "body"', 'params.gift = { type = "boolean", in = "body", Password = "x"',
     "Password", "operations.buy.params.gift.Password"),
])
def test_a_secret_looking_key_anywhere_is_refused_once_at_its_line(
        tmp_path: Path, old: str, new: str, fragment: str, key: str) -> None:
    text = edit(old, new)
    problems = problems_of(tmp_path, shop=text)
    secret = [p for p in problems if "looks like a secret" in p.message]
    assert [(p.line, p.message.split(": ")[0]) for p in secret] == [(line_of(text, fragment), key)]
    assert all(p.line != secret[0].line or p is secret[0] for p in problems)


def test_an_idempotency_header_that_is_a_credential_header_is_refused(tmp_path: Path) -> None:
    text = edit('idempotency_header = "Idempotency-Key"', 'idempotency_header = "Authorization"')
    problem = only_problem(tmp_path, text)
    assert (problem.line, problem.message) == (
        line_of(text, "idempotency_header"),
        "operations.buy.idempotency_header: Authorization is a framing or credential header")


def test_a_base_url_carrying_credentials_is_refused(tmp_path: Path) -> None:
    text = edit('base_url = "https://shop.invalid"', 'base_url = "https://user:pw@shop.invalid"')
    problem = only_problem(tmp_path, text)
    assert problem.line == line_of(text, "base_url")
    assert problem.message.startswith("connector.base_url: must not carry credentials")


def test_a_bad_base_url_override_is_reported_at_the_files_base_url(tmp_path: Path) -> None:
    (tmp_path / "shop.toml").write_text(SHOP)
    with pytest.raises(ConnectorError) as info:
        load_connectors(tmp_path, base_urls={"shop": "ftp://127.0.0.1"})
    assert (info.value.line, info.value.problem) == (
        line_of(SHOP, "base_url"), "connector.base_url: override 'ftp://127.0.0.1' must be an http(s) URL with a host")


def test_duplicate_connector_names_name_both_files(tmp_path: Path) -> None:
    [problem] = problems_of(tmp_path, a=SHOP, b=SHOP)
    assert problem.file == str(tmp_path / "b.toml")
    assert problem.line == line_of(SHOP, 'name = "shop"')
    assert problem.message == f"connector.name: connector shop is already declared in {tmp_path / 'a.toml'}:2"


def test_a_toml_syntax_error_is_reported_at_tomllibs_line(tmp_path: Path) -> None:
    text = edit('path = "/v1/purchases"', 'path = "/v1/purchases')
    problem = only_problem(tmp_path, text)
    assert problem.line == line_of(text, 'path = "/v1/purchases')
    assert problem.message.startswith("invalid TOML: ")


def test_several_files_with_problems_are_all_reported(tmp_path: Path) -> None:
    first = edit('method = "POST"', 'method = "FETCH"').replace('risk = "ask"', 'risk = "maybe"')
    second = edit('name = "shop"', 'name = "Shop"')
    third = "[connector\n"
    problems = problems_of(tmp_path, a=first, b=second, c=third, d=edit('name = "shop"', 'name = "fine"'))
    assert [(Path(p.file).name, p.line, p.message.split(":")[0]) for p in problems] == [
        ("a.toml", line_of(first, "FETCH"), "operations.buy.method"),
        ("a.toml", line_of(first, "maybe"), "operations.buy.risk"),
        ("b.toml", line_of(second, "Shop"), "connector.name"),
        ("c.toml", 1, "invalid TOML"),
    ]
    with pytest.raises(ConnectorError) as info:
        load_connectors(tmp_path)
    assert len(str(info.value.message).splitlines()) == 4


@pytest.mark.parametrize(("old", "new", "fragment", "message"), [
    ('path = "/v1/items"', 'path = "v1/items"', 'path = "v1/items"', "operations.list_items.path: must start with /"),
    ('path = "/v1/items"', 'path = "/v1/../items"', "v1/../items", "operations.list_items.path: must be non-empty"),
    ('"^[A-Z]{3}$"', '"[A-Z]{3}"', "[A-Z]{3}", "operations.buy.params.code.pattern: must be anchored"),
    ('"^[A-Z]{3}$"', '"^[A-Z{3}$"', "[A-Z{3}", "operations.buy.params.code.pattern: is not a regular expression"),
    ("minimum = 1, maximum = 5", "minimum = 6, maximum = 5", "minimum = 6", "operations.buy.params.quantity.maximum"),
    ("max_length = 20", 'max_length = "20"', 'max_length = "20"', "operations.buy.params.note.max_length"),
    ('params.note = { type = "string", in = "body"', 'params.note = { type = "string", in = "body", minimum = 1',
     'string", in = "body", minimum', "operations.buy.params.note.minimum: is not a known key"),
    ("params.gift =", "params.Gift-Wrap =", "Gift-Wrap", "operations.buy.params.Gift-Wrap: must be lower_snake_case"),
    ('field = "price_cents"', 'field = "price"', 'field = "price"',
     "operations.buy.amount.field: no operation keeps price for objects of kind item"),
    ('from_object = "item"', 'from_object = "note"', 'from_object = "note"',
     "operations.buy.amount.from_object: must name an object parameter"),
    ('by_idempotency_key = "key", ', "", "reconcile =", "operations.buy.reconcile: find_purchases needs key"),
    ("exists = true", 'exists = true, equals = "x"', "reconcile =",
     "operations.buy.reconcile.done_when: needs exactly"),
    ('at = "buys[]"', 'at = "buys[0]"', "reconcile =",
     "operations.buy.reconcile.done_when.at: must be a path"),
    ('by_idempotency_key = "key",', 'by_idempotency_key = "key", with = { key = "note" },', "reconcile =",
     "operations.buy.reconcile.with.key: key is required, and note is optional"),
    ('kind = "item", in = "path" }\nreturns', 'kind = "itme", in = "path" }\nreturns', '"itme"',
     "operations.get_item.params.item.kind: no operation of this connector returns objects of kind itme"),
    ('params.colour = { type = "string", in = "query"', 'params.colour = { type = "string", in = "header"',
     "params.colour", "operations.buy.params.colour.in: must be one of path, query, body"),
    ('method = "GET"\npath = "/v1/items/{item}"', 'method = "DELETE"\npath = "/v1/items/{item}"', '"DELETE"',
     "operations.get_item.method: a read uses GET or POST"),
])
def test_each_kind_of_problem_lands_on_its_line(tmp_path: Path, old: str, new: str, fragment: str,
                                                message: str) -> None:
    text = edit(old, new)
    problem = only_problem(tmp_path, text)
    assert (problem.line, problem.message[:len(message)]) == (line_of(text, fragment), message)


def test_a_get_with_a_body_param_is_refused(tmp_path: Path) -> None:
    text = edit('params.key = { type = "string", in = "query" }', 'params.key = { type = "string", in = "body" }')
    problem = only_problem(tmp_path, text)
    assert (problem.line, problem.message) == (
        line_of(text, "params.key"),
        'operations.find_purchases.params.key.in: GET requests carry no body: use in = "query"')


@pytest.mark.parametrize(("old", "new", "fragment", "message"), [
    ('kind = "item"\nin = "path"', 'in = "path"', '[operations.buy.params.item]', "operations.buy.params.item.kind"),
    ('minimum = 1', 'minimum = "one"', 'minimum = "one"', 'operations.buy.params.quantity.minimum'),
    ('exists = true', 'exists = "yes"', 'exists = "yes"', "operations.buy.reconcile.done_when.exists"),
    ('at = "items[].seller"', 'at = "items[].seller[0]"', "seller[0]", "operations.list_items.returns[1].at"),
    ('  "currency",\n]', '  "currency",\n  "session_cookie",\n]', "session_cookie",
     "operations.list_items.returns[0].keep[2]"),
    ('field = "price_cents"', 'field = "cost"', 'field = "cost"', "operations.buy.amount.field"),
    ('internal = true', 'internal = "yes"', 'internal = "yes"', "operations.find_purchases.internal"),
    ('[operations.buy.amount]', '[operations.buy.amount]\nbearer = "x"', 'bearer', "operations.buy.amount.bearer"),
])
def test_problems_in_sub_tables_arrays_of_tables_and_multi_line_arrays_land_on_their_lines(
        tmp_path: Path, old: str, new: str, fragment: str, message: str) -> None:
    text = edit(old, new, TABLE_STYLE)
    problem = only_problem(tmp_path, text)
    assert (problem.line, problem.message.split(": ")[0]) == (line_of(text, fragment), message)


def test_the_table_style_fixture_loads_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "shop.toml").write_text(TABLE_STYLE)
    buy = load_connectors(tmp_path).operation("shop__buy")
    assert (buy.base_url, buy.description, list(buy.params)) == ("https://shop.invalid/api", "Buy an item",
                                                                 ["item", "quantity"])


def test_a_missing_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConnectorError) as info:
        load_connectors(tmp_path / "nowhere")
    assert info.value.problem == "is not a directory"


# --- arguments --------------------------------------------------------------------------------------------------

GOOD = {"item": "obj_01abc", "quantity": 2}


@pytest.mark.parametrize(("args", "says"), [
    ({**GOOD, "price": 1}, "argument 'price' is not a parameter of shop__buy (it takes: item, note, quantity"),
    ({"item": "obj_01abc"}, "argument 'quantity' is required"),
    ({**GOOD, "item": "sub_123"},
     'argument \'item\' must be an object ID (obj_…) of kind item returned by a read tool, not "sub_123"'),
    ({**GOOD, "item": 7}, "argument 'item' must be an object ID"),
    ({**GOOD, "note": 5}, "argument 'note' must be a string, not 5"),
    ({**GOOD, "note": "x" * 21}, "argument 'note' is 21 characters long; at most 20 are allowed"),
    ({**GOOD, "code": "ab1"}, "argument 'code' must match ^[A-Z]{3}$"),
    ({**GOOD, "code": "ABC\n"}, "argument 'code' must match ^[A-Z]{3}$"),
    ({**GOOD, "colour": "green"}, "argument 'colour' must be one of red, blue"),
    ({**GOOD, "quantity": 0}, "argument 'quantity' must be at least 1, not 0"),
    ({**GOOD, "quantity": 6}, "argument 'quantity' must be at most 5, not 6"),
    ({**GOOD, "quantity": True}, "argument 'quantity' must be an integer, not true"),
    ({**GOOD, "quantity": "2"}, "argument 'quantity' must be an integer"),
    ({**GOOD, "gift": "yes"}, "argument 'gift' must be true or false"),
])
def test_invalid_arguments_are_refused_naming_the_parameter(shop: Registry, args: dict[str, object], says: str) -> None:
    with pytest.raises(BadRequest) as info:
        validate_arguments(shop.operation("shop__buy"), args)
    assert info.value.code == "invalid_arguments"
    assert says in info.value.message
    assert info.value.message.startswith("shop__buy: ")


def test_every_wrong_argument_is_named_at_once(shop: Registry) -> None:
    with pytest.raises(BadRequest) as info:
        validate_arguments(shop.operation("shop__buy"), {"note": 1, "extra": 2})
    assert info.value.fields["parameters"] == ["extra", "item", "note", "quantity"]


def test_valid_arguments_come_back_with_object_ids_untouched(shop: Registry) -> None:
    args = {"quantity": 1, "item": "obj_01abc", "gift": False}
    assert validate_arguments(shop.operation("shop__buy"), args) == {"item": "obj_01abc", "quantity": 1,
                                                                     "gift": False}


# --- requests ---------------------------------------------------------------------------------------------------


def test_a_ref_with_slashes_and_dots_cannot_leave_its_path_segment(shop: Registry) -> None:
    request = build_request(shop.operation("shop__buy"), args=GOOD, resolved={"item": "../../admin/x"},
                            idempotency_key="k1")
    assert request.url == "https://shop.invalid/v1/items/%2E%2E%2F%2E%2E%2Fadmin%2Fx/buy"
    assert httpx.URL(request.url).raw_path == b"/v1/items/%2E%2E%2F%2E%2E%2Fadmin%2Fx/buy"
    lone = build_request(shop.operation("shop__get_item"), args={"item": "obj_1"}, resolved={"item": ".."},
                         idempotency_key=None)
    assert httpx.URL(lone.url).raw_path == b"/v1/items/%2E%2E"


def test_the_body_is_canonical_json_with_its_digest(shop: Registry) -> None:
    request = build_request(shop.operation("shop__buy"), args={"quantity": 2, "note": "für dich", "item": "obj_1"},
                            resolved={"item": "it-9"}, idempotency_key="k1")
    assert request.method == "POST"
    assert request.body == b'{"note":"f\\u00fcr dich","quantity":2}'
    assert request.body_sha256 == hashlib.sha256(request.body).hexdigest()
    assert json.loads(request.body) == {"note": "für dich", "quantity": 2}
    assert request.headers == (("content-type", "application/json"), ("Idempotency-Key", "k1"))


def test_query_params_are_encoded_and_object_params_carry_the_resolved_ref(shop: Registry) -> None:
    request = build_request(shop.operation("shop__buy"), args={**GOOD, "colour": "red", "code": "ABC", "gift": True},
                            resolved={"item": "a b&c"}, idempotency_key="k1")
    parts = urlsplit(request.url)
    assert parts.path == "/v1/items/a%20b%26c/buy"
    assert parse_qsl(parts.query) == [("colour", "red"), ("code", "ABC")]
    assert json.loads(request.body or b"") == {"gift": True, "quantity": 2}
    find = build_request(shop.operation("shop__find_purchases"), args={"key": "k/1&x=2"}, resolved={},
                         idempotency_key=None)
    assert find.url == "https://shop.invalid/v1/purchases?key=k%2F1%26x%3D2"
    assert (find.body, find.headers, find.body_sha256) == (None, (), hashlib.sha256(b"").hexdigest())


def test_a_write_with_an_idempotency_header_needs_a_key(shop: Registry) -> None:
    for key in (None, "", "two words", "k\r\nX-Injected: 1"):
        with pytest.raises(ValueError, match="idempotency key"):
            build_request(shop.operation("shop__buy"), args=GOOD, resolved={"item": "it-9"}, idempotency_key=key)


def test_no_credential_header_is_ever_added(shipped: Registry) -> None:
    request = build_request(shipped.operation("merchant__cancel_renewal"), args={"subscription": "obj_1"},
                            resolved={"subscription": "sub_1"}, idempotency_key="act_1")
    assert request.url == "http://127.0.0.1:8001/v1/subscriptions/sub_1/cancel_renewal"
    assert request.headers == (("content-type", "application/json"), ("Idempotency-Key", "act_1"))
    assert request.body == b"{}"


def test_resolved_refs_must_match_the_object_arguments_exactly(shop: Registry) -> None:
    for resolved in ({}, {"item": "it-9", "note": "x"}, {"item": ""}):
        with pytest.raises(ValueError, match="resolved"):
            build_request(shop.operation("shop__buy"), args=GOOD, resolved=resolved, idempotency_key="k1")


def test_build_request_refuses_invalid_arguments(shop: Registry) -> None:
    with pytest.raises(BadRequest):
        build_request(shop.operation("shop__buy"), args={"item": "it-9", "quantity": 1}, resolved={"item": "it-9"},
                      idempotency_key="k1")


CANCEL: Operation = load_connectors(SHIPPED).operation("merchant__cancel_renewal")


@given(ref=st.text(st.characters(codec="utf-8"), min_size=1, max_size=40).filter(str.isprintable))
def test_any_printable_ref_fills_exactly_its_own_segment_and_decodes_back(ref: str) -> None:
    template = CANCEL.path.split("/")
    request = build_request(CANCEL, args={"subscription": "obj_1"}, resolved={"subscription": ref},
                            idempotency_key="k1")
    raw_path = httpx.URL(request.url).raw_path.decode()
    assert raw_path == urlsplit(request.url).path  # httpx sends the path as built: nothing normalised away
    segments = raw_path.split("/")
    assert len(segments) == len(template)
    for segment, expected in zip(segments, template, strict=True):
        assert unquote(segment) == ref if expected == "{subscription}" else segment == expected


# --- objects and reconcile -------------------------------------------------------------------------------------


def test_extract_objects_walks_nested_lists_and_keeps_only_the_declared_fields(tmp_path: Path) -> None:
    text = edit('returns = [ { kind = "item", at = "items[]"', 'returns = [ { kind = "item", at = "pages[].items[]"')
    (tmp_path / "shop.toml").write_text(text)
    op = load_connectors(tmp_path).operation("shop__list_items")
    body = {"pages": [
        {"items": [{"id": "i1", "price_cents": 5, "currency": "EUR", "secret_note": "x"}, "not an object",
                   {"price_cents": 7}, {"id": ""}, {"id": 42}]},
        {"items": [{"id": "i2", "state": None}, {"id": "i1", "price_cents": 99}]},
        {"items": "not a list"},
        "not an object",
    ]}
    assert extract_objects(op, body) == [
        ExtractedObject(kind="item", ref="i1", snapshot={"price_cents": 5, "currency": "EUR"}),
        ExtractedObject(kind="item", ref="i2", snapshot={"state": None}),
    ]
    assert extract_objects(op, ["whatever"]) == [] == extract_objects(op, None)


def test_extract_objects_follows_dotted_refs_and_top_level_lists(tmp_path: Path) -> None:
    text = edit('at = "items[]", ref = "id", keep = ["price_cents", "currency", "state"]',
                'at = "[]", ref = "meta.id", keep = ["price.cents"]')
    (tmp_path / "shop.toml").write_text(text)
    op = load_connectors(tmp_path).operation("shop__list_items")
    assert extract_objects(op, [{"meta": {"id": "i1"}, "price": {"cents": 3}}, {"meta": {}}]) == [
        ExtractedObject(kind="item", ref="i1", snapshot={"price.cents": 3})]


def test_reconcile_by_idempotency_key_passes_the_key_and_looks_for_a_record(shipped: Registry) -> None:
    cancel = shipped.operation("merchant__cancel_renewal")
    find = shipped.reconciler(cancel)
    args = reconcile_arguments(cancel, args={"subscription": "obj_1"}, idempotency_key="act_1")
    assert args == {"idempotency_key": "act_1"}
    request = build_request(find, args=args, resolved={}, idempotency_key=None)
    assert request.url == "http://127.0.0.1:8001/v1/cancellations?idempotency_key=act_1"
    assert reconcile_done(cancel, {"cancellations": [{"id": "c1"}]}) is True
    assert reconcile_done(cancel, {"cancellations": []}) is False
    assert reconcile_done(cancel, {}) is False
    with pytest.raises(ValueError):
        reconcile_arguments(cancel, args={}, idempotency_key=None)


def test_reconcile_by_rereading_maps_the_object_and_checks_the_field(tmp_path: Path) -> None:
    text = (SHIPPED / "merchant.toml").read_text().replace(
        'reconcile = { operation = "find_cancellations", by_idempotency_key = "idempotency_key", '
        'done_when = { at = "cancellations[]", exists = true } }',
        'reconcile = { operation = "get_subscription", with = { subscription = "subscription" }, '
        'done_when = { at = "renewal", equals = "off" } }')
    (tmp_path / "merchant.toml").write_text(text)
    cancel = load_connectors(tmp_path).operation("merchant__cancel_renewal")
    assert cancel.reconcile is not None and cancel.reconcile.operation == "get_subscription"
    args = reconcile_arguments(cancel, args={"subscription": "obj_1", "reason": "moving"}, idempotency_key="k")
    assert args == {"subscription": "obj_1"}
    assert reconcile_done(cancel, {"id": "sub_1", "renewal": "off"}) is True
    assert reconcile_done(cancel, {"id": "sub_1", "renewal": "on"}) is False


def test_reconcile_with_a_param_of_another_kind_is_refused(tmp_path: Path) -> None:
    text = edit('operation = "find_purchases", by_idempotency_key = "key",',
                'operation = "get_item", with = { item = "note" },')
    problem = only_problem(tmp_path, text)
    assert (problem.line, problem.message) == (
        line_of(text, "reconcile ="), "operations.buy.reconcile.with.item: note (string) cannot fill item "
                                      "(object of kind item)")

