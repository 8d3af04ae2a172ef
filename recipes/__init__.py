"""Example training recipes built on flaxhooks."""
