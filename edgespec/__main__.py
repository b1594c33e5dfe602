from edgespec.cli import entry

entry()
