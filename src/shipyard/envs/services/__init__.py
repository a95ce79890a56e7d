"""Services tasks can declare (PostgreSQL); see :mod:`shipyard.envs.services.base`."""
