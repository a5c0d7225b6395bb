"""`python -m node` runs the moeswarm CLI (handy in tests and in containers)."""

from node.cli.root import main

main()
