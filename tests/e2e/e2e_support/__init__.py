"""Helpers for the end-to-end tests: paths, configs, server processes, metrics, waits."""
