"""The Prometheus metrics served at /metrics (`collector`) and what they are called (`names`)."""
