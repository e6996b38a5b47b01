"""artifacts."""
