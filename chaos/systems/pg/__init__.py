"""`pg`: PostgreSQL alone, the second document's default design."""
