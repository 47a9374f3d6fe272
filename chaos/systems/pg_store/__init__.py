"""`pg-store`: the same shell and RabbitMQ, PostgreSQL as the engine's store."""
