"""Specs from YAML files, YAML text or mappings, validated: the spec's own rules (fagen.spec)
and the plan's resource rules (shared memory, registers), with errors that name the field,
the value, the rule and a fix. Also where the shipped specs live.
"""

from __future__ import annotations

import difflib
import math
import re
import typing
from functools import lru_cache
from pathlib import Path

import yaml
from pydantic import ValidationError

from fagen.backward_plan import backward_plan
from fagen.plan import plan
from fagen.spec import REMOVE, AttentionSpec, SpecError, name_like, rule, valid_name, with_fix

_PACKAGE = Path(__file__).resolve().parent
# The shipped specs: packaged as fagen/specs in a wheel, at specs/ beside the package in a checkout.
SPECS = _PACKAGE / "specs" if (_PACKAGE / "specs").is_dir() else _PACKAGE.parent / "specs"


REFERENCE = "attn_f16_d128.yaml"  # the shipped spec a message points to for every field


@lru_cache(maxsize=1)
def _reference() -> dict:
    """The reference spec's fields, as written (a value to offer for a missing field)."""
    try:
        return yaml.safe_load((SPECS / REFERENCE).read_text()) or {}
    except OSError:
        return {}


def _lookup(data: object, loc: list[str]) -> object:
    for key in loc:
        if isinstance(data, str) and key == "kind":  # mask: causal is mask: {kind: causal}
            return data
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def _field_default(loc: list[str]) -> object:
    """The model default of the field at loc, or None."""
    model = AttentionSpec
    for i, key in enumerate(loc):
        field = getattr(model, "model_fields", {}).get(key)
        if field is None:
            return None
        if i == len(loc) - 1:
            return None if field.is_required() else field.default
        inner = [t for t in (typing.get_args(field.annotation) or (field.annotation,)) if isinstance(t, type)]
        model = next((t for t in inner if hasattr(t, "model_fields")), None)
    return None


def _validates(data: dict) -> tuple[bool, list[tuple]]:
    """Whether `data` validates (rules and resources), and the locations of what it breaks."""
    try:
        spec = AttentionSpec.model_validate(data)
        plan(spec)
        if spec.backward is not None:
            backward_plan(spec)
    except ValidationError as err:
        return False, [tuple(str(p) for p in e["loc"] if not str(p).startswith("function-")) for e in err.errors()]
    except SpecError:
        return False, [()]
    return True, []


def _fitting(data: object, loc: list[str], candidates: list) -> object:
    """The first candidate for the field at loc with which the whole spec validates; else the
    first with which that field is no longer at fault (the spec breaks other rules too)."""
    if not isinstance(data, dict):
        return None
    seen, fallback = [], None
    for value in candidates:
        if value is None or value in seen:
            continue
        seen.append(value)
        ok, broken = _validates(with_fix(data, {".".join(loc): value}))
        if ok:
            return value
        if fallback is None and tuple(loc) not in broken:
            fallback = value
    return fallback if fallback is not None else next(iter(seen), None)


def _integer(given: object) -> int | None:
    """A whole number that YAML or a caller typed as something else: 128.0, "128"."""
    if isinstance(given, float) and math.isfinite(given) and given.is_integer():
        return int(given)
    if isinstance(given, str) and given.strip().isascii() and given.strip().isdigit():
        return int(given.strip())
    return None


def _number(given: object) -> float | None:
    try:
        value = float(given) if isinstance(given, str) else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


def _truth(given: object) -> bool | None:
    words = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
    return words.get(str(given).strip().lower()) if isinstance(given, (str, int)) else None


def _candidates(e: dict, loc: list[str]) -> list:
    """Values to offer for a field of the wrong type, or missing, in the order they are tried."""
    given, kind = e.get("input"), e["type"]
    usual = [_lookup(_reference(), loc), _field_default(loc)]
    if kind == "int_type":
        return [_integer(given), 2, *usual, 64, 128, 4, 8, 1, 3, 16, 32, 256, 24, 240, 1024]
    if kind == "float_type":
        return [_number(given), *usual, 30.0, 1.0]
    if kind == "bool_type":
        return [_truth(given), True, False]
    if kind == "literal_error":
        options = re.findall(r"'([^']*)'", e["ctx"]["expected"])
        return [*difflib.get_close_matches(str(given), options, n=1), *usual, *options]
    if kind == "string_type" and loc == ["name"]:
        return [name_like(str(given))]
    if kind == "string_type":  # an expression written as a bare number: its text, else the field's example
        return [str(given) if isinstance(given, (int, float)) else None, *usual, *STRING_EXAMPLES.get(loc[-1], ())]
    return [*usual, {}]


# Text that validates in a string field of the spec (fagen.expression's syntax), tried in turn.
STRING_EXAMPLES = {"expression": ("kv_idx <= q_idx", "score"), "expression_grad": ("1.0f",)}


def _yaml_value(value: object) -> str:
    """`value` as the user writes it in a spec."""
    if isinstance(value, (dict, list)):
        return yaml.safe_dump(value, default_flow_style=True, sort_keys=False).strip()
    text = yaml.safe_dump(value, default_flow_style=True).strip()
    return text.removesuffix("...").strip()


def _type_fix(e: dict, leaf: str, value: object) -> str:
    """The fix for a value of the wrong type: what to write instead, in YAML (`value`: one that
    validates, where one does)."""
    example = f"{leaf}: {_yaml_value(value)}" if value is not None else None
    if e["type"] == "literal_error":
        return f"did you mean {value!r}?" if value is not None else "use one of those"
    if value is None:
        return "see the README's spec reference"
    if e["type"] == "int_type":
        return f"write a whole number without quotes, e.g. {example}"
    if e["type"] == "float_type":
        return f"write a number without quotes, e.g. {example}"
    if e["type"] == "bool_type":
        return f"write true or false without quotes, e.g. {example}"
    if e["type"] == "string_type":
        return f"write text, e.g. {example}"
    if e["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return f"write a mapping of {leaf}'s fields, e.g. {example} (see specs/{REFERENCE})"
    return f"e.g. {example}"


def _explain(err: ValidationError, source: str, data: object = None) -> SpecError:
    """One SpecError for pydantic's errors: a line each (one line for one), and their fixes
    merged into SpecError.fix where each is a change of fields."""
    lines, fix = [f"invalid spec {source}:"], {}
    for e in err.errors():
        loc = [str(p) for p in e["loc"] if not str(p).startswith("function-")]
        where = ".".join(loc)
        msg = e["msg"].removeprefix("Value error, ")
        cause = (e.get("ctx") or {}).get("error")
        change = getattr(cause.args[0], "fix", None) if cause is not None and cause.args else None
        if not where:  # a rule across fields: its message names them already
            pass
        elif e["type"] == "extra_forbidden":
            msg, change = f"unknown key {where!r}; remove it or check its spelling", {where: REMOVE}
        elif e["type"] == "missing":
            value = _fitting(data, loc, _candidates(e, loc))
            msg = f"{where} is required; add it" + (f", e.g. {loc[-1]}: {_yaml_value(value)}" if value is not None
                                                    else "") + f" (specs/{REFERENCE} shows every field)"
            change = {where: value} if value is not None else None
        elif e["type"] == "value_error":
            if msg.startswith(f"{loc[-1]} = ") and where != loc[-1]:
                # a rule of a model that sits at several places names fields relative to itself
                prefix = where[:-len(loc[-1])]
                msg = prefix + msg
                change = {prefix + k: v for k, v in change.items()} if change else change
            msg = msg if where in msg else f"{where} = {e.get('input')!r}: {msg}"
        else:  # the wrong type: pydantic says what it expected, we add what to write
            value = _fitting(data, loc, _candidates(e, loc))
            rule_text = f"must be one of {e['ctx']['expected']}" if e["type"] == "literal_error" else \
                msg[0].lower() + msg[1:]
            msg = f"{where} = {e.get('input')!r}: {rule_text}; {_type_fix(e, loc[-1], value)}"
            change = {where: value} if value is not None else None
        if change and fix is not None:
            fix.update(change)
        else:
            fix = None  # a message without a change of fields: the whole has none
        lines.append(f"  - {msg}")
    if len(lines) == 2:  # one broken rule: one line
        return SpecError(f"{lines[0]} {lines[1].removeprefix('  - ')}", fix)
    return SpecError("\n".join(lines), fix)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML lets a repeated key silently win; in a spec two `stages:` lines are a mistake."""


def _mapping_without_duplicates(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}: keep one of its lines", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)
# YAML 1.1 (PyYAML) reads a plain 1e7, 1.5e3 or 2E-3 as a string: its floats need a dot and a signed
# exponent. In a spec they are numbers (as in YAML 1.2); a quoted "1e7" stays a string, and refused.
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _yaml(text: str, source: str) -> object:
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise SpecError(f"spec {source} is not valid YAML: {' '.join(str(err).split())}") from None


def parse_spec(data: dict | str, source: str = "<dict>") -> AttentionSpec:
    """Validate a mapping of fields, or YAML text, into a spec, with the plan's resource rules
    (shared memory, registers) checked too. For a file, use `load_spec(path)`."""
    if isinstance(data, str):
        data, source = _yaml(data, "<text>" if source == "<dict>" else source), "<text>" if source == "<dict>" else source
    if isinstance(data, Path):
        raise SpecError(f"parse_spec takes a mapping or YAML text, got the path {str(data)!r}; "
                        f"use fagen.load_spec({str(data)!r})")
    if not isinstance(data, dict):
        raise SpecError(f"invalid spec {source}: expected a mapping of fields, got {type(data).__name__}; "
                        f"see specs/attn_f16_d128.yaml for the fields")
    try:
        spec = AttentionSpec.model_validate(data)
    except ValidationError as err:
        raise _explain(err, source, data) from None
    try:
        plan(spec)  # smem and register budgets
        if spec.backward is not None:
            backward_plan(spec)
    except SpecError as err:
        raise SpecError(f"invalid spec {source}: {err}", err.fix) from None
    return spec


def validated(spec: AttentionSpec) -> AttentionSpec:
    """`spec`, validated again: `model_copy(update=...)` builds a spec without running a rule,
    so every path from a spec to kernel text passes through here."""
    if not isinstance(spec, AttentionSpec):
        raise SpecError(f"expected an AttentionSpec, got {type(spec).__name__}; build one with "
                        f"fagen.load_spec(path) or fagen.parse_spec(mapping or YAML text)")
    return parse_spec(spec.model_dump(), f"{spec.name!r}")


def load_spec(path: str | Path) -> AttentionSpec:
    """The spec in a YAML file; its name must be the file's stem. Mappings and YAML text go
    through `parse_spec`."""
    if not isinstance(path, (str, Path)):
        raise SpecError(f"load_spec takes a path to a YAML file, got {type(path).__name__}; "
                        f"for a mapping or YAML text use fagen.parse_spec")
    if isinstance(path, str) and "\n" in path:
        raise SpecError("load_spec takes a path, and this looks like YAML text; use fagen.parse_spec(text)")
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise SpecError(f"cannot read spec {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise SpecError(f"spec {path} is not UTF-8 text: {err.reason}") from None
    spec = parse_spec(_yaml(text, str(path)), str(path))
    if spec.name != path.stem:
        why = f"must equal the file's stem {path.stem!r} (<name>.cu is rendered from <name>.yaml)"
        if valid_name(path.stem):
            raise SpecError(rule("name", spec.name, why, f"set name: {path.stem}, or rename the file to "
                                 f"{spec.name}.yaml", {"name": path.stem}))
        raise SpecError(rule("name", spec.name, why, f"rename the file to {spec.name}.yaml (the stem "
                             f"{path.stem!r} is not a spec name)"))
    return spec
