"""Provider adapters behind one port, :mod:`aivedio.providers.port` (import from there).

One module per provider dialect: ``sandbox`` (aivedio's fake provider), ``replicate``, ``fal``,
``runway`` (poll-only) and ``kling`` (unsigned callbacks), standing on the adapter support
``common``, ``http``, ``redact`` and the verifiers ``verify`` and ``jwks``; ``registry`` builds
them from config.
"""
