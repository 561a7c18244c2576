"""Connector declarations: `policies/connectors/*.toml` → validated operations, one tool each → pure HTTP requests.

A connector file (the shipped `merchant.toml`, `airline.toml` and `hotel.toml` are complete examples):

    [connector]
    name = "merchant"                       # lower_snake_case; its tools are named `merchant__<operation>`
    description = "Subscriptions at the merchant"
    base_url = "https://merchant.invalid"   # http(s), no userinfo/query; `load_connectors(base_urls=...)` overrides it
    credential = "merchant_api"             # the NAME of a binding the egress proxy injects; never a secret value

    [operations.cancel_renewal]
    effect = "write"                        # read | write
    method = "POST"                         # GET POST PUT PATCH DELETE; a read uses GET or POST (quotes, searches)
    path = "/v1/subscriptions/{subscription}/cancel_renewal"   # placeholders are exactly the `in = "path"` params
    description = "Stop the subscription renewing"              # what the model reads
    risk = "ask"                            # writes only, required: auto | ask | deny
    idempotency_header = "Idempotency-Key"  # writes only, when the remote deduplicates by it
    params.subscription = { type = "object", kind = "subscription", in = "path" }
    params.reason = { type = "string", in = "body", max_length = 200, required = false }
    amount = { from_object = "subscription", field = "price_cents", currency_field = "currency" }  # writes only
    reconcile = { operation = "find_cancellations", by_idempotency_key = "idempotency_key",
                  done_when = { at = "cancellations[]", exists = true } }   # writes only, required
    returns = [ { kind = "subscription", at = "", ref = "id", keep = ["renewal"] } ]

Params: `type` is `object` (`kind`; the model passes a server-issued ID `obj_…` and the request carries the object's
external ref), `string` (`max_length`, `pattern` anchored `^…$`, `enum`), `integer` (`minimum`, `maximum`) or
`boolean`; `in` is path | query | body; `required` defaults to true (path params always are); `description`.
Body params become one canonical JSON object; GET and DELETE take none. Every object kind a param takes must be
returned by some operation of the connector (otherwise no ID of it could ever exist).

Paths into a JSON body (`returns.at`, `done_when.at`): `""` is the body itself, `a.b` a field, `a[]` each element
of the list `a` (so `trips[].legs[]` is every leg of every trip). `ref`, `keep` and `amount.field` are field paths
without `[]` inside one returned element. A returned element that is not an object, or whose ref is not a printable
non-empty string, is skipped; missing `keep` fields are left out of the snapshot.

Reconcile: after an uncertain write, call the read `operation` with args mapped by `with` (its param ← this
operation's param; object IDs pass through) and the write's idempotency key in `by_idempotency_key`; the write
happened when `done_when` holds: `exists = true` (`at` selects a non-null value), `exists = false` (it selects none)
or `equals = v` (a selected value equals v). A read marked `internal = true` gets no tool: it exists to reconcile.

Keys that look like secrets (secret, token, password, api_key, authorization, cookie, …) are refused anywhere in the
file, as are secret-looking `keep` fields. Tool names join connector and operation with `__` (MCP clients such as
Claude allow only `[A-Za-z0-9_-]{1,64}`); names never contain `__` themselves, so the split is unambiguous.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Final, Literal
from urllib.parse import quote, urlencode, urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, StrictBool, StrictInt, StrictStr
from pydantic import ValidationError as _PydanticError

from wakeful.proxy.contract import EgressRequest
from wakeful.server.errors import BadRequest, NotFound
from wakeful.server.store.tables import Risk
from wakeful.server.store.toml_lines import Key, TomlLines

__all__ = [
    "OBJECT_ID_PATTERN", "Amount", "BooleanParam", "Connector", "ConnectorError", "ConnectorProblem", "DoneWhen",
    "ExtractedObject", "IntegerParam", "ObjectParam", "Operation", "Param", "Reconcile",
    "Registry", "Returns", "StringParam", "build_request", "extract_objects", "load_connectors",
    "done_when_holds", "reconcile_arguments", "reconcile_done", "validate_arguments", "values_at",
]

OBJECT_ID_PATTERN: Final = "^obj_[0-9a-z]+$"
TOOL_NAME_MAX: Final = 64


_OBJECT_ID: Final = re.compile(OBJECT_ID_PATTERN[1:-1])
_NAME: Final = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)*")
_FIELD: Final = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")
_SELECT: Final = re.compile(r"(?:\[\])?|[A-Za-z0-9_-]+(?:\[\])?(?:\.[A-Za-z0-9_-]+(?:\[\])?)*")
_HEADER: Final = re.compile(r"[A-Za-z0-9-]+")
_HEADER_VALUE: Final = re.compile(r"[\x21-\x7e]+")  # visible ASCII: a key can never smuggle in another header
_SECRETISH: Final = re.compile(
    r"secret|token|passw(?:or)?d|api[_-]?key|authori[sz]|bearer|private[_-]?key|access[_-]?key|cookie", re.I)
_PLACEHOLDER: Final = re.compile(r"\{([^{}]*)\}")
_SEGMENT: Final = re.compile(r"[A-Za-z0-9._~!$&'()*+,;=:@-]+")
_FRAMING_HEADERS: Final = frozenset({"host", "content-type", "content-length", "transfer-encoding", "connection"})
_NO_OVERRIDES: Final[Mapping[str, str]] = MappingProxyType({})
_MISSING: Final = object()


# --- the declaration, as validated from the file ---------------------------------------------------------------


def _matching(pattern: re.Pattern[str], what: str) -> AfterValidator:
    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(f"must be {what}")
        return value

    return AfterValidator(check)


def _base_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http(s) URL with a host")
    if parts.username is not None or parts.password is not None:
        raise ValueError("must not carry credentials: name a binding in `credential` instead")
    if parts.query or parts.fragment:
        raise ValueError("must not have a query or fragment")
    return url.rstrip("/")


def _scalar(value: object) -> str | int | bool | None:
    if value is None or isinstance(value, str | int | bool):
        return value
    raise ValueError("must be a string, integer or boolean")


Name = Annotated[StrictStr, _matching(_NAME, "lower_snake_case starting with a letter, like list_subscriptions")]
FieldPath = Annotated[StrictStr, _matching(_FIELD, "a field name or dotted path, like price.amount")]
SelectPath = Annotated[StrictStr, _matching(_SELECT, 'a path like "", "a.b" or "items[]"')]
HeaderName = Annotated[StrictStr, _matching(_HEADER, "an HTTP header name, like Idempotency-Key")]
Location = Literal["path", "query", "body"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _ParamBase(_Frozen):
    location: Location = Field(alias="in")
    required: StrictBool = True
    description: StrictStr = ""


class ObjectParam(_ParamBase):
    """A server-issued object ID of `kind`; the request carries the object's external reference instead."""

    type: Literal["object"]
    kind: Name


class StringParam(_ParamBase):
    type: Literal["string"]
    max_length: Annotated[StrictInt, Field(ge=1)] | None = None
    pattern: StrictStr | None = None
    """A regular expression anchored with ^…$ (Python and ECMAScript agree on the simple ones)."""
    enum: Annotated[tuple[StrictStr, ...], Field(min_length=1)] | None = None


class IntegerParam(_ParamBase):
    type: Literal["integer"]
    minimum: StrictInt | None = None
    maximum: StrictInt | None = None


class BooleanParam(_ParamBase):
    type: Literal["boolean"]


Param = Annotated[ObjectParam | StringParam | IntegerParam | BooleanParam, Field(discriminator="type")]
_UNION_TAGS: Final = frozenset({"object", "string", "integer", "boolean", "[key]"})


class Returns(_Frozen):
    """Which objects a response holds: each element at `at` is an object of `kind` identified by its `ref` field."""

    kind: Name
    at: SelectPath = ""
    ref: FieldPath
    keep: tuple[FieldPath, ...] = ()
    """The fields copied into the object's snapshot (what the model, approvals and amounts may see)."""


class Amount(_Frozen):
    """Where a write's money is: fields of the snapshot of the object passed in param `from_object`."""

    from_object: Name
    field: FieldPath
    currency_field: FieldPath


class DoneWhen(_Frozen):
    at: SelectPath = ""
    equals: Annotated[str | int | bool | None, PlainValidator(_scalar)] = None
    exists: StrictBool | None = None


class Reconcile(_Frozen):
    operation: Name
    with_: dict[Name, Name] = Field(default_factory=dict, alias="with")
    """The read's param ← this operation's param."""
    by_idempotency_key: Name | None = None
    """The read's param that receives the write's idempotency key."""
    done_when: DoneWhen


class _OperationDecl(_Frozen):
    effect: Literal["read", "write"]
    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"]
    path: StrictStr
    description: Annotated[StrictStr, Field(min_length=1)]
    internal: StrictBool = False
    params: dict[Name, Param] = Field(default_factory=dict)
    returns: tuple[Returns, ...] = ()
    risk: Risk | None = None
    idempotency_header: HeaderName | None = None
    amount: Amount | None = None
    reconcile: Reconcile | None = None


class _ConnectorDecl(_Frozen):
    name: Name
    description: StrictStr = ""
    base_url: Annotated[StrictStr, AfterValidator(_base_url)]
    credential: Name


class _FileDecl(_Frozen):
    connector: _ConnectorDecl
    operations: Annotated[dict[Name, _OperationDecl], Field(min_length=1)]


# --- what the rest of the server uses --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Operation:
    connector: str
    name: str
    base_url: str
    effect: Literal["read", "write"]
    method: str
    path: str
    description: str
    internal: bool
    """No tool is generated; the operation exists to reconcile writes."""
    params: Mapping[str, ObjectParam | StringParam | IntegerParam | BooleanParam]
    returns: tuple[Returns, ...]
    risk: Risk | None
    idempotency_header: str | None
    amount: Amount | None
    reconcile: Reconcile | None

    @property
    def tool_name(self) -> str:
        return f"{self.connector}__{self.name}"



@dataclass(frozen=True, kw_only=True)
class Connector:
    name: str
    description: str
    base_url: str
    credential: str
    """The binding name the egress proxy resolves to a secret; the secret never passes through here."""
    file: str
    operations: Mapping[str, Operation]


@dataclass(frozen=True, kw_only=True)
class Registry:
    connectors: dict[str, Connector]

    def operations(self) -> list[Operation]:
        return [op for connector in self.connectors.values() for op in connector.operations.values()]

    def tools(self) -> list[Operation]:
        """The operations that become MCP tools (internal ones only reconcile)."""
        return [op for op in self.operations() if not op.internal]

    def operation(self, tool_name: str) -> Operation:
        connector, _, name = tool_name.partition("__")
        try:
            return self.connectors[connector].operations[name]
        except KeyError:
            raise NotFound("unknown_tool", f"there is no tool named {tool_name!r}", tool=tool_name) from None

    def reconciler(self, op: Operation) -> Operation:
        """The read that tells whether `op` happened."""
        if op.reconcile is None:
            raise ValueError(f"{op.tool_name} declares no reconcile")
        return self.connectors[op.connector].operations[op.reconcile.operation]


@dataclass(frozen=True, kw_only=True)
class ExtractedObject:
    kind: str
    ref: str
    snapshot: dict[str, object]


@dataclass(frozen=True, kw_only=True)
class ConnectorProblem:
    file: str
    line: int | None
    message: str
    """Starts with the dotted key it is about, e.g. `operations.x.method: must be one of …`."""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}" if self.line else f"{self.file}: {self.message}"


class ConnectorError(BadRequest):
    """Connector declarations that cannot be loaded: every problem in every file, each with its file and line."""

    file: str
    line: int | None
    problem: str
    problems: tuple[ConnectorProblem, ...]

    def __init__(self, problems: Sequence[ConnectorProblem]) -> None:
        first = problems[0]
        self.file, self.line, self.problem, self.problems = first.file, first.line, first.message, tuple(problems)
        super().__init__("invalid_connector", "\n".join(map(str, problems)), file=first.file, line=first.line,
                         problem=first.message,
                         problems=[{"file": p.file, "line": p.line, "message": p.message} for p in problems])


# --- loading -----------------------------------------------------------------------------------------------------


def load_connectors(directory: Path, *, base_urls: Mapping[str, str] = _NO_OVERRIDES) -> Registry:
    """Read and validate every `*.toml` in `directory` (sorted); raise one ConnectorError listing all problems.

    `base_urls` overrides a connector's base URL by connector name (names it does not know are ignored)."""
    if not directory.is_dir():
        raise ConnectorError([ConnectorProblem(file=str(directory), line=None, message="is not a directory")])
    problems: list[ConnectorProblem] = []
    connectors: dict[str, Connector] = {}
    declared: dict[str, str] = {}
    for file in sorted(directory.glob("*.toml")):
        decl, lines, found = _load_file(file, base_urls)
        problems += found
        if decl is None:
            continue
        name = decl.connector.name
        if name in declared:
            problems.append(_problem(str(file), lines, ("connector", "name"),
                                     f"connector {name} is already declared in {declared[name]}"))
            continue
        declared[name] = f"{file}:{lines.line_of(('connector', 'name'))}"
        if not found:
            connectors[name] = _connector(decl, file, base_urls.get(name, decl.connector.base_url).rstrip("/"))
    if problems:
        raise ConnectorError(problems)
    return Registry(connectors=connectors)


def _load_file(file: Path, base_urls: Mapping[str, str]) -> tuple[_FileDecl | None, TomlLines, list[ConnectorProblem]]:
    where = str(file)
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None, TomlLines(""), [ConnectorProblem(file=where, line=None, message="is not UTF-8 text")]
    lines = TomlLines(text)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return None, lines, [_syntax_problem(where, text, exc)]
    secrets = list(_secret_looking(raw))
    problems = [_problem(where, lines, key, message) for key, message in secrets]
    try:
        decl = _FileDecl.model_validate(raw)
    except _PydanticError as exc:
        flagged = {key for key, _ in secrets}
        for error in exc.errors():
            present, shown = _align(raw, (*error["loc"], "type") if error["type"].startswith("union_tag") else
                                    error["loc"])
            if error["type"] != "extra_forbidden" or present not in flagged:
                problems.append(_problem(where, lines, present, _pydantic_message(error), shown=shown))
        return None, lines, problems
    problems += [_problem(where, lines, key, message) for key, message in _semantic_problems(decl)]
    override = base_urls.get(decl.connector.name)
    if override is not None:
        try:
            _base_url(override)
        except ValueError as exc:
            problems.append(_problem(where, lines, ("connector", "base_url"), f"override {override!r} {exc}"))
    return decl, lines, problems


def _connector(decl: _FileDecl, file: Path, base_url: str) -> Connector:
    c = decl.connector
    operations = {
        name: Operation(connector=c.name, name=name, base_url=base_url, effect=op.effect, method=op.method,
                        path=op.path, description=op.description, internal=op.internal,
                        params=MappingProxyType(dict(op.params)), returns=op.returns, risk=op.risk,
                        idempotency_header=op.idempotency_header, amount=op.amount, reconcile=op.reconcile)
        for name, op in decl.operations.items()
    }
    return Connector(name=c.name, description=c.description, base_url=base_url, credential=c.credential,
                     file=str(file), operations=MappingProxyType(operations))


def _dotted(key: Key) -> str:
    return "".join(f"[{step}]" if isinstance(step, int) else f".{step}" for step in key).lstrip(".")


def _problem(file: str, lines: TomlLines, key: Key, message: str, *, shown: Key | None = None) -> ConnectorProblem:
    label = _dotted(key if shown is None else shown)
    return ConnectorProblem(file=file, line=lines.line_of(key), message=f"{label}: {message}" if label else message)


def _syntax_problem(file: str, text: str, exc: tomllib.TOMLDecodeError) -> ConnectorProblem:
    found = re.search(r" \(at line (\d+), column (\d+)\)$", str(exc))
    if found:
        return ConnectorProblem(file=file, line=int(found[1]),
                                message=f"invalid TOML: {str(exc)[:found.start()]} (column {found[2]})")
    return ConnectorProblem(file=file, line=text.count("\n") + 1 if text else None, message=f"invalid TOML: {exc}")


def _secret_looking(raw: object, key: Key = ()) -> Iterator[tuple[Key, str]]:
    if isinstance(raw, dict):
        for name, value in raw.items():
            if _SECRETISH.search(name):
                yield (*key, name), ("looks like a secret: a connector names its credential binding "
                                     '(credential = "…") and never holds a secret value')
            else:
                yield from _secret_looking(value, (*key, name))
    elif isinstance(raw, list):
        for index, value in enumerate(raw):
            if key[-1:] == ("keep",) and isinstance(value, str) and _SECRETISH.search(value):
                yield (*key, index), "looks like a secret: keeping it would copy it into the records"
            else:
                yield from _secret_looking(value, (*key, index))


def _align(raw: object, loc: Sequence[str | int]) -> tuple[Key, Key]:
    """(the deepest key present in the file, the key to show) for a pydantic error location: union tags dropped."""
    node = raw
    present: list[str | int] = []
    shown: list[str | int] = []
    for step in loc:
        if isinstance(node, dict) and step in node:
            node = node[step]
            present.append(step)
        elif isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node):
            node = node[step]
            present.append(step)
        elif step in _UNION_TAGS:
            continue
        else:
            node = None
        shown.append(step)
    return tuple(present), tuple(shown)


def _pydantic_message(error: Any) -> str:
    kind = error["type"]
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        return "is not a known key"
    if kind == "literal_error":
        return "must be one of " + str(error["ctx"]["expected"]).replace("'", "").replace(" or ", ", ")
    if kind.startswith("union_tag"):
        return "must be one of object, string, integer, boolean"
    if kind == "value_error":
        return str(error["ctx"]["error"])
    return str(error["msg"])


def _semantic_problems(decl: _FileDecl) -> Iterator[tuple[Key, str]]:
    ops = decl.operations
    returned = {spec.kind for op in ops.values() for spec in op.returns}
    for name, op in ops.items():
        at: Key = ("operations", name)
        tool = f"{decl.connector.name}__{name}"
        if len(tool) > TOOL_NAME_MAX:
            yield at, f"the tool name {tool} is longer than {TOOL_NAME_MAX} characters"
        yield from _path_problems(op, at)
        for pname, param in op.params.items():
            yield from _param_problems(op, param, (*at, "params", pname), returned)
        if op.effect == "read":
            if op.method in ("PUT", "PATCH", "DELETE"):
                yield (*at, "method"), 'a read uses GET or POST; PUT, PATCH and DELETE change things: effect = "write"'
            for key in ("risk", "idempotency_header", "amount", "reconcile"):
                if getattr(op, key) is not None:
                    yield (*at, key), f"only writes declare {key}" + (": reads are never risky" * (key == "risk"))
            continue
        if op.internal:
            yield (*at, "internal"), "only reads can be internal"
        if op.risk is None:
            yield (*at, "risk"), "is required for writes: auto, ask or deny"
        header = op.idempotency_header
        if header is not None and (header.lower() in _FRAMING_HEADERS or _SECRETISH.search(header)):
            yield (*at, "idempotency_header"), f"{header} is a framing or credential header"
        if op.amount is not None:
            yield from _amount_problems(op, op.amount, (*at, "amount"), ops)
        if op.reconcile is None:
            yield (*at, "reconcile"), "is required for writes: an uncertain outcome is checked, never retried blindly"
        else:
            yield from _reconcile_problems(op, op.reconcile, (*at, "reconcile"), ops)


def _path_problems(op: _OperationDecl, at: Key) -> Iterator[tuple[Key, str]]:
    placeholders = _PLACEHOLDER.findall(op.path)
    skeleton = _PLACEHOLDER.sub("x", op.path)
    if not op.path.startswith("/") or "{" in skeleton or "}" in skeleton:
        yield (*at, "path"), "must start with / and use {param} placeholders"
    elif op.path != "/" and not all(_SEGMENT.fullmatch(s) and s not in (".", "..") for s in skeleton[1:].split("/")):
        yield (*at, "path"), "must be non-empty segments of URL-safe characters (no ?, #, %, or . and .. segments)"
    for name in dict.fromkeys(placeholders):
        param = op.params.get(name)
        if param is None or param.location != "path":
            yield (*at, "path"), f'placeholder {{{name}}} has no parameter with in = "path"'
        elif placeholders.count(name) > 1:
            yield (*at, "path"), f"placeholder {{{name}}} appears more than once"
    for name, param in op.params.items():
        if param.location == "path" and name not in placeholders:
            yield (*at, "params", name, "in"), f'is "path" but the path has no {{{name}}}'


def _param_problems(op: _OperationDecl, param: ObjectParam | StringParam | IntegerParam | BooleanParam, at: Key,
                    returned: set[str]) -> Iterator[tuple[Key, str]]:
    if param.location == "path" and not param.required:
        yield (*at, "required"), "path parameters are always required"
    if param.location == "body" and op.method in ("GET", "DELETE"):
        yield (*at, "in"), f'{op.method} requests carry no body: use in = "query"'
    if isinstance(param, ObjectParam) and param.kind not in returned:
        yield (*at, "kind"), f"no operation of this connector returns objects of kind {param.kind}"
    if isinstance(param, StringParam) and param.pattern is not None:
        if not (param.pattern.startswith("^") and param.pattern.endswith("$")):
            yield (*at, "pattern"), "must be anchored: ^…$"
        else:
            try:
                re.compile(param.pattern)
            except re.error as exc:
                yield (*at, "pattern"), f"is not a regular expression: {exc}"
    if isinstance(param, IntegerParam) and param.minimum is not None and param.maximum is not None:
        if param.minimum > param.maximum:
            yield (*at, "maximum"), "is below minimum"


def _amount_problems(op: _OperationDecl, amount: Amount, at: Key,
                     ops: Mapping[str, _OperationDecl]) -> Iterator[tuple[Key, str]]:
    param = op.params.get(amount.from_object)
    if not isinstance(param, ObjectParam):
        yield (*at, "from_object"), "must name an object parameter of this operation"
        return
    kept = {f for other in ops.values() for spec in other.returns if spec.kind == param.kind for f in spec.keep}
    for key in ("field", "currency_field"):
        if getattr(amount, key) not in kept:
            yield (*at, key), f"no operation keeps {getattr(amount, key)} for objects of kind {param.kind}"


def _reconcile_problems(op: _OperationDecl, rec: Reconcile, at: Key,
                        ops: Mapping[str, _OperationDecl]) -> Iterator[tuple[Key, str]]:
    target = ops.get(rec.operation)
    if target is None or target.effect != "read":
        why = "there is no such operation in this connector" if target is None else "it is a write"
        yield (*at, "operation"), f"must name a read of this connector to reconcile with; {rec.operation}: {why}"
        return
    supplied = set(rec.with_)
    for theirs, ours in rec.with_.items():
        want, have = target.params.get(theirs), op.params.get(ours)
        if want is None or have is None:
            yield (*at, "with", theirs), (f"{rec.operation} has no parameter {theirs}" if want is None
                                          else f"there is no parameter {ours}")
        elif _describe(want) != _describe(have):
            yield (*at, "with", theirs), f"{ours} ({_describe(have)}) cannot fill {theirs} ({_describe(want)})"
        elif want.required and not have.required:
            yield (*at, "with", theirs), f"{theirs} is required, and {ours} is optional"
    key = rec.by_idempotency_key
    if key is not None:
        supplied.add(key)
        if op.idempotency_header is None:
            yield (*at, "by_idempotency_key"), "needs idempotency_header on this operation"
        if not isinstance(target.params.get(key), StringParam):
            yield (*at, "by_idempotency_key"), f"{rec.operation} has no string parameter {key}"
    unfilled = [name for name, param in target.params.items() if param.required and name not in supplied]
    if unfilled:
        yield at, f"{rec.operation} needs {', '.join(unfilled)}: fill it through `with` or by_idempotency_key"
    if (rec.done_when.equals is None) == (rec.done_when.exists is None):
        yield (*at, "done_when"), "needs exactly one of equals or exists"


def _describe(param: Any) -> str:
    return f"object of kind {param.kind}" if isinstance(param, ObjectParam) else str(param.type)


# --- arguments, requests, responses ---------------------------------------------------------------------------


def validate_arguments(op: Operation, args: Mapping[str, object]) -> dict[str, object]:
    """The arguments, checked against the operation's params; object params stay object-ID strings.

    Raises BadRequest("invalid_arguments") naming every parameter that is unknown, missing or wrong."""
    if not isinstance(args, Mapping):
        raise BadRequest("invalid_arguments", f"{op.tool_name} takes an object of named arguments", tool=op.tool_name)
    wrong: dict[str, str] = {}
    for name in args:
        if name not in op.params:
            wrong[name] = f"is not a parameter of {op.tool_name} (it takes: {', '.join(op.params) or 'nothing'})"
    valid: dict[str, object] = {}
    for name, param in op.params.items():
        if name not in args:
            if param.required:
                wrong[name] = "is required"
        elif (problem := _value_problem(param, args[name])) is not None:
            wrong[name] = problem
        else:
            valid[name] = args[name]
    if wrong:
        message = "; ".join(f"argument {name!r} {problem}" for name, problem in wrong.items())
        raise BadRequest("invalid_arguments", f"{op.tool_name}: {message}", tool=op.tool_name, parameters=list(wrong))
    return valid


def _value_problem(param: ObjectParam | StringParam | IntegerParam | BooleanParam, value: object) -> str | None:
    if isinstance(param, ObjectParam):
        if not isinstance(value, str) or not _OBJECT_ID.fullmatch(value):
            return f"must be an object ID (obj_…) of kind {param.kind} returned by a read tool, not {_short(value)}"
    elif isinstance(param, StringParam):
        if not isinstance(value, str):
            return f"must be a string, not {_short(value)}"
        if param.location == "path" and not value:
            return "must not be empty"
        if param.max_length is not None and len(value) > param.max_length:
            return f"is {len(value)} characters long; at most {param.max_length} are allowed"
        if param.pattern is not None and not re.fullmatch(param.pattern, value):
            return f"must match {param.pattern}, not {_short(value)}"
        if param.enum is not None and value not in param.enum:
            return f"must be one of {', '.join(param.enum)}, not {_short(value)}"
    elif isinstance(param, IntegerParam):
        if not isinstance(value, int) or isinstance(value, bool):
            return f"must be an integer, not {_short(value)}"
        if param.minimum is not None and value < param.minimum:
            return f"must be at least {param.minimum}, not {value}"
        if param.maximum is not None and value > param.maximum:
            return f"must be at most {param.maximum}, not {value}"
    elif not isinstance(value, bool):
        return f"must be true or false, not {_short(value)}"
    return None


def _short(value: object) -> str:
    text = json.dumps(value) if isinstance(value, str | int | float | bool | None) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "…"


def build_request(op: Operation, *, args: Mapping[str, object], resolved: Mapping[str, str],
                  idempotency_key: str | None) -> EgressRequest:
    """The request for `op`: `resolved` maps each object argument to its external ref (resolved by the caller).

    Path values are quoted whole (`/` and `.` too), so a value can never add, leave or collapse a segment. Body
    params are one canonical JSON object (always sent, maybe `{}`, when the operation has body params). The
    idempotency key goes in the declared header (required then; ignored for operations without one)."""
    values = validate_arguments(op, args)
    objects = {name for name in values if isinstance(op.params[name], ObjectParam)}
    if set(resolved) != objects:
        raise ValueError(f"resolved must map exactly the object arguments {sorted(objects)}, not {sorted(resolved)}")
    if not all(isinstance(ref, str) and ref for ref in resolved.values()):
        raise ValueError("a resolved external reference must be a non-empty string")
    wire = {name: resolved[name] if name in objects else value for name, value in values.items()}

    def where(location: str) -> dict[str, object]:
        return {name: value for name, value in wire.items() if op.params[name].location == location}

    path = _PLACEHOLDER.sub(lambda m: quote(_text(wire[m[1]]), safe="").replace(".", "%2E"), op.path)
    query = urlencode([(name, _text(value)) for name, value in where("query").items()], quote_via=quote)
    url = op.base_url + path + (f"?{query}" if query else "")
    headers: list[tuple[str, str]] = []
    body = None
    if any(param.location == "body" for param in op.params.values()):
        body = json.dumps(where("body"), sort_keys=True, separators=(",", ":")).encode()
        headers.append(("content-type", "application/json"))
    if op.idempotency_header is not None:
        if idempotency_key is None or not _HEADER_VALUE.fullmatch(idempotency_key):
            raise ValueError(f"{op.tool_name} needs an idempotency key of visible ASCII, not {idempotency_key!r}")
        headers.append((op.idempotency_header, idempotency_key))
    # The one shape of this request from here to the proxy's decision: exactly what will be sent, minus the
    # credential the egress proxy adds after the policy approved it.
    return EgressRequest.of(op.method, url, headers=tuple(headers), body=body)


def _text(value: object) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def values_at(body: object, path: str) -> list[object]:
    """The values a `returns.at` / `done_when.at` path picks out of a JSON body."""
    values = [body]
    for step in path.split(".") if path else ():
        key, each = (step[:-2], True) if step.endswith("[]") else (step, False)
        picked: list[object] = []
        for value in values:
            if key:
                if not isinstance(value, dict) or key not in value:
                    continue
                value = value[key]
            if not each:
                picked.append(value)
            elif isinstance(value, list):
                picked.extend(value)
        values = picked
    return values


def _field(element: Mapping[str, object], path: str) -> object:
    value: object = element
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return _MISSING
        value = value[key]
    return value


def extract_objects(op: Operation, body: object) -> list[ExtractedObject]:
    """The objects a response holds, per `returns`, each once, its snapshot holding only the `keep` fields."""
    found: list[ExtractedObject] = []
    seen: set[tuple[str, str]] = set()
    for spec in op.returns:
        for element in values_at(body, spec.at):
            if not isinstance(element, dict):
                continue
            ref = _field(element, spec.ref)
            if not isinstance(ref, str) or not ref or not ref.isprintable() or (spec.kind, ref) in seen:
                continue
            seen.add((spec.kind, ref))
            snapshot = {name: value for name in spec.keep if (value := _field(element, name)) is not _MISSING}
            found.append(ExtractedObject(kind=spec.kind, ref=ref, snapshot=snapshot))
    return found


def reconcile_arguments(op: Operation, *, args: Mapping[str, object], idempotency_key: str | None) -> dict[str, object]:
    """Arguments for `Registry.reconciler(op)`, from the write's arguments (object IDs pass through) and its key."""
    if op.reconcile is None:
        raise ValueError(f"{op.tool_name} declares no reconcile")
    out = {theirs: args[ours] for theirs, ours in op.reconcile.with_.items() if ours in args}
    if op.reconcile.by_idempotency_key is not None:
        if idempotency_key is None:
            raise ValueError(f"{op.tool_name} reconciles by idempotency key, and none was given")
        out[op.reconcile.by_idempotency_key] = idempotency_key
    return out


def reconcile_done(op: Operation, body: object) -> bool:
    """Whether the reconciling read's response body shows that `op` took effect."""
    if op.reconcile is None:
        raise ValueError(f"{op.tool_name} declares no reconcile")
    return done_when_holds(op.reconcile.done_when, body)


def done_when_holds(done_when: DoneWhen, body: object) -> bool:
    """Whether a response body satisfies a `done_when` condition."""
    values = [value for value in values_at(body, done_when.at) if value is not None]
    if done_when.exists is not None:
        return bool(values) == done_when.exists
    return any(type(value) is type(done_when.equals) and value == done_when.equals for value in values)
