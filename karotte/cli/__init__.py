"""Console scripts: karotte-sandbox (and, later, karotte)."""
