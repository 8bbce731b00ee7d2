"""Media: the consumer that queues work on ``provider_succeeded``, the worker that fetches,
stores, probes, renders and publishes the asset, and signed playback links."""
