"""The reconciler role and the operator's reconciliation queue (``aivedio reconcile``)."""
