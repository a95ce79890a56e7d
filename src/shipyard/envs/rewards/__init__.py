"""Reward components (hidden tests, LLM-as-judge rubrics) and their weighted composite; see :mod:`.base`."""
