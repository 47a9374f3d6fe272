"""`python -m chaos.scenario`: refresh scenarios/schema.json."""

from chaos.scenario.published import write_schema

print(write_schema())
