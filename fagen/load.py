"""Specs from YAML files, YAML text or mappings, validated: the spec's own rules (fagen.spec)
and the plan's resource rules (shared memory, registers), with errors that name the field,
the value, the rule and a fix. Also where the shipped specs live.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import yaml
from pydantic import ValidationError

from fagen.backward_plan import backward_plan
from fagen.plan import plan
from fagen.spec import AttentionSpec, SpecError, rule

_PACKAGE = Path(__file__).resolve().parent
# The shipped specs: packaged as fagen/specs in a wheel, at specs/ beside the package in a checkout.
SPECS = _PACKAGE / "specs" if (_PACKAGE / "specs").is_dir() else _PACKAGE.parent / "specs"


def _type_fix(e: dict, leaf: str) -> str:
    """The fix for a value of the wrong type: what to write instead, in YAML."""
    given = e.get("input")
    if e["type"] == "literal_error":
        close = difflib.get_close_matches(str(given), re.findall(r"'([^']*)'", e["ctx"]["expected"]), n=1)
        return f"did you mean {close[0]!r}?" if close else "use one of those"
    if e["type"] == "int_type":
        example = given if isinstance(given, str) and given.strip().isdigit() else 2
        return f"write a whole number without quotes, e.g. {leaf}: {str(example).strip()}"
    if e["type"] == "float_type":
        return f"write a number without quotes, e.g. {leaf}: 30.0"
    if e["type"] == "bool_type":
        return f"write true or false without quotes, e.g. {leaf}: true"
    if e["type"] == "string_type":
        return f"write text, e.g. {leaf}: \"...\""
    if e["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return f"write a mapping of {leaf}'s fields (see specs/ for examples)"
    return "see the README's spec reference"


def _explain(err: ValidationError, source: str) -> str:
    lines = [f"invalid spec {source}:"]
    for e in err.errors():
        loc = [str(p) for p in e["loc"] if not str(p).startswith("function-")]
        where = ".".join(loc)
        msg = e["msg"].removeprefix("Value error, ")
        if not where:  # a rule across fields: its message names them already
            pass
        elif e["type"] == "extra_forbidden":
            msg = f"unknown key {where!r}; remove it or check its spelling"
        elif e["type"] == "missing":
            msg = f"{where} is required; add it (specs/attn_f16_d128.yaml shows every field)"
        elif e["type"] == "value_error":
            msg = msg if where in msg else f"{where} = {e.get('input')!r}: {msg}"
        else:  # the wrong type: pydantic says what it expected, we add what to write
            rule_text = f"must be one of {e['ctx']['expected']}" if e["type"] == "literal_error" else \
                msg[0].lower() + msg[1:]
            msg = f"{where} = {e.get('input')!r}: {rule_text}; {_type_fix(e, loc[-1])}"
        lines.append(f"  - {msg}")
    if len(lines) == 2:  # one broken rule: one line
        return f"{lines[0]} {lines[1].removeprefix('  - ')}"
    return "\n".join(lines)


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
        raise SpecError(_explain(err, source)) from None
    try:
        plan(spec)  # smem and register budgets
        if spec.backward is not None:
            backward_plan(spec)
    except SpecError as err:
        raise SpecError(f"invalid spec {source}: {err}") from None
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
        raise SpecError(rule("name", spec.name, f"must equal the file's stem {path.stem!r} "
                                                "(generated/<name>.cu is rendered from specs/<name>.yaml)",
                             f"rename the file or set name: {path.stem}"))
    return spec
