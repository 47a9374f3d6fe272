"""The published JSON Schema of a scenario file (`scenarios/schema.json`)."""

from __future__ import annotations

import json
from pathlib import Path

from chaos.scenario.schema import Scenario

# --- the published JSON Schema ---------------------------------------------------------------

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "scenarios" / "schema.json"


def schema_text() -> str:
    """The JSON Schema of a scenario file, as `scenarios/schema.json` holds it."""
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **Scenario.model_json_schema(),
    }
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def write_schema(path: str | Path = SCHEMA_PATH) -> Path:
    """(Re)write the published schema; a test fails when the committed file is stale."""
    path = Path(path)
    path.write_text(schema_text(), encoding="utf-8")
    return path
