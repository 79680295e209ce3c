"""Images: a task's own root filesystem."""
