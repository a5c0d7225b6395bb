"""`python -m node` runs the moeswarm CLI (handy in tests and in containers)."""

from .cli import main

main()
