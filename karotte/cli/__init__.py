"""Console scripts: karotte (environments) and karotte-sandbox (the sandbox alone)."""
