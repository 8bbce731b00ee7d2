"""PostgreSQL: pool, named queries, migrations. The only package that imports asyncpg."""
