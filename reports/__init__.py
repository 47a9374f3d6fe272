"""Reports: retry latency and duplicated LLM cost."""
