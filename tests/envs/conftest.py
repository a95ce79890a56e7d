"""Keeps pytest out of ``hacks/``: its ``conftest.py`` files are reward hacks (data for
``test_hacks.py``) and, collected, would rewrite this test session's own reports and exit status."""

collect_ignore = ["hacks"]
