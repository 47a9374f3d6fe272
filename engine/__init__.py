"""A durable, LLM-driven rule-evaluation engine: a pure decision core and its live runtime."""
