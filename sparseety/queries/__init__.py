"""The read side: the query library over the store (docs/architecture.md).

``base`` (what a query sees and what one query is: :class:`~.base.Scope`, :class:`~.base.QuerySpec`,
the grouping and tenant-hiding SQL helpers) at the bottom; the sub-queries above it (what-if,
outliers, regressions, routing, sessions, tokens, listing, export, ids, caveats) and users' own
SQL (``sql``); the registry on top (``registry``: ``QUERIES``, :class:`~.registry.Queries`). The
API, the CLI, the dashboard and offline analysis import it; the stages (producers, streams,
sinks) never do.
"""
