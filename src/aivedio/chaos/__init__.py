"""``aivedio chaos``: every fault at once against a cluster, and the invariants that must hold."""
