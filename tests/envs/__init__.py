"""Small environments that the episode tests play against (importable as envs.NAME)."""
