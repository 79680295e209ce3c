"""Files `karotte create-env` writes (see karotte/scaffold.py)."""
