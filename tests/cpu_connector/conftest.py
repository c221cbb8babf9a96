"""Fixtures shared by the cpu_connector tests: the tiny model comes from tests/conftest.py."""
