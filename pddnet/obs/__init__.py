"""Observability: request traces (Chrome/Perfetto JSON) and Prometheus metrics per daemon."""
