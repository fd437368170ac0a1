"""A benchmark run's rows, whatever their dataclass (fagen.bench.Row, the forward's;
fagen.bench_backward.BackwardRow): indexed by case, written to and read back from JSON
({"meta": ..., "rows": [...]}) and CSV (a column per field). Pure: no GPU."""

from __future__ import annotations

import csv
import json
from pathlib import Path


def by_case(rows: list) -> dict[str, dict]:
    """{case key: {impl: row}}."""
    table: dict[str, dict] = {}
    for r in rows:
        table.setdefault(r.case, {})[r.impl] = r
    return table


def write_json(rows: list, path: Path, meta: dict) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "rows": [r.as_dict() for r in rows]}, indent=1) + "\n")


def write_csv(rows: list, path: Path, row_type: type) -> None:
    """A line per row, a column per field of row_type (bench.Row, or bench_backward.BackwardRow)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(row_type.__dataclass_fields__))
        w.writeheader()
        for r in rows:
            w.writerow(r.as_dict())


def read_json(path: Path, row_type: type, fix: str):
    """The rows (of row_type) and meta of a file write_json wrote; ValueError (one line: what is
    wrong, then `fix`, what to pass) for a file that is not one."""
    data = read_json_object(path, fix)
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: \"meta\" is a {type(meta).__name__}, not a mapping; {fix}")
    rows = []
    for i, r in enumerate(data["rows"]):
        try:
            rows.append(row_type(**r))
        except TypeError as err:  # not a mapping, or fields missing or unknown
            raise ValueError(f"{path}: rows[{i}] is not a bench row ({err}); {fix}") from None
    return rows, meta


def read_json_object(path: Path, fix: str) -> dict:
    """The top-level mapping of a rows file, its "rows" a list; ValueError (one line) otherwise."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err.msg} at line {err.lineno}, column {err.colno}); {fix}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text; {fix}") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{path}: no \"rows\" list at the top level; {fix}")
    return data
