"""oproj_jax: the TP output-projection all-reduce consumer with Block AttnRes, for JAX."""

from oproj_jax.api import ConsumerResult, available_backends, consumer
from oproj_jax.sharded import tp_consumer, tp_oproj_consumer

__all__ = ["ConsumerResult", "available_backends", "consumer", "tp_consumer", "tp_oproj_consumer"]
