"""tandem."""
