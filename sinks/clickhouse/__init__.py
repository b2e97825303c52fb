"""sinks/clickhouse."""
