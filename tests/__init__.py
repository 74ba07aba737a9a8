"""The test suite: markers for what a test needs in pytest.ini, shared fixtures
in `conftest.py`, shared helpers in `helpers.py` (docs/testing.md)."""
