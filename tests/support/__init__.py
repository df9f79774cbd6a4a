"""Helpers shared by the test suites (not fixtures of one file)."""
