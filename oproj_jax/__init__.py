"""oproj_jax: the TP output-projection all-reduce consumer with Block AttnRes, for JAX."""

from oproj_jax.api import ConsumerResult, available_backends, consumer, explain
from oproj_jax.options import Options
from oproj_jax.sharded import tp_consumer, tp_oproj_consumer

__all__ = ["ConsumerResult", "Options", "available_backends", "consumer", "explain", "tp_consumer", "tp_oproj_consumer"]
