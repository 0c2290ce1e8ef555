"""flashtile's tests (a package: imported by full name, never put on sys.path)."""
