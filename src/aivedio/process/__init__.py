"""The process that runs roles: what a role contributes (``parts``).

Role modules import :mod:`aivedio.process.parts` at module level; nothing in this package imports
a role module, so there is no cycle.
"""
