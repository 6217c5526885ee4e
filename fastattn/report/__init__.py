"""HTML scaling reports built from results files."""
