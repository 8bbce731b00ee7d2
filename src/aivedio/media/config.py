"""Media configuration: one frozen object built at the edge and passed to the consumer/worker."""

from __future__ import annotations

from dataclasses import dataclass, field

from aivedio.consumers import ConsumerSettings
from aivedio.media.fetch import FetchLimits
from aivedio.media.pipeline import MediaLimits
from aivedio.media.retry import RetryPolicy


@dataclass(frozen=True, slots=True)
class MediaConfig:
    """
    - ``group``: the durable bus group of the media consumer.
    - ``concurrency``: operations one worker process runs at once (render runs in threads).
    - ``poll_interval_s``: how often an idle worker looks for due operations.
    - ``lease_s``: how long a claim holds an operation; renewed every third of it while running,
      so only a worker that died (or lost the database) lets it lapse.
    - ``max_relocations``: fresh URLs asked for within one try after the URL was refused.
    - ``key_prefix``: where in the object store originals and renditions go.
    """

    group: str = "media"
    consumer: ConsumerSettings = field(default_factory=ConsumerSettings)
    concurrency: int = 2
    poll_interval_s: float = 0.25
    lease_s: float = 60.0
    max_relocations: int = 2
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    fetch: FetchLimits = field(default_factory=FetchLimits)
    limits: MediaLimits = field(default_factory=MediaLimits)
    key_prefix: str = "media"

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.lease_s <= 0 or self.poll_interval_s <= 0:
            raise ValueError("concurrency >= 1, lease_s > 0 and poll_interval_s > 0")
