"""The billing consumer: reserve / settle / refund ledger rows, unique per (task, attempt, type)."""

from aivedio.billing.config import BillingConfig, PriceTable
from aivedio.billing.consumer import BillingConsumer
from aivedio.billing.ledger import Balance, LedgerType, tenant_balance

__all__ = [
    "Balance",
    "BillingConfig",
    "BillingConsumer",
    "LedgerType",
    "PriceTable",
    "tenant_balance",
]
