"""The Pallas backend: one Mosaic GPU kernel (`oproj_consumer_pallas`) for the whole consumer."""
