"""Contract suites: one set of tests per port, subclassed once per adapter."""
