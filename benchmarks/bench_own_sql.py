"""What the SQL allow-list costs a query of your own (issue 30): ``run_sql`` (formatQuery, EXPLAIN
AST, the catalog, then the query on a read-only client) against the same query run plainly on the
same client, for an all-tenant caller and a tenant (table filters), on a migrated chDB store with
the recorded vLLM requests of tests/data.

    .venv/bin/python benchmarks/bench_own_sql.py [--runs 50]

Printed: the median ms of each, and the median added by the checks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparseety import events as ev
from sparseety.config import load_config
from sparseety.queries.sql import Access, run_sql
from sparseety.sinks.clickhouse.client import Store
from sparseety.sinks.clickhouse.migrate import migrate
from sparseety.sinks.clickhouse.writer import ClickHouseSink
from sparseety.streams.assembler import Assembler
from sparseety.streams.state import MemoryStore
from tests.recorded import load_scenario, scenarios


def _median_ms(fn: object, runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(clickhouse={"dsn": f"chdb://{tmp}/ch", "database": "bench"})
        store = Store.open(cfg)
        migrate(store)
        sink = ClickHouseSink(store)
        n = 0
        for name in scenarios():
            events, _ = load_scenario(name)
            asm = Assembler(load_config().worker, MemoryStore())
            for e in events:
                for o in asm.apply(e):
                    if o.record_name == ev.REQUEST_ACCOUNTING:
                        sink.add(ev.REQUEST_ACCOUNTING, o.record, topic="t", partition=0, offset=n)
                        n += 1
        sink.flush()
        sql = "SELECT tenant, count() AS n, sum(prompt_tokens) AS p FROM bench.requests_v GROUP BY tenant"
        tenant = next(r["tenant"] for r in store.query("SELECT tenant FROM bench.requests LIMIT 1"))
        with store.readers(1) as readers:
            reader = readers.store()
            plain = _median_ms(lambda: reader.query_rows(sql), args.runs)
            print(f"bench_own_sql: {n} requests; plain query {plain:.2f} ms (median of {args.runs})")
            for label, access in (("all-tenant", Access()), ("tenant", Access((tenant,), token_ids=False))):
                checked = _median_ms(lambda a=access: run_sql(reader, sql, access=a), args.runs)
                print(f"bench_own_sql: {label} run_sql {checked:.2f} ms, checks add {checked - plain:.2f} ms")
        store.close()


if __name__ == "__main__":
    main()
