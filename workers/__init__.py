"""Long-running processes, one per role: consume -> decide -> append loops (filled by later issues)."""
